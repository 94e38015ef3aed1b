"""One training step under hybrid context parallelism (:mod:`hybrid_context_parallel`).

Every rank of the data x context-parallel group holds the same global batch of packed
sequences. :func:`schedule_hybrid_cp` says which sequences each rank runs in each round and over
how many ranks; a sequence on ``c`` ranks is cut as ordinary context parallelism cuts it
(``2 c`` chunks, rank ``r`` of the block holds chunks ``r`` and ``2 c - 1 - r``) and its
attention runs over the aligned block's process group with this project's context-parallel
attention. Losses are per token (Megatron requires ``--calculate-per-token-loss``): each rank
sums the loss of its tokens and counts them, the sums and the gradients are all-reduced over the
whole group, and both are divided by the global token count, so the step equals one process
running every sequence whole.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.collectives import all_reduce, get_group_rank, get_group_size
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.hybrid_context_parallel import (HybridContextParallelError, ranks_of,
                                                   schedule_hybrid_cp)


class HybridGroups:
    """One process group per block of neighbouring ranks a schedule runs a sequence on.

    Every rank knows the whole schedule, so every rank creates the same new blocks' groups in
    the same order (``new_group`` is collective over the whole job); a block seen before reuses
    its group. A block of one rank needs none.
    """

    def __init__(self, dp_cp_group):
        self.ranks = dist.get_process_group_ranks(dp_cp_group)
        self.me = get_group_rank(dp_cp_group)
        self.groups: Dict[Tuple[int, ...], object] = {}

    def prepare(self, rounds: List[List[List[int]]]) -> None:
        for round_ids in rounds:
            for sample_id in sorted({i for ids in round_ids for i in ids}):
                block = tuple(ranks_of(round_ids, sample_id))
                if len(block) > 1 and block not in self.groups:
                    self.groups[block] = dist.new_group([self.ranks[i] for i in block])

    def get(self, block: List[int]):
        return self.groups[tuple(block)] if len(block) > 1 else None


def _check_length(sample_id: int, length: int, cp: int) -> None:
    if length % (2 * cp):
        raise HybridContextParallelError(
            f"--hybrid-context-parallel: sequence {sample_id} of the global batch has {length} "
            f"tokens and runs over {cp} ranks; its length must be a multiple of 2 x {cp} "
            f"(pad the packed sequences)")


def run_hybrid_cp_step(samples: Sequence[Dict[str, torch.Tensor]],
                       loss_fn: Callable[[Dict[str, torch.Tensor], object],
                                         Tuple[torch.Tensor, torch.Tensor]],
                       params: List[torch.nn.Parameter], dp_cp_group, groups: HybridGroups,
                       max_seqlen_per_rank: int,
                       forward_only: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one global batch; leaves per-token-mean gradients in ``params``.

    Args:
        samples: every sequence of the global batch, each a dict of ``[1, s]`` tensors
            (``tokens``, ``labels``, ``loss_mask``, ``position_ids``), identical on every rank.
        loss_fn: ``(local_batch, cp_group) -> (loss_sum, num_tokens)`` over this rank's tokens;
            ``cp_group`` is None when the sequence is whole on this rank.
        params: the parameters whose ``.grad`` receive the step's gradients.
        dp_cp_group: the data x context-parallel group.
        groups: the :class:`HybridGroups` of that group (kept across steps).
        max_seqlen_per_rank: ``--max-seqlen-per-dp-cp-rank``.

    Returns:
        ``(loss_sum, num_tokens)`` of the whole global batch, as fp64 tensors.
    """
    lengths = [int(s["tokens"].size(1)) for s in samples]
    rounds = schedule_hybrid_cp(lengths, max_seqlen_per_rank, get_group_size(dp_cp_group))
    groups.prepare(rounds)
    me = get_group_rank(dp_cp_group)
    totals = torch.zeros(2, dtype=torch.float64)
    for round_ids in rounds:
        for sample_id in round_ids[me]:
            block = ranks_of(round_ids, sample_id)
            cp = len(block)
            _check_length(sample_id, lengths[sample_id], cp)
            local = get_batch_on_this_cp_rank(samples[sample_id], cp, me - block[0])
            loss_sum, num_tokens = loss_fn(local, groups.get(block))
            if not forward_only:
                loss_sum.backward()
            totals += torch.stack([loss_sum.detach().double(), num_tokens.detach().double()])
        # The rank sets change between rounds: no rank may start the next one early.
        dist.barrier(group=dp_cp_group)
    all_reduce(totals, dp_cp_group)
    if not forward_only:
        _reduce_grads(params, dp_cp_group, totals[1])
    return totals[0], totals[1]


def _reduce_grads(params: List[torch.nn.Parameter], group, num_tokens: torch.Tensor) -> None:
    """Sum every parameter's gradient over the group, then divide by the global token count."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce(p.grad, group)
        p.grad.div_(num_tokens.to(p.grad.dtype))

"""Token dispatchers: bring each token to the ranks holding its experts, and the results back.

The ``E`` experts are split over the ranks of the expert-parallel (ep) group: rank ``r`` holds
experts ``r E/ep .. (r+1) E/ep - 1``. A dispatcher's :meth:`dispatch` returns the rows its
local experts must process, grouped by local expert (the rows of expert 0, then of expert 1,
...), with the number of rows of each; :meth:`combine` takes the experts' output rows in the
same order and returns ``[T, h]``: for every token, the sum over its routed experts of the
routing probability times the expert's output. A dropped (token, expert) pair adds nothing.

* :class:`AllGatherTokenDispatcher` (``--moe-token-dispatcher-type allgather``): every rank
  gathers all ranks' tokens and routing, runs its experts on the tokens routed to them, and the
  partial results are reduce-scattered back to the ranks the tokens came from.
* :class:`AllToAllTokenDispatcher` (``alltoall``): each rank sorts its token choices by expert
  and sends each expert's rows to the rank holding it (the row counts are exchanged first),
  the experts run, and a reverse all-to-all returns the rows, which are summed per token.

Both accept ranks and experts that receive no rows at all, and equal the single-rank result.
With ``--moe-pad-expert-input-to-capacity`` each rank contributes exactly ``capacity`` rows to
each expert (zero rows with probability 0 fill the gap), so every expert processes
``ep x capacity`` rows whatever the routing.

All communication is over the explicit ``ep_group`` (None: one rank) and differentiable.
"""

import dataclasses
from typing import List, Optional, Tuple

import torch

from megatron.core import collectives
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


@dataclasses.dataclass
class Permutation:
    """Where the rows of a permuted token tensor come from.

    Attributes:
        token_index: ``[N]`` source token of each row; ``num_tokens`` for a padding row.
        probs: ``[N]`` routing probability of each row (0 for a padding row).
        counts: rows of each expert, in expert order (``sum(counts) == N``).
        num_tokens: tokens of the unpermuted tensor.
    """

    token_index: torch.Tensor
    probs: torch.Tensor
    counts: List[int]
    num_tokens: int


def permute(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
            pad_to: Optional[int] = None) -> Tuple[torch.Tensor, Permutation]:
    """Rows of ``tokens [T, h]`` grouped by expert: the tokens routed to expert 0 in token
    order, then those of expert 1, ... (``probs`` and ``routing_map`` are ``[T, E']``).

    With ``pad_to`` every expert gets exactly that many rows, its tokens first, then zero rows.
    """
    num_tokens, hidden = tokens.shape
    by_expert = routing_map.t()                                              # [E', T]
    expert_id, token_id = by_expert.nonzero(as_tuple=True)                  # expert-major
    row_probs = probs.t()[expert_id, token_id]                               # [N]
    counts = by_expert.sum(dim=1)                                            # [E']
    if pad_to is not None:
        if counts.numel() and int(counts.max()) > pad_to:
            raise ValueError(f"an expert has {int(counts.max())} tokens, more than the "
                             f"{pad_to} rows it is padded to")
        starts = torch.cumsum(counts, 0) - counts
        slot = expert_id * pad_to + (torch.arange(expert_id.numel(), device=tokens.device)
                                     - starts[expert_id])
        total = pad_to * by_expert.size(0)
        padded_tokens = torch.full((total,), num_tokens, dtype=torch.long, device=tokens.device)
        token_id = padded_tokens.index_put((slot,), token_id)
        row_probs = row_probs.new_zeros(total).index_put((slot,), row_probs)
        count_list = [pad_to] * by_expert.size(0)
    else:
        count_list = counts.tolist()
    with_pad_row = torch.cat([tokens, tokens.new_zeros(1, hidden)])          # [T + 1, h]
    rows = with_pad_row.index_select(0, token_id)                            # [N, h]
    return rows, Permutation(token_id, row_probs, count_list, num_tokens)


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """``[N, h]`` expert outputs -> ``[T, h]``: each token's sum of probability x row."""
    weighted = rows * perm.probs.unsqueeze(1).to(rows.dtype)                 # [N, h]
    out = rows.new_zeros(perm.num_tokens + 1, rows.size(1))
    return out.index_add(0, perm.token_index, weighted)[:perm.num_tokens]    # [T, h]


def _sort_chunks(rows: torch.Tensor, sizes: List[int], order: List[int]) -> torch.Tensor:
    """Cut ``rows`` into chunks of ``sizes`` and concatenate them in ``order``."""
    chunks = rows.split(sizes)
    return torch.cat([chunks[i] for i in order]) if order else rows


class _Dispatcher:
    def __init__(self, num_experts: int, ep_group):
        self.ep_group = ep_group
        self.ep_size = get_group_size(ep_group)
        self.ep_rank = get_group_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"--num-experts ({num_experts}) must be divisible by the "
                             f"expert-parallel group size ({self.ep_size})")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = self.ep_rank * self.num_local_experts


class AllGatherTokenDispatcher(_Dispatcher):
    """Gather every rank's tokens, keep the rows of the local experts, reduce-scatter back."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 pad_to: Optional[int] = None):
        """``tokens [T, h]``, ``probs`` / ``routing_map`` ``[T, E]`` -> (rows of the local
        experts ``[N, h]``, rows per local expert, a handle for :meth:`combine`).
        ``pad_to``: the capacity each rank's tokens are padded to per expert."""
        # Each rank's gradient of a gathered token covers only its own experts: the backward
        # sums them (reduce-scatter), which is what tensor_parallel_output_grad asks for.
        all_tokens = gather_from_sequence_parallel_region(tokens, self.ep_group, True)
        all_probs = gather_from_sequence_parallel_region(probs, self.ep_group, True)
        all_map = _gather_rows(routing_map, self.ep_group)                  # [ep T, E]
        local = slice(self.first_local_expert,
                      self.first_local_expert + self.num_local_experts)
        rows, perm = permute(all_tokens, all_probs[:, local], all_map[:, local],
                             None if pad_to is None else pad_to * self.ep_size)
        return rows, perm.counts, perm

    def combine(self, rows: torch.Tensor, handle: Permutation) -> torch.Tensor:
        """Local experts' output rows -> this rank's ``[T, h]``."""
        partial = unpermute(rows, handle)                                    # [ep T, h]
        return reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)


def _gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather a bool ``[T, E]`` along dim 0 (no gradient)."""
    world = get_group_size(group)
    if world == 1:
        return tensor
    as_bytes = tensor.to(torch.uint8).contiguous()
    out = as_bytes.new_empty((world * tensor.size(0),) + tuple(tensor.shape[1:]))
    collectives.all_gather_into_tensor(out, as_bytes, group)
    return out.bool()


@dataclasses.dataclass
class _AllToAllHandle:
    perm: Permutation
    received_sizes: List[int]     # rows received from each (source rank, local expert)
    expert_order: List[int]       # chunk order that groups the received rows by local expert
    send_splits: List[int]
    recv_splits: List[int]


class AllToAllTokenDispatcher(_Dispatcher):
    """Sort token choices by expert, exchange rows with an all-to-all, and back again."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 pad_to: Optional[int] = None):
        """Same contract as :meth:`AllGatherTokenDispatcher.dispatch`."""
        rows, perm = permute(tokens, probs, routing_map, pad_to)             # [N, h]
        ep, local = self.ep_size, self.num_local_experts
        counts = torch.tensor(perm.counts, dtype=torch.long, device=tokens.device)  # [E]
        received = torch.empty_like(counts)
        # Rank r receives, from every rank, the counts of the experts it holds.
        collectives.all_to_all_single(received, counts, self.ep_group)
        received = received.view(ep, local)                                  # [source, expert]
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        exchanged = all_to_all(rows, self.ep_group, recv_splits, send_splits)
        sizes = received.flatten().tolist()                                  # source-major
        order = [src * local + e for e in range(local) for src in range(ep)]
        expert_rows = _sort_chunks(exchanged, sizes, order) if ep > 1 else exchanged
        handle = _AllToAllHandle(perm, sizes, order, send_splits, recv_splits)
        return expert_rows, received.sum(dim=0).tolist(), handle

    def combine(self, rows: torch.Tensor, handle: _AllToAllHandle) -> torch.Tensor:
        """Local experts' output rows -> this rank's ``[T, h]``."""
        if self.ep_size > 1:
            sizes_by_expert = [handle.received_sizes[i] for i in handle.expert_order]
            inverse = [0] * len(handle.expert_order)
            for position, chunk in enumerate(handle.expert_order):
                inverse[chunk] = position
            rows = _sort_chunks(rows, sizes_by_expert, inverse)
        returned = all_to_all(rows, self.ep_group, handle.send_splits, handle.recv_splits)
        return unpermute(returned, handle.perm)


def build_token_dispatcher(dispatcher_type: str, num_experts: int, ep_group):
    """The dispatcher of ``--moe-token-dispatcher-type``."""
    if dispatcher_type == "allgather":
        return AllGatherTokenDispatcher(num_experts, ep_group)
    if dispatcher_type == "alltoall":
        return AllToAllTokenDispatcher(num_experts, ep_group)
    raise ValueError(f"--moe-token-dispatcher-type must be allgather or alltoall, "
                     f"got {dispatcher_type!r}")

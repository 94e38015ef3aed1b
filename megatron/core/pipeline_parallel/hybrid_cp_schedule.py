"""The forward/backward schedule of hybrid context parallelism (``--hybrid-context-parallel``).

Each data x context-parallel rank reads its micro-batches of the step as usual: packed samples
``[1, s]`` (tokens, labels, loss mask, position ids, and segment ids numbering the sequences of
the pack). The schedule

1. cuts every pack into its sequences at the segment-id changes (each sequence attends only to
   itself, so it can run on its own), dropping each one's trailing tokens without loss (the
   padding of the pack);
2. all-gathers the sequences of the step over the data x context group, in rank order, so every
   rank holds the whole global batch and numbers its sequences alike;
3. deals them to the ranks with :func:`~megatron.core.hybrid_context_parallel.schedule_hybrid_cp`;
4. runs, round after round, the sequences this rank was given: a sequence on ``c`` ranks is
   padded at its end to a multiple of ``2 c`` tokens (pad label, no loss; causal attention
   keeps the padding from changing the sequence's own tokens), cut as context
   parallelism cuts it (chunks ``r`` and ``2 c - 1 - r`` for the block's ``r``-th rank), and run
   as a micro-batch of its own with the model's attention switched to the block's process group;
   the ranks meet at a barrier between rounds, where the blocks change.

Losses are per token (``--calculate-per-token-loss``): every micro-batch returns the loss sum of
its tokens and their count, and the gradient reduction over the data x context group divides the
summed gradients by the summed count, so the step equals one process running every sequence
whole. Gradient reduction waits for the last sequence, as in the other schedules.

Cost: step 2 moves the global batch's tokens to every rank (five numbers a token), which
Megatron avoids by sending each sequence only to the ranks that run it.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.hybrid_context_parallel import (HybridContextParallelError, ranks_of,
                                                   schedule_hybrid_cp)
from megatron.core.pipeline_parallel.schedules import MicroBatchLosses, forward_backward_step

INT_KEYS = ("tokens", "labels", "position_ids", "segment_ids")
KEYS = INT_KEYS + ("loss_mask",)


class HybridGroups:
    """One process group per block of neighbouring ranks a schedule runs a sequence on.

    Every rank knows the whole schedule, so every rank creates the same new blocks' groups in
    the same order (``new_group`` is collective over the whole job); a block seen before reuses
    its group. A block of one rank needs none.
    """

    def __init__(self, dp_cp_group):
        self.ranks = dist.get_process_group_ranks(dp_cp_group)
        self.groups: Dict[Tuple[int, ...], object] = {}

    def prepare(self, rounds: List[List[List[int]]]) -> None:
        for round_ids in rounds:
            for sample_id in sorted({i for ids in round_ids for i in ids}):
                block = tuple(ranks_of(round_ids, sample_id))
                if len(block) > 1 and block not in self.groups:
                    self.groups[block] = dist.new_group([self.ranks[i] for i in block])

    def get(self, block: List[int]):
        return self.groups[tuple(block)] if len(block) > 1 else None


@dataclass
class HybridCPSetup:
    """What the schedule needs beyond the common keywords.

    Args:
        dp_cp_group: the data x context-parallel group.
        groups: its :class:`HybridGroups` (kept across steps).
        max_seqlen_per_rank: ``--max-seqlen-per-dp-cp-rank``.
        pad_token: the token and label a sequence is padded with (its loss mask is 0).
        use_cp_group: ``(model, group) -> context manager`` running the model's attention over
            ``group`` (None: whole sequences on this rank).
    """

    dp_cp_group: object
    groups: HybridGroups
    max_seqlen_per_rank: int
    pad_token: int
    use_cp_group: Callable


def split_packed(item: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """The sequences of one packed sample (``[1, s]`` tensors), cut where ``segment_ids``
    changes; each keeps its own position ids and gets segment id 0. A sequence's trailing
    tokens without loss (the pack's padding) are dropped, keeping at least one token: under
    causal attention they change no other token's output and add nothing to the loss."""
    missing = [k for k in KEYS if item.get(k) is None]
    if missing:
        raise HybridContextParallelError(
            f"--hybrid-context-parallel needs packed samples with {', '.join(KEYS)}; "
            f"missing {', '.join(missing)} (use --sft)")
    if item["tokens"].size(0) != 1:
        raise HybridContextParallelError(
            f"--hybrid-context-parallel needs --micro-batch-size 1, got a micro-batch of "
            f"{item['tokens'].size(0)} packs")
    seg = item["segment_ids"].view(-1)
    cuts = (torch.nonzero(seg[1:] != seg[:-1]).view(-1) + 1).tolist()
    bounds = [0] + cuts + [seg.numel()]
    out = []
    trained = item["loss_mask"].view(-1) != 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        carried = torch.nonzero(trained[start:end]).view(-1)
        end = start + (int(carried[-1]) + 1 if carried.numel() else 1)
        part = {k: item[k][:, start:end] for k in KEYS}
        part["segment_ids"] = torch.zeros_like(part["segment_ids"])
        out.append(part)
    return out


def _all_gather_padded(tensor: torch.Tensor, size: int, group) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (last dim at most ``size``, zero-padded to it for the exchange)."""
    padded = torch.zeros(*tensor.shape[:-1], size, dtype=tensor.dtype, device=tensor.device)
    padded[..., :tensor.size(-1)] = tensor
    parts = [torch.empty_like(padded) for _ in range(get_group_size(group))]
    dist.all_gather(parts, padded, group=group)
    return parts


def gather_sequences(local: List[Dict[str, torch.Tensor]], group) -> List[Dict[str, torch.Tensor]]:
    """Every rank's sequences, rank 0's first, each as ``[1, length]`` tensors on the CPU.

    The five values of a token travel as fp64 (exact for token ids below 2**53 and for a 0/1
    or fp32 loss mask)."""
    dev = device.current_device()
    lengths = torch.tensor([p["tokens"].size(1) for p in local], dtype=torch.int64, device=dev)
    counts = _all_gather_padded(torch.tensor([lengths.numel()], device=dev), 1, group)
    all_lengths = _all_gather_padded(lengths, max(int(c) for c in counts), group)
    rows = torch.cat([torch.cat([p[k].double() for k in KEYS]) for p in local], dim=1)
    totals = [int(part.sum()) for part in all_lengths]
    all_rows = _all_gather_padded(rows.to(dev), max(totals), group)
    out = []
    for count, lens, block in zip(counts, all_lengths, all_rows):
        offset = 0
        for length in lens[:int(count)].tolist():
            piece = block[:, offset:offset + length].cpu()
            offset += length
            seq = {k: piece[i:i + 1].long() for i, k in enumerate(INT_KEYS)}
            seq["loss_mask"] = piece[4:5].float()
            out.append(seq)
    return out


def local_part(seq: Dict[str, torch.Tensor], block: List[int], rank: int,
               pad_token: int) -> Dict[str, torch.Tensor]:
    """This rank's part of a sequence run on ``block``: padded at its end to a multiple of
    ``2 len(block)`` tokens (pad token and label, no loss, the last position id repeated, so
    it stays within the position table), then cut."""
    cp = len(block)
    length = seq["tokens"].size(1)
    pad = (-length) % (2 * cp) if cp > 1 else 0
    if pad:
        last = int(seq["position_ids"][0, -1])
        extra = {"tokens": torch.full((1, pad), pad_token),
                 "labels": torch.full((1, pad), pad_token),
                 "position_ids": torch.full((1, pad), last),
                 "segment_ids": torch.zeros(1, pad, dtype=torch.long),
                 "loss_mask": torch.zeros(1, pad)}
        seq = {k: torch.cat([seq[k], extra[k].to(seq[k].dtype)], dim=1) for k in KEYS}
    return get_batch_on_this_cp_rank(seq, cp, rank - block[0])


def _unwrap(value, what: str):
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"the hybrid context-parallel schedule takes one {what}")
        return value[0]
    return value


def forward_backward_hybrid_context_parallel(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
        forward_only: bool = False, grad_scale_func: Optional[Callable] = None,
        no_sync_func: Optional[Callable] = None, calculate_per_token_loss: bool = False,
        hybrid_cp: Optional[HybridCPSetup] = None, **_pipeline_kwargs) -> MicroBatchLosses:
    """One step's forward (and backward) of ``num_microbatches`` packed samples per rank, dealt
    as sequences over the data x context ranks (module docstring); returns each sequence's
    logged values (a rank runs its own number of them)."""
    if hybrid_cp is None or not calculate_per_token_loss:
        raise HybridContextParallelError("--hybrid-context-parallel needs its setup and "
                                         "--calculate-per-token-loss")
    model = _unwrap(model, "model chunk")
    data_iterator = _unwrap(data_iterator, "data iterator")
    no_sync = _unwrap(no_sync_func, "no_sync_func") or contextlib.nullcontext
    group = hybrid_cp.dp_cp_group
    local = [seq for _ in range(num_microbatches) for seq in split_packed(next(data_iterator))]
    sequences = gather_sequences(local, group)
    rounds = schedule_hybrid_cp([int(s["tokens"].size(1)) for s in sequences],
                                hybrid_cp.max_seqlen_per_rank, get_group_size(group))
    hybrid_cp.groups.prepare(rounds)
    me = get_group_rank(group)
    work = [(j, sid) for j, round_ids in enumerate(rounds) for sid in round_ids[me]]
    logged = MicroBatchLosses()

    def run(j: int, sid: int) -> None:
        block = ranks_of(rounds[j], sid)
        part = local_part(sequences[sid], block, me, hybrid_cp.pad_token)
        with hybrid_cp.use_cp_group(model, hybrid_cp.groups.get(block)):
            forward_backward_step(forward_step_func, iter([part]), model, 1, forward_only,
                                   grad_scale_func, True, logged)

    with no_sync():
        for k, (j, sid) in enumerate(work[:-1]):
            run(j, sid)
            if work[k + 1][0] != j:
                # The blocks change between rounds: no rank may start the next one early.
                dist.barrier(group=group)
    run(*work[-1])
    return logged

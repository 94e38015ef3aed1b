"""Expert tensor parallelism over ranks that hold different tokens.

When ``--expert-tensor-parallel-size`` differs from ``--tensor-model-parallel-size``, the ranks
of an expert-tensor-parallel group route different tokens (their own slice of the sequence, or
their own micro-batch), yet each holds a slice of the same experts, and a split expert needs
the same rows on all of its ranks. So after the token dispatcher has brought each rank the rows
of its local experts, :func:`gather_expert_rows` all-gathers those rows over the expert-TP group
(every rank then holds the rows of all its group, grouped by local expert again); the experts
run on them, their partial outputs summed over the group as usual; and
:func:`return_own_rows` hands each rank back the outputs of its own rows, in the order the
dispatcher gave them.

The gathered rows are the same on every rank of the group and their gradient arrives whole on
each (the experts sum it over the group), so the gather's backward keeps this rank's own part;
the return's backward all-gathers, since every rank's output rows feed the same experts.
Row counts differ between ranks: pieces are padded to the longest for the collective.
"""

import dataclasses
from typing import List, Tuple

import torch

from megatron.core import collectives
from megatron.core.collectives import get_group_rank, get_group_size


def _gather_uneven(rows: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """Concatenate every rank's ``rows`` (rank ``r`` holds ``sizes[r]`` of them), rank order."""
    width = max(sizes)
    if width == 0:
        return rows.new_zeros((0,) + tuple(rows.shape[1:]))
    padded = rows.new_zeros((width,) + tuple(rows.shape[1:]))
    padded[:rows.size(0)] = rows
    out = rows.new_empty((len(sizes) * width,) + tuple(rows.shape[1:]))
    collectives.all_gather_into_tensor(out, padded.contiguous(), group)
    return torch.cat([out[r * width:r * width + n] for r, n in enumerate(sizes)])


def _own_part(rows: torch.Tensor, sizes: List[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return rows[start:start + sizes[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sizes, group):
        ctx.sizes, ctx.rank = sizes, get_group_rank(group)
        return _gather_uneven(rows, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_part(grad, ctx.sizes, ctx.rank).contiguous(), None, None


class _OwnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        # A copy, not a view: what keeps this rank's rows must not keep the whole group's.
        return _own_part(rows, sizes, get_group_rank(group)).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_uneven(grad.contiguous(), ctx.sizes, ctx.group), None, None


@dataclasses.dataclass
class ExpertRowsHandle:
    """How :func:`gather_expert_rows` ordered the rows, for :func:`return_own_rows`."""

    source_sizes: List[int]   # rows from each rank of the group
    chunk_sizes: List[int]    # rows of each (source rank, local expert), source-major
    order: List[int]          # chunk order that groups the gathered rows by local expert


def gather_expert_rows(rows: torch.Tensor, counts: List[int],
                       group) -> Tuple[torch.Tensor, List[int], ExpertRowsHandle]:
    """``rows [N, h]`` grouped by local expert (``counts[i]`` of expert ``i``) on each rank of
    the expert-TP ``group`` -> the rows of the whole group, grouped by local expert, with the
    rows per local expert, and a handle for :func:`return_own_rows`."""
    world, local = get_group_size(group), len(counts)
    mine = torch.tensor(counts, dtype=torch.long, device=rows.device)
    every = mine.new_empty(world * local)
    collectives.all_gather_into_tensor(every, mine, group)
    table = every.view(world, local)                                    # [source, expert]
    source_sizes = table.sum(dim=1).tolist()
    gathered = _GatherRows.apply(rows.contiguous(), source_sizes, group)
    chunk_sizes = table.flatten().tolist()
    order = [src * local + e for e in range(local) for src in range(world)]
    chunks = gathered.split(chunk_sizes)
    by_expert = torch.cat([chunks[i] for i in order]) if order else gathered
    return by_expert, table.sum(dim=0).tolist(), ExpertRowsHandle(source_sizes, chunk_sizes,
                                                                  order)


def return_own_rows(rows: torch.Tensor, handle: ExpertRowsHandle, group) -> torch.Tensor:
    """The experts' output on the gathered rows -> this rank's own rows, in its order."""
    chunks = rows.split([handle.chunk_sizes[i] for i in handle.order])
    source_major = [None] * len(handle.order)
    for position, chunk in enumerate(handle.order):
        source_major[chunk] = chunks[position]
    ordered = torch.cat(source_major) if source_major else rows
    return _OwnRows.apply(ordered, handle.source_sizes, group)

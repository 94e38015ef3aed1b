"""Weight shards: a linear weight cut further, along its output rows, over a weight-shard group.

This is the building block of Megatron's ``--tensor-parallel-num-weight-shards N`` (and
``--expert-tensor-parallel-num-weight-shards`` for routed experts), which Megatron calls
generalized tensor parallelism. ``N = tp * g``: each weight is split into ``N`` pieces along
its first dim (``out_features``); the ``tp`` split is ordinary tensor parallelism, and the
further ``g``-way split is held by a *weight-shard group* of ``g`` ranks that read different
samples (the group is carved out of the data-parallel ranks, next to tensor parallelism in the
rank order ``tp-gtp-cp-ep-dp-pp``).

The computation is unchanged: before its matmul a layer all-gathers the ``g`` row blocks of its
tensor-parallel weight (so the GEMM sees exactly the weight it would see without shards), and on
the way back the weight gradient of that full tensor-parallel weight is reduce-scattered
(summed) over the group, so each rank keeps the summed gradient of its own rows. Only the
memory of the weight (and of its gradient and optimizer state) shrinks to ``1 / g``.

Layout, for a tensor-parallel weight of ``r`` rows: rank ``k`` of the weight-shard group holds
rows ``[k r / g, (k + 1) r / g)``. In a checkpoint the weight is described as the full,
unsharded tensor; the offset of a shard along dim 0 is (Megatron's table):

=========================  =======================================  =====================
weight kind                dim 0 (chunk index, number of chunks)    dim 1
=========================  =======================================  =====================
column-parallel (dim 0)    ``(tp_rank * g + k, tp * g)``            whole
row-parallel (dim 1)       ``(k, g)``                               ``(tp_rank, tp)``
no tensor parallelism      ``(k, g)``                               whole
=========================  =======================================  =====================

so a checkpoint written with shards loads at any other ``(tp, g)`` and into the unsharded layout.
Biases and norms are not sharded (every rank of the group keeps the same copy).
"""

from typing import List, Optional, Tuple

import torch

from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.tensor_parallel.mappings import (gather_along_first_dim,
                                                    reduce_scatter_along_first_dim)
from megatron.core.tensor_parallel.utils import divide


def num_shards(group) -> int:
    """The size of a weight-shard group (1 for None: no shards)."""
    return get_group_size(group)


def shard_rows(tensor: torch.Tensor, group, what: str = "weight") -> torch.Tensor:
    """This rank's contiguous block of ``tensor``'s rows (dim 0) in the weight-shard ``group``."""
    g = num_shards(group)
    if g == 1:
        return tensor
    rows = divide(tensor.size(0), g,
                  f"{what} dim 0 of size {tensor.size(0)} over {g} weight shards "
                  f"(--tensor-parallel-num-weight-shards / --tensor-model-parallel-size)")
    start = get_group_rank(group) * rows
    return tensor[start:start + rows].clone()


class _GatherWeightShards(torch.autograd.Function):
    """Forward: all-gather the row blocks; backward: reduce-scatter (sum) the row blocks."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        return gather_along_first_dim(shard.contiguous(), group)

    @staticmethod
    def backward(ctx, grad_full):
        return reduce_scatter_along_first_dim(grad_full.contiguous(), ctx.group), None


def gather_weight_shards(shard: torch.Tensor, group) -> torch.Tensor:
    """The whole tensor-parallel weight from this rank's shard (identity without shards).

    Its gradient flows back to ``shard`` summed over the group: each rank of the group computes
    the gradient of the whole weight on its own samples, and keeps the sum of its rows."""
    if num_shards(group) == 1:
        return shard
    return _GatherWeightShards.apply(shard, group)


def mark_weight_shard(param: torch.Tensor, group) -> None:
    """Tag ``param`` as a weight shard: ``weight_shards`` (g) and ``weight_shard_rank`` (k)."""
    param.weight_shards = num_shards(group)
    param.weight_shard_rank = get_group_rank(group)


def checkpoint_box(local_shape: Tuple[int, ...], partition_dim: int, tp_rank: int,
                   tp_size: int, shard_rank: int, shards: int,
                   stride: int = 1) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(global_shape, global_offset)`` of a weight shard in a checkpoint (Megatron's layout).

    ``local_shape``: the shard's shape on this rank; ``partition_dim``: 0 for a column-parallel
    weight, 1 for a row-parallel one, -1 without tensor parallelism."""
    if stride != 1:
        raise ValueError(f"a weight split into {stride} interleaved tensor-parallel blocks has "
                         "no single checkpoint box once cut into weight shards")
    rows, rest = local_shape[0], tuple(local_shape[1:])
    if partition_dim == 0:
        chunk, chunks = tp_rank * shards + shard_rank, tp_size * shards
        return (rows * chunks,) + rest, (rows * chunk,) + (0,) * len(rest)
    if partition_dim == 1:
        cols = local_shape[1]
        return ((rows * shards, cols * tp_size) + rest[1:],
                (rows * shard_rank, cols * tp_rank) + (0,) * len(rest[1:]))
    return (rows * shards,) + rest, (rows * shard_rank,) + (0,) * len(rest)


def weight_shard_ranks(world_size: int, tp_size: int, num_weight_shards: Optional[int],
                       flag: str = "--tensor-parallel-num-weight-shards") -> List[List[int]]:
    """The weight-shard groups (lists of global ranks) in Megatron's order ``tp-gtp-...``.

    ``num_weight_shards`` (None: no shards) must be a multiple of ``tp_size``; the group size
    is ``num_weight_shards / tp_size`` and its ranks are ``tp_size`` apart."""
    g = weight_shards_per_tp_rank(tp_size, num_weight_shards, flag)
    block = tp_size * g
    if world_size % block:
        raise ValueError(f"{flag} ({num_weight_shards}) does not divide the world size "
                         f"({world_size})")
    return [[base + t + tp_size * k for k in range(g)]
            for base in range(0, world_size, block) for t in range(tp_size)]


def expert_weight_shard_ranks(world_size: int, expert_tp_size: int, ep_size: int,
                              num_weight_shards: Optional[int]) -> List[List[int]]:
    """The expert weight-shard groups in Megatron's expert order ``etp-ep-egtp-edp-pp``: the
    group has ``num_weight_shards / expert_tp_size`` ranks, ``expert_tp_size * ep_size``
    apart (``--expert-tensor-parallel-num-weight-shards``)."""
    flag = "--expert-tensor-parallel-num-weight-shards"
    g = weight_shards_per_tp_rank(expert_tp_size, num_weight_shards, flag)
    stride = expert_tp_size * ep_size
    if world_size % (stride * g):
        raise ValueError(f"{flag} ({num_weight_shards}) x --expert-model-parallel-size "
                         f"({ep_size}) does not divide the world size ({world_size})")
    return [[base + j + stride * k for k in range(g)]
            for base in range(0, world_size, stride * g) for j in range(stride)]


def weight_shards_per_tp_rank(tp_size: int, num_weight_shards: Optional[int],
                              flag: str = "--tensor-parallel-num-weight-shards") -> int:
    """``num_weight_shards / tp_size`` with Megatron's checks (1 when unset)."""
    if num_weight_shards is None:
        return 1
    if num_weight_shards < tp_size or num_weight_shards % tp_size:
        raise ValueError(f"{flag} ({num_weight_shards}) must be a multiple of the "
                         f"tensor-parallel size ({tp_size}) and at least as large")
    return num_weight_shards // tp_size

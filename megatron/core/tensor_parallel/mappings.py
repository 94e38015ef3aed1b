"""Communication between tensor-parallel ranks as paired autograd functions.

Each function's backward is the communication its forward's transpose needs, so a model written
with them gets correct gradients with no extra code. They come in pairs whose forward and
backward are swapped:

====================================  =========================  ==========================
function                              forward                    backward
====================================  =========================  ==========================
copy_to_tensor_model_parallel_region  identity                   all-reduce
reduce_from_tensor_model_parallel_..  all-reduce                 identity
scatter_to_tensor_model_parallel_..   split last dim             all-gather last dim
gather_from_tensor_model_parallel_..  all-gather last dim        split last dim
scatter_to_sequence_parallel_region   split dim 0                all-gather dim 0
gather_from_sequence_parallel_region  all-gather dim 0           reduce-scatter dim 0 (or split)
reduce_scatter_to_sequence_parall..   reduce-scatter dim 0       all-gather dim 0
all_to_all                            all-to-all of dim 0        the reverse all-to-all
====================================  =========================  ==========================

Every function takes its group explicitly (the tensor-parallel group, or for ``all_to_all`` the
expert-parallel one) and is the identity when the group has one rank (or is None). Splits keep
this rank's piece (rank ``r`` gets the ``r``-th piece); gathers concatenate in rank order. None
of them modifies its input.
"""

import torch

from megatron.core.collectives import (all_gather_into_tensor, all_reduce, all_to_all_single,
                                       get_group_rank, get_group_size, reduce_scatter_tensor)
from megatron.core.tensor_parallel.utils import divide, split_tensor_along_last_dim

# ---- the raw operations (no autograd) --------------------------------------------------------

def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, into a new tensor."""
    if get_group_size(group) == 1:
        return input_
    return all_reduce(input_.clone(memory_format=torch.contiguous_format), group)


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = get_group_size(group)
    if world == 1:
        return input_
    return split_tensor_along_last_dim(input_, world)[get_group_rank(group)].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = get_group_size(group)
    if world == 1:
        return input_
    size = divide(input_.size(0), world,
                  f"sequence-parallel split of dim 0 (shape {tuple(input_.shape)}) over "
                  f"--tensor-model-parallel-size {world}")
    start = get_group_rank(group) * size
    return input_[start:start + size].contiguous()


def gather_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = get_group_size(group)
    if world == 1:
        return input_
    out = torch.empty((input_.size(0) * world,) + tuple(input_.shape[1:]),
                      dtype=input_.dtype, device=input_.device)
    return all_gather_into_tensor(out, input_, group)


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = get_group_size(group)
    if world == 1:
        return input_
    stacked = gather_along_first_dim(input_, group)          # [world * d0, ..., d_last]
    return torch.cat(stacked.chunk(world, dim=0), dim=-1)     # [d0, ..., world * d_last]


def reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = get_group_size(group)
    if world == 1:
        return input_
    size = divide(input_.size(0), world,
                  f"sequence-parallel reduce-scatter of dim 0 (shape {tuple(input_.shape)}) "
                  f"over --tensor-model-parallel-size {world}")
    out = torch.empty((size,) + tuple(input_.shape[1:]), dtype=input_.dtype,
                      device=input_.device)
    return reduce_scatter_tensor(out, input_.contiguous(), group)


# ---- the autograd functions ------------------------------------------------------------------

class _CopyToModelParallelRegion(torch.autograd.Function):
    """Forward identity, backward all-reduce. Pair: :class:`_ReduceFromModelParallelRegion`."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward all-reduce, backward identity. Pair: :class:`_CopyToModelParallelRegion`."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward split last dim, backward all-gather last dim.

    Pair: :class:`_GatherFromModelParallelRegion`.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward all-gather last dim, backward split last dim.

    Pair: :class:`_ScatterToModelParallelRegion`. The backward assumes the gathered output's
    gradient is the same on every rank (the ranks compute the same thing from it).
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward split dim 0, backward all-gather dim 0.

    Pair: :class:`_GatherFromSequenceParallelRegion` with ``tensor_parallel_output_grad=False``.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward all-gather dim 0; backward reduce-scatter dim 0, or split dim 0.

    Pair: :class:`_ReduceScatterToSequenceParallelRegion`. When the gathered output feeds a
    tensor-parallel layer (``tensor_parallel_output_grad=True``) each rank holds only a partial
    gradient, so the backward sums them (reduce-scatter). When every rank computes the same thing
    from the output, the gradients are already whole and the backward only splits.
    """

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward reduce-scatter dim 0, backward all-gather dim 0.

    Pair: :class:`_GatherFromSequenceParallelRegion`.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_first_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Forward all-to-all along dim 0 with per-rank split sizes; backward the same exchange
    reversed (the sizes swapped), which is its transpose. It is its own pair."""

    @staticmethod
    def forward(ctx, input_, group, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return (_all_to_all(grad_output, ctx.group, ctx.input_split_sizes,
                            ctx.output_split_sizes), None, None, None)


def _all_to_all(input_: torch.Tensor, group, output_split_sizes, input_split_sizes):
    rows = (sum(output_split_sizes) if output_split_sizes is not None else input_.size(0))
    out = torch.empty((rows,) + tuple(input_.shape[1:]), dtype=input_.dtype,
                      device=input_.device)
    return all_to_all_single(out, input_, group, output_split_sizes, input_split_sizes)


# ---- public entry points ---------------------------------------------------------------------

def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward identity, backward all-reduce over ``group``."""
    if get_group_size(group) == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward all-reduce over ``group``, backward identity."""
    if get_group_size(group) == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward keep this rank's slice of the last dim, backward all-gather the last dim."""
    if get_group_size(group) == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward all-gather the last dim, backward keep this rank's slice of it."""
    if get_group_size(group) == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward keep this rank's slice of dim 0 (``[s, b, h] -> [s/tp, b, h]``), backward
    all-gather dim 0."""
    if get_group_size(group) == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward all-gather dim 0 (``[s/tp, b, h] -> [s, b, h]``); backward reduce-scatter dim 0,
    or only split it when ``tensor_parallel_output_grad`` is False."""
    if get_group_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward reduce-scatter dim 0 (``[s, b, h] -> [s/tp, b, h]``), backward all-gather dim 0."""
    if get_group_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


def all_to_all(input_: torch.Tensor, group, output_split_sizes=None,
               input_split_sizes=None) -> torch.Tensor:
    """Rows ``input_split_sizes[j]`` of ``input_`` (in order) go to rank ``j``; the result holds
    ``output_split_sizes[i]`` rows from each rank ``i``, in rank order. None: equal pieces.
    Backward sends the gradient rows back the same way. Pieces may be empty, on any rank."""
    if get_group_size(group) == 1:
        return input_
    return _AllToAll.apply(input_, group, output_split_sizes, input_split_sizes)

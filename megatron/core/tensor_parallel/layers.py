"""Tensor-parallel layers: column- and row-split linear layers and a vocab-split embedding.

Shapes follow Megatron: activations are ``[s, b, h]``; with sequence parallelism the activations
between tensor-parallel regions are ``[s/tp, b, h]``.

Every weight is initialised on its FULL (unsplit) shape, on the CPU, from the default torch
generator, and only then cut to this rank's shard. Building the same model from the same seed
therefore gives the same full weights under any tensor-parallel size.

Parameters carry Megatron's attributes, which the optimizer, gradient clipping and checkpoint
code read:

- ``tensor_model_parallel`` (bool): the parameter is a shard, different on every tp rank;
- ``partition_dim``: the dim it was cut along (0 for column-parallel, 1 for row-parallel);
- ``partition_stride``: how many interleaved blocks each rank holds (see ``stride``);
- ``sequence_parallel`` (bool, on replicated parameters only): its gradient is partial on each tp
  rank under sequence parallelism and must be all-reduced over the tp group before use.
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import device, meta_init
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.tensor_parallel.mappings import (gather_along_first_dim,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_along_first_dim,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.utils import VocabUtility, divide
from megatron.core.tensor_parallel.weight_shards import (gather_weight_shards, mark_weight_shard,
                                                         num_shards, shard_rows)

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True when ``param`` should count once per tp group from this rank.

    Shards count on every rank; replicated parameters count only on tp rank 0 (used so that a
    gradient norm or parameter count does not add up the same copy ``tp`` times).
    """
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """Mark ``tensor`` with Megatron's tensor-parallel attributes (it must not have them yet)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise AttributeError(f"parameter already has attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the "replicated" attributes unless it already has them."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor,
                                          source: torch.Tensor) -> None:
    """Copy the attributes of ``source`` (defaults where it has none) onto ``destination``."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        setattr(destination, attribute, getattr(source, attribute, value))


def _initialize_affine_weight_cpu(weight: Parameter, full_shape: Tuple[int, int],
                                  partition_dim: int, init_method: Callable, tp_group,
                                  stride: int = 1) -> None:
    """Fill ``weight`` with this rank's shard of a weight initialised on its full shape.

    The full weight is drawn on the CPU from the default generator (in float32, or float64 when
    the parameters are float64), cast to the parameter dtype, cut along ``partition_dim`` into
    ``stride * tp`` equal blocks, and rank ``r`` keeps blocks ``r, r + tp, r + 2 tp, ...``
    concatenated in that order.
    """
    tp_size = get_group_size(tp_group)
    tp_rank = get_group_rank(tp_group)
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if weight.is_meta and meta_init.skips_draws():
        return   # built on the meta device: the values come when the piece is materialised
    master_dtype = torch.promote_types(weight.dtype, torch.float32)
    master = torch.empty(full_shape, dtype=master_dtype, device="cpu", requires_grad=False)
    init_method(master)
    master = master.to(dtype=weight.dtype)
    block = divide(full_shape[partition_dim], stride * tp_size,
                   f"weight dim {partition_dim} of size {full_shape[partition_dim]} split into "
                   f"stride ({stride}) x --tensor-model-parallel-size ({tp_size}) blocks")
    blocks = torch.split(master, block, dim=partition_dim)
    mine = torch.cat(blocks[tp_rank::tp_size], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine)


def _new_parameter(shape, dtype: torch.dtype, zero: bool = False) -> Parameter:
    factory = torch.zeros if zero else torch.empty
    return Parameter(factory(shape, dtype=dtype, device=device.current_device()))


def _to_weight_shard(weight: Parameter, group, layer: str) -> Parameter:
    """``weight`` cut to this rank's block of rows in the weight-shard ``group`` (itself when
    the group has one rank), keeping its tensor-parallel attributes."""
    if num_shards(group) == 1:
        return weight
    shard = Parameter(shard_rows(weight.data, group, f"{layer} weight"))
    copy_tensor_model_parallel_attributes(shard, weight)
    mark_weight_shard(shard, group)
    return shard


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight.T + bias`` with the tensor-parallel communication of a column-split layer.

    Forward: with sequence parallelism, all-gather the ``[s/tp, b, h]`` input along dim 0 first.
    Backward: the input gradient needs summing over the tp group (each rank holds a partial
    one). Without sequence parallelism it is all-reduced asynchronously while the weight gradient
    is computed; with it, it is reduce-scattered back to ``[s/tp, b, h]``. Under sequence
    parallelism only the local ``[s/tp, b, h]`` input is kept for backward and gathered again
    there, which saves ``(tp - 1) / tp`` of that activation's memory.

    Weight gradients: returned as ordinary ``.grad``, which the data-parallel wrapper adds into
    its ``main_grad`` buffer; or, when the weight carries ``fuse_wgrad_accumulation = True`` and a
    ``main_grad`` (set by the wrapper under ``--gradient-accumulation-fusion``), added here
    straight into ``main_grad`` (one ``addmm_`` in fp32, no separate gradient tensor), and marked
    ``grad_added_to_main_grad`` so the wrapper does not add it again.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, group, async_grad_allreduce, sequence_parallel,
                output_buffer=None):
        ctx.save_for_backward(input_, weight)
        ctx.use_bias = bias is not None
        ctx.group = group
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel = sequence_parallel
        total_input = gather_along_first_dim(input_, group) if sequence_parallel else input_
        out = None
        if output_buffer is not None and bias is None and total_input.dtype == weight.dtype:
            out = output_buffer.acquire(tuple(total_input.shape[:-1]) + (weight.size(0),),
                                        total_input.dtype, total_input.device)
        ctx.output_buffer = output_buffer if out is not None else None
        output = torch.matmul(total_input, weight.t(), out=out)      # [s, b, out/tp]
        if bias is not None:
            # The product is this function's own fresh tensor (not saved for backward): adding
            # the bias in place gives the same values without a second output-sized allocation.
            if bias.dtype == output.dtype:
                output.add_(bias)
            else:
                output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        group = ctx.group
        total_input = (gather_along_first_dim(input_, group) if ctx.sequence_parallel
                       else input_)
        grad_input = handle = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)                  # [s, b, in]
            if ctx.async_grad_allreduce and get_group_size(group) > 1:
                handle = torch.distributed.all_reduce(grad_input, group=group, async_op=True)
        grad_weight = grad_bias = None
        grad_2d = grad_output.reshape(-1, grad_output.size(-1))       # [s*b, out/tp]
        if ctx.needs_input_grad[1]:
            input_2d = total_input.reshape(-1, total_input.size(-1))  # [s*b, in]
            if getattr(weight, "fuse_wgrad_accumulation", False) and hasattr(weight, "main_grad"):
                grad_weight = _accumulate_into_main_grad(weight, grad_2d, input_2d)
            else:
                grad_weight = grad_2d.t().matmul(input_2d)            # [out/tp, in]
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(dim=0)
        if handle is not None:
            handle.wait()
        if grad_input is not None and ctx.sequence_parallel:
            grad_input = reduce_scatter_along_first_dim(grad_input, group)  # [s/tp, b, in]
        if ctx.output_buffer is not None:
            ctx.output_buffer.release()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _accumulate_into_main_grad(weight: torch.Tensor, grad_2d: torch.Tensor,
                               input_2d: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad += grad_2d^T input_2d`` in place; returns the placeholder gradient.

    In fp32 this is a single ``addmm_`` into the buffer. With half-precision activations the
    product is formed in their dtype and added in fp32 (torch has no mixed-dtype ``addmm``).
    The returned tensor is uninitialised and never read: autograd needs a gradient for the
    data-parallel wrapper's hook to run, and the hook skips it because of the mark set here.
    """
    main_grad = weight.main_grad                                      # [out/tp, in]
    if grad_2d.dtype == main_grad.dtype and input_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)
    else:
        main_grad.add_(grad_2d.t().matmul(input_2d))
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def linear_with_grad_accumulation_and_async_allreduce(
        input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
        async_grad_allreduce: bool, sequence_parallel: bool,
        output_buffer: Optional["ReusableOutputBuffer"] = None) -> torch.Tensor:
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication`.

    Args:
        input: ``[s, b, h]``, or ``[s/tp, b, h]`` with ``sequence_parallel``.
        weight: ``[out/tp, h]``.
        bias: ``[out/tp]`` or None.
        group: the tensor-parallel group.
        async_grad_allreduce: all-reduce the input gradient over ``group`` (overlapped with the
            weight-gradient matmul); must be False with ``sequence_parallel``.
        sequence_parallel: gather the input along dim 0 first, reduce-scatter its gradient.
        output_buffer: write the output (bias-free layers only) into this kept storage, which
            the layer's backward frees again; only for outputs nothing reads after that
            backward (see :class:`ReusableOutputBuffer`).
    """
    if async_grad_allreduce and sequence_parallel:
        raise ValueError("async_grad_allreduce and sequence_parallel are exclusive: under "
                         "sequence parallelism the input gradient is reduce-scattered")
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, group, async_grad_allreduce, sequence_parallel, output_buffer)


class ReusableOutputBuffer:
    """Storage kept for one large layer output that lives from the forward to the backward.

    On CPU each allocation above glibc's mmap threshold (32 MiB at most) is new memory from the
    kernel, zeroed one page fault per 4 KiB as it is first written. The output layer's
    ``[s, b, V/tp]`` logits (412 MiB for s 512, b 4, V 50304 in fp32) would pay that every
    micro-batch; written into kept storage, they pay it once.

    :meth:`acquire` hands out the storage (as a new, non-view tensor) unless an earlier forward
    still holds it, i.e. its backward has not run yet (then it returns None and the layer
    allocates as usual, so pipeline schedules with several forwards in flight stay correct);
    the layer's backward calls :meth:`release`. Give one only to a layer whose output nothing
    reads after that layer's backward: the output layer feeding the loss during training.
    """

    def __init__(self):
        self._storage: Optional[torch.Tensor] = None
        self._in_use = False

    def acquire(self, shape: Tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> Optional[torch.Tensor]:
        if self._in_use:
            return None
        numel = 1
        for size in shape:
            numel *= size
        kept = self._storage
        if kept is None or kept.numel() != numel or kept.dtype != dtype or kept.device != device:
            self._storage = None  # free the old storage before taking the new one
            self._storage = kept = torch.empty(numel, dtype=dtype, device=device)
        self._in_use = True
        return torch.empty(0, dtype=dtype, device=device).set_(kept.untyped_storage(), 0, shape)

    def release(self) -> None:
        self._in_use = False


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank ``r`` computes ``Y_r = X A_r + b_r``.

    The weight is stored as ``[output_size / tp, input_size]`` (like ``torch.nn.Linear``).

    Args:
        input_size: first dim of ``A``.
        output_size: second dim of ``A``; must be divisible by ``stride * tp``.
        init_method: in-place initialiser applied to the full ``[output_size, input_size]``
            weight.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        bias: add a bias (initialised to zero).
        gather_output: all-gather the output so every rank returns the full ``Y``; otherwise
            rank ``r`` returns ``Y_r``.
        skip_bias_add: do not add the bias; return it as the second output so the caller can
            fuse it into a later op.
        sequence_parallel: the input is ``[s/tp, b, h]``, this rank's piece of the sequence; it is
            all-gathered along dim 0 inside, and its gradient reduce-scattered back.
        params_dtype: dtype of the parameters.
        stride: number of interleaved blocks per rank, for fused weights such as a stacked
            ``[q; k; v]`` projection (``stride = 3``), so each rank holds its share of each block.
        skip_weight_param_allocation: create no weight; ``forward`` must then be given one (the
            output layer sharing the word embedding's weight).
        weight_shard_group: a weight-shard group (None: none); the weight is then stored as this
            rank's ``1/g`` block of rows and all-gathered before the matmul
            (:mod:`~megatron.core.tensor_parallel.weight_shards`).
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Callable, tp_group,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 stride: int = 1, skip_weight_param_allocation: bool = False,
                 weight_shard_group=None):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True (the output would be the full sequence)")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        tp_size = get_group_size(tp_group)
        self.output_size_per_partition = divide(
            output_size, tp_size,
            f"ColumnParallelLinear output size ({output_size}) over "
            f"--tensor-model-parallel-size ({tp_size})")
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _new_parameter((self.output_size_per_partition, input_size),
                                         params_dtype)
            _initialize_affine_weight_cpu(self.weight, (output_size, input_size), 0,
                                          init_method, tp_group, stride)
            self.weight = _to_weight_shard(self.weight, weight_shard_group, "ColumnParallelLinear")
        self.weight_shard_group = weight_shard_group if self.weight is not None else None
        if bias:
            self.bias = _new_parameter((self.output_size_per_partition,), params_dtype, True)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor, weight: Optional[torch.Tensor] = None,
                output_buffer: Optional[ReusableOutputBuffer] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns ``(output, output_bias)``; ``output_bias`` is None unless ``skip_bias_add``.

        Args:
            input: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).
            weight: the weight to use when the layer was built with
                ``skip_weight_param_allocation``; shape ``[output_size / tp, input_size]``.
            output_buffer: see :func:`linear_with_grad_accumulation_and_async_allreduce`.
        """
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with "
                                 "skip_weight_param_allocation=True; pass weight= to forward")
            weight = gather_weight_shards(self.weight, self.weight_shard_group)
        else:
            expected = (self.output_size_per_partition, self.input_size)
            if tuple(weight.shape) != expected:
                raise ValueError(f"ColumnParallelLinear: weight= has shape {tuple(weight.shape)}, "
                                 f"expected {expected}")
        bias = None if self.skip_bias_add else self.bias
        async_allreduce = not self.sequence_parallel and get_group_size(self.tp_group) > 1
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input, weight, bias, self.tp_group, async_allreduce,
            self.sequence_parallel, output_buffer)                    # [s, b, out/tp]
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(
                output_parallel, self.tp_group)                       # [s, b, out]
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by rows and ``X`` by columns: ``Y = sum_r X_r A_r + b``.

    The weight is stored as ``[output_size, input_size / tp]``. The bias is replicated and
    added once, after the partial products are summed.

    Args:
        input_size: first dim of ``A``; must be divisible by tp.
        output_size: second dim of ``A``.
        init_method: in-place initialiser applied to the full ``[output_size, input_size]``
            weight.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        bias: add a bias (initialised to zero).
        input_is_parallel: the input is already split along its last dim (the output of a
            ColumnParallelLinear); otherwise the full input is split here.
        skip_bias_add: do not add the bias; return it as the second output.
        sequence_parallel: reduce-scatter the output along dim 0 to ``[s/tp, b, h]`` instead of
            all-reducing it. The bias is then marked ``sequence_parallel`` (its gradient is
            partial on each rank).
        params_dtype: dtype of the parameters.
        weight_shard_group: a weight-shard group (None: none); see ColumnParallelLinear. The
            weight's rows (``output_size``) are cut, the bias stays whole.
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Callable, tp_group,
                 bias: bool = True, input_is_parallel: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 weight_shard_group=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                             "input_is_parallel=True")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        tp_size = get_group_size(tp_group)
        self.input_size_per_partition = divide(
            input_size, tp_size,
            f"RowParallelLinear input size ({input_size}) over "
            f"--tensor-model-parallel-size ({tp_size})")
        self.weight = _new_parameter((output_size, self.input_size_per_partition), params_dtype)
        _initialize_affine_weight_cpu(self.weight, (output_size, input_size), 1, init_method,
                                      tp_group, 1)
        self.weight = _to_weight_shard(self.weight, weight_shard_group, "RowParallelLinear")
        self.weight_shard_group = weight_shard_group
        if bias:
            self.bias = _new_parameter((output_size,), params_dtype, True)
            set_defaults_if_not_set_tensor_model_parallel_attributes(self.bias)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns ``(output, output_bias)``; ``output_bias`` is None unless ``skip_bias_add``.

        Args:
            input: ``[s, b, h / tp]`` when ``input_is_parallel``, else ``[s, b, h]``.

        Output is ``[s, b, out]``, or ``[s/tp, b, out]`` with sequence parallelism.
        """
        if self.input_is_parallel:
            input_parallel = input
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(
                input, self.tp_group)                                 # [s, b, h/tp]
        # No communication inside: the input is already split, and its gradient stays split.
        weight = gather_weight_shards(self.weight, self.weight_shard_group)  # [out, in/tp]
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, weight, None, self.tp_group, False, False)  # [s, b, out] partial
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(
                output_parallel, self.tp_group)                       # [s/tp, b, out]
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows over the tensor-parallel group.

    Rank ``r`` holds rows ``[r V / tp, (r + 1) V / tp)``. Each rank looks up the ids it owns,
    writes zeros for the others, and the partial results are summed over the group.

    Args:
        num_embeddings: vocabulary size (padded; must be divisible by tp).
        embedding_dim: hidden size.
        init_method: in-place initialiser applied to the full ``[V, h]`` table.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        params_dtype: dtype of the table.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 tp_group, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        tp_size = get_group_size(tp_group)
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, get_group_rank(tp_group), tp_size))
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _new_parameter((self.num_embeddings_per_partition, embedding_dim),
                                     params_dtype)
        _initialize_affine_weight_cpu(self.weight, (num_embeddings, embedding_dim), 0,
                                      init_method, tp_group, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` of any shape -> embeddings of shape ``input_ids.shape + (h,)``."""
        lookup = _embedding_lookup(self.weight)
        if get_group_size(self.tp_group) == 1:
            return lookup(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = lookup(local_ids, self.weight)              # [..., h], partial
        output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)


class EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient goes straight into ``main_grad``.

    Backward adds each looked-up row's gradient into ``weight.main_grad`` with one
    ``index_add_``, in place of autograd's dense ``[V, h]`` gradient (allocated, zero-filled,
    filled, then added into ``main_grad`` by the data-parallel wrapper). Used under
    ``--gradient-accumulation-fusion`` (the wrapper marks the weight
    ``fuse_wgrad_accumulation`` and gives it ``main_grad``).

    The weight's gradient placeholder follows :func:`_accumulate_into_main_grad`: an
    uninitialised tensor that the wrapper's hook skips because ``grad_added_to_main_grad`` is
    set. When that mark is already set, the output layer of the same stage (tied embeddings)
    has accumulated its part into ``main_grad`` earlier in this backward and handed autograd a
    placeholder; this lookup then returns no gradient, so autograd has no two placeholders to
    add up (which would cost a vocabulary-sized sum) and still calls the hook once.
    """

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        # The parameter itself, not a saved tensor: backward reads its main_grad, which a
        # saved-tensor hook (activation offloading, memory probes) would hand back without.
        ctx.weight = weight
        return F.embedding(ids, weight)                               # [..., h]

    @staticmethod
    def backward(ctx, grad_output):
        (ids,), weight = ctx.saved_tensors, ctx.weight
        main_grad = weight.main_grad                                  # [V/tp, h]
        rows = grad_output.reshape(-1, grad_output.size(-1))          # [n, h]
        main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
        if getattr(weight, "grad_added_to_main_grad", False):
            return None, None
        weight.grad_added_to_main_grad = True
        return None, torch.empty_like(weight)


def _embedding_lookup(weight: torch.Tensor) -> Callable:
    """``F.embedding``, or its fused-accumulation form when the weight asks for it."""
    if (getattr(weight, "fuse_wgrad_accumulation", False) and hasattr(weight, "main_grad")
            and weight.requires_grad and torch.is_grad_enabled()):
        return EmbeddingWithGradAccumulation.apply
    return F.embedding

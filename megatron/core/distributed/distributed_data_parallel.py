"""Data-parallel wrapper: gradients accumulate into contiguous buffers and are averaged in buckets.

What the optimizer sees: every trainable parameter ``p`` has ``p.main_grad``, a view into one
contiguous buffer per gradient dtype (fp32 with ``accumulate_allreduce_grads_in_fp32``, else the
parameter's dtype: bf16 under ``--bf16 --grad-reduce-in-bf16``), or an fp32 tensor of its own for
the parameters named by ``fp32_local_accumulation_patterns`` (see :mod:`.grad_buffer`). Backward adds each micro-batch's gradient into ``main_grad`` and sets
``p.grad`` to None (a post-accumulate-grad hook, so ``p.grad`` never outlives one backward).
After :meth:`DistributedDataParallel.finish_grad_sync`, ``main_grad`` holds the gradient summed over
micro-batches and averaged over the data-parallel group (with ``use_distributed_optimizer``, only
in this rank's shard of each bucket: the reduction is a reduce-scatter).

One training step::

    model.zero_grad_buffer()
    for i, batch in enumerate(micro_batches):
        ctx = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    model.finish_grad_sync()          # or finalize_model_grads([model], ...)
    optimizer.step()                  # reads p.main_grad

With ``overlap_grad_reduce`` the all-reduce of a bucket starts from the backward hooks of the
last micro-batch as soon as all of that bucket's gradients are in, so communication overlaps the
rest of backward; ``finish_grad_sync`` then only waits.
"""

import fnmatch
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.grad_buffer import GradBuffer

# Megatron's default when overlapping: large enough that collectives are bandwidth-bound.
DEFAULT_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


def _matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Whether a parameter name matches one of the fnmatch ``patterns`` (``'all'``: any)."""
    return any(pattern == "all" or fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _same_ranks(group_a, group_b) -> bool:
    """Whether two process groups hold the same global ranks."""
    if group_a is group_b:
        return True
    return dist.get_process_group_ranks(group_a) == dist.get_process_group_ranks(group_b)


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients are accumulated and averaged over ``dp_group`` in buckets.

    Args:
        module: the model (chunk) to wrap; its parameters must be on one device per dtype.
        dp_group: data-parallel process group (``ParallelState.dp_group``).
        accumulate_allreduce_grads_in_fp32: keep ``main_grad`` and reduce in fp32
            (``--accumulate-allreduce-grads-in-fp32``), whatever the parameters' dtype.
        overlap_grad_reduce: start bucket all-reduces during the last micro-batch's backward
            (``--overlap-grad-reduce``).
        bucket_size: elements per bucket (``--ddp-bucket-size``). None: one bucket per buffer
            without overlap; ``max(40M, 1M x dp size)`` with overlap. An explicit size is honoured
            in both modes.
        use_distributed_optimizer: lay buckets out padded to a multiple of the dp size and
            reduce-scatter them instead of all-reducing (``--use-distributed-optimizer``): after
            :meth:`finish_grad_sync` only this rank's shard of each bucket (see
            :meth:`Bucket.shard_range`) holds the dp-averaged gradient, which is all the
            distributed optimizer reads; the rest of ``main_grad`` keeps local values.
        gradient_accumulation_fusion: let the tensor-parallel linear layers add their weight
            gradients straight into ``main_grad`` (``--gradient-accumulation-fusion``, the
            default; off with ``--no-gradient-accumulation-fusion``): each weight gets
            ``fuse_wgrad_accumulation = True``, which those layers look for.
        expert_dp_group: the expert-data-parallel group (``ParallelState.expert_dp_group``).
            Parameters marked ``allreduce = False`` (the MoE experts) then get buffers of
            their own, :attr:`expert_grad_buffers`, summed over that group and divided by the
            ``dp_group`` size: every rank's loss reaches an expert through the dispatcher's
            all-to-all, so the sum over expert-data-parallel ranks already covers all of
            ``dp_group``'s losses. None, or a group of the same ranks as ``dp_group``: one set
            of buffers for all parameters.
        calculate_per_token_loss: sum gradients over the groups instead of averaging
            (``--calculate-per-token-loss``): the losses are sums over tokens, and
            :meth:`scale_gradients` divides by the step's token count afterwards.
        reduce_scatter_with_fp32_accumulation: with ``use_distributed_optimizer``, each
            rank sums the pieces of its shard in fp32 and rounds once
            (``--ddp-reduce-scatter-with-fp32-accumulation``).
        fp32_local_accumulation_patterns: parameters whose name (as ``module`` names it)
            matches one of these fnmatch patterns, or any with ``'all'``, accumulate
            micro-batches in an fp32 ``main_grad`` of their own when their buffer is half
            precision (``--ddp-param-name-patterns-for-fp32-local-accumulation``);
            :attr:`fp32_local_param_names` lists them.
        weight_shard_dp_group / expert_weight_shard_dp_group: the data-parallel ranks of
            ``dp_group`` (``expert_dp_group``) that hold the same weight shard, i.e. without this
            rank's weight-shard peers. Parameters marked ``weight_shards > 1`` (see
            :mod:`megatron.core.tensor_parallel.weight_shards`; dense ones, and experts marked
            ``allreduce = False``) then get buffers of their own,
            :attr:`weight_shard_grad_buffers`, summed over that group and divided by the
            ``dp_group`` size: the layers' reduce-scatter has already summed over the peers.
            Not with ``use_distributed_optimizer``.
    """

    def __init__(self, module: torch.nn.Module, *, dp_group,
                 accumulate_allreduce_grads_in_fp32: bool = False,
                 overlap_grad_reduce: bool = False, bucket_size: Optional[int] = None,
                 use_distributed_optimizer: bool = False,
                 gradient_accumulation_fusion: bool = False, expert_dp_group=None,
                 calculate_per_token_loss: bool = False,
                 reduce_scatter_with_fp32_accumulation: bool = False,
                 fp32_local_accumulation_patterns: Sequence[str] = (),
                 weight_shard_dp_group=None, expert_weight_shard_dp_group=None):
        super().__init__()
        if dp_group is None:
            raise ValueError("DistributedDataParallel needs dp_group=<the data-parallel process "
                             "group> (ParallelState.dp_group), got None")
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        # Expert parameters need buffers of their own only when their group differs.
        if expert_dp_group is not None and _same_ranks(expert_dp_group, dp_group):
            expert_dp_group = None
        self.expert_dp_group = expert_dp_group
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = max(DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * self.dp_size)
        self.bucket_size = bucket_size

        self._param_names = {p: name for name, p in module.named_parameters()}
        self.fp32_local_param_names = [
            name for p, name in self._param_names.items()
            if p.requires_grad and _matches_any(name, fp32_local_accumulation_patterns)]
        fp32_local = [p for p, name in self._param_names.items()
                      if name in self.fp32_local_param_names]
        # Reverse order: backward produces the last layers' gradients first.
        self.shard_dp_groups = {False: weight_shard_dp_group, True: expert_weight_shard_dp_group}
        by_dtype: Dict[torch.dtype, list] = {}
        expert_by_dtype: Dict[torch.dtype, list] = {}
        shard_by_key: Dict[tuple, list] = {}
        for param in reversed(list(module.parameters())):
            if not param.requires_grad:
                continue
            dtype = torch.float32 if accumulate_allreduce_grads_in_fp32 else param.dtype
            shard_key = self._weight_shard_key(param, dtype, use_distributed_optimizer)
            is_expert = expert_dp_group is not None and not getattr(param, "allreduce", True)
            if shard_key is not None:
                shard_by_key.setdefault(shard_key, []).append(param)
            else:
                (expert_by_dtype if is_expert else by_dtype).setdefault(dtype, []).append(param)

        self.grad_buffers: Dict[torch.dtype, GradBuffer] = {}
        self.expert_grad_buffers: Dict[torch.dtype, GradBuffer] = {}
        self.weight_shard_grad_buffers: Dict[tuple, GradBuffer] = {}
        self.param_to_grad_buffer: Dict[torch.nn.Parameter, GradBuffer] = {}
        sets = [(self.grad_buffers, dp_group, by_dtype),
                (self.expert_grad_buffers, expert_dp_group, expert_by_dtype)]
        sets += [(self.weight_shard_grad_buffers, self.shard_dp_groups[key[1]], {key: params})
                 for key, params in shard_by_key.items()]
        for buffers, group, grouped in sets:
            for key, params in grouped.items():
                dtype = key[0] if isinstance(key, tuple) else key
                buffer = GradBuffer(params, dtype, group, bucket_size, overlap_grad_reduce,
                                    use_distributed_optimizer,
                                    average_over=1 if calculate_per_token_loss else self.dp_size,
                                    fp32_accumulation=reduce_scatter_with_fp32_accumulation,
                                    fp32_local_params=fp32_local)
                buffers[key] = buffer
                for param in params:
                    self.param_to_grad_buffer[param] = buffer

        for param in self.param_to_grad_buffer:
            param.fuse_wgrad_accumulation = gradient_accumulation_fusion
        self._grad_hook_handles = [param.register_post_accumulate_grad_hook(self._make_param_hook())
                                   for param in self.param_to_grad_buffer]

    def _weight_shard_key(self, param, dtype, use_distributed_optimizer) -> Optional[tuple]:
        """``(dtype, is_expert)`` of a weight shard's buffer; None for any other parameter."""
        if getattr(param, "weight_shards", 1) == 1:
            return None
        expert = not getattr(param, "allreduce", True)
        name = self._param_names.get(param, "?")
        if self.shard_dp_groups[expert] is None:
            kind = "expert_weight_shard_dp_group" if expert else "weight_shard_dp_group"
            raise ValueError(f"parameter {name!r} is a weight shard: DistributedDataParallel "
                             f"needs {kind}= (the data-parallel ranks without its weight-shard "
                             f"peers)")
        if use_distributed_optimizer:
            raise ValueError(f"parameter {name!r} is a weight shard: weight shards are not "
                             f"built with --use-distributed-optimizer yet")
        return dtype, expert

    def _make_param_hook(self):
        """The hook run after backward has accumulated a parameter's ``.grad``.

        It adds ``.grad`` into ``main_grad`` and frees ``.grad``. A layer that already wrote its
        gradient straight into ``main_grad`` (fused weight-gradient accumulation) sets
        ``param.grad_added_to_main_grad = True`` and the add is skipped. In the last micro-batch
        with ``overlap_grad_reduce``, it also reports the parameter ready, which launches its
        bucket's all-reduce once the whole bucket is in.
        """

        def hook(param: torch.nn.Parameter) -> None:
            buffer = self.param_to_grad_buffer[param]
            if buffer.param_to_bucket[param].communication_issued:
                raise RuntimeError(
                    f"a gradient of parameter {self._param_names.get(param, '?')!r} arrived after "
                    f"its bucket's all-reduce was issued; call zero_grad_buffer() before the next "
                    f"step's backward, and run backward only once per micro-batch")
            if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
            param.grad_added_to_main_grad = False
            if self.overlap_grad_reduce and buffer.is_last_microbatch:
                buffer.register_grad_ready(param)

        return hook

    def all_grad_buffers(self) -> List[GradBuffer]:
        """The data-parallel buffers, then the expert ones, then the weight shards'."""
        return (list(self.grad_buffers.values()) + list(self.expert_grad_buffers.values())
                + list(self.weight_shard_grad_buffers.values()))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside this context only accumulate; none of them starts a reduction.

        Use it for all but the last micro-batch of a step.
        """
        for buffer in self.all_grad_buffers():
            buffer.is_last_microbatch = False
        try:
            yield
        finally:
            for buffer in self.all_grad_buffers():
                buffer.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (async with overlap)."""
        for buffer in self.all_grad_buffers():
            buffer.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Complete the reduction: afterwards every ``main_grad`` is averaged over the dp group.

        Call once per step, after the last micro-batch's backward.
        """
        for buffer in self.all_grad_buffers():
            buffer.finish_grad_sync()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every ``main_grad`` by ``factor`` (after :meth:`finish_grad_sync`)."""
        for buffer in self.all_grad_buffers():
            buffer.scale(factor)

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and forget the previous step's reduction; call before a step."""
        for param in self.param_to_grad_buffer:
            param.grad_added_to_main_grad = False
        for buffer in self.all_grad_buffers():
            buffer.reset()

    def broadcast_params(self) -> None:
        """Copy every parameter from data-parallel rank 0 to the other ranks of the dp group."""
        for param in self.module.parameters():
            group = self.dp_group
            if self.expert_dp_group is not None and not getattr(param, "allreduce", True):
                group = self.expert_dp_group
            if getattr(param, "weight_shards", 1) > 1:   # peers hold other rows: not them
                group = self.shard_dp_groups[not getattr(param, "allreduce", True)]
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state dict, with its own keys (no ``module.`` prefix)."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's checkpoint state (its own method when it has one)."""
        save = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if save is not None:
            return save(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

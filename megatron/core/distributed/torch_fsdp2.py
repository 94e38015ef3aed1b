"""Fully sharded data parallelism on PyTorch's FSDP2 (``--use-torch-fsdp2``).

:class:`TorchFullyShardedDataParallel` applies ``torch.distributed.fsdp.fully_shard`` over a
one-dimensional ``DeviceMesh`` of the data-parallel (x context-parallel) group: first to each
unit the caller names (every transformer layer, the untied embedding and output layer), then to
the whole model, which takes what is left (final norm, a tied embedding). Every parameter then
is a ``DTensor`` holding this rank's dim-0 shard; the sharding, the all-gathers before each
unit's forward and backward, and the reduce-scatter of gradients are FSDP2's own.

It answers the training loop as :class:`~megatron.core.distributed.DistributedDataParallel`
does:

* :meth:`no_sync` turns FSDP2's gradient synchronisation off for the micro-batches it wraps,
  so they accumulate unsharded gradients locally, and the last micro-batch's backward runs one
  reduce-scatter per unit (averaged over the mesh, as the grad-buffer wrapper averages over
  the data-parallel group; summed with ``calculate_per_token_loss``, then divided by the
  token count through :meth:`scale_gradients`);
* with pipeline parallelism each model chunk (each virtual stage's too) is a wrapper of its
  own over its stage's data-parallel group, and the schedule keeps a chunk's :meth:`no_sync`
  open until that chunk's last backward, so the in-flight micro-batches of 1F1B accumulate
  unsharded and each unit still reduce-scatters once per step;
* afterwards each ``param.grad`` is a ``DTensor``: this rank's shard of the averaged gradient;
  nothing is left for :meth:`finish_grad_sync` to do;
* checkpoints see whole tensors: :meth:`state_dict_for_save_checkpoint` gathers each sharded
  tensor (a collective: every rank of the mesh calls it, in the same order) and
  :meth:`load_state_dict` takes whole tensors and keeps this rank's shard of each, so a
  checkpoint moves freely between runs with and without FSDP2.

The parameter attributes the optimizer and the norms read (``tensor_model_parallel``,
``shared``, ``sequence_parallel``, ...) are carried from the original parameters onto the
sharded ones.
"""

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import device

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# torch.distributed.fsdp and torch.distributed.tensor are imported where FSDP2 is set up, not
# here: importing them costs each process about 0.7 s of CPU at start, which every run that does
# not shard paid (a startup test checks that a plain run leaves them unimported).

# Attributes that say how a parameter is split, shared or grouped; kept across sharding.
PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride",
                    "sequence_parallel", "sum_grad_over_tp", "shared", "allreduce",
                    "is_embedding_or_output_parameter")


def is_dtensor(value) -> bool:
    """Whether ``value`` is a ``DTensor``, without importing ``torch.distributed.tensor``: no
    DTensor can exist before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a ``DTensor`` (sharing its storage,
    so in-place changes reach the DTensor), else ``tensor`` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def gather_full(value):
    """``value`` with every ``DTensor`` in it (nested dicts, lists, tuples) replaced by the
    whole tensor. Collective over each DTensor's mesh; every rank must pass the same tree."""
    if is_dtensor(value):
        return value.full_tensor()
    if isinstance(value, dict):
        return type(value)((k, gather_full(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(gather_full(v) for v in value)
    return value


def shard_like(full: torch.Tensor, like: "DTensor") -> "DTensor":
    """This rank's shard of the whole tensor ``full``, laid out as ``like`` (no communication:
    every rank holds ``full``)."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a whole tensor of shape {tuple(full.shape)} cannot take the place of "
                         f"a sharded one of shape {tuple(like.shape)}")
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def _cast_floats(tree, dtype: Optional[torch.dtype]):
    """``tree`` with its fp32 tensors cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    if isinstance(tree, dict):
        return type(tree)((k, _cast_floats(v, dtype)) for k, v in tree.items())
    if isinstance(tree, torch.Tensor) and tree.dtype == torch.float32:
        return tree.to(dtype)
    return tree


def _flat_items(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _data_parallel_mesh(dp_group, device_type: str, replicas: int):
    """The mesh to shard over and the group of one shard set: ``dp_group`` itself (one
    dimension), or with ``replicas > 1`` a (replica, shard) mesh of its ranks, consecutive ranks
    sharing a replica. Each rank creates only the two groups it belongs to (local
    synchronisation), so every data-parallel group may build its own mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if replicas == 1:
        return DeviceMesh.from_group(dp_group, device_type), dp_group
    ranks = dist.get_process_group_ranks(dp_group)
    if replicas < 1 or len(ranks) % replicas:
        raise ValueError(f"hybrid sharding needs the data-parallel size ({len(ranks)}) "
                         f"divisible by the number of replicas ({replicas})")
    grid = torch.tensor(ranks, dtype=torch.int).reshape(replicas, len(ranks) // replicas)
    row, col = next((r, c) for r in range(grid.shape[0]) for c in range(grid.shape[1])
                    if grid[r, c] == dist.get_rank())
    shard = dist.new_group(grid[row].tolist(), use_local_synchronization=True)
    replicate = dist.new_group(grid[:, col].tolist(), use_local_synchronization=True)
    mesh = DeviceMesh.from_group([replicate, shard], device_type, mesh=grid,
                                 mesh_dim_names=("replicate", "shard"))
    return mesh, shard


def _broadcast_from_first(module, dp_group, expert_units, expert_dp_group) -> None:
    """Copy the first rank's weights over ``dp_group``; the experts' over
    ``expert_dp_group`` (the ranks of one expert-parallel position hold the same experts)."""
    experts = {id(p) for unit in expert_units for p in unit.parameters()}
    for param in module.parameters():
        group = expert_dp_group if id(param) in experts else dp_group
        dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def _divide_gradients_by(unit, factor: float, mesh_size: int) -> None:
    """Make the sharded ``unit``'s reduction divide its summed gradients by ``factor`` (in
    place of FSDP2's mean over the mesh)."""
    if mesh_size > 1:
        unit.set_gradient_divide_factor(factor)
        # A plain sum, then the division (gloo has no pre-multiplied sum).
        unit.set_force_sum_reduction_for_comms(True)
    elif factor != 1.0:
        # One rank (an expert mesh at EP = DP): FSDP2 divides its copy by the factor, and
        # again by the pre- and post-factors it splits it into when it forces a sum or the
        # reduce dtype is fp16 (its overflow guard): fp16 reductions came out divided by
        # factor**2 (tested). Left at FSDP2's default it divides nothing on one rank; the
        # hook, run on the reduced gradient in the reduce dtype, divides once.
        unit.set_all_reduce_hook(lambda grad: grad.div_(factor))


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Shard ``module`` over ``dp_group`` with FSDP2.

    Args:
        module: the model chunk (on its device, weights initialised identically on every rank).
        dp_group: the data-parallel (x context-parallel) process group to shard over
            (``ParallelState.dp_cp_group``).
        units: sub-modules sharded as units of their own, in forward order; each is gathered
            just before its forward and freed after it. Parameters outside every unit belong to
            the root unit. A parameter used outside its unit's forward (a tied embedding read
            by the output layer) must stay in the root.
        reshard_after_forward: free each unit's gathered parameters after its forward and
            gather them again for backward (``--torch-fsdp2-no-reshard-after-forward`` turns
            it off: more memory, one all-gather fewer per unit).
        compute_dtype: with bf16 or fp16 (``--bf16`` / ``--fp16``), the parameters stay fp32
            shards (the main weights) and FSDP2's mixed-precision policy gathers them in that
            dtype for forward and backward and reduces gradients in fp32 (with fp16 they are
            still multiplied by the loss scale; the optimizer unscales them). Checkpoints then
            hold the weights in that dtype, as a half-precision model's (the fp32 values go
            with the optimizer state). None: compute in
            the parameters' dtype.
        broadcast_first: copy rank 0's weights to the group before sharding
            (``--data-parallel-random-init``).
        reduce_dtype: the dtype gradients are reduce-scattered in (FSDP2's ``reduce_dtype``;
            the sharded gradients are then kept in the parameters' dtype). None: fp32 with a
            compute dtype, else the parameters' dtype.
        replicas: hybrid sharding (HSDP): split ``dp_group`` into this many replicas of
            consecutive ranks; each parameter is sharded within a replica and replicated
            across them (a two-dimensional mesh, FSDP2's HSDP: reduce-scatter within, then
            all-reduce across). 1: shard over the whole group.
        expert_units: the mixture-of-experts layers' expert modules (their parameters are
            marked ``allreduce = False``), sharded as units of their own over
            ``expert_dp_group`` before the units that hold them. Every rank's tokens reach
            an expert through the dispatcher, so its gradient is summed over the
            expert-data-parallel ranks and divided by the size of ``dp_group`` (as the
            grad-buffer wrapper does), not averaged over its own mesh.
        expert_dp_group: the expert-data-parallel group (``ParallelState.expert_dp_group``);
            required with ``expert_units``.
        calculate_per_token_loss: leave every gradient summed over the ranks, experts' too
            (``--calculate-per-token-loss``): the loss functions return sums, and the
            gradients are divided by the global batch's token count afterwards
            (:meth:`scale_gradients`), as the grad-buffer wrapper leaves its sums.
    """

    def __init__(self, module: torch.nn.Module, *, dp_group,
                 units: Sequence[torch.nn.Module] = (), reshard_after_forward: bool = True,
                 compute_dtype: Optional[torch.dtype] = None, broadcast_first: bool = False,
                 reduce_dtype: Optional[torch.dtype] = None, replicas: int = 1,
                 expert_units: Sequence[torch.nn.Module] = (), expert_dp_group=None,
                 calculate_per_token_loss: bool = False):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__()
        if dp_group is None:
            raise ValueError("TorchFullyShardedDataParallel needs dp_group=<the data-parallel "
                             "process group> (ParallelState.dp_cp_group), got None")
        if expert_units and (expert_dp_group is None or replicas != 1):
            raise ValueError("TorchFullyShardedDataParallel: expert_units need "
                             "expert_dp_group=<ParallelState.expert_dp_group> and replicas=1 "
                             f"(got {expert_dp_group}, {replicas})")
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.compute_dtype = compute_dtype
        if broadcast_first:
            _broadcast_from_first(module, dp_group, expert_units, expert_dp_group)
        attributes = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
                      for name, p in module.named_parameters()}
        device_type = next(module.parameters()).device.type
        if device_type == "meta":   # built on the meta device: allocated after sharding
            device_type = device.current_device().type
        self.mesh, self._shard_group = _data_parallel_mesh(dp_group, device_type, replicas)
        if reduce_dtype is None and compute_dtype is not None:
            reduce_dtype = torch.float32
        # The units' inputs keep their dtypes: activations already come out of the units in
        # the compute dtype, and the fp32 rotary angles must stay fp32 (cast, they moved a
        # bf16 run's first loss off the same run without FSDP2).
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                      cast_forward_inputs=False)
        kwargs = dict(reshard_after_forward=reshard_after_forward, mp_policy=policy)
        divide_by = 1.0 if calculate_per_token_loss else float(self.dp_size)
        if expert_units:
            expert_mesh = DeviceMesh.from_group(expert_dp_group, device_type)
            for unit in expert_units:
                fully_shard(unit, mesh=expert_mesh, **kwargs)
                _divide_gradients_by(unit, divide_by, expert_mesh.size())
        for unit in units:
            fully_shard(unit, mesh=self.mesh, **kwargs)
        fully_shard(module, mesh=self.mesh, **kwargs)
        if calculate_per_token_loss:
            for unit in (*units, module):
                _divide_gradients_by(unit, 1.0, self.mesh.size())
        for name, param in module.named_parameters():
            for attr, value in attributes.get(name, {}).items():
                setattr(param, attr, value)

    @property
    def shard_group(self):
        """The group each parameter is sharded over (its norms are summed over it)."""
        return self._shard_group

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside only accumulate unsharded gradients; no reduce-scatter."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self) -> None:
        """Nothing to start: the last micro-batch's backward reduce-scatters."""

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP2 finishes its reduce-scatters at the end of backward."""

    def zero_grad_buffer(self) -> None:
        """Nothing to zero: the optimizer drops the sharded gradients (``zero_grad``)."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply this rank's shard of every gradient by ``factor`` (after the reduction)."""
        for param in self.module.parameters():
            if param.grad is not None:
                local_tensor(param.grad).mul_(factor)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state, with whole tensors (collective)."""
        return gather_full(self.module.state_dict(prefix=prefix, keep_vars=False))

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's checkpoint state, with whole tensors (collective)."""
        save = getattr(self.module, "state_dict_for_save_checkpoint", None)
        tree = (save(prefix=prefix, keep_vars=False) if save is not None
                else self.module.state_dict(prefix=prefix))
        return _cast_floats(gather_full(tree), self.compute_dtype)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load whole tensors (the module's own nested or flat keys); each sharded tensor keeps
        this rank's shard. No communication."""
        current = dict(self.module.state_dict())
        flat = dict(_flat_items(state_dict)) if any(
            isinstance(v, dict) for v in state_dict.values()) else dict(state_dict)
        for key, value in list(flat.items()):
            like = current.get(key)
            if is_dtensor(like) and isinstance(value, torch.Tensor) and not is_dtensor(value):
                flat[key] = shard_like(value, like)
        return self.module.load_state_dict(flat, strict=strict)

"""Checkpoints of fully sharded runs in Megatron-LM's ``torch_dcp`` format
(``--ckpt-format torch_dcp``).

Megatron-LM writes this format only under ``--use-torch-fsdp2`` with tensor and pipeline size
1: it hands ``torch.distributed.checkpoint`` the same state dict its ``torch`` format pickles,
with the FSDP2 model's own tensors (DTensor shards) in place of whole ones. The folder is a
plain DCP one (``.metadata`` and one ``__<rank>_0.distcp`` per rank, no ``metadata.json``) in
the usual iteration folder with the usual tracker, and its keys are DCP's flattened names of
that dict:

* ``model.<key>``: Megatron-Core's name of each weight (``embedding.word_embeddings.weight``,
  ``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...), a SwiGLU fc1 whole;
* ``optimizer.state.<i>.{exp_avg,exp_avg_sq,step}`` and ``optimizer.param_groups.<g>.<field>``:
  the torch optimizer's own ``state_dict()`` (parameters numbered in group order); with
  ``--bf16`` / ``--fp16`` the mixed-precision layout, one level down
  (``optimizer.optimizer.state...``, ``optimizer.grad_scaler...``,
  ``optimizer.fp32_from_fp16_params.<g>.<i>``);
* ``args``, ``checkpoint_version``, ``iteration``, ``num_floating_point_operations_so_far``,
  ``opt_param_scheduler.<field>``, ``rerun_state_machine.{mode,sharded.<field>}`` and
  ``rng_state.<n>.<field>`` (this rank's RNG states, every data-parallel rank's with
  ``--data-parallel-random-init``).

Each rank writes its own rows of every sharded tensor; global rank 0 writes the rest once (DCP
keeps one copy of a replicated entry). Loading reads this rank's rows of each tensor, so the
folder loads at any other data-parallel size. Reading goes through the restricted
:class:`~megatron.checkpoint.dist.DistCheckpointReader`: no code in a checkpoint runs.
"""

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint import fsdp_dtensor
from megatron.checkpoint.dist import (DistCheckpointError, DistCheckpointReader,
                                      DistCheckpointWriteError, ObjectShard, TensorShard,
                                      save_shards)
from megatron.checkpoint.dist.reader import is_dist_checkpoint, read_backend
from megatron.checkpoint.layout import CHECKPOINT_VERSION, CheckpointError, checkpoint_dir_name
from megatron.checkpoint.publish import begin_save, crash_point, finish_save
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError
from megatron.checkpoint.saved_args import check_args, plain_args
from megatron.checkpoint.state import rng_state_snapshot, set_rng_state_snapshot
from megatron.core import rerun_state_machine as rerun_enums
from megatron.core.distributed.torch_fsdp2 import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

FORMAT = "torch_dcp"
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."
MOMENTS = ("exp_avg", "exp_avg_sq")


def layout_error(what: str, fsdp2: bool, tp_size: int, pp_size: int) -> Optional[str]:
    """The one-line refusal of the format outside Megatron-LM's limits for it (FSDP2, tensor
    and pipeline size 1), or None within them; ``what`` names the flag or folder."""
    if fsdp2 and tp_size <= 1 and pp_size <= 1:
        return None
    return (f"{what}: --ckpt-format torch_dcp is written and read only with --use-torch-fsdp2 "
            "and --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1, as in "
            f"Megatron-LM (got {'' if fsdp2 else 'no '}--use-torch-fsdp2, tensor size "
            f"{tp_size}, pipeline size {pp_size}); use --ckpt-format torch_dist or fsdp_dtensor")


def is_torch_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a plain DCP folder (no ``metadata.json``) whose model keys are
    ``model.<key>``, not fsdp_dtensor's ``model.module.<key>``."""
    if not is_dist_checkpoint(path) or read_backend(path) is not None:
        return False
    try:
        keys = DistCheckpointReader(path).metadata.state_dict_metadata
    except (DistCheckpointError, UnsafeCheckpointError, OSError):
        return False
    model = [k for k in keys if k.startswith(MODEL_PREFIX)]
    return bool(model) and not any(k.startswith(fsdp_dtensor.MODEL_PREFIX) for k in model)


def _model(model_chunks, pstate, what: str):
    """``(named live DTensors, layout)`` of the one FSDP2 model chunk; refuses anything else."""
    from megatron.core.distributed.torch_fsdp2 import TorchFullyShardedDataParallel

    error = layout_error(what, all(isinstance(c, TorchFullyShardedDataParallel)
                                   for c in model_chunks), pstate.tp_size, pstate.pp_size)
    if error:
        raise CheckpointError(error)
    return fsdp_dtensor.model_tensors(model_chunks), fsdp_dtensor.layout_of(model_chunks, pstate)


def _pieces(name: str, tensor: torch.Tensor, layout):
    return fsdp_dtensor.pieces(name, tensor, layout, swiglu_halves=False, fmt=FORMAT)


def _first_replica(tensor: "DTensor") -> bool:
    """Whether this rank is the copy that writes ``tensor``'s rows (HSDP: replica 0)."""
    coordinate = tensor.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())


def _dtensor_items(key: str, tensor: "DTensor") -> list:
    """This rank's rows of a sharded optimizer tensor stored whole under ``key``."""
    if not _first_replica(tensor):
        return []
    start, count, _ = fsdp_dtensor._shard_rows(tensor)
    if count == 0:
        return []
    local = tensor.to_local()
    return [TensorShard(key, local.detach(), tuple(tensor.shape),
                        (start,) + (0,) * (tensor.dim() - 1))]


# -- saving ----------------------------------------------------------------------------------------

def _model_items(named, layout, dtype: Optional[torch.dtype]) -> list:
    items = []
    for name, tensor in named:
        local = tensor.to_local().detach()
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        for piece in _pieces(name, tensor, layout):
            if piece.written:
                items.append(TensorShard(MODEL_PREFIX + piece.key,
                                         local[piece.rows[0]:piece.rows[1]],
                                         piece.global_shape, piece.global_offset))
    return items


def optimizer_tree(optimizer) -> dict:
    """What Megatron-LM's optimizer ``state_dict()`` holds, with this run's DTensor shards in
    place of whole tensors: the torch optimizer's own dict, or with a half-precision model the
    mixed-precision wrapper's (``optimizer``, ``grad_scaler``, ``fp32_from_fp16_params``)."""
    inner = optimizer.optimizer.state_dict()
    if not getattr(optimizer, "half", False):
        return inner
    tree = {"optimizer": inner}
    if getattr(optimizer, "grad_scaler", None) is not None:
        tree["grad_scaler"] = optimizer.grad_scaler.state_dict()
    tree["fp32_from_fp16_params"] = [list(g["params"]) for g in optimizer.optimizer.param_groups]
    return tree


def rerun_tree() -> dict:
    """Megatron-LM's rerun state machine entry of a run that never re-runs a step."""
    sharded = dict(fsdp_dtensor.FRESH_RERUN_STATE)
    sharded.pop("mode")
    sharded.update(state=rerun_enums.RerunState.NOT_RUNNING_YET, current_iteration=-1,
                   error_injector_checkpoint={"error_injection_rate": 0,
                                              "error_injection_type":
                                                  rerun_enums.RerunDiagnostic.TRANSIENT_ERROR,
                                              "injected_error_type": None},
                   data_iterator_checkpoints=None, large_value_counts={}, max_values={})
    return {"mode": rerun_enums.mode_for_checkpoint("disabled"), "sharded": sharded}


def _rng_list(args, pstate) -> list:
    """Megatron-LM's ``rng_state`` list: this rank's states, or with
    ``--data-parallel-random-init`` every data-parallel rank's (collective over that group)."""
    if not getattr(args, "data_parallel_random_init", False) or pstate.dp_size == 1:
        return [rng_state_snapshot()]
    states = [None] * pstate.dp_size
    dist.all_gather_object(states, rng_state_snapshot(), group=pstate.dp_group)
    return states


def _leaf_items(flat: Dict[str, Any], rank0: bool) -> list:
    """Sharded tensors from every rank, everything else from global rank 0 alone."""
    items = []
    for key, value in flat.items():
        if is_dtensor(value) and any(p.is_shard() for p in value.placements):
            items += _dtensor_items(key, value)
            continue
        if is_dtensor(value):
            value = value.to_local()   # replicated: every rank holds all of it
        if not rank0:
            continue
        if isinstance(value, torch.Tensor):
            items.append(TensorShard(key, value.detach().cpu().clone(), tuple(value.shape),
                                     (0,) * value.dim()))
        else:
            items.append(ObjectShard(key, value, listed=False))
    return items


def _items(iteration: int, model_chunks, optimizer, opt_param_scheduler, args, pstate) -> list:
    named, layout = _model(model_chunks, pstate, f"--save {args.save}")
    half = model_chunks[0].compute_dtype if getattr(optimizer, "half", False) else None
    items = _model_items(named, layout, half)
    tree = {"args": plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration, "num_floating_point_operations_so_far": 0,
            "rerun_state_machine": rerun_tree()}
    if not args.no_save_optim:
        tree["optimizer"] = optimizer_tree(optimizer)
        tree["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    rng = None if args.no_save_rng else _rng_list(args, pstate)
    if rng is not None:
        tree["rng_state"] = rng
    return items + _leaf_items(fsdp_dtensor.flatten(tree), dist.get_rank() == 0)


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate) -> str:
    """Write iteration ``iteration`` under ``args.save`` in the torch_dcp format: every rank
    its own shards, nothing gathered; collective. Staged and published as the other formats
    are (:mod:`megatron.checkpoint.publish`)."""
    tmp_root = begin_save(args.save, iteration)
    iter_dir = os.path.join(tmp_root, checkpoint_dir_name(iteration))
    error = ""
    try:
        items = _items(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
        crash_point("before_files")
        save_shards(iter_dir, items, backend=False)
        crash_point("after_file")
    except DistCheckpointWriteError as err:
        error = str(err)
    finish_save(args.save, iteration, error)
    return os.path.join(args.save, checkpoint_dir_name(iteration))


# -- loading ---------------------------------------------------------------------------------

def _read_rows(reader, key: str, tensor: "DTensor", out: torch.Tensor) -> None:
    """This rank's rows of ``tensor`` from the whole tensor stored under ``key``."""
    if tuple(reader.shape(key)) != tuple(tensor.shape):
        raise DistCheckpointError(f"{key!r} is stored with shape {list(reader.shape(key))}, "
                                  f"this model's is {list(tensor.shape)}")
    start, count, _ = fsdp_dtensor._shard_rows(tensor)
    if count:
        reader.read(key, (start,) + (0,) * (tensor.dim() - 1), tuple(out.shape), out=out)


def _model_values(reader, named, layout) -> List[torch.Tensor]:
    """This rank's shard of every model tensor, in the local shard's dtype."""
    values = []
    for name, tensor in named:
        local = tensor.to_local()
        out = torch.empty(local.shape, dtype=local.dtype)
        for piece in _pieces(name, tensor, layout):
            key = MODEL_PREFIX + piece.key
            if key not in reader:
                raise DistCheckpointError(f"has no {key!r}")
            if tuple(reader.shape(key)) != piece.global_shape:
                raise DistCheckpointError(f"{key!r} is stored with shape "
                                          f"{list(reader.shape(key))}, this model's is "
                                          f"{list(piece.global_shape)}")
            rows = out[piece.rows[0]:piece.rows[1]]
            reader.read(key, piece.global_offset, tuple(rows.shape), out=rows)
        values.append(out)
    return values


def _torch_prefix(reader, half: bool) -> str:
    """Where the torch optimizer's own state dict sits: ``optimizer.`` or, saved by a
    half-precision run, ``optimizer.optimizer.``."""
    nested = OPTIMIZER_PREFIX + "optimizer."
    return nested if any(k.startswith(nested) for k in reader.metadata.state_dict_metadata) \
        else OPTIMIZER_PREFIX


def _optimizer_state(reader, optimizer, prefix: str) -> Tuple[dict, list]:
    """The torch optimizer's ``state`` (this rank's shards of the moments, as DTensors laid
    out like their parameters) and its groups' saved fields, parameters numbered in group
    order as ``torch.optim.Optimizer.state_dict`` numbers them."""
    from torch.distributed.tensor import DTensor

    inner = optimizer.optimizer
    state, groups, index = {}, [], 0
    for g, group in enumerate(inner.param_groups):
        saved = fsdp_dtensor.read_tree(reader, f"{prefix}param_groups.{g}")
        if not isinstance(saved, dict):
            raise DistCheckpointError(f"has no {prefix}param_groups.{g} (the optimizer has "
                                      f"{len(inner.param_groups)} groups)")
        groups.append(saved)
        for param in group["params"]:
            entry = {}
            for field in MOMENTS:
                key = f"{prefix}state.{index}.{field}"
                if key not in reader:
                    raise DistCheckpointError(f"has no {key!r}")
                local = param.to_local()
                out = torch.empty(local.shape, dtype=reader.dtype(key))
                _read_rows(reader, key, param, out)
                entry[field] = DTensor.from_local(out.to(local.device, local.dtype),
                                                  param.device_mesh, param.placements,
                                                  shape=param.shape, stride=param.stride())
            step = f"{prefix}state.{index}.step"
            if step in reader:
                entry["step"] = reader.read(step)
            state[param] = entry
            index += 1
    return state, groups


def _main_params(reader, optimizer) -> Optional[List[torch.Tensor]]:
    """This rank's rows of the fp32 weights a half-precision run saved, or None."""
    prefix = OPTIMIZER_PREFIX + "fp32_from_fp16_params."
    out = []
    for g, group in enumerate(optimizer.optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            key = f"{prefix}{g}.{i}"
            if key not in reader:
                return None
            value = torch.empty(param.to_local().shape, dtype=torch.float32)
            _read_rows(reader, key, param, value)
            out.append(value)
    return out


def _read_optimizer(reader, optimizer, path: str) -> dict:
    if not any(k.startswith(OPTIMIZER_PREFIX) for k in reader.metadata.state_dict_metadata):
        raise CheckpointError(f"{path}: has no optimizer state (saved with --no-save-optim?); "
                              "pass --no-load-optim or --finetune")
    half = getattr(optimizer, "half", False)
    state, groups = _optimizer_state(reader, optimizer, _torch_prefix(reader, half))
    schedule = fsdp_dtensor.read_tree(reader, "opt_param_scheduler")
    if schedule is None:
        raise CheckpointError(f"{path}: has no opt_param_scheduler state; pass "
                              "--no-load-optim or --finetune")
    scaler = fsdp_dtensor.read_tree(reader, OPTIMIZER_PREFIX + "grad_scaler")
    return {"state": state, "groups": groups, "schedule": schedule, "scaler": scaler,
            "mains": _main_params(reader, optimizer)}


def _apply_optimizer(optimizer, opt_param_scheduler, optim: dict) -> None:
    inner = optimizer.optimizer
    for group, saved in zip(inner.param_groups, optim["groups"]):
        for field, value in saved.items():
            if field != "params":
                group[field] = tuple(value) if field == "betas" else value
    inner.state.clear()
    inner.state.update(optim["state"])
    if optim["scaler"] is not None and getattr(optimizer, "grad_scaler", None) is not None:
        optimizer.grad_scaler.load_state_dict(optim["scaler"])
    if optim["mains"] is not None:
        params = [p for g in inner.param_groups for p in g["params"]]
        with torch.no_grad():
            for param, value in zip(params, optim["mains"]):
                param.to_local().copy_(value)
    opt_param_scheduler.load_state_dict(optim["schedule"])


def _open(iter_dir: str) -> Tuple[DistCheckpointReader, Any]:
    try:
        reader = DistCheckpointReader(iter_dir)
        saved = reader.read_object("args") if "args" in reader.byte_keys() else None
        return reader, saved
    except (DistCheckpointError, UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(str(err)) from None


def _rng_state(reader, args, pstate):
    states = fsdp_dtensor.read_tree(reader, "rng_state")
    if not isinstance(states, list) or not states:
        return None
    random_init = getattr(args, "data_parallel_random_init", False)
    return states[pstate.dp_rank] if random_init and len(states) == pstate.dp_size \
        else states[0]


def load_checkpoint(iter_dir: str, iteration: int, release: bool, model_chunks, optimizer,
                    opt_param_scheduler, args, pstate, weights_only: bool = False):
    """Load a torch_dcp iteration folder into a fully sharded run at any data-parallel size:
    each rank reads only its own rows. Returns the saved args. Everything is read and checked
    before the model or optimizer changes."""
    named, layout = _model(model_chunks, pstate, iter_dir)
    reader, saved = _open(iter_dir)
    check_args(saved, args, iter_dir, ignore=("padded_vocab_size",))
    restore = not (args.finetune or release) and not weights_only
    optim = rng = None
    try:
        values = _model_values(reader, named, layout)
        if restore and not args.no_load_optim:
            optim = _read_optimizer(reader, optimizer, iter_dir)
        if restore and not args.no_load_rng:
            rng = _rng_state(reader, args, pstate)
            if rng is None:
                raise CheckpointError(f"{iter_dir}: has no RNG state (saved with "
                                      "--no-save-rng?); pass --no-load-rng")
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise CheckpointError(f"{iter_dir}: {err}") from None
    with torch.no_grad():
        for (_, tensor), value in zip(named, values):
            tensor.to_local().copy_(value)
    if optim is not None:
        _apply_optimizer(optimizer, opt_param_scheduler, optim)
    elif optimizer is not None:
        optimizer.reload_model_params()
    if rng is not None:
        set_rng_state_snapshot(rng)
    return saved

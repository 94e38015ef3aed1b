"""Checkpoints of fully sharded runs in Megatron's ``fsdp_dtensor`` format
(``--ckpt-format fsdp_dtensor``).

The folder is a plain ``torch.distributed.checkpoint`` one (``.metadata`` and one
``__<rank>_0.distcp`` per rank, no ``metadata.json``: that file marks ``torch_dist``), in the
iteration folder and with the tracker of the other formats. Its keys are Megatron-LM's for this
format, the flattened names of the state dict it hands to DCP:

* ``model.module.<key>``: the weights, one tensor per layer (``decoder.layers.<g>.`` with the
  global layer number) under Megatron-Core's names; a SwiGLU fc1 is stored as its two halves
  ``linear_fc1.weight_w`` / ``linear_fc1.weight_v`` (the same for the bias);
* ``optimizer.state.module.module.module.<key>.{exp_avg,exp_avg_sq,step}``: Adam's state of
  each weight, and ``optimizer.param_to_group_meta.module.module.module.<key>.<field>`` the
  hyper-parameters of its group;
* ``args``, ``checkpoint_version``, ``iteration``, ``num_floating_point_operations_so_far``,
  ``opt_param_scheduler.<field>``, ``rerun_state_machine.sharded.<field>`` and
  ``rng_state.(<pp>, <tp>).<dp>.<field>``: byte entries (``torch.save`` of the plain object) and,
  for the RNG states' tensors, small tensor entries.

Every rank writes its own FSDP2 shard of each tensor (dim-0 rows of its tensor-parallel slice,
placed in the global tensor) and nothing is gathered; loading reads any slice, so a checkpoint
saved at one data-parallel, tensor-parallel or context-parallel size loads at another under
FSDP2. Without FSDP the format is refused, as Megatron-LM refuses it; ``--ckpt-convert-format``
under FSDP2 turns it into ``torch`` or ``torch_dist``. Everything is read through
:class:`~megatron.checkpoint.dist.DistCheckpointReader`, whose unpickling is restricted: no
code in a checkpoint runs.
"""

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint import optimizer_state
from megatron.checkpoint.dist import (DistCheckpointError, DistCheckpointReader,
                                      DistCheckpointWriteError, ObjectShard, TensorShard,
                                      chunk_layout, placements, save_shards)
from megatron.checkpoint.dist.keys import KeyMappingError
from megatron.checkpoint.dist.reader import is_dist_checkpoint, read_backend
from megatron.checkpoint.layout import CHECKPOINT_VERSION, CheckpointError, checkpoint_dir_name
from megatron.checkpoint.names import dotted_names, lookup_dotted
from megatron.checkpoint.publish import begin_save, crash_point, finish_save
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError
from megatron.checkpoint.saved_args import check_args, plain_args
from megatron.checkpoint.state import rng_state_snapshot, set_rng_state_snapshot
from megatron.core.distributed.torch_fsdp2 import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

FORMAT = "fsdp_dtensor"
MODEL_PREFIX = "model.module."
STATE_PREFIX = "optimizer.state.module.module.module."
GROUP_PREFIX = "optimizer.param_to_group_meta.module.module.module."
MOMENTS = ("exp_avg", "exp_avg_sq")
# Megatron-LM's rerun state machine, fresh (nothing requested, no error injection): what a run
# here, which never enables it under FSDP, has to record.
FRESH_RERUN_STATE = {"mode": "disabled", "rerun_requested": False,
                     "checkpoint_requested": False, "restart_again_requested": False,
                     "continue_requested": False, "failed_validation_call": None,
                     "initial_result": None, "suspicious_node": None,
                     "suspicious_device": None}


def is_fsdp_dtensor_checkpoint(path: str) -> bool:
    """Whether the iteration folder ``path`` is a DCP folder without ``metadata.json``: not
    Megatron-Core's ``torch_dist`` (which always writes it), so ``fsdp_dtensor``."""
    return is_dist_checkpoint(path) and read_backend(path) is None


def not_fully_sharded_error(path_or_flag: str) -> str:
    """The one-line refusal of the format in a run whose model is not sharded by FSDP2."""
    return (f"{path_or_flag}: --ckpt-format fsdp_dtensor holds FSDP-sharded DTensors and is "
            "read and written only by a fully sharded run (--use-torch-fsdp2, or "
            "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads or "
            "optim_grads_params), as in Megatron-LM; to use it without FSDP, load it under FSDP "
            "with --ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR")


# -- flattening, as torch.distributed.checkpoint names nested state ------------------------------

def _terminal(values: list) -> bool:
    """DCP stores a list as one object unless it holds a tensor or a container to open."""
    for value in values:
        if isinstance(value, (dict, torch.Tensor)):
            return False
        if isinstance(value, list) and not _terminal(value):
            return False
    return True


def flatten(tree: dict, prefix: str = "") -> Dict[str, Any]:
    """``tree``'s leaves by DCP's flattened names (dicts opened, lists by index when they hold
    a tensor or a container; an empty dict has no entry)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        elif isinstance(value, list) and not _terminal(value):
            out.update(flatten(dict(enumerate(value)), path + "."))
        else:
            out[path] = value
    return out


def _objects(flat: Dict[str, Any], writes_tensors: bool) -> list:
    items = []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            if writes_tensors:
                items.append(TensorShard(key, value.detach().clone(), tuple(value.shape),
                                         (0,) * value.dim()))
        else:
            items.append(ObjectShard(key, value, listed=False))
    return items


# -- where this rank's shard of each tensor goes ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of this rank's local shard sit at ``global_offset`` of stored ``key``."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    rows: Tuple[int, int]
    written: bool


def _shard_rows(tensor: torch.Tensor) -> Tuple[int, int, bool]:
    """(first row, rows) of this rank's FSDP2 shard in the tensor-parallel slice, and whether
    this rank is the copy that writes it (HSDP: replica 0)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not is_dtensor(tensor):
        raise CheckpointError(f"--ckpt-format {FORMAT}: a model tensor of shape "
                              f"{tuple(tensor.shape)} is not sharded by FSDP2")
    mesh, places = tensor.device_mesh, tensor.placements
    if any(p.is_shard() and p.dim != 0 for p in places):
        raise CheckpointError(f"--ckpt-format {FORMAT}: only dim-0 FSDP2 shards are stored, "
                              f"got placements {places}")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, places)
    coordinate = mesh.get_coordinate()
    first = all(c == 0 for c, p in zip(coordinate, places) if p.is_replicate())
    return int(offset[0]), int(shape[0]), first


def _swiglu_half(key: str, half: int) -> str:
    return f"{key}_{'wv'[half]}"


def pieces(name: str, tensor: torch.Tensor, layout, swiglu_halves: bool = True,
           fmt: str = FORMAT) -> List[Piece]:
    """Where this rank's shard of the model tensor ``name`` (a dotted name of the chunk's
    state, a DTensor over the FSDP mesh whose global shape is the TP slice) is stored.
    ``swiglu_halves=False``: a SwiGLU fc1 stays one tensor (``torch_dcp``); ``fmt`` names the
    format in errors."""
    start, count, first = _shard_rows(tensor)
    try:
        places = placements(name, tuple(tensor.shape), layout)
    except KeyMappingError as err:
        raise CheckpointError(f"--ckpt-format {fmt}: {err}") from None
    if any(p.stacked for p in places):
        raise CheckpointError(f"--ckpt-format {fmt}: {name}: expert tensors are not built "
                              "in this format yet; use --ckpt-format torch_dist")
    # A SwiGLU fc1: Megatron-LM's fsdp_dtensor stores its halves apart.
    split = len(places) == 2 and swiglu_halves
    out = []
    for half, place in enumerate(places):
        r0, r1 = place.local_rows or (0, tensor.shape[0])
        lo, hi = max(r0, start), min(r1, start + count)
        if lo >= hi:
            continue
        key, shape, offset = place.key, list(place.global_shape), list(place.global_offset)
        if split:
            key = _swiglu_half(key, half)
            shape[0] //= 2
            offset[0] -= half * shape[0]
        offset[0] += lo - r0
        out.append(Piece(key, tuple(shape), tuple(offset), (lo - start, hi - start),
                         place.written and first))
    return out


def stored_keys(name: str, tensor: torch.Tensor, layout) -> List[str]:
    """The stored keys of model tensor ``name`` (two for a SwiGLU fc1), without prefix."""
    try:
        places = placements(name, tuple(tensor.shape), layout)
    except KeyMappingError as err:
        raise CheckpointError(f"--ckpt-format {FORMAT}: {err}") from None
    if len(places) == 2:
        return [_swiglu_half(place.key, half) for half, place in enumerate(places)]
    return [places[0].key]


def _inner(chunk, what: str = f"--ckpt-format {FORMAT}"):
    """The module FSDP2 sharded (its parameters are DTensors); ``what`` names the checkpoint
    or flag in the refusal of a model FSDP2 did not shard."""
    from megatron.core.distributed.torch_fsdp2 import TorchFullyShardedDataParallel

    if not isinstance(chunk, TorchFullyShardedDataParallel):
        raise CheckpointError(not_fully_sharded_error(what))
    return chunk.module


def _inner_or_refuse(model_chunks, what: str) -> None:
    for chunk in model_chunks:
        _inner(chunk, what)


def model_tensors(model_chunks) -> List[Tuple[str, torch.Tensor]]:
    """``(dotted name, live DTensor)`` of every tensor the model chunk saves, in its order."""
    if len(model_chunks) != 1:
        raise CheckpointError(f"--ckpt-format {FORMAT}: one model chunk expected (FSDP runs "
                              f"without pipeline stages), got {len(model_chunks)}")
    tree = _inner(model_chunks[0]).state_dict_for_save_checkpoint(keep_vars=True)
    return [(name, lookup_dotted(tree, name)) for name in dotted_names(tree)]


def layout_of(model_chunks, pstate):
    """The chunk's layout with per-layer keys; every FSDP rank writes its own rows."""
    module = _inner(model_chunks[0])
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return dataclasses.replace(chunk_layout(module.config, pstate), per_layer=True, dp_rank=0,
                               expert_dp_rank=0)


# -- saving ----------------------------------------------------------------------------------------

def _model_items(named, layout) -> list:
    items = []
    for name, tensor in named:
        local = tensor.to_local()
        for piece in pieces(name, tensor, layout):
            if piece.written:
                items.append(TensorShard(MODEL_PREFIX + piece.key,
                                         local[piece.rows[0]:piece.rows[1]].detach(),
                                         piece.global_shape, piece.global_offset))
    return items


def _param_names(named) -> Dict[int, str]:
    return {id(tensor): name for name, tensor in named}


def _group_meta(group: dict, args) -> dict:
    meta = {k: v for k, v in group.items() if k != "params"}
    meta.setdefault("wd_mult", 1.0)
    meta.setdefault("lr_mult", 1.0)
    return optimizer_state.megatron_core_group(meta, args)


def _optimizer_items(optimizer, named, layout, args, common: bool) -> list:
    """Adam's moments of this rank's shards (and each parameter's step, once), and with
    ``common`` every parameter's group hyper-parameters."""
    inner = getattr(optimizer, "optimizer", optimizer)
    names = _param_names(named)
    items = []
    for group in inner.param_groups:
        meta = _group_meta(group, args)
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise CheckpointError(f"--ckpt-format {FORMAT}: an optimizer parameter of shape "
                                      f"{tuple(param.shape)} is not in the model's state")
            state = inner.state.get(param, {})
            for piece in pieces(name, param, layout):
                if not piece.written:
                    continue
                key = STATE_PREFIX + piece.key
                for field in MOMENTS:
                    if field in state:
                        value = state[field].to_local()[piece.rows[0]:piece.rows[1]]
                        items.append(TensorShard(f"{key}.{field}", value.detach(),
                                                 piece.global_shape, piece.global_offset))
                if "step" in state and not any(piece.global_offset):
                    step = torch.as_tensor(state["step"]).detach().float()
                    items.append(TensorShard(f"{key}.step", step, (), ()))
            if common:
                for key in stored_keys(name, param, layout):
                    items += _objects(flatten(meta, f"{GROUP_PREFIX}{key}."), False)
    return items


def rng_key(pstate) -> str:
    """Megatron-LM's key of this (pipeline, tensor) rank's list of RNG states."""
    return f"rng_state.({pstate.pp_rank}, {pstate.tp_rank})"


def _common_items(iteration: int, args, opt_param_scheduler) -> list:
    """What global rank 0 alone writes: the run's arguments, position and schedule."""
    tree = {"args": plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration, "num_floating_point_operations_so_far": 0,
            "rerun_state_machine": {"sharded": dict(FRESH_RERUN_STATE)}}
    if not args.no_save_optim:
        tree["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return _objects(flatten(tree), False)


def _rng_items(args, pstate) -> list:
    """Every data-parallel rank's RNG states (collective over the data-parallel group),
    written by its rank 0 under this (pipeline, tensor) rank's key."""
    if args.no_save_rng:
        return []
    states = [None] * pstate.dp_size
    dist.all_gather_object(states, rng_state_snapshot(), group=pstate.dp_group)
    if pstate.dp_rank != 0 or pstate.cp_rank != 0:
        return []
    prefix, _ = rng_key(pstate).split(".", 1)
    return _objects(flatten({prefix: {rng_key(pstate)[len(prefix) + 1:]: states}}), True)


def _items(iteration: int, model_chunks, optimizer, opt_param_scheduler, args, pstate) -> list:
    named = model_tensors(model_chunks)
    layout = layout_of(model_chunks, pstate)
    items = _rng_items(args, pstate)
    items += _model_items(named, layout)
    common = dist.get_rank() == 0
    if not args.no_save_optim:
        items += _optimizer_items(optimizer, named, layout, args, common)
    if common:
        items += _common_items(iteration, args, opt_param_scheduler)
    return items


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate) -> str:
    """Write iteration ``iteration`` under ``args.save`` in the fsdp_dtensor format: every
    rank its own shards, nothing gathered; collective. Staged and published as the other
    formats are (:mod:`megatron.checkpoint.publish`)."""
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
    finish_save(args.save, iteration, error, getattr(args, "verify_integrity", False))
    return os.path.join(args.save, checkpoint_dir_name(iteration))


# -- loading ----------------------------------------------------------------------------------

def _nest(flat: Dict[str, Any]) -> Any:
    """The tree DCP flattened into ``flat`` (relative names), lists where every key of a level
    is its index."""
    tree: Dict[str, Any] = {}
    for key, value in flat.items():
        node, parts = tree, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _listify(tree)


def _listify(node):
    if not isinstance(node, dict):
        return node
    node = {k: _listify(v) for k, v in node.items()}
    if node and sorted(node) == [str(i) for i in range(len(node))]:
        return [node[str(i)] for i in range(len(node))]
    return node


def read_tree(reader: DistCheckpointReader, prefix: str) -> Any:
    """Everything stored under ``prefix`` (``rng_state.(0, 0)``, ``opt_param_scheduler``), as
    the nested object it was saved from; None when nothing is."""
    meta = reader.metadata.state_dict_metadata
    flat = {}
    for key in meta:
        if key == prefix:
            return _read_entry(reader, key)
        if key.startswith(prefix + "."):
            flat[key[len(prefix) + 1:]] = _read_entry(reader, key)
    return _nest(flat) if flat else None


def _read_entry(reader: DistCheckpointReader, key: str) -> Any:
    if key in reader.byte_keys():
        return reader.read_object(key)
    return reader.read(key)


def _read_shard(reader, prefix, name: str, tensor: torch.Tensor, layout) -> torch.Tensor:
    """This rank's shard of stored tensor(s) ``prefix + key`` (``prefix``: a string, or a
    function of the key) for model tensor ``name``, in the dtype and shape of ``tensor``'s local
    shard."""
    local = tensor.to_local()
    out = torch.empty(local.shape, dtype=local.dtype)
    covered = 0
    for piece in pieces(name, tensor, layout):
        key = prefix(piece.key) if callable(prefix) else prefix + piece.key
        if tuple(reader.shape(key)) != piece.global_shape:
            raise DistCheckpointError(f"{key!r} is stored with shape {list(reader.shape(key))}, "
                                      f"this model's is {list(piece.global_shape)}")
        rows = out[piece.rows[0]:piece.rows[1]]
        reader.read(key, piece.global_offset, tuple(rows.shape), out=rows)
        covered += piece.rows[1] - piece.rows[0]
    if covered != local.shape[0]:
        raise DistCheckpointError(f"{name}: the stored tensors cover {covered} of this rank's "
                                  f"{local.shape[0]} rows")
    return out


def _absent(reader, keys: List[str], strict: bool, missing: List[str]) -> bool:
    """Whether any of ``keys`` is not in the checkpoint: an error naming it when ``strict``,
    else noted in ``missing`` (the tensor then keeps its current value)."""
    absent = [k for k in keys if k not in reader.metadata.state_dict_metadata]
    if absent and strict:
        raise DistCheckpointError(f"has no {absent[0]!r} (--no-strict-fsdp-dtensor-load loads "
                                  "what is there and keeps the rest)")
    missing += absent
    return bool(absent)


def _model_values(reader, named, layout, strict: bool,
                  missing: List[str]) -> List[Optional[torch.Tensor]]:
    return [None if _absent(reader, [MODEL_PREFIX + k for k in stored_keys(name, t, layout)],
                            strict, missing)
            else _read_shard(reader, MODEL_PREFIX, name, t, layout) for name, t in named]


def _optimizer_state(reader, optimizer, named, layout, strict: bool = True,
                     missing: Optional[List[str]] = None) -> Tuple[dict, list]:
    """The inner torch optimizer's ``state`` (this rank's shards of the moments, as DTensors
    laid out like their parameters; a parameter whose moments are absent, when not ``strict``,
    starts afresh) and each group's saved hyper-parameters."""
    from torch.distributed.tensor import DTensor

    missing = [] if missing is None else missing
    inner = getattr(optimizer, "optimizer", optimizer)
    names = _param_names(named)
    state, metas = {}, []
    for group in inner.param_groups:
        saved_meta = None
        for param in group["params"]:
            name = names[id(param)]
            keys = stored_keys(name, param, layout)
            if _absent(reader, [f"{STATE_PREFIX}{k}.{f}" for k in keys for f in MOMENTS],
                       strict, missing):
                continue
            entry = {}
            for field in MOMENTS:
                local = _read_shard(reader, lambda k, f=field: f"{STATE_PREFIX}{k}.{f}", name,
                                    param, layout).to(param.to_local().device,
                                                      param.to_local().dtype)
                entry[field] = DTensor.from_local(local, param.device_mesh, param.placements,
                                                  shape=param.shape, stride=param.stride())
            step_key = f"{STATE_PREFIX}{keys[0]}.step"
            if step_key in reader.metadata.state_dict_metadata:
                entry["step"] = reader.read(step_key).float()
            state[param] = entry
            if saved_meta is None:
                saved_meta = read_tree(reader, f"{GROUP_PREFIX}{keys[0]}")
        metas.append(saved_meta or {})
    return state, metas


def _read_optimizer(reader, optimizer, named, layout, path: str, strict: bool,
                    missing: List[str]) -> Tuple[dict, list, dict]:
    """The optimizer's state, its groups' saved hyper-parameters and the scheduler's state."""
    if not any(k.startswith(STATE_PREFIX) for k in reader.tensor_keys()):
        raise CheckpointError(f"{path}: has no optimizer state (saved with --no-save-optim?); "
                              "pass --no-load-optim or --finetune")
    state, metas = _optimizer_state(reader, optimizer, named, layout, strict, missing)
    schedule = read_tree(reader, "opt_param_scheduler")
    if schedule is None:
        raise CheckpointError(f"{path}: has no opt_param_scheduler state; pass "
                              "--no-load-optim or --finetune")
    return state, metas, schedule


def _apply_optimizer(optimizer, state: dict, metas: list) -> None:
    inner = getattr(optimizer, "optimizer", optimizer)
    for group, meta in zip(inner.param_groups, metas):
        for field in ("lr", "weight_decay", "betas", "eps"):
            if field in meta:
                group[field] = tuple(meta[field]) if field == "betas" else meta[field]
    inner.state.clear()
    inner.state.update(state)


@torch.no_grad()
def _copy_model(named, values) -> None:
    for (_, tensor), value in zip(named, values):
        if value is None:
            continue
        local = tensor.to_local()
        local.copy_(value.to(local.dtype))


def _open(iter_dir: str) -> Tuple[DistCheckpointReader, Any]:
    try:
        reader = DistCheckpointReader(iter_dir)
        saved = reader.read_object("args") if "args" in reader.byte_keys() else None
        return reader, saved
    except (DistCheckpointError, UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(str(err)) from None


def saved_args(iter_dir: str):
    return _open(iter_dir)[1]


def load_checkpoint(iter_dir: str, iteration: int, release: bool, model_chunks, optimizer,
                    opt_param_scheduler, args, pstate, weights_only: bool = False):
    """Load an fsdp_dtensor iteration folder into a fully sharded run at its layout: each rank
    reads only its own shards. Returns the saved args. Everything is read and checked before
    the model or optimizer changes."""
    _inner_or_refuse(model_chunks, iter_dir)
    reader, saved = _open(iter_dir)
    check_args(saved, args, iter_dir, ignore=("padded_vocab_size",))
    named = model_tensors(model_chunks)
    layout = layout_of(model_chunks, pstate)
    restore = not (args.finetune or release) and not weights_only
    optim, missing = None, []
    strict = getattr(args, "strict_fsdp_dtensor_load", True)
    try:
        values = _model_values(reader, named, layout, strict, missing)
        if restore and not args.no_load_optim:
            optim = _read_optimizer(reader, optimizer, named, layout, iter_dir, strict, missing)
        rng = read_tree(reader, rng_key(pstate)) if restore and not args.no_load_rng else None
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise CheckpointError(f"{iter_dir}: does not fit this model: {err}") from None
    if missing and dist.get_rank() == 0:
        print(f"NOTE: {iter_dir}: {len(missing)} tensor(s) not in the checkpoint keep their "
              f"current values (--no-strict-fsdp-dtensor-load): {', '.join(missing[:5])}"
              f"{' ...' if len(missing) > 5 else ''}", flush=True)
    _copy_model(named, values)
    if optim is not None:
        _apply_optimizer(optimizer, optim[0], optim[1])
        opt_param_scheduler.load_state_dict(optim[2])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if rng is not None:
        set_rng_state_snapshot(rng[pstate.dp_rank] if len(rng) == pstate.dp_size else rng[0])
    elif restore and not args.no_load_rng and dist.get_rank() == 0:
        print(f"NOTE: {iter_dir} has no RNG state for (tensor, pipeline) layout "
              f"{pstate.tp_size} x {pstate.pp_size} (saved at another layout); RNGs are "
              "seeded from --seed", flush=True)
    return saved

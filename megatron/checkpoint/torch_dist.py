"""Training checkpoints in Megatron-Core's ``torch_dist`` format (``--ckpt-format torch_dist``).

Saving: every rank writes its own shards of the model (its TP piece of its pipeline stage's
layers, its expert-TP piece of its experts, under Megatron-Core's global keys,
:mod:`megatron.checkpoint.dist`) and of the Adam
state (``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``, and
``optimizer.state.fp32_param.<key>`` for a half-precision model); data-parallel copies are
written once, by DP rank 0. With ``--use-distributed-optimizer`` every data-parallel rank writes
the range of each parameter's state it owns, as boxes of the same global tensors (no gather;
the keys and shapes on disk are the same), and reads back only about its own share. Global
rank 0 writes
``common_state`` (args, iteration, scheduler, optimizer param groups and step) and the
metadata. The folder is staged, and published with the tracker only after every rank finished,
as in :mod:`megatron.checkpoint.load`.

Loading reads any slice of any saved tensor, so a checkpoint saved at any (TP, PP, VPP, DP,
EP, expert TP, distributed optimizer on or off) loads at any other, optimizer state included;
nothing is unpickled except through :mod:`megatron.checkpoint.safe_unpickle`.
"""

import argparse
import dataclasses
import os
import re
import threading
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint import emerging_state, muon_state, object_storage, optimizer_state
from megatron.checkpoint.dist import (DistCheckpointError, DistCheckpointReader,
                                      DistCheckpointWriteError, ObjectShard, ShardWriter,
                                      TensorShard, chunk_layout, common_objects,
                                      extra_state_objects, load_model_state, model_shards,
                                      object_key, optimizer_state_shards, range_shards, read_local,
                                      read_local_rows, save_shards, tensor_shards, write_metadata)
from megatron.checkpoint.dist import flattened, glu_interleave
from megatron.checkpoint.dist.keys import (OPTIMIZER_STATE_PREFIX, TRANSFORMER_ENGINE,
                                           KeyMappingError, expert_names, extra_state_value,
                                           glu_interleaved_names, placements, te_moe_norm_key)
from megatron.checkpoint.layout import CHECKPOINT_VERSION, CheckpointError, checkpoint_dir_name
from megatron.checkpoint.names import dotted_names
from megatron.checkpoint.publish import begin_save, crash_point, finish_save
from megatron.checkpoint.router_bias import (is_router_bias, note_zero_router_bias,
                                           optimizer_refusal)
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError
from megatron.checkpoint.saved_args import check_args, plain_args
from megatron.checkpoint.state import (copy_to_cpu, main_values_of, rng_state_snapshot,
                                      set_rng_state_snapshot)
from megatron.core import rerun_state_machine as rerun_enums
from megatron.model.module import flatten_state_dict
from megatron.core.collectives import get_group_rank, get_group_size

MAIN_PREFIX = OPTIMIZER_STATE_PREFIX + "fp32_param."
RERUN_KEY = "rerun_state_machine"
RERUN_SHARD_KEY = "rerun_state_machine_state"
# Megatron-Core's loader expects its rerun state machine's entry; this is a fresh machine's
# state (nothing requested, no error injection), in plain values.
_FRESH_RERUN_STATE = {"rerun_requested": False, "checkpoint_requested": False,
                      "restart_again_requested": False, "continue_requested": False,
                      "error_injector_checkpoint": {"error_injection_rate": 0,
                                                    "error_injection_type": "transient_error",
                                                    "injected_error_type": None},
                      "failed_validation_call": None, "initial_result": None,
                      "suspicious_node": None, "suspicious_device": None,
                      "data_iterator_checkpoints": None, "large_value_counts": {},
                      "max_values": {}}
# What Megatron-Core records of how its sharded state was laid out (read back on load).
_CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _moe_config(model_chunks):
    """The model's ``MoEConfig`` (None for a dense model), also on a pipeline stage that holds
    no MoE layer (``GPTModel.moe_config``)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            found = getattr(module, "moe_config", None)
            if found is not None and found.num_moe_experts is not None:
                return found
    return None


def _layouts(model_chunks, config, pstate) -> list:
    vp = pstate.virtual_pp_size
    moe = _moe_config(model_chunks)
    experts, freq = (moe.num_moe_experts, moe.moe_layer_freq) if moe is not None else (None, 1)
    interleaved = glu_interleaved_names(moe)
    return [dataclasses.replace(chunk_layout(config, pstate, i if vp is not None else None,
                                             experts, freq), glu_interleaved=interleaved,
                                **_weight_shard_fields(chunk, pstate))
            for i, chunk in enumerate(model_chunks)]


# A parameter of a transformer layer: its name in the layer.
LAYER_IN_MODULE = re.compile(r"(?:.*\.)?layers\.\d+\.(.+)")


def _weight_shard_fields(chunk, pstate) -> dict:
    """The ``ChunkLayout`` fields of a chunk's weight shards, dense and experts' (none
    without them)."""
    dense = getattr(pstate, "weight_shard_group", None)
    experts = getattr(pstate, "expert_weight_shard_group", None)
    names = sorted({LAYER_IN_MODULE.fullmatch(name).group(1)
                    for name, param in chunk.named_parameters()
                    if getattr(param, "weight_shards", 1) > 1
                    and LAYER_IN_MODULE.fullmatch(name)})
    if (dense is None and experts is None) or not names:
        return {}
    return dict(weight_shards=get_group_size(dense), weight_shard_rank=get_group_rank(dense),
                expert_weight_shards=get_group_size(experts),
                expert_weight_shard_rank=get_group_rank(experts),
                weight_shard_names=tuple(names))


def _chunk_trees(model_chunks) -> List[dict]:
    return [chunk.state_dict_for_save_checkpoint() for chunk in model_chunks]


def _optimizer_entries(optimizer, trees: List[dict]) -> Tuple[optimizer_state.SourceOptimizer,
                                                               dict]:
    """Per-parameter Adam (or Muon) state of this rank (a non-distributed optimizer) and the
    state dict it came from."""
    if muon_state.is_muon(optimizer):
        return _muon_entries(optimizer, trees)
    state_dict = optimizer.state_dict()
    found, why = optimizer_state.SourceOptimizer.read({"optimizer": state_dict}, trees,
                                                      members=_current_order(optimizer, trees))
    if found is None:
        raise CheckpointError(f"--ckpt-format torch_dist: cannot save the "
                                            f"optimizer state: {why}")
    return found, state_dict


def _muon_entries(optimizer, trees: List[dict]):
    """Muon's per-parameter state (:mod:`megatron.checkpoint.muon_state`) in the shape
    :func:`_optimizer_entries` returns."""
    entries, step, state_dict = muon_state.saved_entries(optimizer, trees)
    for where, main in muon_state.main_copies(optimizer, trees).items():
        entries.setdefault(where, {})[optimizer_state.MAIN] = main
    hparams = {}
    for group in optimizer.param_groups:   # Muon's groups first: theirs are recorded
        key = (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)))
        hparams.setdefault(key, {k: v for k, v in group.items() if k != "params"})
    scaler = state_dict.get("grad_scaler")
    return optimizer_state.SourceOptimizer(entries, step, hparams, scaler), state_dict


def _distributed_optimizer_shards(optimizer, trees, layouts, half: bool, pre_014: bool = False):
    """What this rank of the distributed optimizer writes of its own state (no collective),
    and its group hyper-parameters by (wd_mult, lr_mult) and step. ``pre_014``: in the layout
    of Megatron-Core before 0.14 (:mod:`megatron.checkpoint.dist.flattened`)."""
    shards_of = flattened.flat_range_shards if pre_014 else range_shards
    groups = _current_order(optimizer, trees)
    local = optimizer.local_param_state()
    items = []
    for members, row in zip(groups, local):
        for (chunk, name, shape), entry in zip(members, row):
            if entry is None:
                continue
            for field in optimizer_state.MOMENTS:
                if field in entry:
                    items += shards_of(name, shape, entry["start"], entry[field],
                                       layouts[chunk], f"{OPTIMIZER_STATE_PREFIX}{field}.")
            if half or pre_014:   # Megatron-Core before 0.14 always stored the main copy
                items += shards_of(name, shape, entry["start"], entry["param"],
                                   layouts[chunk], MAIN_PREFIX)
    metas = optimizer.group_metadata()
    hparams = {optimizer_state.group_signature(m):
               {k: v for k, v in m.items()
                if k not in ("step", "bias_correction", "model_params")}
               for m in metas}
    step = max((int(m.get("step", 0)) for m in metas), default=0)
    return items, hparams, step


def _common_state(iteration, args, opt_param_scheduler, hparams, step, grad_scaler,
                  distributed: bool = False) -> dict:
    """Global rank 0's ``common_state``. Megatron-Core before 0.14 (``--dist-ckpt-save-pre-
    mcore-014``) recorded no ``content_metadata``; its distributed optimizer names its sharding
    type beside the param groups."""
    saved_args = plain_args(args)
    vars(saved_args).pop(RERUN_KEY, None)   # saved under its own key (_rerun_shards)
    pre_014 = getattr(args, "dist_ckpt_save_pre_mcore_014", False)
    common = {"args": saved_args,
              "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0}
    if not pre_014:
        common["content_metadata"] = dict(_CONTENT_METADATA)
    if not args.no_save_optim:
        common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        groups = [optimizer_state.megatron_core_group(dict(group, wd_mult=key[0],
                                                          lr_mult=key[1]), args)
                  for key, group in sorted(hparams.items(), reverse=True)]
        common["optimizer"] = {"state": {"common_step": torch.tensor(float(step))},
                               "param_groups": groups}
        if grad_scaler is not None:
            common["optimizer"]["grad_scaler"] = grad_scaler
        if pre_014 and distributed:
            common["optimizer"] = flattened.nest_common(common["optimizer"])
    return common


def _shards(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate) -> list:
    """Everything this rank writes (collective: the RNG states)."""
    config = _model_config(model_chunks)
    # A GLU-interleaved fc1 is written as Megatron-Core writes it at this TP size, in two
    # halves of each rank's rows like a SwiGLU fc1 (see megatron.checkpoint.dist.glu_interleave).
    layouts = [dataclasses.replace(layout, glu_interleaved=())
               for layout in _layouts(model_chunks, config, pstate)]
    trees = _chunk_trees(model_chunks)
    rng_states = None
    if not args.no_save_rng:
        rng_states = [None] * pstate.dp_size
        dist.all_gather_object(rng_states, rng_state_snapshot(), group=pstate.dp_group)
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()
    half = args.fp16 or args.bf16
    entries, items, hparams, step, grad_scaler = None, [], None, 0, None
    distributed = hasattr(optimizer, "local_param_state")   # the distributed optimizer
    if not args.no_save_optim:
        if distributed:
            items, hparams, step = _distributed_optimizer_shards(
                optimizer, trees, layouts, half, getattr(args, "dist_ckpt_save_pre_mcore_014",
                                                         False))
            scaler = getattr(optimizer, "grad_scaler", None)
            grad_scaler = scaler.state_dict() if scaler is not None else None
        else:
            entries, state_dict = _optimizer_entries(optimizer, trees)
            hparams, step = entries.hparams, entries.step
            grad_scaler = state_dict.get("grad_scaler") if isinstance(state_dict, dict) else None
    matrices = {}
    if entries is not None and emerging_state.is_emerging(optimizer):
        matrices = emerging_state.matrices(optimizer, muon_state.param_members(optimizer, trees))
    for chunk, (tree, layout) in enumerate(zip(trees, layouts)):
        items += model_shards(tree, layout)
        num_local = sum(1 for name in dotted_names(tree) if name.endswith(
            "input_layernorm.weight") and ".layers." in name and not name.startswith("mtp."))
        items += extra_state_objects(layout, num_local, expert_names(tree),
                                     extra_state_value(args.transformer_impl))
        if entries is None:
            continue
        for (where, name), fields in entries.entries.items():
            if where != chunk:
                continue
            matrix = matrices.get((where, name))
            if matrix is not None:
                kinds = emerging_state.field_kinds(optimizer, matrix)
                items += emerging_state.field_shards(
                    matrix, kinds, {k: fields[k] for k in kinds}, layout)
            else:
                moments = {k: v for k, v in fields.items()
                           if k in optimizer_state.MOMENTS + muon_state.MUON_FIELDS}
                items += optimizer_state_shards(name, moments, layout)
            if half:
                main = fields.get(optimizer_state.MAIN)
                if main is not None:
                    items += tensor_shards(name, main, layout, MAIN_PREFIX)
    common = None
    if dist.get_rank() == 0:
        common = _common_state(iteration, args, opt_param_scheduler, hparams, step, grad_scaler,
                               distributed)
    items += _rerun_shards(args, common)
    if pstate.dp_rank == 0 and pstate.cp_rank == 0:  # global rank 0 is DP and CP rank 0
        items += common_objects(common, rng_states, pstate.pp_rank, pstate.pp_size,
                                pstate.tp_rank, pstate.tp_size)
    if args.transformer_impl == TRANSFORMER_ENGINE:
        items = _te_moe_norm_keys(items, trees, layouts)
    return items


def _rerun_shards(args, common: Optional[dict]) -> list:
    """The rerun state machine's entry in Megatron-Core's layout: while a re-run from this
    checkpoint is pending (``args.rerun_state_machine``, see :class:`~megatron.training.
    train_state.TrainState`), ``common_state`` holds its ``mode``, ``state`` and
    ``current_iteration`` under ``rerun_state_machine`` and every rank writes its own part as
    ``rerun_state_machine_state/shard_<rank>_<world>``, with Megatron-Core's enum types. With
    nothing pending, global rank 0 writes a fresh machine's part (``common`` is its state)."""
    entry = getattr(args, RERUN_KEY, None)
    if entry is None:
        return [] if common is None else [ObjectShard(object_key(RERUN_SHARD_KEY),
                                                      dict(_FRESH_RERUN_STATE))]
    rank, world = dist.get_rank(), dist.get_world_size()
    if common is not None:
        common[RERUN_KEY] = {"mode": rerun_enums.mode_for_checkpoint(entry["mode"]),
                             "state": rerun_enums.RerunState(int(entry["state"])),
                             "current_iteration": int(entry["current_iteration"])}
    mine = dict(entry["sharded_by_rank"][rank])
    injector = dict(mine["error_injector_checkpoint"])
    injector["error_injection_type"] = rerun_enums.RerunDiagnostic(
        injector["error_injection_type"])
    if injector.get("injected_error_type") is not None:
        injector["injected_error_type"] = rerun_enums.RerunDiagnostic(
            injector["injected_error_type"])
    mine["error_injector_checkpoint"] = injector
    return [ObjectShard(object_key(RERUN_SHARD_KEY, (rank,), (world,)), mine)]


def _te_moe_norm_keys(items: list, trees: List[dict], layouts: list) -> list:
    """The items with MoE layers' pre-MLP norms under the TransformerEngine spec's key
    (:func:`~megatron.checkpoint.dist.keys.te_moe_norm_key`)."""
    moe_layers = set()
    for tree, layout in zip(trees, layouts):
        for name in dotted_names(tree):
            if name.endswith(".mlp.router.weight") and ".layers." in name \
                    and not name.startswith("mtp."):
                local = int(name.split(".layers.")[1].split(".")[0])
                moe_layers.add(layout.layer_offset + local)
    if not moe_layers:
        return items
    if not any(layout.per_layer for layout in layouts):
        moe_layers = True   # stacked keys: every layer is an MoE layer (--moe-layer-freq 1)
    return [dataclasses.replace(item, key=te_moe_norm_key(item.key, moe_layers))
            if isinstance(item, TensorShard) else item for item in items]


def _model_config(model_chunks):
    module = model_chunks[0]
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module.config


def check_savable(model_chunks, pstate, optimizer=None) -> None:
    """Before training: raise :class:`CheckpointError` when a tensor of the model has no
    Megatron-Core key, or a parameter of ``optimizer`` (when it is saved) cannot be named, so a
    run that cannot save torch_dist stops at start-up, naming the tensor and the torch format,
    rather than at its first save."""
    if optimizer is not None and not muon_state.is_muon(optimizer):
        try:
            _current_order(optimizer, _chunk_trees(model_chunks))
        except CheckpointError as err:
            raise CheckpointError(f"{err}; or save with --ckpt-format torch") from None
    layouts = _layouts(model_chunks, _model_config(model_chunks), pstate)
    for tree, layout in zip(_chunk_trees(model_chunks), layouts):
        for name, tensor in flatten_state_dict(tree).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            try:
                placements(name, tuple(tensor.shape), layout)
            except KeyMappingError as err:
                raise CheckpointError(f"--ckpt-format torch_dist (the default) cannot save this "
                                      f"model: {err}; save it with --ckpt-format torch") from None


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate) -> str:
    """Write iteration ``iteration`` under ``args.save`` in the torch_dist format; collective."""
    tmp_root = begin_save(args.save, iteration)
    iter_dir = os.path.join(tmp_root, checkpoint_dir_name(iteration))
    error = ""
    try:
        items = _shards(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
        crash_point("before_files")
        save_shards(iter_dir, items)
        crash_point("after_file")
    except DistCheckpointWriteError as err:
        error = str(err)
    finish_save(args.save, iteration, error, getattr(args, "verify_integrity", False),
                object_storage.save_url(args))
    return os.path.join(args.save, checkpoint_dir_name(iteration))


def _cpu_copy(items: list) -> list:
    """The items with every tensor copied to CPU memory, so training may go on changing them."""
    out = []
    for item in items:
        if isinstance(item, TensorShard):
            out.append(dataclasses.replace(item, tensor=item.tensor.detach().to("cpu",
                                                                                copy=True)))
        else:
            out.append(dataclasses.replace(item, obj=copy_to_cpu(item.obj)))
    return out


class AsyncDistSave:
    """``--async-save`` of a torch_dist checkpoint: :func:`start_async` copies this rank's
    shards to CPU and a thread writes its data file; :meth:`finish` (collective, main thread)
    gathers every rank's records, rank 0 writes the metadata, and the folder is published."""

    def __init__(self, iteration: int, save_dir: str, iter_dir: str, items: list):
        self.iteration, self.save_dir, self.iter_dir = iteration, save_dir, iter_dir
        self.items, self.records, self.error = items, [], ""
        self.integrity = False  # --verify-integrity: a manifest is written before publishing
        self.upload_url = None  # an msc:// --save: uploaded once published
        self.thread = threading.Thread(target=self._write, daemon=True,
                                       name=f"torch-dist-writer-{iteration}")

    def _write(self) -> None:
        try:
            crash_point("before_files")
            with ShardWriter(self.iter_dir, dist.get_rank()) as writer:
                writer.add(self.items)
            self.records = writer.records
            crash_point("after_file")
        except BaseException as err:  # noqa: BLE001 - raised on every rank at finish()
            self.error = f"rank {dist.get_rank()}: {type(err).__name__}: {err}"
        self.items = []

    def busy(self) -> bool:
        return self.thread.is_alive()

    def finish(self) -> None:
        self.thread.join()
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((self.records, self.error), gathered, dst=0)
        error = ""
        if dist.get_rank() == 0:
            errors = [e for _, e in gathered if e]
            if not errors:
                try:
                    write_metadata(self.iter_dir, [r for rs, _ in gathered for r in rs])
                except DistCheckpointWriteError as err:
                    errors.append(str(err))
            error = "; ".join(errors)
        finish_save(self.save_dir, self.iteration, error, self.integrity, self.upload_url)


def start_async(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                pstate) -> AsyncDistSave:
    """Begin a background torch_dist save (collective: the shards are gathered here)."""
    tmp_root = begin_save(args.save, iteration)
    iter_dir = os.path.join(tmp_root, checkpoint_dir_name(iteration))
    items = _cpu_copy(_shards(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                              pstate))
    if dist.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    job = AsyncDistSave(iteration, args.save, iter_dir, items)
    job.upload_url = object_storage.save_url(args)
    job.thread.start()
    return job


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def _open(iter_dir: str) -> Tuple[DistCheckpointReader, dict]:
    try:
        reader = flattened.open_view(DistCheckpointReader(iter_dir))
        common = reader.common_state()
        return glu_interleave.open_view(reader, common.get("args")), common
    except (DistCheckpointError, UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(str(err)) from None


def saved_args(iter_dir: str) -> Optional[argparse.Namespace]:
    return _open(iter_dir)[1].get("args")


# --dist-ckpt-strictness, as Megatron-Core's StrictHandling: what happens to saved model tensors
# this model has no place for (unexpected), and to tensors it needs that the checkpoint lacks
# (missing): "raise" stops the load, "log" prints them and goes on, "ignore" goes on. A missing
# tensor that does not stop the load keeps the model's current value. The return_* modes hand
# the keys to a caller of Megatron-Core's loader; a training run has none, so they ignore them.
STRICTNESS = {  # mode -> (unexpected, missing)
    "assume_ok_unexpected": ("ignore", "raise"), "log_unexpected": ("log", "raise"),
    "raise_unexpected": ("raise", "raise"), "raise_all": ("raise", "raise"),
    "log_all": ("log", "log"), "ignore_all": ("ignore", "ignore"),
    "return_unexpected": ("ignore", "raise"), "return_all": ("ignore", "ignore"),
}


def _check_strictness(reader, model_chunks, layouts, args, path: str) -> List[frozenset]:
    """--dist-ckpt-strictness (see :data:`STRICTNESS`); returns, per chunk, the tensors the
    checkpoint lacks that keep the model's values."""
    strictness = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    on_unexpected, on_missing = STRICTNESS[strictness]
    if on_unexpected == "ignore" and on_missing == "raise":
        return [frozenset()] * len(model_chunks)
    from megatron.checkpoint.dist.keys import placements

    saved = set(reader.tensor_keys())
    wanted, keep = set(), []
    for chunk, layout in zip(model_chunks, layouts):
        tree, absent, absent_keys = chunk.state_dict_for_save_checkpoint(), set(), set()
        for name in dotted_names(tree):
            keys = {p.key for p in placements(name, tuple(_local_param(tree, name).shape),
                                               layout)}
            wanted |= keys
            if not keys <= saved:
                absent.add(name)
                absent_keys |= keys - saved
        if on_missing != "raise":   # else the load itself stops, naming the tensor
            keep.append(frozenset(absent))
            _report(f"{path}: {len(absent_keys)} tensor(s) this model needs are not in the "
                    "checkpoint", sorted(absent_keys), on_missing, strictness,
                    "; they keep their current values")
        else:
            keep.append(frozenset())
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(wanted))
        wanted = {k for keys_ in gathered for k in keys_}
    unexpected = sorted(k for k in saved
                        if not k.startswith(OPTIMIZER_STATE_PREFIX) and k not in wanted)
    _report(f"{path}: {len(unexpected)} saved tensor(s) this model has no place for",
            unexpected, on_unexpected, strictness, "; ignored")
    return keep


def _report(message: str, names: List[str], action: str, strictness: str,
            outcome: str) -> None:
    """Raise (``action`` "raise") or note ("log") ``names``, if any; "ignore" passes."""
    if not names or action == "ignore":
        return
    text = f"{message}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
    if action == "raise":
        raise CheckpointError(text + f" (--dist-ckpt-strictness {strictness})")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"NOTE: {text}{outcome} (--dist-ckpt-strictness {strictness})", flush=True)


def _absent_router_biases(reader, model_chunks, layouts) -> List[frozenset]:
    """Per chunk, the router biases (dotted names) an older checkpoint lacks: they load as
    zeros (:mod:`megatron.checkpoint.router_bias`)."""
    from megatron.checkpoint.dist.keys import placements, stored_key

    absent = []
    for chunk, layout in zip(model_chunks, layouts):
        tree = chunk.state_dict_for_save_checkpoint()
        absent.append(frozenset(
            name for name in dotted_names(tree) if is_router_bias(name)
            and any(stored_key(p.key, reader) not in reader for p in placements(
                name, tuple(_local_param(tree, name).shape), layout))))
    return absent


def _as_fp32(tree):
    """``tree`` with every floating tensor replaced by an fp32 copy (a template to read the
    checkpoint's values into without rounding them to the model's half precision)."""
    if isinstance(tree, dict):
        return {k: _as_fp32(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return tree.detach().to(torch.float32)
    return tree


def _load_model(reader, model_chunks, layouts, path: str, keep: List[frozenset],
                zero: List[frozenset], wide: bool = False) -> List[dict]:
    """Load every chunk's tensors; returns the states read (in fp32 with ``wide``:
    --load-main-params-from-ckpt keeps them for the main params)."""
    loaded = []
    try:
        for chunk, layout, kept, zeros in zip(model_chunks, layouts, keep, zero):
            template = chunk.state_dict_for_save_checkpoint()
            loaded.append(load_model_state(reader, _as_fp32(template) if wide else template,
                                           layout, kept, zeros))
    except (DistCheckpointError, UnsafeCheckpointError, ValueError) as err:
        raise CheckpointError(f"{path}: model state does not fit the model: "
                                            f"{err}") from None
    for chunk, state in zip(model_chunks, loaded):
        chunk.load_state_dict(state, strict=True)
    return loaded


def _model_param_groups(optimizer) -> List[list]:
    """The model's own parameters of each of the optimizer's groups: the distributed
    optimizer's groups hold its shards (its ``model_param_groups`` the whole), the fp16/bf16
    wrapper's the fp32 main copies of its half-precision parameters."""
    whole = getattr(optimizer, "model_param_groups", None)
    if whole:
        return whole
    halves = getattr(optimizer, "float16_groups", None)
    mains = getattr(optimizer, "fp32_from_float16_groups", None)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        model_of = ({id(main): half for main, half in zip(mains[g], halves[g])}
                    if halves is not None and mains is not None else {})
        groups.append([model_of.get(id(p), p) for p in group["params"]])
    return groups


def _current_order(optimizer, trees: List[dict]) -> List[List[Tuple[int, str, tuple]]]:
    """``(chunk, name, shape)`` of every parameter of each of the optimizer's groups: found by
    the storage each parameter shares with the saved model tree, so any grouping (muP,
    --decoupled-lr, --apply-wd-to-qk-layernorm) is saved and read back; where that does not
    find every parameter, by Megatron's rule (decayed, then biases and 1-D parameters)."""
    params = _model_param_groups(optimizer)
    found = optimizer_state.members_by_identity(params, trees)
    if found is not None:
        return found
    order = optimizer_state.param_order(trees)
    groups = []
    keys = [(float(g.get("wd_mult", 1.0)), float(g.get("lr_mult", 1.0)))
            for g in optimizer.param_groups]
    if len(set(keys)) != len(keys):
        raise CheckpointError("--ckpt-format torch_dist: two param groups of this run have the "
                              "same wd_mult and lr_mult and their parameters could not be "
                              "named; pass --no-load-optim")
    for g, (key, members_now) in enumerate(zip(keys, params)):
        members = [p for p in order if optimizer_state.group_key(p[1], p[2]) == key]
        if len(members) != len(members_now):
            raise CheckpointError(
                f"--ckpt-format torch_dist: param group {g} of this run holds "
                f"{len(members_now)} parameters, {len(members)} by Megatron's grouping; "
                "pass --no-load-optim")
        groups.append(members)
    return groups


def _state_fields(args) -> Tuple[str, ...]:
    """The optimizer state fields this run reads: Adam's two moments, or Lion's one."""
    return optimizer_state.STATE_FIELDS.get(getattr(args, "optimizer", "adam"),
                                            optimizer_state.MOMENTS)


def _load_optimizer(reader, common, optimizer, model_chunks, layouts, args, path) -> None:
    try:
        saved = flattened.unnest_common(common.get("optimizer"))
    except DistCheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from err
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise CheckpointError(f"{path}: has no optimizer state (saved with "
                                            "--no-save-optim?); pass --no-load-optim or "
                                            "--finetune")
    if saved.get("param_state_sharding_type") == flattened.GATHERED_TYPE:
        raise CheckpointError(
            f"{path}: the distributed optimizer's state was saved gathered on one rank "
            f"({flattened.GATHERED_TYPE!r}, Megatron-Core before 0.14 without "
            "--ckpt-fully-parallel-save), a layout not read here; pass --no-load-optim")
    trees = _chunk_trees(model_chunks)
    if muon_state.is_muon(optimizer):
        _load_muon(reader, saved, optimizer, trees, layouts, args, path)
        return
    groups = _current_order(optimizer, trees)
    step = int(float(saved.get("state", {}).get("common_step", 0)))
    saved_groups = {optimizer_state.group_signature(g): g for g in saved["param_groups"]}
    half = args.fp16 or args.bf16
    main_present = half and any(k.startswith(MAIN_PREFIX) for k in reader.tensor_keys())
    all_hparams = []
    for group in optimizer.param_groups:
        key = optimizer_state.group_signature(group)
        hparams = {k: v for k, v in group.items() if k not in ("params", "model_params")}
        hparams.update({k: v for k, v in saved_groups.get(key, {}).items()
                        if k in ("lr", "weight_decay", "betas", "eps")})
        all_hparams.append(hparams)
    if hasattr(optimizer, "load_local_param_state"):  # the distributed optimizer
        _load_distributed(reader, optimizer, trees, layouts, groups, all_hparams, step,
                          main_present, saved.get("grad_scaler"), path,
                          _state_fields(args))
        return
    fields = _state_fields(args)
    state, param_groups, mains, index = {}, [], [], 0
    try:
        for hparams, members in zip(all_hparams, groups):
            ids, main_row = [], []
            for chunk, name, _ in members:
                like = _local_param(trees[chunk], name)
                entry = {"step": torch.tensor(float(step))} if "exp_avg_sq" in fields else {}
                try:
                    for field in fields:
                        entry[field] = read_local(reader, name, like.float(), layouts[chunk],
                                                  f"{OPTIMIZER_STATE_PREFIX}{field}.")
                    state[index] = entry
                except DistCheckpointError:
                    # A frozen parameter never stepped, so it was saved without state; it
                    # gets none back, as in the run that saved it.
                    if like.requires_grad:
                        raise
                if half:
                    main_row.append(read_local(reader, name, like.float(), layouts[chunk],
                                               MAIN_PREFIX) if main_present
                                    else like.detach().float().clone())
                ids.append(index)
                index += 1
            param_groups.append(dict(hparams, params=ids))
            mains.append(main_row)
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise CheckpointError(f"{path}: optimizer state does not fit: "
                                            f"{err}") from None
    inner = {"state": state, "param_groups": param_groups}
    if half:
        full = {"optimizer": inner, "fp32_from_fp16_params": mains}
        if saved.get("grad_scaler") is not None:
            full["grad_scaler"] = saved["grad_scaler"]
        optimizer.load_state_dict(full)
    else:
        optimizer.load_state_dict(inner)


def _load_muon(reader, saved: dict, optimizer, trees, layouts, args, path: str) -> None:
    """Muon's state (:mod:`megatron.checkpoint.muon_state`), each tensor read at this rank's
    layout; a ``dist_muon`` optimizer keeps its own share."""
    step = int(float(saved.get("state", {}).get("common_step", 0)))
    saved_groups = {(float(g.get("wd_mult", 1.0)), float(g.get("lr_mult", 1.0))): g
                    for g in saved["param_groups"]}
    hparams = []
    for group in optimizer.param_groups:
        key = (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)))
        extra = {k: v for k, v in group.items() if k != "params"}
        extra.update({k: v for k, v in saved_groups.get(key, {}).items()
                      if k in ("lr", "weight_decay")})
        hparams.append(extra)

    def read(chunk: int, name: str, prefix: str) -> torch.Tensor:
        like = _local_param(trees[chunk], name)
        return read_local(reader, name, like.float(), layouts[chunk], prefix)

    half = args.fp16 or args.bf16
    read_matrix = (_emerging_reader(reader, optimizer, trees, layouts, step)
                   if emerging_state.is_emerging(optimizer) else None)
    try:
        inner = muon_state.load_inner_state(optimizer, trees, read, step, hparams, read_matrix)
        mains = None
        if half:
            present = any(k.startswith(MAIN_PREFIX) for k in reader.tensor_keys())
            mains = [[read(c, n, MAIN_PREFIX) if present else
                      _local_param(trees[c], n).detach().float().clone() for c, n in row]
                     for row in muon_state.main_members(optimizer, trees)]
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise CheckpointError(f"{path}: optimizer state does not fit: {err}") from None
    if not half:
        optimizer.load_state_dict(inner)
        return
    full = {"optimizer": inner, "fp32_from_fp16_params": mains}
    if saved.get("grad_scaler") is not None:
        full["grad_scaler"] = saved["grad_scaler"]
    optimizer.load_state_dict(full)


def _emerging_reader(reader, optimizer, trees, layouts, step: int):
    """``read_matrix(chunk, name)`` for :func:`muon_state.load_inner_state`: SOAP's or adaptive
    Muon's state of one matrix weight at this layout (None before the first step: the
    optimizer starts it afresh, as a run that has not stepped)."""
    found = emerging_state.matrices(optimizer, muon_state.param_members(optimizer, trees))

    def read_matrix(chunk: int, name: str):
        if step == 0:
            return None
        matrix = found[(chunk, name)]
        kinds = emerging_state.field_kinds(optimizer, matrix)
        like = _local_param(trees[chunk], name).detach().float()
        entry = emerging_state.read_fields(
            reader, matrix, kinds, layouts[chunk],
            lambda prefix, layout: read_local(reader, name, like, layout, prefix))
        if "Q_L" in kinds:  # SOAP counts its own steps
            entry["step"] = step
        return entry

    return read_matrix


def _local_param(tree: dict, name: str) -> torch.Tensor:
    node = tree
    parts = name.split(".")
    i = 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if isinstance(node, dict) and key in node:
                node, i = node[key], j
                break
        else:
            raise KeyError(name)
    return node


def _load_distributed(reader, optimizer, trees, layouts, groups, all_hparams, step: int,
                      main_present: bool, grad_scaler, path: str,
                      fields: Tuple[str, ...] = optimizer_state.MOMENTS) -> None:
    """The distributed optimizer reads, for each of its pieces, only the band of rows that
    holds it (about 1/DP of each parameter's state), at any saved layout."""

    def read(g: int, i: int, start: int, end: int) -> dict:
        chunk, name, shape = groups[g][i]
        inner = int(torch.Size(shape[1:]).numel())
        rows = (start // inner, (end - 1) // inner + 1)
        cut = slice(start - rows[0] * inner, end - rows[0] * inner)
        values = {field: read_local_rows(reader, name, shape, rows, layouts[chunk],
                                         f"{OPTIMIZER_STATE_PREFIX}{field}.").reshape(-1)[cut]
                  for field in fields}
        if main_present:
            values["param"] = read_local_rows(reader, name, shape, rows, layouts[chunk],
                                              MAIN_PREFIX).reshape(-1)[cut]
        else:  # an fp32 model is its own main copy
            values["param"] = _local_param(trees[chunk], name).detach().reshape(-1)[
                start:end].float()
        return values

    metas = [dict(hparams, step=step) for hparams in all_hparams]
    try:
        optimizer.load_local_param_state(metas, read, grad_scaler)
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise CheckpointError(f"{path}: optimizer state does not fit: "
                                            f"{err}") from None


def _check_vocab(saved, args, path: str) -> None:
    """The vocabulary a torch_dist checkpoint was padded from must fit this run's table."""
    saved_padded = getattr(saved, "padded_vocab_size", None)
    if saved_padded is None or saved_padded == args.padded_vocab_size:
        return
    from megatron.training import global_vars

    try:
        vocab = global_vars.get_tokenizer().vocab_size
    except Exception:  # noqa: BLE001 - no tokenizer set up: the smaller table must do
        vocab = min(saved_padded, args.padded_vocab_size)
    if saved_padded < vocab:
        raise CheckpointError(
            f"{path}: saved with a vocabulary table of {saved_padded} rows; this run's has "
            f"{args.padded_vocab_size}, and the tokenizer needs {vocab}")


def load_checkpoint(iter_dir: str, iteration: int, release: bool, model_chunks, optimizer,
                    opt_param_scheduler, args, pstate, weights_only: bool = False) -> dict:
    """Load a torch_dist iteration folder at this run's layout; returns the common state."""
    reader, common = _open(iter_dir)
    # The vocabulary's padding follows the TP size; the tables are read row by row (see
    # read_local), so only the true vocabulary must match.
    check_args(common.get("args"), args, iter_dir,
                              ignore=("padded_vocab_size",))
    _check_vocab(common.get("args"), args, iter_dir)
    layouts = _layouts(model_chunks, _model_config(model_chunks), pstate)
    keep = _check_strictness(reader, model_chunks, layouts, args, iter_dir)
    zero = _absent_router_biases(reader, model_chunks, layouts)
    filled = sorted(set().union(*zero))
    note_zero_router_bias(iter_dir, filled)
    restore = not (args.finetune or release)
    # --load-main-params-from-ckpt: a fresh optimizer's main params take the values read.
    fresh_optimizer = optimizer is not None and not (restore and not args.no_load_optim)
    wide = (not weights_only and fresh_optimizer
            and getattr(args, "load_main_params_from_ckpt", False))
    loaded = _load_model(reader, model_chunks, layouts, iter_dir, keep, zero, wide)
    if weights_only:
        return common
    if restore and not args.no_load_optim and filled:
        raise CheckpointError(optimizer_refusal(iter_dir, filled))
    if restore and not args.no_load_optim:
        _load_optimizer(reader, common, optimizer, model_chunks, layouts, args, iter_dir)
        if "opt_param_scheduler" not in common:
            raise CheckpointError(f"{iter_dir}: has no opt_param_scheduler state;"
                                                " pass --no-load-optim or --finetune")
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params(main_values_of(model_chunks, loaded) if wide else None)
    if restore and not args.no_load_rng:
        key = (f"rng_state/shard_{pstate.pp_rank}.{pstate.tp_rank}_"
               f"{pstate.pp_size}.{pstate.tp_size}")
        if key in reader.byte_keys():
            rng = reader.read_single_object(key)
            set_rng_state_snapshot(rng[pstate.dp_rank] if len(rng) == pstate.dp_size
                                         else rng[0])
        elif dist.get_rank() == 0:
            print(f"NOTE: {iter_dir} has no RNG state for (tensor, pipeline) layout "
                  f"{pstate.tp_size} x {pstate.pp_size} (saved at another layout); RNGs are "
                  "seeded from --seed", flush=True)
    if restore:
        common = dict(common, **{RERUN_KEY: _rerun_entry(reader, common, args, iter_dir,
                                                         dist.get_rank(),
                                                         dist.get_world_size())})
    return common


def _rerun_entry(reader, common: dict, args, path: str, rank: int,
                 world: int) -> Optional[dict]:
    """The rerun state machine entry of rank ``rank`` of ``world`` (``mode``, ``state``,
    ``current_iteration`` and its own ``sharded`` part) when the checkpoint holds a pending
    re-run, in Megatron-Core's layout (:func:`_rerun_shards`); None when nothing is pending.
    As Megatron does, the state is ignored, with a note, when the world, tensor- or
    pipeline-parallel size changed."""
    saved = common.get(RERUN_KEY)
    if not isinstance(saved, dict):   # none, or this project's older files: inside args
        return getattr(common.get("args"), RERUN_KEY, None)
    state = saved.get("state")
    if int(getattr(state, "value", state) or 0) == 0:
        return None
    key = object_key(RERUN_SHARD_KEY, (rank,), (world,))
    old = common.get("args")
    same = all(getattr(old, name, None) == getattr(args, name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size"))
    if key not in reader.byte_keys() or not same:
        if rank == 0:
            print(f"NOTE: {path} holds a pending re-run (rerun_state_machine) saved at another "
                  "world, tensor- or pipeline-parallel size; it is ignored, as Megatron does",
                  flush=True)
        return None
    return {"mode": rerun_enums.mode_from_checkpoint(saved.get("mode")), "state": state,
            "current_iteration": saved["current_iteration"],
            "sharded": reader.read_single_object(key)}


__all__ = ["save_checkpoint", "start_async", "load_checkpoint",
           "saved_args"]

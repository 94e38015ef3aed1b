"""Megatron-Core ``torch_dist`` checkpoints to and from the canonical stream of
:mod:`megatron.convert.schema`.

:func:`load_dist` reads an iteration folder written by Megatron-Core (or by :func:`save_dist`)
with :class:`megatron.checkpoint.dist.DistCheckpointReader`: the model's description comes
from ``common_state``'s ``args`` (Megatron's field names and conventions, read by the same rules
as a legacy checkpoint's args), the tensors are read by global key, a layer at a time, so the
saved TP / PP layout does not matter. An ``fsdp_dtensor`` or ``torch_dcp`` folder is read the
same way through the per-layer view of :mod:`megatron.convert.fsdp_io` (weights only).

:func:`save_dist` writes the stream as a ``torch_dist`` folder at a target TP x PP (even
split, no virtual stages), as the target's ranks would: one data file per target rank
(``__<rank>_0.distcp``, rank = pp_rank x TP + tp_rank), each holding that rank's pieces under
Megatron-Core's keys, global shapes and offsets, written by this one process, then one
``.metadata``. Byte entries: ``common_state/shard_0_1`` (``args`` with the target layout and
``ckpt_format`` ``torch_dist``, ``checkpoint_version`` 3.0, ``iteration``,
``opt_param_scheduler`` when the source has one, ``num_floating_point_operations_so_far``,
``content_metadata`` and this project's ``conversion`` record) and the empty extra-state entry
of each layer's linear modules. The Adam state travels as in the legacy formats
(:mod:`megatron.checkpoint.optimizer_state`): read as views of the source, written under
``optimizer.state.exp_avg.<key>`` / ``exp_avg_sq`` (and ``fp32_param`` for a half-precision
target) with the param groups and step in ``common_state``. RNG states are dropped, and so is
Megatron's ``rerun_state_machine_state``; Megatron-LM loads the result with
``--no-load-rng``.
"""

import argparse
import enum
import os
import tempfile
import types
from typing import Dict, Iterable, Iterator, Optional

import torch

from megatron.checkpoint import optimizer_state
from megatron.checkpoint.dist import keys
from megatron.checkpoint.dist.model_state import tensor_shards
from megatron.checkpoint.dist.flattened import open_view, unnest_common
from megatron.checkpoint.dist.reader import (DistCheckpointError, DistCheckpointReader,
                                             is_dist_checkpoint)
from megatron.checkpoint.fsdp_dtensor import is_fsdp_dtensor_checkpoint
from megatron.checkpoint.dist.writer import (DistCheckpointWriteError, ObjectShard, ShardWriter,
                                             write_metadata)
from megatron.checkpoint.layout import CHECKPOINT_VERSION, checkpoint_dir_name, read_tracker
from megatron.checkpoint.publish import publish
from megatron.checkpoint.router_bias import is_router_bias, note_zero_router_bias_once
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError, stand_ins_in
from megatron.convert import megatron_io
from megatron.convert.megatron_layout import (MTP_LAYER, SCHEDULER_KEY, expert_of,
                                              layer_tensor_names, mtp_tensor_shapes,
                                              split_tensor, tp_split_rule)
# The legacy saver's target (sizes, vocabulary rows, args) and its per-piece placement rules,
# shared so that both formats make the same checks and the same TP shards.
from megatron.convert.megatron_save import (SaveTarget, check_tensors, embedding_writes,
                                            final_writes, mtp_writes)
from megatron.convert.target import staged_target
from megatron.convert.schema import ConversionError, ModelMeta, Piece

FORMATS = ("torch", "torch_dist")
_WORD = "language_model.embedding.word_embeddings.weight"
_POSITION = "language_model.embedding.position_embeddings.weight"
_OUTPUT = "language_model.output_layer.weight"
_FINAL_NORM = "language_model.encoder.final_layernorm."
# What Megatron-Core records about how the model's sharded state was built (plain tensors,
# one piece per key and rank), so its loader builds the same keys.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def iteration_dir(load_dir: str, ckpt_step: Optional[int]):
    tracked = read_tracker(load_dir) if os.path.isdir(load_dir) else None
    if tracked is None and ckpt_step is None:
        return None
    iteration, release = (ckpt_step, False) if ckpt_step is not None else tracked
    return os.path.join(load_dir, checkpoint_dir_name(iteration, release)), \
        iteration, release


def find_dist_checkpoint(load_dir: str, ckpt_step: Optional[int] = None) -> Optional[str]:
    """The iteration folder of ``load_dir`` when it is a torch_dist one (a ``.metadata``, no
    ``mp_rank_*`` folders), else None."""
    found = iteration_dir(load_dir, ckpt_step)
    if found is None:
        return None
    iter_dir = found[0]
    if not os.path.isdir(iter_dir) or not is_dist_checkpoint(iter_dir):
        return None
    if any(name.startswith("mp_rank_") for name in os.listdir(iter_dir)):
        return None
    return iter_dir


def _open(load_dir: str, ckpt_step: Optional[int]):
    iter_dir = find_dist_checkpoint(load_dir, ckpt_step)
    if iter_dir is None:
        raise ConversionError(f"--load-dir {load_dir}: no torch_dist iteration folder")
    if is_fsdp_dtensor_checkpoint(iter_dir):
        from megatron.convert.fsdp_io import open_fsdp

        from megatron.checkpoint.torch_dcp import FORMAT, is_torch_dcp_checkpoint

        view, common = open_fsdp(iter_dir, FORMAT if is_torch_dcp_checkpoint(iter_dir)
                                 else "fsdp_dtensor")
        return view, common, iteration_dir(load_dir, ckpt_step)
    try:
        reader = open_view(DistCheckpointReader(iter_dir))   # also Megatron-Core < 0.14's
        common = reader.common_state()
    except (DistCheckpointError, UnsafeCheckpointError) as err:
        raise ConversionError(str(err)) from None
    return reader, common, iteration_dir(load_dir, ckpt_step)


def _meta(reader: DistCheckpointReader, common: dict, iteration: int, release: bool,
          true_vocab_size: Optional[int]) -> ModelMeta:
    """The model's description from the saved args, by the legacy loader's rules."""
    args = common.get("args")
    where = f"{reader.path} (common_state)"
    if args is None or not hasattr(args, "num_layers"):
        raise ConversionError(f"{where}: holds no args namespace")
    if (any(k.endswith(".mlp.shared_experts.gate_weight") for k in reader.tensor_keys())
            and not getattr(args, "moe_shared_expert_gate", False)):
        raise ConversionError(f"{where}: holds mlp.shared_experts.gate_weight but its args lack "
                              "--moe-shared-expert-gate")
    if any(k.startswith(("lm_head.", "binary_head.", "pooler.")) for k in reader.tensor_keys()):
        raise ConversionError(f"{where}: a BERT model; torch_dist conversion supports GPT only")
    source = types.SimpleNamespace(
        args=args, scheduler=common.get("opt_param_scheduler"), release=release,
        iteration=common.get("iteration", iteration), bert=False, num_tokentypes=0,
        binary_head=False, file=lambda *_: where)
    meta = megatron_io._meta_from_args(source, true_vocab_size)
    meta.source_args = _plain(meta.source_args)
    meta.source_args["ckpt_format"] = "torch_dist"
    return meta


def _fsdp_source(reader) -> bool:
    """Whether ``reader`` is the view of an fsdp_dtensor folder (per-layer keys, no optimizer
    carried)."""
    return getattr(reader, "per_layer", False)


def _plain(source_args: dict) -> dict:
    """The saved args without Megatron's own classes (read as stand-ins; as training does, a
    value that is not plain data is not written again) and with enum members (``exit_signal``)
    as their plain values, so any target file loads with ``weights_only``."""
    plain = (type(None), bool, int, float, str, list, tuple, dict, torch.dtype)
    out = {}
    for key, value in source_args.items():
        if isinstance(value, enum.Enum):
            value = value.value
        if key == SCHEDULER_KEY or (isinstance(value, plain) and not stand_ins_in(value)):
            out[key] = value
    return out


def _view_prefix(reader: DistCheckpointReader, view: Optional[str]) -> str:
    """Where a view's tensors sit: the Adam moments under ``optimizer.state.<field>.``; the fp32
    main copies under ``optimizer.state.fp32_param.`` (or the weights, an fp32 model's own)."""
    if view is None:
        return ""
    if view == optimizer_state.MAIN:
        prefix = keys.OPTIMIZER_STATE_PREFIX + "fp32_param."
        return prefix if any(k.startswith(prefix) for k in reader.tensor_keys()) else ""
    return f"{keys.OPTIMIZER_STATE_PREFIX}{view}."


def _optimizer_meta(reader: DistCheckpointReader, common: dict) -> tuple:
    """``ModelMeta.optimizer`` of a torch_dist checkpoint, or None and why it is not carried."""
    try:
        saved = unnest_common(common.get("optimizer"))   # Megatron-Core < 0.14's nesting too
    except DistCheckpointError as err:
        raise ConversionError(str(err)) from None
    if not isinstance(saved, dict) or "param_groups" not in saved:
        return None, "the source has no optimizer state"
    moments = [k for k in reader.tensor_keys() if k.startswith(keys.OPTIMIZER_STATE_PREFIX)]
    if not moments:
        return None, ("its optimizer state is not in the non-distributed layout "
                      "(optimizer.state.exp_avg.*)")
    hparams = {}
    for group in saved["param_groups"]:
        key = (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)))
        if key[1] != 1.0:
            return None, f"a param group scales its learning rate (lr_mult {key[1]})"
        hparams[key] = {k: v for k, v in group.items() if k != "params"}
    step = saved.get("state", {}).get("common_step", 0)
    if int(float(step)) == 0:
        return None, "its optimizer has not taken a step (no Adam state yet)"
    return {"step": int(float(step)), "hparams": hparams, "has_main": False,
            "grad_scaler": saved.get("grad_scaler")}, ""


def _per_layer(meta: ModelMeta) -> bool:
    """Whether the model's layers are stored under per-layer keys (Megatron-Core's
    non-homogeneous block, :func:`megatron.checkpoint.dist.keys.per_layer_keys`)."""
    return bool(meta.num_experts) and keys.per_layer_keys(meta.moe_layer_freq)


def _layout_error(reader: DistCheckpointReader, key: str, meta: ModelMeta) -> ConversionError:
    saved = "per-layer" if any(keys.is_per_layer_key(k) for k in reader.tensor_keys()) \
        else "stacked"
    wanted = "per-layer" if _per_layer(meta) else "stacked"
    why = (f"; the file's layers are under {saved} keys but its args' --moe-layer-freq "
           f"{meta.moe_layer_freq} means {wanted} keys" if saved != wanted else "")
    return ConversionError(f"{reader.path}: no {key} in the checkpoint{why}")


def _layer(reader: DistCheckpointReader, meta: ModelMeta, index: int,
           prefix: str = "") -> Dict[str, torch.Tensor]:
    tensors = {}
    per_layer = _per_layer(meta) or _fsdp_source(reader)
    for name in layer_tensor_names(meta, index):
        key = prefix + keys.layer_key(name, index if per_layer else None,
                                      mla=meta.multi_latent_attention)
        if meta.multi_latent_attention:
            key = keys.stored_key(key, reader)
        if key not in reader and is_router_bias(name):
            note_zero_router_bias_once(reader.path, key)
            tensors[name] = torch.zeros(meta.num_experts, dtype=_router_dtype(reader, key))
            continue
        if key not in reader:
            raise _layout_error(reader, key, meta)
        shape = reader.shape(key)
        expert = expert_of(name)
        start, size = (), ()
        if not per_layer:
            if shape[0] != meta.num_layers:
                raise ConversionError(f"{reader.path}: {key} stacks {shape[0]} layers, the args "
                                      f"say --num-layers {meta.num_layers}")
            start, size = (index,), (1,)
        if expert is not None:
            if shape[len(start)] != meta.num_experts:
                raise ConversionError(f"{reader.path}: {key} stacks {shape[len(start)]} "
                                      f"experts, the args say --num-experts {meta.num_experts}")
            start, size = start + (expert[0],), size + (1,)
        rest = shape[len(start):]
        tensor = reader.read(key, start + (0,) * len(rest), size + tuple(rest))
        tensors[name] = tensor.reshape(rest)
    return tensors


def _mtp_depth(reader: DistCheckpointReader, meta: ModelMeta, depth: int,
               prefix: str = "") -> Dict[str, torch.Tensor]:
    """Multi-token prediction depth ``depth``: its own tensors under their names, its layer
    as one layer of the per-layer layout under ``mtp.layers.K.transformer_layer.``."""
    tensors = {}
    per_layer_prefix = keys.per_layer_prefix(0)
    for name in mtp_tensor_shapes(meta):
        if not name.startswith(MTP_LAYER):
            tensors[name] = _read(reader, f"{keys.MTP_PREFIX}{depth}.{name}", prefix)
            continue
        inner = name[len(MTP_LAYER):]
        key = keys.mtp_layer_prefix(depth) + keys.layer_key(
            inner, 0, mla=meta.multi_latent_attention)[len(per_layer_prefix):]
        key = prefix + key
        if meta.multi_latent_attention:
            key = keys.stored_key(key, reader)
        if key not in reader and is_router_bias(inner):
            note_zero_router_bias_once(reader.path, key)
            tensors[name] = torch.zeros(meta.num_experts, dtype=_router_dtype(reader, key))
            continue
        if key not in reader:
            raise ConversionError(f"{reader.path}: no {key} in the checkpoint (its args say "
                                  f"--mtp-num-layers {meta.mtp_num_layers})")
        expert = expert_of(inner)
        if expert is None:
            tensors[name] = reader.read(key)
            continue
        shape = reader.shape(key)
        tensor = reader.read(key, (expert[0],) + (0,) * (len(shape) - 1), (1,) + shape[1:])
        tensors[name] = tensor.reshape(shape[1:])
    return tensors


def _router_dtype(reader: DistCheckpointReader, bias_key: str) -> torch.dtype:
    """The dtype of the router weight beside ``bias_key``."""
    return reader.dtype(bias_key[:-len("bias")] + "weight")


def _read(reader: DistCheckpointReader, key: str, prefix: str = "") -> torch.Tensor:
    key = prefix + key
    if key not in reader:
        raise ConversionError(f"{reader.path}: no {key} in the checkpoint")
    return reader.read(key)


def load_dist(load_dir: str, ckpt_step: Optional[int] = None, *,
              true_vocab_size: Optional[int] = None,
              view: Optional[str] = None) -> Iterator[Piece]:
    """Yield the canonical stream of the torch_dist checkpoint in ``load_dir`` (``view``: an
    optimizer field in the weights' shapes, as :func:`megatron.convert.megatron_io.load_megatron`
    streams it).

    Raises:
        ConversionError: no torch_dist folder, a model this converter does not handle (BERT),
            a missing tensor (or layers under the other layout than the args'
            ``--moe-layer-freq`` implies) or a refused byte entry, naming it.
    """
    reader, common, (_, iteration, release) = _open(load_dir, ckpt_step)
    meta = _meta(reader, common, iteration, release, true_vocab_size)
    meta.optimizer, meta.optimizer_note = _optimizer_meta(reader, common)
    if _fsdp_source(reader):
        meta.optimizer_note = ("the optimizer state of an fsdp_dtensor or torch_dcp source is "
                               "not carried")
    prefix = _view_prefix(reader, view)
    yield Piece("meta", meta=meta)
    try:
        word = _read(reader, keys.OTHER_KEYS[_WORD], prefix)
        if word.size(0) != meta.padded_vocab_size:
            raise ConversionError(f"{reader.path}: the word embeddings have {word.size(0)} "
                                  f"rows but the saved args say padded_vocab_size "
                                  f"{meta.padded_vocab_size}")
        tensors = {"word_embeddings": word}
        if meta.position_embedding_type == "learned_absolute":
            tensors["position_embeddings"] = _read(reader, keys.OTHER_KEYS[_POSITION], prefix)
        yield Piece("embeddings", tensors)
        del tensors, word
        for index in range(meta.num_layers):
            yield Piece("layer", _layer(reader, meta, index, prefix), index=index)
            reader.clear_cache()
        norm = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
        yield Piece("final_norm", {n: _read(reader, keys.OTHER_KEYS[_FINAL_NORM + n], prefix)
                                   for n in norm})
        if meta.untie_embeddings_and_output_weights:
            yield Piece("output_layer", {"weight": _read(reader, keys.OTHER_KEYS[_OUTPUT],
                                                         prefix)})
        for depth in range(meta.mtp_num_layers):
            yield Piece("mtp", _mtp_depth(reader, meta, depth, prefix), index=depth)
            reader.clear_cache()
    except DistCheckpointError as err:
        raise ConversionError(str(err)) from None


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

class _DistTarget:
    """The target's writers (one per rank) and the layout of each of its chunks."""

    def __init__(self, target, root: str):
        self.target, self.meta = target, target.meta
        self.tp, self.pp = target.tp, target.pp
        self.writers = {(tp_rank, pp_rank): ShardWriter(root, pp_rank * self.tp + tp_rank)
                        for pp_rank in range(self.pp) for tp_rank in range(self.tp)}

    def layout(self, tp_rank: int, pp_rank: int) -> keys.ChunkLayout:
        return keys.ChunkLayout(num_layers=self.meta.num_layers,
                                layer_offset=pp_rank * self.target.per_stage,
                                tp_rank=tp_rank, tp_size=self.tp,
                                swiglu=self.meta.gated_linear_unit,
                                num_experts=self.meta.num_experts,
                                per_layer=_per_layer(self.meta),
                                mla=self.meta.multi_latent_attention)

    def put(self, tp_rank: int, pp_rank: int, name: str, tensor: torch.Tensor,
            prefix: str = "") -> None:
        """Write what target rank (tp_rank, pp_rank) would write of its local ``name``."""
        writer = self.writers[(tp_rank, pp_rank)]
        writer.add(tensor_shards(name, tensor, self.layout(tp_rank, pp_rank), prefix))

    def close(self) -> list:
        return [r for w in self.writers.values() for r in w.close()]


def _save_embeddings(out: _DistTarget, piece: Piece, prefix: str = "") -> None:
    for tp_rank, pp_rank, path, tensor in embedding_writes(out.target, piece):
        name = ".".join(path)
        if name == "word_embeddings_for_head.weight":
            continue  # tied: stored once, as the embedding
        out.put(tp_rank, pp_rank, name, tensor, prefix)


def _save_layer(out: _DistTarget, piece: Piece, prefix: str = "") -> None:
    target = out.target
    check_tensors(f"layer {piece.index}", piece.tensors, target.shapes[piece.index])
    pp_rank, local = target.stage_of(piece.index)
    for name, tensor in piece.tensors.items():
        rule = tp_split_rule(name, out.meta.gated_linear_unit)
        shards = ([tensor] * out.tp if rule is None
                  else split_tensor(tensor, rule[0], rule[1], out.tp))
        for tp_rank, shard in enumerate(shards):
            out.put(tp_rank, pp_rank, f"language_model.encoder.layers.{local}.{name}", shard,
                    prefix)
    if not prefix:
        experts = out.meta.num_experts if out.meta.is_moe_layer(piece.index) else None
        out.writers[(0, pp_rank)].add(ObjectShard(fqn, None) for fqn in keys.extra_state_keys(
            piece.index, out.meta.num_layers, range(experts) if experts else None, experts,
            shared_expert=bool(out.meta.moe_shared_expert_intermediate_size),
            per_layer=_per_layer(out.meta), attention_modules=(
                keys.mla_attention_modules(piece.tensors) if out.meta.multi_latent_attention
                else None)))


def _save_mtp(out: _DistTarget, piece: Piece, prefix: str = "") -> None:
    """One multi-token prediction depth on the last stage, and its byte entries."""
    last = out.pp - 1
    for tp_rank, pp_rank, path, tensor in mtp_writes(out.target, piece):
        out.put(tp_rank, pp_rank, ".".join(path), tensor, prefix)
    if not prefix:
        moe = out.meta.num_experts if out.meta.is_moe_layer(out.meta.num_layers - 1) else None
        out.writers[(0, last)].add(ObjectShard(fqn, None) for fqn in keys.mtp_extra_state_keys(
            piece.index, range(moe) if moe else None, moe,
            shared_expert=bool(moe and out.meta.moe_shared_expert_intermediate_size),
            attention_modules=(keys.mla_attention_modules(piece.tensors)
                               if out.meta.multi_latent_attention else None)))


def _save_final(out: _DistTarget, piece: Piece, prefix: str = "") -> None:
    for tp_rank, pp_rank, path, tensor in final_writes(out.target, piece):
        out.put(tp_rank, pp_rank, ".".join(path), tensor, prefix)


def _common_state(target) -> dict:
    args = argparse.Namespace(**_plain(vars(target.args())))
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    source = target.meta.source_args or {}
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": target.meta.iteration,
             "num_floating_point_operations_so_far":
                 source.get("num_floating_point_operations_so_far", 0) or 0,
             "content_metadata": dict(CONTENT_METADATA),
             "conversion": target.conversion_record()}
    if source.get(SCHEDULER_KEY) is not None:
        state["opt_param_scheduler"] = source[SCHEDULER_KEY]
    info = target.meta.optimizer if target.optimizer else None
    if info is not None:
        groups = [optimizer_state.megatron_core_group(dict(hparams, wd_mult=key[0],
                                                           lr_mult=key[1]), args)
                  for key, hparams in sorted(info["hparams"].items(), reverse=True)]
        state["optimizer"] = {"state": {"common_step": torch.tensor(float(info["step"]))},
                              "param_groups": groups}
        if info.get("grad_scaler") is not None:
            state["optimizer"]["grad_scaler"] = info["grad_scaler"]
    return state


def _consume(pieces: Iterator[Piece], out: _DistTarget, prefix: str = "") -> None:
    target = out.target
    wanted = {"embeddings", "final_norm"} | ({"output_layer"} if not target.tied else set())
    wanted |= {("layer", i) for i in range(out.meta.num_layers)}
    wanted |= {("mtp", k) for k in range(out.meta.mtp_num_layers)}
    seen = set()
    for piece in pieces:
        key = (piece.kind, piece.index) if piece.kind in ("layer", "mtp") else piece.kind
        if key not in wanted and piece.kind != "output_layer":
            raise ConversionError(f"unexpected piece in the stream: {piece.kind}"
                                  + (f" {piece.index}" if piece.index is not None else ""))
        if key in seen:
            raise ConversionError(f"the stream holds {key} twice")
        seen.add(key)
        if piece.kind == "embeddings":
            _save_embeddings(out, piece, prefix)
        elif piece.kind == "layer":
            _save_layer(out, piece, prefix)
        elif piece.kind == "mtp":
            _save_mtp(out, piece, prefix)
        else:
            _save_final(out, piece, prefix)
    missing = wanted - seen
    if missing:
        names = sorted(k if isinstance(k, str) else f"{k[0]} {k[1]}" for k in missing)
        raise ConversionError(f"the stream ended without {', '.join(names[:5])}")


def save_dist(pieces: Iterable[Piece], save_dir: str, target_tp: int, target_pp: int, *,
              make_vocab_size_divisible_by: Optional[int] = None,
              optimizer_streams: Optional[Dict[str, Iterable[Piece]]] = None,
              overwrite: bool = False) -> str:
    """Write the stream as a torch_dist checkpoint at ``target_tp`` x ``target_pp`` in
    ``save_dir`` (new or empty, or replaced whole with ``overwrite``); returns the iteration
    folder. Sizes, vocabulary padding, release vs iteration naming, the checks on the stream and
    the staging next to ``save_dir`` are those of
    :func:`megatron.convert.megatron_save.save_megatron`: nothing changes in ``save_dir`` until
    the new checkpoint is complete.
    """
    pieces = iter(pieces)
    first = next(pieces, None)
    if first is None or first.kind != "meta" or first.meta is None:
        raise ConversionError("the stream must start with its meta piece")
    if first.meta.model_type != "GPT":
        raise ConversionError(f"--target-ckpt-format torch_dist: only GPT models, not "
                              f"{first.meta.model_type}")
    target = SaveTarget(first.meta, target_tp, target_pp, make_vocab_size_divisible_by,
                     optimizer=bool(optimizer_streams))
    name = checkpoint_dir_name(target.meta.iteration, target.release)
    with staged_target(save_dir, overwrite) as root:
        staging = tempfile.mkdtemp(prefix=".tmp_convert_", dir=root)
        _write_dist(pieces, target, os.path.join(staging, name), optimizer_streams, save_dir)
        label = "release" if target.release else str(target.meta.iteration)
        publish(staging, root, name, label)
    return os.path.join(save_dir, name)


def _write_dist(pieces: Iterator[Piece], target, root: str,
                optimizer_streams: Optional[Dict[str, Iterable[Piece]]], save_dir: str) -> None:
    """The iteration folder ``root``: the model's (and optimizer's) shards and metadata."""
    out = None
    try:
        out = _DistTarget(target, root)
        out.writers[(0, 0)].add_object(keys.object_key("common_state"), _common_state(target))
        _consume(pieces, out)
        if target.optimizer:
            fields = optimizer_state.MOMENTS + ((optimizer_state.MAIN,) if target.half else ())
            for field in fields:
                stream = iter(optimizer_streams[field])
                next(stream)  # its meta piece: the same model
                prefix = keys.OPTIMIZER_STATE_PREFIX + (
                    "fp32_param." if field == optimizer_state.MAIN else f"{field}.")
                _consume(stream, out, prefix)
        write_metadata(root, out.close())
    except DistCheckpointWriteError as err:
        raise ConversionError(f"--save-dir {save_dir}: {err}") from None
    finally:
        if out is not None:
            out.close()

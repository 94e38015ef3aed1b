"""Megatron-layout checkpoints of any TP / PP to and from the canonical stream of
:mod:`megatron.convert.schema`.

:func:`load_megatron` reads ``iter_XXXXXXX/mp_rank_*/model_optim_rng.pt`` files saved under any
tensor-parallel size, any pipeline split (even, uneven first / last stages, or interleaved virtual
stages saved as ``model0``, ``model1``, ...) and yields whole tensors a layer at a time.
:func:`save_megatron` writes the stream as a checkpoint at a target TP x PP (even split, no virtual
stages) with the keys and nesting ``GPTModel.state_dict_for_save_checkpoint`` produces.

How tensors are split over TP ranks (``megatron/core/tensor_parallel/layers.py``):

====================================  ===========================================================
word embeddings, output layer         rows, contiguous (vocab-parallel / column-parallel)
query_key_value weight and bias       rows, contiguous; each rank holds whole query groups
dense weight                          columns (row-parallel); its bias is replicated
dense_h_to_4h weight and bias         rows; with SwiGLU stride 2: rank r holds [gate_r; value_r]
dense_4h_to_h weight                  columns (row-parallel); its bias is replicated
norms, position embeddings            replicated (rank 0's copy is read)
====================================  ===========================================================

The optimizer and RNG states are dropped: they belong to parameters as sharded at the source and
cannot be resharded exactly. Every file written carries ``"conversion": {"from_layout": [tp, pp]
(None for a source that is not a Megatron checkpoint), "optimizer": "dropped", "rng":
"dropped"}``. The LR / weight-decay schedule (``opt_param_scheduler``) is layout-free and is kept:
the loader passes it in ``meta.source_args[SCHEDULER_KEY]``, the saver writes it back.

Memory. Source files are opened with ``torch.load(mmap=True)`` once per piece and closed again,
so only the pages of the piece being read are mapped. Target files are first written whole with
``torch.serialization.skip_data`` (shapes and metadata; the tensor bytes are left as space to fill
and never allocated), then every piece of the stream is copied into them through a shared
``mmap`` opened for that piece and one file alone (target shards are views of the piece, except
SwiGLU's stride-2 ``dense_h_to_4h`` and vocabulary rows added as padding). Resident at most: the
largest piece (the embedding table, or one transformer layer) about twice -- joined in memory,
plus either its source pages or one target file's pages mapped. Nothing grows with the number of
layers, and no temporary files are written.
"""

import argparse
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import types
import zipfile
import zlib
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron import checkpointing
from megatron.convert.schema import (ConversionError, ModelMeta, Piece, fit_vocab_rows,
                                     padded_vocab_size)

# Key of ``meta.source_args`` carrying the source's ``opt_param_scheduler`` state (not a flag).
SCHEDULER_KEY = "_opt_param_scheduler"

_QKV = "self_attention.query_key_value"
_DENSE = "self_attention.dense"
_H_TO_4H = "mlp.dense_h_to_4h"
_4H_TO_H = "mlp.dense_4h_to_h"


# ---------------------------------------------------------------------------------------------
# Tensor-parallel split rules
# ---------------------------------------------------------------------------------------------

def layer_tensor_names(meta: ModelMeta) -> List[str]:
    """The tensors of one transformer layer, in the order the model's state dict has them."""
    layer_norm = meta.normalization == "LayerNorm"
    qkv_bias = meta.add_bias_linear or meta.add_qkv_bias
    names = [("input_layernorm.weight", True), ("input_layernorm.bias", layer_norm),
             (f"{_QKV}.weight", True), (f"{_QKV}.bias", qkv_bias),
             (f"{_DENSE}.weight", True), (f"{_DENSE}.bias", meta.add_bias_linear),
             ("post_attention_layernorm.weight", True),
             ("post_attention_layernorm.bias", layer_norm),
             (f"{_H_TO_4H}.weight", True), (f"{_H_TO_4H}.bias", meta.add_bias_linear),
             (f"{_4H_TO_H}.weight", True), (f"{_4H_TO_H}.bias", meta.add_bias_linear)]
    return [name for name, present in names if present]


def layer_tensor_shapes(meta: ModelMeta) -> Dict[str, Tuple[int, ...]]:
    """Whole (unsplit) shape of every tensor of one layer."""
    h, ffn = meta.hidden_size, meta.ffn_hidden_size
    qkv = (meta.num_attention_heads + 2 * meta.num_query_groups) * meta.kv_channels
    h_to_4h = 2 * ffn if meta.swiglu else ffn
    shapes = {f"{_QKV}.weight": (qkv, h), f"{_QKV}.bias": (qkv,),
              f"{_DENSE}.weight": (h, meta.num_attention_heads * meta.kv_channels),
              f"{_H_TO_4H}.weight": (h_to_4h, h), f"{_H_TO_4H}.bias": (h_to_4h,),
              f"{_4H_TO_H}.weight": (h, ffn)}
    return {name: shapes.get(name, (h,)) for name in layer_tensor_names(meta)}


def tp_split_rule(name: str, swiglu: bool) -> Optional[Tuple[int, int]]:
    """``(dim, stride)`` a layer tensor is split along over TP ranks, None when replicated."""
    if name.startswith(_QKV + "."):
        return 0, 1
    if name.startswith(_H_TO_4H + "."):
        return 0, 2 if swiglu else 1
    if name in (f"{_DENSE}.weight", f"{_4H_TO_H}.weight"):
        return 1, 1
    return None


def join_shards(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The whole tensor from its TP shards: each shard is ``stride`` blocks along ``dim`` and the
    whole is block 0 of every rank, then block 1 of every rank, ... (always a new tensor)."""
    if stride == 1:
        return torch.cat(list(shards), dim=dim)
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([blocks[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def split_tensor(full: torch.Tensor, dim: int, stride: int, tp_size: int) -> List[torch.Tensor]:
    """The inverse of :func:`join_shards`: ``stride * tp_size`` equal blocks along ``dim``, rank
    ``r`` taking blocks ``r, r + tp_size, ...``. Views of ``full`` when ``stride`` is 1 (no
    copy), new tensors otherwise."""
    size = full.size(dim)
    if size % (stride * tp_size) != 0:
        raise ConversionError(f"a tensor of shape {tuple(full.shape)} cannot be split into "
                              f"{stride} x {tp_size} blocks along dim {dim}")
    blocks = torch.split(full, size // (stride * tp_size), dim=dim)
    if stride == 1:
        return list(blocks)
    return [torch.cat(blocks[r::tp_size], dim=dim) for r in range(tp_size)]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def _read(path: str, shared: bool = False) -> dict:
    """One rank's file, memory-mapped (MAP_SHARED when ``shared``: writes go to the file) and
    loaded with ``weights_only`` through the checkpoint allow-list."""
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing")
    flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
    try:
        with torch.serialization.safe_globals(checkpointing._allow_list()), \
                torch.serialization.set_default_mmap_options(flags):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if shared or "mmap" not in str(err):
                    raise
                # A file in torch's legacy (non-zip) format cannot be mapped: read it whole.
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise ConversionError(f"{path}: refusing to load; the file holds objects other than "
                                  f"tensors and plain data ({first})") from None
        raise ConversionError(f"{path}: cannot be read ({first})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise ConversionError(f"{path}: not a model_optim_rng checkpoint (no 'iteration' key)")
    return state


def _get(tree: dict, keys: Sequence[str], path: str):
    node = tree
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ConversionError(f"{path}: no {'.'.join(keys)} in the saved model state")
        node = node[key]
    return node


def _encoder(language_model: dict, path: str) -> dict:
    """The layers' dict (``encoder``; ``transformer`` in older Megatron files)."""
    encoder = language_model.get("encoder", language_model.get("transformer"))
    if not isinstance(encoder, dict):
        raise ConversionError(f"{path}: no language_model.encoder in the saved model state")
    return encoder


class _Source:
    """Where every tensor of a Megatron checkpoint lives: files, chunks, local layer numbers."""

    def __init__(self, load_dir: str, ckpt_step: Optional[int]):
        tracked = checkpointing.read_tracker(load_dir) if os.path.isdir(load_dir) else None
        if tracked is None:
            raise ConversionError(f"--load-dir {load_dir}: no {checkpointing.TRACKER_FILENAME}; "
                                  "not a Megatron checkpoint folder")
        self.iteration, self.release = tracked
        if ckpt_step is not None:
            self.iteration, self.release = ckpt_step, False
        self.load_dir = load_dir
        iter_dir = os.path.join(load_dir, checkpointing.checkpoint_dir_name(
            self.iteration, self.release))
        if not os.path.isdir(iter_dir):
            raise ConversionError(f"{iter_dir}: missing (named by "
                                  f"{checkpointing.TRACKER_FILENAME} or --ckpt-step)")
        try:
            self.tp, self.pp = checkpointing.saved_layout(iter_dir)
        except checkpointing.CheckpointError as err:
            raise ConversionError(str(err)) from None
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                path = self.file(tp_rank, pp_rank)
                if not os.path.isfile(path):
                    raise ConversionError(f"{path}: missing; {iter_dir} holds TP {self.tp} x PP "
                                          f"{self.pp} rank folders, so every one is needed")
        first = _read(self.file(0, 0))
        self.args = first.get("args")
        if not isinstance(self.args, argparse.Namespace):
            raise ConversionError(f"{self.file(0, 0)}: holds no args namespace")
        self.scheduler = first.get("opt_param_scheduler")
        chunks = sorted(int(k[5:]) for k in first if re.fullmatch(r"model\d+", k))
        if "model" not in first and not chunks:
            raise ConversionError(f"{self.file(0, 0)}: no model state ('model' or 'model0')")
        self.vp = None if "model" in first else len(chunks)
        del first
        self._check_args_layout(iter_dir)
        self.layer_map = self._layer_map()

    def file(self, tp_rank: int, pp_rank: int) -> str:
        return checkpointing.checkpoint_file(self.load_dir, self.iteration, tp_rank, pp_rank,
                                             self.pp, self.release)

    def chunk_key(self, chunk: int) -> str:
        return "model" if self.vp is None else f"model{chunk}"

    def _check_args_layout(self, iter_dir: str) -> None:
        saved = (getattr(self.args, "tensor_model_parallel_size", self.tp),
                 getattr(self.args, "pipeline_model_parallel_size", self.pp))
        if saved != (self.tp, self.pp):
            raise ConversionError(
                f"{iter_dir}: the rank folders say TP {self.tp} x PP {self.pp} but the saved "
                f"args say TP {saved[0]} x PP {saved[1]}; the checkpoint is incomplete or mixed")

    def _layer_map(self) -> List[Tuple[int, int, int]]:
        """``(pp_rank, chunk, local index)`` of every global layer."""
        from megatron.core.config import ConfigError
        from megatron.model.transformer import get_num_layers_and_offset

        layout = types.SimpleNamespace(
            num_layers=self.args.num_layers,
            first_pipeline_num_layers=getattr(self.args, "decoder_first_pipeline_num_layers",
                                              None),
            last_pipeline_num_layers=getattr(self.args, "decoder_last_pipeline_num_layers",
                                             None))
        where = {}
        try:
            for pp_rank in range(self.pp):
                for chunk in range(self.vp or 1):
                    count, offset = get_num_layers_and_offset(
                        layout, self.pp, pp_rank, self.vp, chunk if self.vp else None)
                    for local in range(count):
                        where[offset + local] = (pp_rank, chunk, local)
        except ConfigError as err:
            raise ConversionError(f"{self.file(0, 0)}: the saved pipeline split cannot be "
                                  f"reproduced: {err}") from None
        if sorted(where) != list(range(self.args.num_layers)):
            raise ConversionError(f"{self.file(0, 0)}: the saved pipeline split does not cover "
                                  f"--num-layers {self.args.num_layers}")
        return [where[i] for i in range(self.args.num_layers)]

    def _language_model(self, tp_rank: int, pp_rank: int, chunk: int) -> Tuple[dict, str]:
        path = self.file(tp_rank, pp_rank)
        return _get(_read(path), [self.chunk_key(chunk), "language_model"], path), path

    def read_tp(self, pp_rank: int, chunk: int, keys: Sequence[str], join_dim: Optional[int],
                stride: int = 1) -> torch.Tensor:
        """One tensor under ``language_model`` (``keys[0] == "encoder"``: under the encoder):
        the TP shards joined along ``join_dim``, or rank 0's copy when None."""
        shards = []
        for tp_rank in range(self.tp) if join_dim is not None else [0]:
            language_model, path = self._language_model(tp_rank, pp_rank, chunk)
            if keys[0] == "encoder":
                shards.append(_get(_encoder(language_model, path), keys[1:], path))
            else:
                shards.append(_get(language_model, keys, path))
        if join_dim is None:
            return shards[0].clone()
        return join_shards(shards, join_dim, stride)

    def read_layer(self, index: int, names: Sequence[str], swiglu: bool) -> Dict[str, torch.Tensor]:
        """All tensors of global layer ``index``, joined; the files are opened once per rank."""
        pp_rank, chunk, local = self.layer_map[index]
        per_rank = []
        for tp_rank in range(self.tp):
            language_model, path = self._language_model(tp_rank, pp_rank, chunk)
            encoder = _encoder(language_model, path)
            per_rank.append({name: _get(encoder, [f"layers.{local}.{name}"], path)
                             for name in names})
        out = {}
        for name in names:
            rule = tp_split_rule(name, swiglu)
            if rule is None:
                out[name] = per_rank[0][name].clone()
            else:
                out[name] = join_shards([shards[name] for shards in per_rank], *rule)
        return out


def _params_dtype(args) -> torch.dtype:
    dtype = getattr(args, "params_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.bfloat16 if getattr(args, "bf16", False) else torch.float32


def _true_vocab_size(args, padded: int, override: Optional[int], where: str) -> int:
    """The tokenizer's size: ``override`` (--true-vocab-size), else from the tokenizer the saved
    args name; when that cannot be built, every row of the padded table is kept."""
    if override is not None:
        size = override
    else:
        from megatron.tokenizer import build_tokenizer

        try:
            quiet = argparse.Namespace(**{**vars(args), "rank": 1, "padded_vocab_size": padded})
            size = build_tokenizer(quiet).vocab_size
        except Exception as err:  # noqa: BLE001 - any tokenizer failure: fall back, say why
            print(f"NOTE: cannot build the tokenizer {where} names "
                  f"({type(err).__name__}: {str(err)[:160]}), so its true vocabulary size is "
                  f"unknown; keeping all {padded} rows of the embedding table (pass "
                  "--true-vocab-size to re-pad exactly)", file=sys.stderr, flush=True)
            return padded
    if not 0 < size <= padded:
        raise ConversionError(f"--true-vocab-size {size} must be between 1 and the saved padded "
                              f"vocabulary size ({padded}) of {where}")
    return size


def _abspath(path: Optional[str]) -> Optional[str]:
    return os.path.abspath(path) if path else None


def _meta_from_args(src: _Source, true_vocab_size: Optional[int]) -> ModelMeta:
    args = src.args
    heads = args.num_attention_heads
    gqa = getattr(args, "group_query_attention", False)
    position = getattr(args, "position_embedding_type", "learned_absolute")
    if getattr(args, "use_rotary_position_embeddings", False):
        position = "rope"
    epsilon = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None)
    padded = args.padded_vocab_size
    source_args = dict(vars(args))
    if src.scheduler is not None:
        source_args[SCHEDULER_KEY] = src.scheduler
    return ModelMeta(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if gqa else heads,
        kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        max_position_embeddings=(getattr(args, "max_position_embeddings", None)
                                 or args.seq_length),
        vocab_size=_true_vocab_size(args, padded, true_vocab_size, src.file(0, 0)),
        padded_vocab_size=padded, position_embedding_type=position,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        normalization=getattr(args, "normalization", "LayerNorm"),
        norm_epsilon=epsilon if epsilon is not None else 1e-5,
        swiglu=getattr(args, "swiglu", False), openai_gelu=getattr(args, "openai_gelu", False),
        add_bias_linear=getattr(args, "add_bias_linear", True),
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        untie_embeddings_and_output_weights=getattr(
            args, "untie_embeddings_and_output_weights", False),
        apply_residual_connection_post_layernorm=getattr(
            args, "apply_residual_connection_post_layernorm", False),
        params_dtype=_params_dtype(args), seq_length=getattr(args, "seq_length", None),
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128) or 1,
        tokenizer_type=getattr(args, "tokenizer_type", None),
        vocab_file=_abspath(getattr(args, "vocab_file", None)),
        merge_file=_abspath(getattr(args, "merge_file", None)),
        tokenizer_model=_abspath(getattr(args, "tokenizer_model", None)),
        iteration=0 if src.release else src.iteration,
        consumed_train_samples=getattr(args, "consumed_train_samples", 0) or 0,
        consumed_valid_samples=getattr(args, "consumed_valid_samples", 0) or 0,
        source_args=source_args)


def load_megatron(load_dir: str, ckpt_step: Optional[int] = None, *,
                  true_vocab_size: Optional[int] = None) -> Iterator[Piece]:
    """Yield the canonical stream of the Megatron checkpoint in ``load_dir``.

    Args:
        load_dir: the folder holding ``latest_checkpointed_iteration.txt``.
        ckpt_step: read this iteration instead of the tracker's.
        true_vocab_size: the tokenizer's size (``--true-vocab-size``); by default it is learned
            by building the tokenizer the saved args name.

    Raises:
        ConversionError: a missing tracker, folder, rank file or tensor, naming it.
    """
    src = _Source(load_dir, ckpt_step)
    meta = _meta_from_args(src, true_vocab_size)
    yield Piece("meta", meta=meta)

    embedding = ["embedding"]
    word = src.read_tp(0, 0, embedding + ["word_embeddings", "weight"], 0)
    if word.size(0) != meta.padded_vocab_size:
        raise ConversionError(f"{src.file(0, 0)}: the word embeddings have {word.size(0)} rows "
                              f"but the saved args say padded_vocab_size "
                              f"{meta.padded_vocab_size}")
    tensors = {"word_embeddings": word}
    if meta.position_embedding_type == "learned_absolute":
        tensors["position_embeddings"] = src.read_tp(
            0, 0, embedding + ["position_embeddings", "weight"], None)
    yield Piece("embeddings", tensors)
    del tensors, word

    names = layer_tensor_names(meta)
    for index in range(meta.num_layers):
        yield Piece("layer", src.read_layer(index, names, meta.swiglu), index=index)

    last, last_chunk = src.pp - 1, (src.vp or 1) - 1
    norm_names = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
    norm = {name: src.read_tp(last, last_chunk, ["encoder", f"final_layernorm.{name}"], None)
            for name in norm_names}
    yield Piece("final_norm", norm)
    if meta.untie_embeddings_and_output_weights:
        yield Piece("output_layer", {"weight": src.read_tp(
            last, last_chunk, ["output_layer", "weight"], 0)})


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

class _Target:
    """The target layout: checked sizes, vocabulary rows, stage of every layer, file skeletons."""

    def __init__(self, meta: ModelMeta, tp: int, pp: int, divisible_by: Optional[int]):
        self.meta, self.tp, self.pp = meta, tp, pp
        self._check_sizes()
        self.divisible_by = divisible_by or meta.make_vocab_size_divisible_by or 1
        self.vocab_rows = padded_vocab_size(meta.vocab_size, self.divisible_by, tp)
        self.per_stage = meta.num_layers // pp
        self.release = meta.iteration == 0
        self.names = layer_tensor_names(meta)
        self.shapes = layer_tensor_shapes(meta)
        self.tied = not meta.untie_embeddings_and_output_weights

    def _check_sizes(self) -> None:
        meta, tp, pp = self.meta, self.tp, self.pp
        if tp < 1 or pp < 1:
            raise ConversionError(f"--target-tensor-parallel-size ({tp}) and "
                                  f"--target-pipeline-parallel-size ({pp}) must be >= 1")
        for flag, value in (("--num-attention-heads", meta.num_attention_heads),
                            ("--num-query-groups", meta.num_query_groups),
                            ("--ffn-hidden-size", meta.ffn_hidden_size)):
            if value % tp != 0:
                raise ConversionError(f"--target-tensor-parallel-size {tp} does not divide "
                                      f"{flag} ({value}); choose a divisor of {value}")
        if pp > meta.num_layers or meta.num_layers % pp != 0:
            raise ConversionError(f"--target-pipeline-parallel-size {pp} does not divide "
                                  f"--num-layers ({meta.num_layers}) into equal stages")

    def stage_of(self, layer: int) -> Tuple[int, int]:
        return layer // self.per_stage, layer % self.per_stage

    def shard_shape(self, shape: Tuple[int, ...], rule: Optional[Tuple[int, int]]):
        if rule is None:
            return shape
        shape = list(shape)
        shape[rule[0]] //= self.tp
        return tuple(shape)

    def model_skeleton(self, pp_rank: int) -> dict:
        """One TP rank's ``model`` tree of ``pp_rank``, as empty (unallocated) tensors."""
        meta, dtype = self.meta, self.meta.params_dtype
        first, last = pp_rank == 0, pp_rank == self.pp - 1
        vocab_shard = (self.vocab_rows // self.tp, meta.hidden_size)
        language_model = {}
        if first:
            embedding = {"word_embeddings": {"weight": torch.empty(vocab_shard, dtype=dtype)}}
            if meta.position_embedding_type == "learned_absolute":
                embedding["position_embeddings"] = {"weight": torch.empty(
                    (meta.max_position_embeddings, meta.hidden_size), dtype=dtype)}
            language_model["embedding"] = embedding
        encoder = {}
        for local in range(self.per_stage):
            for name in self.names:
                shape = self.shard_shape(self.shapes[name], tp_split_rule(name, meta.swiglu))
                encoder[f"layers.{local}.{name}"] = torch.empty(shape, dtype=dtype)
        if last:
            norm = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
            for name in norm:
                encoder[f"final_layernorm.{name}"] = torch.empty(meta.hidden_size, dtype=dtype)
        language_model["encoder"] = encoder
        if last and not self.tied:
            language_model["output_layer"] = {"weight": torch.empty(vocab_shard, dtype=dtype)}
        model = {"language_model": language_model}
        if last and not first and self.tied:
            model["word_embeddings_for_head"] = {"weight": torch.empty(vocab_shard, dtype=dtype)}
        return model

    def args(self) -> argparse.Namespace:
        """The source's args with the layout, vocabulary and shape fields of the target."""
        meta = self.meta
        values = {k: v for k, v in (meta.source_args or {}).items() if k != SCHEDULER_KEY}
        values.update(
            num_layers=meta.num_layers, hidden_size=meta.hidden_size,
            ffn_hidden_size=meta.ffn_hidden_size, num_attention_heads=meta.num_attention_heads,
            num_query_groups=meta.num_query_groups,
            group_query_attention=meta.group_query_attention, kv_channels=meta.kv_channels,
            max_position_embeddings=meta.max_position_embeddings,
            position_embedding_type=meta.position_embedding_type,
            use_rotary_position_embeddings=meta.position_embedding_type == "rope",
            rotary_percent=meta.rotary_percent, rotary_base=meta.rotary_base,
            normalization=meta.normalization, norm_epsilon=meta.norm_epsilon,
            swiglu=meta.swiglu, openai_gelu=meta.openai_gelu,
            add_bias_linear=meta.add_bias_linear, add_qkv_bias=meta.add_qkv_bias,
            untie_embeddings_and_output_weights=meta.untie_embeddings_and_output_weights,
            apply_residual_connection_post_layernorm=meta.apply_residual_connection_post_layernorm,
            params_dtype=meta.params_dtype, fp16=meta.params_dtype == torch.float16,
            bf16=meta.params_dtype == torch.bfloat16,
            tokenizer_type=meta.tokenizer_type, vocab_file=meta.vocab_file,
            merge_file=meta.merge_file, tokenizer_model=meta.tokenizer_model,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            padded_vocab_size=self.vocab_rows, make_vocab_size_divisible_by=self.divisible_by,
            num_layers_per_virtual_pipeline_stage=None,
            virtual_pipeline_model_parallel_size=None,
            decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
            iteration=meta.iteration, consumed_train_samples=meta.consumed_train_samples,
            consumed_valid_samples=meta.consumed_valid_samples)
        if meta.seq_length is not None:
            values["seq_length"] = meta.seq_length
        if meta.source_args is None and meta.tokenizer_type == "NullTokenizer":
            values["vocab_size"] = meta.vocab_size - 1  # NullTokenizer adds its end-of-document
        return argparse.Namespace(**values)

    def conversion_record(self) -> dict:
        source = self.meta.source_args
        layout = None
        if source is not None:
            layout = [source.get("tensor_model_parallel_size", 1),
                      source.get("pipeline_model_parallel_size", 1)]
        return {"from_layout": layout, "optimizer": "dropped", "rng": "dropped"}


def _prepare_save_dir(save_dir: str) -> bool:
    """Refuse a save dir that is a file or holds anything; returns whether it was created."""
    if os.path.exists(save_dir):
        if not os.path.isdir(save_dir):
            raise ConversionError(f"--save-dir {save_dir}: exists and is not a folder")
        present = sorted(os.listdir(save_dir))
        if present:
            raise ConversionError(f"--save-dir {save_dir}: not empty (holds "
                                  f"{', '.join(present[:3])}{' ...' if len(present) > 3 else ''})"
                                  "; choose a new or empty folder")
        return False
    try:
        os.makedirs(save_dir)
    except OSError as err:
        raise ConversionError(f"--save-dir {save_dir}: cannot be created "
                              f"({err.strerror})") from None
    return True


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_files(target: _Target, root: str) -> Dict[Tuple[int, int], str]:
    """Every target rank's file, complete but for the tensor bytes (written later in place)."""
    args = target.args()
    meta = target.meta
    scheduler = (meta.source_args or {}).get(SCHEDULER_KEY)
    files = {}
    for pp_rank in range(target.pp):
        for tp_rank in range(target.tp):
            state = {"args": args, "checkpoint_version": checkpointing.CHECKPOINT_VERSION,
                     "iteration": meta.iteration, "model": target.model_skeleton(pp_rank)}
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler
            state["conversion"] = target.conversion_record()
            path = checkpointing.checkpoint_file(root, meta.iteration, tp_rank, pp_rank,
                                                 target.pp, target.release)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with torch.serialization.skip_data():
                torch.save(state, path)
            files[(tp_rank, pp_rank)] = path
    return files


def _copy_into(path: str, items: list, what: str) -> None:
    """Copy ``(key path under model, tensor)`` items into the file at ``path``, mapped (shared)
    for this call only: the mapping goes when the loaded tensors do, at return."""
    model = _read(path, shared=True)["model"]
    for keys, tensor in items:
        dst = _get(model, keys, path)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ConversionError(f"{what}: {'.'.join(keys)} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dst.shape)} for the target layout")
        dst.copy_(tensor)


def _write(files: Dict[Tuple[int, int], str], writes: List[Tuple[int, int, tuple, torch.Tensor]],
           what: str) -> None:
    """Copy ``(tp_rank, pp_rank, key path under model, tensor)`` into the target files, one
    file mapped at a time."""
    by_file: Dict[Tuple[int, int], list] = {}
    for tp_rank, pp_rank, keys, tensor in writes:
        by_file.setdefault((tp_rank, pp_rank), []).append((keys, tensor))
    for rank, items in by_file.items():
        _copy_into(files[rank], items, what)


def _check_tensors(what: str, tensors: Dict[str, torch.Tensor],
                   expected: Dict[str, Tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors)
                   if tuple(tensors[k].shape) != tuple(expected[k]))
    if missing or extra or wrong:
        detail = ([f"missing {missing}"] if missing else []) + (
            [f"unexpected {extra}"] if extra else []) + [
            f"{k} has shape {tuple(tensors[k].shape)}, expected {expected[k]}" for k in wrong]
        raise ConversionError(f"{what} does not match the model the meta describes: "
                              + "; ".join(detail))


def _vocab_shards(target: _Target, table: torch.Tensor, what: str) -> List[torch.Tensor]:
    """Each TP rank's rows of ``table`` fitted to the target's padded size, with
    :func:`fit_vocab_rows`'s rule (rows past the table's are zeros; only padding rows are
    dropped), built shard by shard: views where the rows exist, so no whole copy is made."""
    if table.size(0) < target.meta.vocab_size:
        raise ConversionError(f"{what} has {table.size(0)} rows, fewer than the vocabulary size "
                              f"{target.meta.vocab_size} in the meta")
    per_rank = target.vocab_rows // target.tp
    shards = []
    for tp_rank in range(target.tp):
        start = tp_rank * per_rank
        if start + per_rank <= table.size(0):
            shards.append(table[start:start + per_rank])                     # [V/tp, h]
        else:
            shards.append(fit_vocab_rows(table[start:], 0, per_rank))         # zeros appended
    return shards


def _embedding_writes(target: _Target, piece: Piece) -> list:
    meta = target.meta
    word = piece.tensors.get("word_embeddings")
    expected = {"word_embeddings": (0 if word is None else word.size(0), meta.hidden_size)}
    if meta.position_embedding_type == "learned_absolute":
        expected["position_embeddings"] = (meta.max_position_embeddings, meta.hidden_size)
    _check_tensors("the embeddings", piece.tensors, expected)
    writes = []
    for tp_rank, shard in enumerate(_vocab_shards(target, word, "the word embeddings")):
        writes.append((tp_rank, 0, ("language_model", "embedding", "word_embeddings", "weight"),
                       shard))
        if target.tied and target.pp > 1:
            writes.append((tp_rank, target.pp - 1, ("word_embeddings_for_head", "weight"), shard))
    if "position_embeddings" in piece.tensors:
        for tp_rank in range(target.tp):
            writes.append((tp_rank, 0, ("language_model", "embedding", "position_embeddings",
                                        "weight"), piece.tensors["position_embeddings"]))
    return writes


def _layer_writes(target: _Target, piece: Piece) -> list:
    _check_tensors(f"layer {piece.index}", piece.tensors, target.shapes)
    pp_rank, local = target.stage_of(piece.index)
    writes = []
    for name, tensor in piece.tensors.items():
        rule = tp_split_rule(name, target.meta.swiglu)
        shards = ([tensor] * target.tp if rule is None
                  else split_tensor(tensor, rule[0], rule[1], target.tp))
        for tp_rank, shard in enumerate(shards):
            writes.append((tp_rank, pp_rank, ("language_model", "encoder",
                                              f"layers.{local}.{name}"), shard))
    return writes


def _final_writes(target: _Target, piece: Piece) -> list:
    meta, last = target.meta, target.pp - 1
    if piece.kind == "final_norm":
        names = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
        _check_tensors("the final norm", piece.tensors, {n: (meta.hidden_size,) for n in names})
        return [(tp_rank, last, ("language_model", "encoder", f"final_layernorm.{name}"), tensor)
                for name, tensor in piece.tensors.items() for tp_rank in range(target.tp)]
    if target.tied:
        raise ConversionError("the stream has an output layer but the meta says the embeddings "
                              "are tied (untie_embeddings_and_output_weights is False)")
    weight = piece.tensors.get("weight")
    _check_tensors("the output layer", piece.tensors,
                   {"weight": (weight.size(0) if weight is not None else 0, meta.hidden_size)})
    return [(tp_rank, last, ("language_model", "output_layer", "weight"), shard)
            for tp_rank, shard in enumerate(_vocab_shards(target, weight, "the output layer"))]


def _consume(pieces: Iterator[Piece], target: _Target, files: dict) -> None:
    """Write every piece into the target files; check that the stream is complete."""
    wanted = {"embeddings", "final_norm"} | ({"output_layer"} if not target.tied else set())
    wanted |= {("layer", i) for i in range(target.meta.num_layers)}
    seen = set()
    for piece in pieces:
        key = ("layer", piece.index) if piece.kind == "layer" else piece.kind
        if key not in wanted and piece.kind != "output_layer":
            raise ConversionError(f"unexpected piece in the stream: {piece.kind}"
                                  + (f" {piece.index}" if piece.index is not None else ""))
        if key in seen:
            raise ConversionError(f"the stream holds {key} twice")
        seen.add(key)
        if piece.kind == "embeddings":
            writes = _embedding_writes(target, piece)
        elif piece.kind == "layer":
            writes = _layer_writes(target, piece)
        else:
            writes = _final_writes(target, piece)
        _write(files, writes, piece.kind if piece.index is None else f"layer {piece.index}")
        del writes, piece
    missing = wanted - seen
    if missing:
        names = sorted(str(k if isinstance(k, str) else f"layer {k[1]}") for k in missing)
        raise ConversionError(f"the stream ended without {', '.join(names[:5])}"
                              + (" ..." if len(names) > 5 else ""))


def _refresh_zip_checksums(path: str) -> None:
    """Rewrite the CRC-32 of every member of the (stored, uncompressed) zip at ``path``.

    The files were written with placeholder tensor bytes and filled in place afterwards, so the
    checksums torch recorded describe the placeholders; loading verifies them
    (:func:`megatron.checkpointing.load_state_file`). Each member's CRC sits in its local header
    (offset 14), in its central-directory entry (offset 16) and, when flag bit 3 is set, in the
    data descriptor after its bytes.
    """
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    with open(path, "r+b") as f:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise ConversionError(f"{path}: member {info.filename} is compressed; "
                                      "cannot refresh its checksum in place")
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            crc, left = 0, info.file_size
            while left:
                block = f.read(min(left, 1 << 24))
                crc = zlib.crc32(block, crc)
                left -= len(block)
            if info.flag_bits & 0x08:
                descriptor = f.read(4)
                at = f.tell() if descriptor == b"PK\x07\x08" else f.tell() - 4
                f.seek(at)
                f.write(struct.pack("<I", crc))
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crc))
            info.CRC = crc
        _patch_central_directory(f, path, {i.header_offset: i.CRC for i in infos})


def _patch_central_directory(f, path: str, crc_by_offset: Dict[int, int]) -> None:
    """Write each member's CRC into its central-directory entry (found by its local offset)."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    tail_len = min(size, 65536 + 22)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ConversionError(f"{path}: no zip end-of-central-directory record")
    count, cd_size, cd_offset = struct.unpack("<HII", tail[eocd + 10:eocd + 20])
    locator = tail.rfind(b"PK\x06\x07", 0, eocd)
    if locator >= 0:  # zip64: the real offsets are in the zip64 end record
        (zip64_end,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        f.seek(zip64_end)
        record = f.read(56)
        count, cd_size, cd_offset = struct.unpack("<QQQ", record[32:56])
    f.seek(cd_offset)
    directory = bytearray(f.read(cd_size))
    at = 0
    while at + 46 <= len(directory) and directory[at:at + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack("<HHH", directory[at + 28:at + 34])
        (offset,) = struct.unpack("<I", directory[at + 42:at + 46])
        if offset == 0xFFFFFFFF:  # the real offset is in the zip64 extra field
            offset = _zip64_offset(directory[at + 46 + name_len:at + 46 + name_len + extra_len],
                                   directory[at + 20:at + 28])
        if offset in crc_by_offset:
            directory[at + 16:at + 20] = struct.pack("<I", crc_by_offset[offset])
        at += 46 + name_len + extra_len + comment_len
    f.seek(cd_offset)
    f.write(directory)


def _zip64_offset(extra: bytes, sizes: bytes) -> int:
    """The local-header offset from a central entry's zip64 extra field."""
    compressed, uncompressed = struct.unpack("<II", sizes)
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[at:at + 4])
        if tag == 0x0001:
            fields = extra[at + 4:at + 4 + length]
            skip = 8 * ((uncompressed == 0xFFFFFFFF) + (compressed == 0xFFFFFFFF))
            return struct.unpack("<Q", fields[skip:skip + 8])[0]
        at += 4 + length
    raise ConversionError("zip64 central entry without its offset field")


def _commit(staging: str, save_dir: str, target: _Target, files: dict) -> str:
    """fsync every file, move the iteration folder into place, then the tracker (renames)."""
    for path in files.values():
        _refresh_zip_checksums(path)
        _fsync(path)
        _fsync(os.path.dirname(path))
    name = checkpointing.checkpoint_dir_name(target.meta.iteration, target.release)
    _fsync(os.path.join(staging, name))
    final = os.path.join(save_dir, name)
    os.replace(os.path.join(staging, name), final)
    shutil.rmtree(staging)
    _fsync(save_dir)
    tracker = os.path.join(save_dir, checkpointing.TRACKER_FILENAME)
    with open(tracker + ".tmp", "w") as f:
        f.write("release" if target.release else str(target.meta.iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)
    _fsync(save_dir)
    return final


def save_megatron(pieces: Iterable[Piece], save_dir: str, target_tp: int, target_pp: int, *,
                  make_vocab_size_divisible_by: Optional[int] = None) -> str:
    """Write the stream as a Megatron checkpoint at ``target_tp`` x ``target_pp`` in
    ``save_dir`` (which must be new or empty); returns the iteration folder.

    The vocabulary is padded to ``padded_vocab_size(meta.vocab_size, divisible_by, target_tp)``
    rows (``divisible_by`` defaults to the source's), as a training run at the target layout
    computes it; rows past the source's are zeros. A checkpoint with a training position is
    written as ``iter_XXXXXXX`` with that iteration and consumed samples; one without (iteration
    0, e.g. from Hugging Face) as ``release``. Nothing appears in ``save_dir`` until every file is
    complete and fsynced; on any failure the staging folder is removed.

    Raises:
        ConversionError: a non-empty save dir, a target size that does not divide the model, or
            a stream that does not match its meta.
    """
    pieces = iter(pieces)
    first = next(pieces, None)
    if first is None or first.kind != "meta" or first.meta is None:
        raise ConversionError("the stream must start with its meta piece")
    target = _Target(first.meta, target_tp, target_pp, make_vocab_size_divisible_by)
    created = _prepare_save_dir(save_dir)
    staging = tempfile.mkdtemp(prefix=".tmp_convert_", dir=save_dir)
    try:
        files = _create_files(target, staging)
        _consume(pieces, target, files)
        return _commit(staging, save_dir, target, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.listdir(save_dir):
            os.rmdir(save_dir)
        raise

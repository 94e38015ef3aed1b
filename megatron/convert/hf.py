"""Hugging Face folders to and from the canonical stream (:mod:`megatron.convert.schema`).

``save_hf`` writes what ``transformers`` loads offline with ``from_pretrained(folder)``:
``config.json``, the weights as safetensors (``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json``) and the
tokenizer files (:mod:`megatron.convert.hf_tokenizer`). ``load_hf`` reads such a folder back a
layer at a time. These architectures are written and read:

- ``GPT2LMHeadModel`` (:mod:`megatron.convert.hf_gpt2`) for ``--position-embedding-type
  learned_absolute`` models;
- for ``--position-embedding-type rope`` (or ``yarn``) with ``--normalization RMSNorm``:
  ``Qwen3ForCausalLM`` (:mod:`megatron.convert.hf_qwen3`) with ``--qk-layernorm``,
  ``Qwen2ForCausalLM`` (:mod:`megatron.convert.hf_qwen2`) with ``--add-qkv-bias
  --disable-bias-linear``, else ``LlamaForCausalLM`` (:mod:`megatron.convert.hf_llama`); these
  three also carry ``--use-rope-scaling`` (transformers' ``llama3`` rope type) and YaRN. With
  LayerNorm, ``StableLmForCausalLM``
  (:mod:`megatron.convert.hf_stablelm`) for ``--swiglu`` models and ``GPTNeoXForCausalLM``
  (:mod:`megatron.convert.hf_neox`) for GeLU ones;
- for mixture-of-experts models (``--num-experts``), ``MixtralForCausalLM``
  (:mod:`megatron.convert.hf_mixtral`), with a gated shared expert ``Qwen2MoeForCausalLM``
  (:mod:`megatron.convert.hf_qwen2_moe`), with ``--qk-layernorm`` ``Qwen3MoeForCausalLM``
  (:mod:`megatron.convert.hf_qwen3_moe`);
- for mixture-of-experts models with ``--quick-geglu`` (gpt-oss's clamped, offset experts,
  biases, attention sinks and alternating windows), ``GptOssForCausalLM``
  (:mod:`megatron.convert.hf_gpt_oss`);
- for ``--multi-latent-attention`` models (dense, or MoE with DeepSeek's sigmoid router, expert
  bias and dense first layers), ``DeepseekV3ForCausalLM`` (:mod:`megatron.convert.hf_deepseek_v3`);
- for BERT, ``BertForPreTraining`` / ``MegatronBertForPreTraining`` (or ``*ForMaskedLM`` without
  the binary head) (:mod:`megatron.convert.hf_bert`).

Anything the chosen architecture cannot compute exactly is refused with a ConversionError naming
the flag. The vocabulary: HF tables have exactly the tokenizer's ``vocab_size`` rows, so the
padding rows of a Megatron table are dropped on saving; loading gives ``padded_vocab_size ==
vocab_size`` and the Megatron saver pads again (with zero rows).

``transformers`` itself is not needed by either direction (only ``safetensors``).
"""

import contextlib
import dataclasses
import json
import os
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from megatron.convert import (hf_bert, hf_gpt2, hf_llama, hf_mixtral, hf_neox, hf_qwen2,
                              hf_qwen2_moe, hf_qwen3, hf_qwen3_moe, hf_stablelm)
from megatron.convert.hf_common import ConfigView, canonical_layer_shapes
from megatron.model.rotary_pos_embedding import yarn_get_mscale
from megatron.convert.megatron_layout import mtp_tensor_shapes
from megatron.convert.hf_tokenizer import (detect_tokenizer, detect_wordpiece, plan_tokenizer,
                                           write_tokenizer)
from megatron.convert.schema import ConversionError, ModelMeta, Piece, bert_head_shapes
from megatron.convert.target import staged_target
from megatron.convert import hf_deepseek_v3, hf_gpt_oss, hf_mistral

_FAMILIES = {**{family.MODEL_TYPE: family
                for family in (hf_gpt2, hf_llama, hf_mixtral, hf_neox, hf_qwen2, hf_qwen2_moe,
                               hf_qwen3, hf_qwen3_moe, hf_stablelm)},
             **{model_type: hf_bert for model_type in hf_bert.POST_LN_BY_MODEL_TYPE}}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 2 * 1024 ** 3
_FAMILIES.update({hf_mistral.MODEL_TYPE: hf_mistral,
                  hf_gpt_oss.MODEL_TYPE: hf_gpt_oss,
                  hf_deepseek_v3.MODEL_TYPE: hf_deepseek_v3})


# ---- choosing the architecture -----------------------------------------------------------------


# Flags of a Megatron source that change what the weights compute in a way none of the
# transformers classes written here (GPT-2, Llama, GPT-NeoX, StableLM, BERT) can express.
_NUMERICS_WITHOUT_HF_EQUIVALENT = (
    ("apply_layernorm_1p", "--apply-layernorm-1p"),
    ("squared_relu", "--squared-relu"), ("rotary_interleaved", "--rotary-interleaved"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor"),
    ("use_mup", "--use-mup"),   # embedding, logit and attention multipliers
    ("enable_mhc_connections", "--enable-mhc-connections"),   # residual streams
)


def _refuse_numerics_flags(meta: ModelMeta) -> None:
    source = meta.source_args or {}
    for name, flag in _NUMERICS_WITHOUT_HF_EQUIVALENT:
        if source.get(name):
            raise ConversionError(f"{flag}: no Hugging Face architecture written here (GPT-2, "
                                  "Llama, Qwen2, Qwen3, GPT-NeoX, StableLM, BERT) computes this "
                                  "model; convert it to Megatron checkpoints only")


def _refuse_qk_layernorm(meta: ModelMeta) -> None:
    """Per-head q/k norms where no family written here has them (only Qwen3's do, with
    rotary positions and RMSNorm)."""
    if meta.qk_layernorm and (meta.model_type != "GPT" or meta.normalization != "RMSNorm"
                              or meta.position_embedding_type not in ("rope", "yarn")):
        raise ConversionError(
            "--qk-layernorm: only Qwen3ForCausalLM and Qwen3MoeForCausalLM have per-head "
            "query/key norms here (with --position-embedding-type rope or yarn and "
            "--normalization RMSNorm); convert it to Megatron checkpoints only")


def _refuse_family_gaps(meta: ModelMeta, family) -> None:
    """Rescaled rotaries, which only some families compute."""
    name = getattr(family, "ARCHITECTURE", "BERT")
    scaled = (meta.use_rope_scaling and meta.position_embedding_type == "rope") or (
        meta.position_embedding_type == "yarn")
    if scaled and not getattr(family, "ROPE_SCALING", False):
        flag = ("--use-rope-scaling" if meta.position_embedding_type == "rope"
                else "--position-embedding-type yarn")
        raise ConversionError(f"{flag}: {name} has no rescaled rotary here (Llama, Qwen2 and "
                              "Qwen3 have); convert it to Megatron checkpoints only")


def family_for_meta(meta: ModelMeta):
    """The architecture module that writes ``meta``'s model, or a ConversionError listing every
    feature (with its flag) that stands in the way."""
    if meta.model_type == "GPT" and hf_gpt_oss.is_gpt_oss(meta):
        return _gpt_oss_family(meta)
    hf_gpt_oss.refuse_elsewhere(meta)
    if meta.multi_latent_attention and meta.model_type == "GPT":
        return _deepseek_v3_family(meta)
    if meta.mtp_num_layers:
        raise ConversionError(f"--mtp-num-layers {meta.mtp_num_layers}: of the Hugging Face "
                              "architectures here only DeepSeek-V3 (--multi-latent-attention) "
                              "holds multi-token prediction layers")
    _refuse_qk_layernorm(meta)
    _refuse_numerics_flags(meta)
    hf_mistral.check_attention(meta)
    if meta.model_type == "BERT":
        _refuse_family_gaps(meta, hf_bert)
        problems = hf_bert.unsupported_features(meta)
        if problems:
            raise ConversionError(f"{hf_bert.architecture(meta)} (the Hugging Face architecture "
                                  "for this BERT) cannot express: " + "; ".join(problems))
        return hf_bert
    if meta.model_type != "GPT":
        raise ConversionError(f"model type {meta.model_type!r}: only GPT and BERT models can be "
                              "written as Hugging Face folders")
    kind = meta.position_embedding_type
    if meta.num_experts and meta.qk_layernorm:
        family, chosen_by = hf_qwen3_moe, f"--num-experts {meta.num_experts} --qk-layernorm"
    elif meta.num_experts and meta.moe_shared_expert_intermediate_size:
        family, chosen_by = hf_qwen2_moe, (f"--num-experts {meta.num_experts} "
                                           "--moe-shared-expert-intermediate-size "
                                           f"{meta.moe_shared_expert_intermediate_size}")
    elif meta.num_experts:
        family, chosen_by = hf_mixtral, f"--num-experts {meta.num_experts}"
    elif kind == "learned_absolute":
        family, chosen_by = hf_gpt2, f"--position-embedding-type {kind}"
    elif kind in ("rope", "yarn"):
        family, chosen_by = _rope_family(meta)
        if family is hf_llama and hf_mistral.windowed(meta):
            family, chosen_by = hf_mistral, f"{chosen_by} --window-size"
    else:
        raise ConversionError(f"--position-embedding-type {kind}: only learned_absolute "
                              "(-> GPT2LMHeadModel) and rope or yarn (-> LlamaForCausalLM, "
                              "Qwen2ForCausalLM, Qwen3ForCausalLM, StableLmForCausalLM or "
                              "GPTNeoXForCausalLM) models can be written as Hugging Face folders")
    _refuse_family_gaps(meta, family)
    problems = family.unsupported_features(meta)
    if problems:
        raise ConversionError(f"{family.ARCHITECTURE} (the Hugging Face architecture for "
                              f"{chosen_by}) cannot express: " + "; ".join(problems))
    return family


def _gpt_oss_family(meta: ModelMeta):
    """gpt-oss for an MoE model with --quick-geglu, or what stands in the way."""
    _refuse_numerics_flags(meta)
    family = hf_gpt_oss
    _refuse_family_gaps(meta, family)
    problems = family.unsupported_features(meta)
    if meta.multi_latent_attention:
        problems.insert(0, "--multi-latent-attention (gpt-oss has grouped-query attention)")
    if problems:
        raise ConversionError(f"{family.ARCHITECTURE} (the Hugging Face architecture for "
                              f"--num-experts {meta.num_experts} --quick-geglu) cannot "
                              "express: " + "; ".join(problems))
    return family


def _deepseek_v3_family(meta: ModelMeta):
    """DeepSeek-V3 for --multi-latent-attention (dense or MoE), or what stands in the way."""
    _refuse_numerics_flags(meta)
    hf_mistral.check_attention(meta)
    family = hf_deepseek_v3
    problems = family.unsupported_features(meta)
    if meta.position_embedding_type not in ("rope", "yarn"):
        problems.insert(0, f"--position-embedding-type {meta.position_embedding_type}")
    elif meta.position_embedding_type == "rope" and yarn_get_mscale(
            meta.rotary_scaling_factor, meta.mscale_all_dim) != 1.0:
        problems.insert(0, f"--rope-type rope with --rotary-scaling-factor "
                        f"{meta.rotary_scaling_factor} and --mscale-all-dim "
                        f"{meta.mscale_all_dim} (a YaRN softmax scale over a plain rotary)")
    if problems:
        raise ConversionError(f"{family.ARCHITECTURE} (the Hugging Face architecture for "
                              "--multi-latent-attention) cannot express: " + "; ".join(problems))
    return family


def _rope_family(meta: ModelMeta):
    """``(family, the flags that chose it)`` for a rotary model: for RMSNorm Qwen3 with
    per-head q/k norms, Qwen2 with biases on q, k, v only, else Llama; StableLM for
    LayerNorm + SwiGLU, GPT-NeoX for LayerNorm + GeLU without GQA."""
    kind = meta.position_embedding_type
    if meta.normalization != "LayerNorm":
        chosen_by = f"--position-embedding-type {kind} --normalization {meta.normalization}"
        if meta.qk_layernorm:
            return hf_qwen3, chosen_by + " --qk-layernorm"
        if meta.add_qkv_bias and not meta.add_bias_linear:
            return hf_qwen2, chosen_by + " --add-qkv-bias --disable-bias-linear"
        return hf_llama, chosen_by
    if meta.swiglu:
        return hf_stablelm, "--position-embedding-type rope --normalization LayerNorm --swiglu"
    if meta.group_query_attention:
        raise ConversionError(
            f"--group-query-attention --num-query-groups {meta.num_query_groups} with "
            f"{meta.num_attention_heads} heads, --position-embedding-type rope, --normalization "
            "LayerNorm and a GeLU MLP: no Hugging Face architecture written here computes this "
            "model (GPT-NeoX has one key/value head per query head; StableLM needs --swiglu)")
    return hf_neox, "--position-embedding-type rope --normalization LayerNorm, GeLU MLP"


# ---- writing -----------------------------------------------------------------------------------


class _ShardWriter:
    """Collects named tensors into safetensors files of at most ``max_shard_size`` bytes each
    (one bigger tensor gets a file of its own), so at most one shard is held in memory.

    Shards are written under temporary names; :meth:`finish` renames them to
    ``model.safetensors`` (one shard) or ``model-0000k-of-0000n.safetensors`` plus the index.
    """

    def __init__(self, folder: str, max_shard_size: int):
        self.folder = folder
        self.max_shard_size = max_shard_size
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.shards = []                 # (temporary path, tensor names)

    def add(self, tensors: Dict[str, torch.Tensor], dtype: torch.dtype,
            keep_float32: Tuple[str, ...] = ()) -> None:
        """``tensors`` in ``dtype``, those whose names end with ``keep_float32`` in float32."""
        for name, tensor in tensors.items():
            # A private contiguous copy: safetensors refuses views that share storage.
            wanted = torch.float32 if keep_float32 and name.endswith(keep_float32) else dtype
            tensor = tensor.detach().to(device="cpu", dtype=wanted).clone(
                memory_format=torch.contiguous_format)
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.max_shard_size:
                self._flush()
            self.pending[name] = tensor
            self.pending_bytes += size
            self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.folder, f".tmp-shard-{len(self.shards):05d}.safetensors")
        save_file(self.pending, path, metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], os.path.join(self.folder, SINGLE_FILE))
            return
        count, weight_map = len(self.shards), {}
        for k, (path, names) in enumerate(self.shards):
            name = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.replace(path, os.path.join(self.folder, name))
            weight_map.update({tensor_name: name for tensor_name in names})
        _write_json(os.path.join(self.folder, INDEX_FILE),
                    {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})


def _write_json(path: str, content: dict) -> None:
    """Write ``content`` to ``path`` through a temporary file and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _check_tensors(piece: Piece, shapes: Dict[str, Tuple[int, ...]], what: str,
                   min_rows: Optional[Dict[str, int]] = None) -> None:
    """The piece holds exactly ``shapes``' tensors with those shapes; a name in ``min_rows`` may
    have any number of rows from the given minimum (vocabulary tables)."""
    have, want = set(piece.tensors), set(shapes)
    if have != want:
        raise ConversionError(f"stream: {what} has tensors {sorted(have)}; expected "
                              f"{sorted(want)} for this model's settings")
    for name, shape in shapes.items():
        got = tuple(piece.tensors[name].shape)
        rows = (min_rows or {}).get(name)
        ok = got == shape if rows is None else (
            len(got) == len(shape) and got[1:] == shape[1:] and got[0] >= rows)
        if not ok:
            expected = shape if rows is None else f"(>= {rows},) + {shape[1:]}"
            raise ConversionError(f"stream: {what} tensor {name!r} has shape {list(got)}; "
                                  f"expected {expected}")


def _expected_pieces(meta: ModelMeta):
    """(kind, index, tensor shapes, minimum rows) of every piece after meta, in stream order."""
    h, vocab = meta.hidden_size, meta.vocab_size
    embeddings = {"word_embeddings": (vocab, h)}
    if meta.position_embedding_type == "learned_absolute":
        embeddings["position_embeddings"] = (meta.max_position_embeddings, h)
    if meta.model_type == "BERT" and meta.num_tokentypes:
        embeddings["tokentype_embeddings"] = (meta.num_tokentypes, h)
    yield "embeddings", None, embeddings, {"word_embeddings": vocab}
    for index in range(meta.num_layers):
        yield "layer", index, canonical_layer_shapes(meta, index), None
    norm = {"weight": (h,)}
    if meta.normalization == "LayerNorm":
        norm["bias"] = (h,)
    yield "final_norm", None, norm, None
    if meta.untie_embeddings_and_output_weights:
        yield "output_layer", None, {"weight": (vocab, h)}, {"weight": vocab}
    if meta.model_type == "BERT":
        for kind, shapes in bert_head_shapes(meta, vocab):
            yield kind, None, shapes, ({"bias": vocab} if kind == "lm_head" else None)
    for depth in range(meta.mtp_num_layers):
        yield "mtp", depth, mtp_tensor_shapes(meta), None


def _convert_pieces(pieces: Iterator[Piece], meta: ModelMeta, family,
                    writer: _ShardWriter) -> None:
    """Check each piece against ``meta`` and hand its HF tensors to ``writer``."""
    to_hf = {"embeddings": family.embeddings_to_hf, "final_norm": family.final_norm_to_hf,
             "output_layer": family.output_layer_to_hf}
    main = {}   # the main model's HF tables, which the MTP depths carry copies of
    for kind, index, shapes, min_rows in _expected_pieces(meta):
        what = kind if index is None else f"{kind} {index}"
        piece = next(pieces, None)
        if piece is None:
            raise ConversionError(f"stream: ended before {what}")
        if piece.kind != kind or piece.index != index:
            got = piece.kind if piece.index is None else f"{piece.kind} {piece.index}"
            raise ConversionError(f"stream: expected {what}, got {got}")
        _check_tensors(piece, shapes, what, min_rows)
        if kind == "layer":
            writer.add(family.layer_to_hf(index, piece.tensors, meta), meta.params_dtype,
                       getattr(family, "KEEP_FLOAT32", ()))
        elif kind == "mtp":
            writer.add(family.mtp_to_hf(index, piece.tensors, meta, main), meta.params_dtype,
                       getattr(family, "KEEP_FLOAT32", ()))
        elif kind in to_hf:
            tensors = to_hf[kind](piece.tensors, meta)
            if meta.mtp_num_layers:
                main.update(tensors)
                main.setdefault("lm_head.weight", main.get("model.embed_tokens.weight"))
            writer.add(tensors, meta.params_dtype)
        else:
            writer.add(family.head_to_hf(kind, piece.tensors, meta), meta.params_dtype)
    extra = next(pieces, None)
    if extra is not None:
        raise ConversionError(f"stream: unexpected {extra.kind} piece after the last one")


def save_hf(pieces: Iterable[Piece], save_dir: str, *, allow_no_tokenizer: bool = False,
            max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False) -> None:
    """Write the canonical stream ``pieces`` as a Hugging Face folder ``save_dir``.

    The model, the architecture it maps to and the tokenizer files are checked on the meta
    piece, before anything is written. Weights go to safetensors files of at most
    ``max_shard_size`` bytes, so memory holds one shard (plus the piece in flight), not the
    whole model; a model that fits in one shard is one ``model.safetensors``. Everything is
    written in a new folder next to ``save_dir`` and renamed into place once complete
    (:func:`megatron.convert.target.staged_target`): a failure leaves ``save_dir`` as it was.

    Args:
        pieces: the canonical stream, meta first.
        save_dir: the folder to write: new or empty, or with ``overwrite`` a folder whose
            content is replaced once the new one is complete.
        allow_no_tokenizer: write a model whose ``--tokenizer-type`` is NullTokenizer (or
            unrecorded, or not exportable) without tokenizer files instead of refusing it.
        max_shard_size: bytes per safetensors file (default 2 GiB).
        overwrite: replace a non-empty ``save_dir`` (refused otherwise).

    Raises:
        TargetRefusedError: ``save_dir`` is not empty and ``overwrite`` is False.
        ConversionError: the model cannot be expressed (the message names the flag), a
            tokenizer file is missing or unreadable, or the stream is malformed.
    """
    pieces = iter(pieces)
    first = next(pieces, None)
    if first is None or first.kind != "meta" or first.meta is None:
        raise ConversionError("stream: the first piece must be the meta piece")
    meta = first.meta
    family = family_for_meta(meta)
    tokenizer = plan_tokenizer(meta, allow_no_tokenizer)
    config = family.hf_config(meta, tokenizer.bos_id, tokenizer.eos_id)
    if "pad_token_id" in config:
        config["pad_token_id"] = tokenizer.pad_id
    with staged_target(save_dir, overwrite) as folder:
        writer = _ShardWriter(folder, max_shard_size)
        _convert_pieces(pieces, meta, family, writer)
        writer.finish()
        write_tokenizer(tokenizer, folder)
        special_ids = {key: config[key] for key in ("bos_token_id", "eos_token_id")
                       if config[key] is not None}
        if special_ids:
            _write_json(os.path.join(folder, "generation_config.json"), special_ids)
        _write_json(os.path.join(folder, "config.json"), config)


# ---- reading -----------------------------------------------------------------------------------


class _Weights:
    """The tensors of a folder's ``model.safetensors`` or sharded index, read one at a time.

    Args:
        folder: the Hugging Face folder.
        stack: keeps the opened files; closing it closes them.
    """

    def __init__(self, folder: str, stack: contextlib.ExitStack):
        self.folder = folder
        self.stack = stack
        self.handles = {}
        self.file_of = _weight_map(folder)

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name``, checked to have ``shape`` (what config.json implies)."""
        from safetensors import safe_open

        if name not in self.file_of:
            raise ConversionError(f"{self.folder}: tensor {name!r} is missing from the weights "
                                  f"({SINGLE_FILE} / {INDEX_FILE})")
        path = self.file_of[name]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        tensor = self.handles[path].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ConversionError(f"{path}: tensor {name!r} has shape {list(tensor.shape)}; "
                                  f"config.json implies {list(shape)}")
        return tensor


def _weight_map(folder: str) -> Dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    index = os.path.join(folder, INDEX_FILE)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConversionError(f"{index}: not a safetensors index with a 'weight_map' "
                                  f"({err})") from None
        files = {name: os.path.join(folder, file) for name, file in names.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise ConversionError(f"{path}: listed in {index} but missing")
        return files
    if os.path.isfile(single):
        from safetensors import safe_open

        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as err:  # safetensors raises its own error type for corrupt files
            raise ConversionError(f"{single}: not a readable safetensors file ({err})") from None
    raise ConversionError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} is there (only "
                          "safetensors weights are read; convert pytorch_model.bin first)")


def _read_config(folder: str) -> ConfigView:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing; a Hugging Face model folder needs config.json")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(values, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return ConfigView(values, path)


def load_hf(load_dir: str) -> Iterator[Piece]:
    """The canonical stream of the Hugging Face folder ``load_dir`` (GPT-2, Llama, GPT-NeoX,
    StableLM or BERT).

    config.json, the architecture and the weight files are checked when this is called; the
    tensors are then read lazily, one piece at a time, as the stream is consumed. The meta's
    ``padded_vocab_size`` equals ``vocab_size`` (the Megatron saver pads), ``seq_length`` is
    ``max_position_embeddings`` (HF configs do not record the training length), and the tokenizer
    fields point at the folder's files (see :func:`detect_tokenizer`).

    Raises:
        ConversionError: config.json or the weights are missing, the ``model_type`` is not
            one of the families above, or a setting / tensor does not fit our model.
    """
    config = _read_config(load_dir)
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise config.unsupported("model_type", model_type, " or ".join(map(repr, _FAMILIES)))
    family = _FAMILIES[model_type]
    if family is hf_bert:
        with contextlib.ExitStack() as stack:      # a BERT's meta depends on its tensors
            meta = family.meta_from_config(config, _Weights(load_dir, stack))
        meta = dataclasses.replace(meta, **detect_wordpiece(load_dir))
    else:
        meta = family.meta_from_config(config)
        meta = dataclasses.replace(meta, **detect_tokenizer(load_dir))
    _weight_map(load_dir)          # fail now, not at the first tensor
    if hasattr(family, "mtp_depths_in"):
        with contextlib.ExitStack() as stack:
            depths = family.mtp_depths_in(_Weights(load_dir, stack), config, meta.num_layers)
        if depths and not meta.is_moe_layer(meta.num_layers - 1):
            raise config.unsupported("num_nextn_predict_layers", depths, "0 for a model whose "
                                     "last layer is dense (our MTP layer is the last layer's "
                                     "kind, DeepSeek's an MoE layer)")
        meta = dataclasses.replace(meta, mtp_num_layers=depths)
    return _stream(load_dir, family, meta)


def _stream(folder: str, family, meta: ModelMeta) -> Iterator[Piece]:
    with contextlib.ExitStack() as stack:
        weights = _Weights(folder, stack)
        yield Piece("meta", meta=meta)
        yield Piece("embeddings", family.embeddings_from_hf(weights, meta))
        for index in range(meta.num_layers):
            yield Piece("layer", family.layer_from_hf(weights, index, meta), index=index)
        yield Piece("final_norm", family.final_norm_from_hf(weights, meta))
        if family is hf_bert:
            for kind, tensors in family.heads_from_hf(weights, meta):
                yield Piece(kind, tensors)
            return
        output = family.output_layer_from_hf(weights, meta)
        if output is not None:
            yield Piece("output_layer", output)
        for depth in range(meta.mtp_num_layers):
            yield Piece("mtp", family.mtp_from_hf(weights, depth, meta), index=depth)

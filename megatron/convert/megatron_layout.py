"""Where tensors sit in Megatron-layout checkpoint files and how they are split over
tensor-parallel ranks: the rules :mod:`megatron.convert.megatron_io` (loading) and
:mod:`megatron.convert.megatron_save` (saving) share, and the safe memory-mapped reader of one
rank's file. The split table is in :mod:`megatron.convert.megatron_io`'s docstring.
"""

import mmap
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint import mcore_torch, optimizer_state, safe_unpickle
from megatron.checkpoint.names import dotted_names
from megatron.convert.schema import ConversionError, ModelMeta

# Key of ``meta.source_args`` carrying the source's ``opt_param_scheduler`` state (not a flag).
SCHEDULER_KEY = "_opt_param_scheduler"

_QKV = "self_attention.query_key_value"
_DENSE = "self_attention.dense"
_H_TO_4H = "mlp.dense_h_to_4h"
_4H_TO_H = "mlp.dense_4h_to_h"
_Q_NORM = "self_attention.q_layernorm"
_K_NORM = "self_attention.k_layernorm"
_ROUTER = "mlp.router.weight"
_EXPERT = "mlp.experts.local_experts"
_SHARED = "mlp.shared_experts"
_OFFSET = "self_attention.core_attention.softmax_offset"

# Where BERT's own tensors sit in a rank's ``model`` tree (the nesting Megatron saves): the
# token-type table on the first stage; the heads, by stream piece kind, on the last stage.
TOKENTYPE_KEYS = ("language_model", "embedding", "tokentype_embeddings", "weight")
BERT_HEAD_KEYS = {"pooler": ("language_model", "pooler"), "lm_head": ("lm_head",),
                  "binary_head": ("binary_head",)}


# ---------------------------------------------------------------------------------------------
# Tensor-parallel split rules
# ---------------------------------------------------------------------------------------------

def layer_tensor_names(meta: ModelMeta, index: int = 0) -> List[str]:
    """The tensors of global layer ``index`` (0-based; MoE or dense by
    ``meta.moe_layer_freq``), in the order the model's state dict has them."""
    layer_norm = meta.normalization == "LayerNorm"
    qkv_bias = meta.add_bias_linear or meta.add_qkv_bias
    if meta.multi_latent_attention:
        names = [("input_layernorm.weight", True), ("input_layernorm.bias", layer_norm)]
        names += [(name, True) for name in mla_tensor_shapes(meta)]
        names += [("post_attention_layernorm.weight", True),
                  ("post_attention_layernorm.bias", layer_norm)]
        return _mlp_tensor_names(meta, index, names)
    names = [("input_layernorm.weight", True), ("input_layernorm.bias", layer_norm),
             (f"{_QKV}.weight", True), (f"{_QKV}.bias", qkv_bias),
             (f"{_DENSE}.weight", True), (f"{_DENSE}.bias", meta.add_bias_linear),
             (f"{_Q_NORM}.weight", meta.qk_layernorm),
             (f"{_Q_NORM}.bias", meta.qk_layernorm and layer_norm),
             (f"{_K_NORM}.weight", meta.qk_layernorm),
             (f"{_K_NORM}.bias", meta.qk_layernorm and layer_norm),
             (_OFFSET, meta.softmax_type == "learnable"),
             ("post_attention_layernorm.weight", True),
             ("post_attention_layernorm.bias", layer_norm)]
    return _mlp_tensor_names(meta, index, names)


def mla_tensor_shapes(meta: ModelMeta) -> Dict[str, Tuple[int, ...]]:
    """Multi-latent attention's tensors and whole shapes, in the model's state-dict order."""
    h, heads = meta.hidden_size, meta.num_attention_heads
    q_head, c, norm = meta.qk_head_dim + meta.qk_pos_emb_head_dim, meta.kv_lora_rank, []
    a = "self_attention."
    if meta.q_lora_rank is None:
        shapes = {a + "linear_q_proj.weight": (heads * q_head, h)}
    else:
        q = meta.q_lora_rank
        shapes = {a + "linear_q_down_proj.weight": (q, h)}
        shapes.update({a + "q_layernorm.weight": (q,)} if meta.qk_layernorm else {})
        shapes[a + "linear_q_up_proj.weight"] = (heads * q_head, q)
    shapes[a + "linear_kv_down_proj.weight"] = (c + meta.qk_pos_emb_head_dim, h)
    if meta.qk_layernorm:
        shapes[a + "kv_layernorm.weight"] = (c,)
        norm = [a + "q_layernorm.bias", a + "kv_layernorm.bias"]
    shapes[a + "linear_kv_up_proj.weight"] = (heads * (meta.qk_head_dim + meta.v_head_dim), c)
    shapes[a + "linear_proj.weight"] = (h, heads * meta.v_head_dim)
    if meta.normalization == "LayerNorm":
        for name in norm:
            if name.replace(".bias", ".weight") in shapes:
                shapes[name] = shapes[name.replace(".bias", ".weight")]
    if meta.add_bias_linear:
        shapes[a + "linear_proj.bias"] = (h,)
    return shapes


def _mlp_tensor_names(meta: ModelMeta, index: int, names: list) -> List[str]:
    if meta.is_moe_layer(index):
        names.append((_ROUTER, True))
        names.append(("mlp.router.bias", meta.add_bias_linear))
        names.append(("mlp.router.expert_bias", meta.moe_router_enable_expert_bias))
        for expert in range(meta.num_experts):
            names += [(f"{_EXPERT}.{expert}.linear_fc1.weight", True),
                      (f"{_EXPERT}.{expert}.linear_fc1.bias", meta.add_bias_linear),
                      (f"{_EXPERT}.{expert}.linear_fc2.weight", True),
                      (f"{_EXPERT}.{expert}.linear_fc2.bias", meta.add_bias_linear)]
        shared = bool(meta.moe_shared_expert_intermediate_size)
        names += [(f"{_SHARED}.linear_fc1.weight", shared),
                  (f"{_SHARED}.linear_fc2.weight", shared),
                  (f"{_SHARED}.gate_weight", shared and meta.moe_shared_expert_gate)]
    else:
        names += [(f"{_H_TO_4H}.weight", True), (f"{_H_TO_4H}.bias", meta.add_bias_linear),
                  (f"{_4H_TO_H}.weight", True), (f"{_4H_TO_H}.bias", meta.add_bias_linear)]
    return [name for name, present in names if present]


def expert_of(name: str) -> Optional[Tuple[int, str]]:
    """``(J, "linear_fc1.weight")`` for expert J's tensor ``name``, None for any other."""
    if not name.startswith(_EXPERT + "."):
        return None
    number, rest = name[len(_EXPERT) + 1:].split(".", 1)
    return int(number), rest


def layer_tensor_shapes(meta: ModelMeta, index: int = 0) -> Dict[str, Tuple[int, ...]]:
    """Whole (unsplit) shape of every tensor of global layer ``index``."""
    h, ffn = meta.hidden_size, meta.ffn_hidden_size
    qkv = (meta.num_attention_heads + 2 * meta.num_query_groups) * meta.kv_channels
    h_to_4h = 2 * ffn if meta.gated_linear_unit else ffn
    moe_ffn = meta.expert_ffn_size
    fc1 = 2 * moe_ffn if meta.gated_linear_unit else moe_ffn
    shared = meta.moe_shared_expert_intermediate_size or 0
    shapes = {_ROUTER: (meta.num_experts or 0, h),
              f"{_SHARED}.linear_fc1.weight": (2 * shared if meta.gated_linear_unit else shared, h),
              f"{_SHARED}.linear_fc2.weight": (h, shared), f"{_SHARED}.gate_weight": (1, h)}
    for expert in range(meta.num_experts or 0):
        shapes.update({f"{_EXPERT}.{expert}.linear_fc1.weight": (fc1, h),
                       f"{_EXPERT}.{expert}.linear_fc1.bias": (fc1,),
                       f"{_EXPERT}.{expert}.linear_fc2.weight": (h, moe_ffn)})
    shapes.update({f"{_QKV}.weight": (qkv, h), f"{_QKV}.bias": (qkv,),
              f"{_DENSE}.weight": (h, meta.num_attention_heads * meta.kv_channels),
              f"{_H_TO_4H}.weight": (h_to_4h, h), f"{_H_TO_4H}.bias": (h_to_4h,),
              f"{_4H_TO_H}.weight": (h, ffn), _OFFSET: (meta.num_attention_heads,)})
    # --qk-layernorm's norms are over one head and replicated on every TP rank.
    shapes.update({f"{norm}.{kind}": (meta.kv_channels,) for norm in (_Q_NORM, _K_NORM)
                   for kind in ("weight", "bias")})
    shapes["mlp.router.expert_bias"] = shapes["mlp.router.bias"] = (meta.num_experts or 0,)
    if meta.multi_latent_attention:
        shapes.update(mla_tensor_shapes(meta))
    return {name: shapes.get(name, (h,)) for name in layer_tensor_names(meta, index)}


# Multi-latent attention's projections split by heads (its down projections are replicated).
_MLA_ROW_SPLIT = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
                  "self_attention.linear_kv_up_proj.weight")


MTP_LAYER = "transformer_layer."


def mtp_tensor_shapes(meta: ModelMeta) -> Dict[str, Tuple[int, ...]]:
    """Whole shape of every tensor of one multi-token prediction depth (an ``mtp`` piece),
    in the model's state-dict order; its layer is the last decoder layer's kind."""
    h = meta.hidden_size
    norm = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
    shapes = {f"{which}.{n}": (h,) for which in ("enorm", "hnorm") for n in norm}
    shapes["eh_proj.weight"] = (h, 2 * h)
    shapes.update({f"final_layernorm.{n}": (h,) for n in norm})
    layer = layer_tensor_shapes(meta, meta.num_layers - 1)
    shapes.update({MTP_LAYER + name: shape for name, shape in layer.items()})
    return shapes


def mtp_split_rule(name: str, swiglu: bool) -> Optional[Tuple[int, int]]:
    """:func:`tp_split_rule` for a tensor of an ``mtp`` piece: ``eh_proj`` by rows."""
    if name.startswith(MTP_LAYER):
        return tp_split_rule(name[len(MTP_LAYER):], swiglu)
    return (0, 1) if name == "eh_proj.weight" else None


def tp_split_rule(name: str, swiglu: bool) -> Optional[Tuple[int, int]]:
    """``(dim, stride)`` a layer tensor is split along over TP ranks, None when replicated.
    Experts are split over expert-TP, which the converter keeps equal to TP: fc1 by rows (its
    SwiGLU halves each), fc2 by columns, like the dense MLP; the router is replicated. The
    shared expert is split over TP the same way."""
    expert = expert_of(name)
    if name.startswith(_SHARED + "."):
        expert = (None, name[len(_SHARED) + 1:])
    if expert is not None:
        name = {"linear_fc1.weight": f"{_H_TO_4H}.weight", "linear_fc1.bias": f"{_H_TO_4H}.bias",
                "linear_fc2.weight": f"{_4H_TO_H}.weight"}.get(expert[1], expert[1])
    if name.startswith(_QKV + ".") or name == _OFFSET or name in _MLA_ROW_SPLIT:
        return 0, 1
    if name.startswith(_H_TO_4H + "."):
        return 0, 2 if swiglu else 1
    if name in (f"{_DENSE}.weight", f"{_4H_TO_H}.weight", "self_attention.linear_proj.weight"):
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

def read_rank_file(path: str, shared: bool = False) -> dict:
    """One rank's file, memory-mapped (MAP_SHARED when ``shared``: writes go to the file) and
    loaded with ``weights_only``, Megatron's own classes as inert stand-ins
    (:mod:`megatron.checkpoint.safe_unpickle`)."""
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing")
    flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
    try:
        with torch.serialization.set_default_mmap_options(flags):
            try:
                state = safe_unpickle.torch_load(path, mmap=True)
            except RuntimeError as err:
                if shared or "mmap" not in str(err):
                    raise
                # A file in torch's legacy (non-zip) format cannot be mapped: read it whole.
                state = safe_unpickle.torch_load(path)
    except safe_unpickle.UnsafeCheckpointError as err:
        raise ConversionError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConversionError(f"{path}: cannot be read ({first})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise ConversionError(f"{path}: not a model_optim_rng checkpoint (no 'iteration' key)")
    chunks = [key for key in state if key == "model" or re.fullmatch(r"model\d+", key)]
    if not shared and any(mcore_torch.is_mcore_state(state[key]) for key in chunks):
        # A Megatron-Core model's torch-format save: read under the legacy names. Its Adam
        # state lists Megatron-Core's parameter order, which is not mapped: it is dropped.
        untied = bool(getattr(state.get("args"), "untie_embeddings_and_output_weights", False))
        try:
            for key in chunks:
                state[key] = mcore_torch.to_legacy_tree(state[key], untied, path)
        except ValueError as err:
            raise ConversionError(str(err)) from None
        if "optimizer" in state:
            state[optimizer_state.MCORE_ORDER_KEY] = True
    return state


def get_path(tree: dict, keys: Sequence[str], path: str):
    node = tree
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ConversionError(f"{path}: no {'.'.join(keys)} in the saved model state")
        node = node[key]
    return node


def has_prefix(tree, prefix: str) -> bool:
    """Whether a nested ``tree`` holds any key under dotted ``prefix``."""
    return any(name == prefix or name.startswith(prefix + ".") for name in dotted_names(tree))



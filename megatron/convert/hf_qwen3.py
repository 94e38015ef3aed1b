"""Qwen3 (``Qwen3ForCausalLM``, model_type ``qwen3``) to and from the canonical stream.

A Qwen3 layer is a Llama layer (:mod:`megatron.convert.hf_llama`) without biases whose queries
and keys are RMS-normalised per head, over ``head_dim``, before the rotary embedding: ours with
``--qk-layernorm --normalization RMSNorm --disable-bias-linear``. HF's ``self_attn.q_norm`` /
``k_norm`` ``[head_dim]`` are Megatron-Core's ``self_attention.q_layernorm`` /
``k_layernorm`` weights, replicated over tensor-parallel ranks. ``head_dim`` is always written:
transformers' Qwen3 takes 128 when it is absent, not hidden / heads.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama, hf_qwen2
from megatron.convert.hf_common import ConfigView
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
ROPE_SCALING = True
HF_DEFAULT_HEAD_DIM = 128

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf

_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
          "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Qwen3 cannot express, each naming its flag."""
    problems = [p.replace("Llama", "Qwen3") for p in hf_llama.unsupported_features(meta)
                if not p.startswith("--add-qkv-bias")]
    if meta.add_bias_linear or meta.add_qkv_bias:
        problems.append("linear biases (Qwen3 has none in its MLP, and its attention_bias "
                        "would put one on o_proj too; train with --disable-bias-linear and "
                        "without --add-qkv-bias)")
    if not meta.qk_layernorm:
        problems.append("no --qk-layernorm (Qwen3 normalises queries and keys per head)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Qwen3 folder for ``meta`` (full attention in every layer)."""
    config = hf_qwen2.hf_config(meta, bos_id, eos_id)
    config.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                   "attention_bias": False})
    return config


def norms_to_hf(p: str, t: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The per-head q / k norms under HF layer prefix ``p`` (shared with Qwen3-MoE)."""
    return {p + hf: t[ours] for hf, ours in _NORMS.items()}


def norms_from_hf(get, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {ours: get(hf, (meta.kv_channels,)) for hf, ours in _NORMS.items()}


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    out = hf_llama.layer_to_hf(index, t, meta)
    out.update(norms_to_hf(f"model.layers.{index}.", t))
    return out


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Qwen3 config.json describes; refuses settings our model cannot compute."""
    hf_qwen2.refuse_sliding_window(config)
    if config.get("attention_bias", False):
        raise config.unsupported("attention_bias", config.get("attention_bias"),
                                 "false (our --add-qkv-bias has no bias on o_proj)")
    meta = hf_llama.meta_from_config(config)
    return dataclasses.replace(meta, qk_layernorm=True,
                               kv_channels=config.need("head_dim", default=HF_DEFAULT_HEAD_DIM))


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    out = hf_llama.layer_from_hf(weights, index, meta)
    p = f"model.layers.{index}."
    out.update(norms_from_hf(lambda name, shape: weights.get(p + name, shape), meta))
    return out

"""Qwen2 (``Qwen2ForCausalLM``, model_type ``qwen2``) to and from the canonical stream.

A Qwen2 layer is a Llama layer (:mod:`megatron.convert.hf_llama`) whose q, k and v projections
always have biases and whose output projection and MLP have none: ours with
``--add-qkv-bias --disable-bias-linear``. The q / k / v biases are split from the fused
``query_key_value.bias`` per query group, as the weights are. Sliding-window attention
(``use_sliding_window``) is refused on import and written off on export.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama
from megatron.convert.hf_common import ConfigView, join_qkv, split_qkv
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"
ROPE_SCALING = True

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Qwen2 cannot express, each naming its flag."""
    problems = [p.replace("Llama", "Qwen2") for p in hf_llama.unsupported_features(meta)
                if not p.startswith("--add-qkv-bias")]
    if meta.add_bias_linear:
        problems.append("--add-bias-linear (Qwen2 has biases on q, k and v only; train with "
                        "--disable-bias-linear --add-qkv-bias)")
    elif not meta.add_qkv_bias:
        problems.append("no --add-qkv-bias (Qwen2's q, k and v projections have biases)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Qwen2 folder for ``meta`` (full attention in every layer)."""
    config = hf_llama.hf_config(meta, bos_id, eos_id)
    for name in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[name]
    config.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                   "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": meta.num_layers})
    return config


def qkv_bias_to_hf(p: str, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """The fused q/k/v bias as HF's three (shared with Qwen3-MoE)."""
    qb, kb, vb = split_qkv(t["self_attention.query_key_value.bias"], meta)
    return {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
            p + "self_attn.v_proj.bias": vb}


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    out = hf_llama.layer_to_hf(index, t, meta)
    out.update(qkv_bias_to_hf(f"model.layers.{index}.", t, meta))
    return out


def refuse_sliding_window(config: ConfigView) -> None:
    if config.get("use_sliding_window", False):
        raise config.unsupported("use_sliding_window", config.get("use_sliding_window"),
                                 "false (full causal attention)")


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Qwen2 config.json describes; refuses settings our model cannot compute."""
    refuse_sliding_window(config)
    meta = hf_llama.meta_from_config(config)
    return dataclasses.replace(meta, add_bias_linear=False, add_qkv_bias=True)


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    out = hf_llama.layer_from_hf(weights, index, meta)
    p, hn = f"model.layers.{index}.", meta.kv_channels
    q_rows, kv_rows = meta.num_attention_heads * hn, meta.num_query_groups * hn
    out["self_attention.query_key_value.bias"] = join_qkv(
        weights.get(p + "self_attn.q_proj.bias", (q_rows,)),
        weights.get(p + "self_attn.k_proj.bias", (kv_rows,)),
        weights.get(p + "self_attn.v_proj.bias", (kv_rows,)), meta)
    return out

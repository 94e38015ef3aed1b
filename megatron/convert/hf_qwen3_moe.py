"""Qwen3-MoE (``Qwen3MoeForCausalLM``, model_type ``qwen3_moe``) to and from the canonical stream.

Attention as Qwen3 (:mod:`megatron.convert.hf_qwen3`: per-head q / k RMSNorms, no biases); MLP
a mixture of SwiGLU experts without a shared expert, routed as Qwen2-MoE routes
(:mod:`megatron.convert.hf_qwen2_moe`: softmax over all experts, top-k, renormalised with
``norm_topk_prob`` = our default, else our ``--moe-router-pre-softmax``):

- ``mlp.gate.weight`` ``[E, h]`` is our ``mlp.router.weight``;
- expert J's ``gate_proj`` / ``up_proj`` are the halves ``[gate; value]`` of our
  ``mlp.experts.local_experts.J.linear_fc1.weight``, ``down_proj`` its ``linear_fc2``.

Dense layers (our ``--moe-layer-freq``) are written as Qwen2-MoE writes them: in
``mlp_only_layers`` with ``decoder_sparse_step`` 1, a SwiGLU MLP of ``intermediate_size``.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama, hf_mixtral, hf_qwen2_moe, hf_qwen3
from megatron.convert.hf_common import ConfigView
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
ROPE_SCALING = True

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Qwen3-MoE cannot express, each naming its flag."""
    # Mixtral's rules, less those Qwen3-MoE lifts: routing without renormalisation, dense
    # layers between the MoE ones, YaRN.
    lifted = ("--moe-router-pre-softmax", "--moe-layer-freq", "--position-embedding-type")
    problems = [p.replace("Mixtral", "Qwen3-MoE") for p in hf_mixtral.unsupported_features(meta)
                if not p.startswith(lifted)]
    if not meta.qk_layernorm:
        problems.append("no --qk-layernorm (Qwen3-MoE normalises queries and keys per head)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Qwen3-MoE folder for ``meta``."""
    config = hf_mixtral.hf_config(meta, bos_id, eos_id)
    for name in ("num_local_experts", "router_jitter_noise"):
        del config[name]
    config.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "num_experts": meta.num_experts, "moe_intermediate_size": meta.expert_ffn_size,
        "intermediate_size": meta.ffn_hidden_size, "norm_topk_prob": not meta.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(meta.num_layers) if not meta.is_moe_layer(i)],
        "attention_bias": False, "use_sliding_window": False,
    })
    return config


def _swiglu_to_hf(prefix: str, fc1: torch.Tensor, fc2: torch.Tensor) -> Dict[str, torch.Tensor]:
    half = fc1.size(0) // 2
    return {prefix + "gate_proj.weight": fc1[:half], prefix + "up_proj.weight": fc1[half:],
            prefix + "down_proj.weight": fc2}


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    p = f"model.layers.{index}."
    out = hf_llama.attention_to_hf(p, t, meta)
    out.update(hf_qwen3.norms_to_hf(p, t))
    if not meta.is_moe_layer(index):
        out.update(_swiglu_to_hf(p + "mlp.", t["mlp.dense_h_to_4h.weight"],
                                 t["mlp.dense_4h_to_h.weight"]))
        return out
    out[p + "mlp.gate.weight"] = t["mlp.router.weight"]
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out.update(_swiglu_to_hf(f"{p}mlp.experts.{expert}.", t[ours + "linear_fc1.weight"],
                                 t[ours + "linear_fc2.weight"]))
    return out


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Qwen3-MoE config.json describes; refuses settings our model cannot
    compute."""
    dense = hf_qwen3.meta_from_config(config)
    freq = hf_qwen2_moe._moe_layer_freq(config, dense.num_layers)
    # Published configs say num_experts; transformers 5 writes it as num_local_experts.
    experts = ("num_local_experts" if config.get("num_experts") is None
               and config.get("num_local_experts") is not None else "num_experts")
    return dataclasses.replace(
        dense, ffn_hidden_size=config.need("intermediate_size"), moe_layer_freq=freq,
        num_experts=config.need(experts), moe_router_topk=config.need("num_experts_per_tok"),
        moe_ffn_hidden_size=config.need("moe_intermediate_size"),
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_aux_loss_coeff=hf_mixtral.aux_loss_coef_from_config(config))


def _swiglu_from_hf(get, prefix: str, ffn: int, h: int):
    fc1 = torch.cat([get(prefix + "gate_proj.weight", (ffn, h)),
                     get(prefix + "up_proj.weight", (ffn, h))])
    return fc1, get(prefix + "down_proj.weight", (h, ffn))


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, p = meta.hidden_size, f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = hf_llama.attention_from_hf(get, meta)
    out.update(hf_qwen3.norms_from_hf(get, meta))
    if not meta.is_moe_layer(index):
        out["mlp.dense_h_to_4h.weight"], out["mlp.dense_4h_to_h.weight"] = _swiglu_from_hf(
            get, "mlp.", meta.ffn_hidden_size, h)
        return out
    out["mlp.router.weight"] = get("mlp.gate.weight", (meta.num_experts, h))
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out[ours + "linear_fc1.weight"], out[ours + "linear_fc2.weight"] = _swiglu_from_hf(
            get, f"mlp.experts.{expert}.", meta.expert_ffn_size, h)
    return out

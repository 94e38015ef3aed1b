"""Qwen2-MoE (``Qwen2MoeForCausalLM``, model_type ``qwen2_moe``) to and from the canonical stream.

A Qwen2-MoE layer is a Llama layer (:mod:`megatron.convert.hf_llama`) with biases on q, k and v
only (``qkv_bias``; ours: ``--add-qkv-bias --disable-bias-linear``) whose MLP is a mixture of
SwiGLU experts plus one shared SwiGLU expert whose output is scaled per token by a sigmoid gate
(ours: ``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``):

- ``mlp.gate.weight`` ``[E, h]`` is our ``mlp.router.weight``;
- expert J's ``gate_proj`` / ``up_proj`` are the halves ``[gate; value]`` of our
  ``mlp.experts.local_experts.J.linear_fc1.weight``, ``down_proj`` its ``linear_fc2``;
- ``mlp.shared_expert.*`` likewise for ``mlp.shared_experts.linear_fc{1,2}``, and
  ``mlp.shared_expert_gate.weight`` ``[1, h]`` is ``mlp.shared_experts.gate_weight``.

Dense layers between the MoE ones (our ``--moe-layer-freq``): transformers makes layer i
(0-based) sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``,
else a plain SwiGLU MLP of ``intermediate_size`` (``mlp.gate_proj`` / ``up_proj`` /
``down_proj``, no bias), which is our dense ``mlp.dense_h_to_4h`` / ``dense_4h_to_h`` of
``--ffn-hidden-size``. Any pattern is written exactly as ``decoder_sparse_step`` 1 with the
dense layers in ``mlp_only_layers`` (a step N > 1 would make layers N-1, 2N-1, ... sparse, not
Megatron's 0, N, 2N, ...); read back as Megatron's integer form when it is one, else its list.

Routing: transformers takes a softmax over all E logits and keeps the k largest; with
``norm_topk_prob`` it divides them by their sum, which equals our default (softmax over the top-k
logits); without, it is our ``--moe-router-pre-softmax``. Other routings are refused.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama, hf_mixtral
from megatron.convert.hf_common import ConfigView, join_qkv, split_qkv
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Qwen2-MoE cannot express, each naming its flag."""
    # Mixtral's rules, less those Qwen2-MoE lifts: q/k/v biases, the shared expert, routing
    # without renormalisation.
    lifted = ("linear biases", "--moe-shared-expert-intermediate-size",
              "--moe-router-pre-softmax", "--moe-layer-freq")
    problems = [p.replace("Mixtral", "Qwen2-MoE") for p in hf_mixtral.unsupported_features(meta)
                if not p.startswith(lifted)]
    if meta.add_bias_linear:
        problems.append("--add-bias-linear (Qwen2-MoE has biases on q, k and v only; train "
                        "with --disable-bias-linear, optionally --add-qkv-bias)")
    if not meta.moe_shared_expert_intermediate_size:
        problems.append("no shared expert (Qwen2-MoE needs --moe-shared-expert-intermediate-size "
                        "and --moe-shared-expert-gate)")
    elif not meta.moe_shared_expert_gate:
        problems.append("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate "
                        "(Qwen2-MoE gates its shared expert)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Qwen2-MoE folder for ``meta``."""
    config = hf_mixtral.hf_config(meta, bos_id, eos_id)
    for name in ("num_local_experts", "router_jitter_noise", "intermediate_size"):
        del config[name]
    dense = [i for i in range(meta.num_layers) if not meta.is_moe_layer(i)]
    config.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "num_experts": meta.num_experts, "moe_intermediate_size": meta.expert_ffn_size,
        "intermediate_size": (meta.ffn_hidden_size if dense
                              else meta.moe_shared_expert_intermediate_size),
        "shared_expert_intermediate_size": meta.moe_shared_expert_intermediate_size,
        "norm_topk_prob": not meta.moe_router_pre_softmax, "qkv_bias": bool(meta.add_qkv_bias),
        "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False,
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
    if meta.add_qkv_bias:
        out.update(_qkv_bias_to_hf(p, t, meta))
    if not meta.is_moe_layer(index):
        out.update(_swiglu_to_hf(p + "mlp.", t["mlp.dense_h_to_4h.weight"],
                                 t["mlp.dense_4h_to_h.weight"]))
        return out
    out[p + "mlp.gate.weight"] = t["mlp.router.weight"]
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out.update(_swiglu_to_hf(f"{p}mlp.experts.{expert}.", t[ours + "linear_fc1.weight"],
                                 t[ours + "linear_fc2.weight"]))
    out.update(_swiglu_to_hf(p + "mlp.shared_expert.", t["mlp.shared_experts.linear_fc1.weight"],
                             t["mlp.shared_experts.linear_fc2.weight"]))
    out[p + "mlp.shared_expert_gate.weight"] = t["mlp.shared_experts.gate_weight"]
    return out


def _qkv_bias_to_hf(p, t, meta):
    qb, kb, vb = split_qkv(t["self_attention.query_key_value.bias"], meta)
    return {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
            p + "self_attn.v_proj.bias": vb}


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Qwen2-MoE config.json describes; refuses settings our model cannot compute."""
    if config.get("use_sliding_window", False):
        raise config.unsupported("use_sliding_window", True, "false (full causal attention)")
    meta = hf_llama.meta_from_config(config)
    freq = _moe_layer_freq(config, meta.num_layers)
    shared = config.need("shared_expert_intermediate_size")
    return dataclasses.replace(
        meta, add_bias_linear=False, add_qkv_bias=bool(config.get("qkv_bias", True)),
        ffn_hidden_size=shared if freq == 1 else config.need("intermediate_size"),
        moe_layer_freq=freq, num_experts=config.need("num_experts"),
        moe_router_topk=config.need("num_experts_per_tok"),
        moe_ffn_hidden_size=config.need("moe_intermediate_size"),
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True,
        moe_aux_loss_coeff=hf_mixtral.aux_loss_coef_from_config(config))


def _moe_layer_freq(config: ConfigView, num_layers: int):
    """Megatron's ``--moe-layer-freq`` for transformers' sparse layers: 1 (all), N (layers 0,
    N, 2N, ...) or the list of 0/1."""
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise config.unsupported("decoder_sparse_step", step, "an integer >= 1")
    dense = set(config.get("mlp_only_layers", None) or [])
    sparse = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    for every in range(1, num_layers + 1):
        if sparse == [int(i % every == 0) for i in range(num_layers)]:
            return every
    return sparse


def _swiglu_from_hf(weights, prefix: str, ffn: int, h: int):
    fc1 = torch.cat([weights.get(prefix + "gate_proj.weight", (ffn, h)),
                     weights.get(prefix + "up_proj.weight", (ffn, h))])
    return fc1, weights.get(prefix + "down_proj.weight", (h, ffn))


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, hn = meta.hidden_size, meta.kv_channels
    p = f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = hf_llama.attention_from_hf(get, meta)
    if meta.add_qkv_bias:
        q_rows, kv_rows = meta.num_attention_heads * hn, meta.num_query_groups * hn
        out["self_attention.query_key_value.bias"] = join_qkv(
            get("self_attn.q_proj.bias", (q_rows,)), get("self_attn.k_proj.bias", (kv_rows,)),
            get("self_attn.v_proj.bias", (kv_rows,)), meta)
    if not meta.is_moe_layer(index):
        out["mlp.dense_h_to_4h.weight"], out["mlp.dense_4h_to_h.weight"] = _swiglu_from_hf(
            weights, p + "mlp.", meta.ffn_hidden_size, h)
        return out
    out["mlp.router.weight"] = get("mlp.gate.weight", (meta.num_experts, h))
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out[ours + "linear_fc1.weight"], out[ours + "linear_fc2.weight"] = _swiglu_from_hf(
            weights, f"{p}mlp.experts.{expert}.", meta.expert_ffn_size, h)
    shared = "mlp.shared_experts."
    out[shared + "linear_fc1.weight"], out[shared + "linear_fc2.weight"] = _swiglu_from_hf(
        weights, p + "mlp.shared_expert.", meta.moe_shared_expert_intermediate_size, h)
    out[shared + "gate_weight"] = get("mlp.shared_expert_gate.weight", (1, h))
    return out

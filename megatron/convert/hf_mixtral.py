"""Mixtral (``MixtralForCausalLM``, model_type ``mixtral``) to and from the canonical stream.

A Mixtral layer is a Llama layer (:mod:`megatron.convert.hf_llama`: rotary positions over the
whole head, pre-RMSNorm, grouped-query attention, no biases) whose MLP is a mixture of SwiGLU
experts, every layer:

- ``block_sparse_moe.gate.weight`` ``[E, h]`` is our ``mlp.router.weight``;
- expert J's ``w1`` (gate) and ``w3`` (up) ``[ffn, h]`` are the halves ``[gate; value]`` of our
  ``mlp.experts.local_experts.J.linear_fc1.weight``, ``w2`` ``[h, ffn]`` is ``linear_fc2``.

Routing: transformers takes a softmax over all E router logits, keeps the k largest
probabilities and divides them by their sum. That equals a softmax over the k largest logits,
which is what our router computes by default (``--moe-router-score-function softmax`` without
``--moe-router-pre-softmax`` or ``--moe-router-topk-scaling-factor``), and the tokens are never
dropped. Every other routing is refused, naming its flag.

``sliding_window`` W is ``--window-size W-1,0`` on every layer, as for Mistral
(:mod:`megatron.convert.hf_mistral`). ``router_aux_loss_coef`` is ``--moe-aux-loss-coeff`` of
``--moe-router-load-balancing-type aux_loss`` (transformers' load-balancing loss), both ways.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama, hf_mistral
from megatron.convert.hf_common import ConfigView
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"

# Saved flags (``meta.source_args``) whose routing or expert layout Mixtral cannot compute, with
# the value that is harmless.
_SOURCE_FLAGS = (
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor", None),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", None),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", False),
    ("moe_router_num_groups", "--moe-router-num-groups", None),
    ("moe_router_group_topk", "--moe-router-group-topk", None),
)

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Mixtral cannot express, each naming its flag (empty: all fine)."""
    # Llama's rules hold for Mixtral's attention and norms (its biases are refused below).
    problems = [p.replace("Llama", "Mixtral") for p in hf_llama.unsupported_features(meta)
                if not p.startswith("--add-qkv-bias")]
    if meta.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {meta.position_embedding_type} (Mixtral "
                        "uses rope)")
    if not meta.num_experts:
        problems.append("a dense MLP without --num-experts (Mixtral's MLP is a mixture of "
                        "experts)")
    if meta.add_bias_linear or meta.add_qkv_bias:
        problems.append("linear biases (Mixtral has none; train with --disable-bias-linear "
                        "and without --add-qkv-bias)")
    if meta.moe_shared_expert_intermediate_size:
        problems.append(f"--moe-shared-expert-intermediate-size "
                        f"{meta.moe_shared_expert_intermediate_size} (Mixtral has no shared "
                        "expert)")
    if meta.moe_router_score_function != "softmax":
        problems.append(f"--moe-router-score-function {meta.moe_router_score_function} "
                        "(Mixtral routes by softmax)")
    if meta.moe_router_pre_softmax:
        problems.append("--moe-router-pre-softmax (Mixtral renormalises the top-k "
                        "probabilities)")
    if meta.moe_router_topk_scaling_factor not in (None, 1.0):
        problems.append(f"--moe-router-topk-scaling-factor "
                        f"{meta.moe_router_topk_scaling_factor} (Mixtral does not scale)")
    source = meta.source_args or {}
    for name, flag, harmless in _SOURCE_FLAGS:
        value = source.get(name, harmless)
        if value is not None and value != harmless and not (
                name == "moe_expert_capacity_factor" and value < 0):
            problems.append(f"{flag} {value} (Mixtral has no such routing)")
    freq = meta.moe_layer_freq if meta.moe_layer_freq != 1 else source.get("moe_layer_freq", 1)
    if freq not in (1, None) and not (isinstance(freq, (list, tuple)) and all(freq)):
        problems.append(f"--moe-layer-freq {freq} (every Mixtral layer is an MoE layer)")
    return problems + hf_mistral.window_problems(meta)


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Mixtral folder for ``meta`` (Llama's fields plus the experts')."""
    config = hf_llama.hf_config(meta, bos_id, eos_id)
    for name in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[name]
    config.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "intermediate_size": meta.expert_ffn_size,
        "num_local_experts": meta.num_experts, "num_experts_per_tok": meta.moe_router_topk,
        "router_aux_loss_coef": aux_loss_coef_to_hf(meta),
        "router_jitter_noise": 0.0, "output_router_logits": False,
        "sliding_window": hf_mistral.sliding_window(meta),
    })
    return config


def _expert_prefix(index: int, expert: int) -> str:
    return f"model.layers.{index}.block_sparse_moe.experts.{expert}."


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    p = f"model.layers.{index}."
    ffn = meta.expert_ffn_size
    out = hf_llama.attention_to_hf(p, t, meta)
    out[p + "block_sparse_moe.gate.weight"] = t["mlp.router.weight"]
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        fc1 = t[ours + "linear_fc1.weight"]                               # [2 ffn, h]
        e = _expert_prefix(index, expert)
        out[e + "w1.weight"] = fc1[:ffn]
        out[e + "w3.weight"] = fc1[ffn:]
        out[e + "w2.weight"] = t[ours + "linear_fc2.weight"]
    return out


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Mixtral config.json describes; refuses settings our model cannot compute."""
    meta = hf_llama.meta_from_config(config)
    experts = config.need("num_local_experts")
    return dataclasses.replace(meta, add_bias_linear=False, num_experts=experts,
                               window_size=hf_mistral.window_from_config(config),
                               moe_router_topk=config.need("num_experts_per_tok"),
                               moe_ffn_hidden_size=meta.ffn_hidden_size,
                               moe_aux_loss_coeff=aux_loss_coef_from_config(config))


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, ffn = meta.hidden_size, meta.expert_ffn_size
    p = f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = hf_llama.attention_from_hf(get, meta)
    out["mlp.router.weight"] = get("block_sparse_moe.gate.weight", (meta.num_experts, h))
    for expert in range(meta.num_experts):
        e, ours = _expert_prefix(index, expert), f"mlp.experts.local_experts.{expert}."
        out[ours + "linear_fc1.weight"] = torch.cat([weights.get(e + "w1.weight", (ffn, h)),
                                                     weights.get(e + "w3.weight", (ffn, h))])
        out[ours + "linear_fc2.weight"] = weights.get(e + "w2.weight", (h, ffn))
    return out


def aux_loss_coef_from_config(config: ConfigView) -> Optional[float]:
    """``--moe-aux-loss-coeff`` (of the ``aux_loss`` type) for a config's
    ``router_aux_loss_coef``; None when the config has no such key."""
    return config.need("router_aux_loss_coef", float, default=None)


def aux_loss_coef_to_hf(meta: ModelMeta) -> float:
    """``router_aux_loss_coef`` for ``meta``: a Hugging Face source's own, else from the saved
    args of a Megatron source (:func:`router_aux_loss_coef`)."""
    if meta.moe_aux_loss_coeff is not None:
        return meta.moe_aux_loss_coeff
    return router_aux_loss_coef(meta.source_args or {})


def router_aux_loss_coef(source_args: dict) -> float:
    """transformers' ``router_aux_loss_coef`` from a run's saved args: its coefficient, or with
    several balancing types (Megatron's lists) the one of ``aux_loss`` (the loss transformers
    computes), 0 without it."""
    coeff = source_args.get("moe_aux_loss_coeff", 0.0) or 0.0
    types = source_args.get("moe_router_load_balancing_type")
    if not isinstance(coeff, (list, tuple)):
        return coeff
    if isinstance(types, (list, tuple)) and "aux_loss" in types:
        return coeff[list(types).index("aux_loss")]
    return 0.0

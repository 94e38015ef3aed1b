"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``) to and from the canonical
stream.

Attention is our ``--multi-latent-attention`` with ``--qk-layernorm`` (the latent norms), the
tensors kept as they are: ``q_proj`` / ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` are our
``linear_q_proj`` / ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``;
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` our ``linear_kv_down_proj`` /
``kv_layernorm`` / ``linear_kv_up_proj``; ``o_proj`` our ``linear_proj``. Positions are rotated
as neighbouring pairs (``rope_interleave`` true; our default, without ``--rotary-interleaved``).

The first ``first_k_dense_replace`` layers have a SwiGLU MLP of ``intermediate_size`` (our
``--moe-layer-freq`` list ``[0]*k + [1]*(L-k)``), the others ``n_routed_experts`` SwiGLU experts
of ``moe_intermediate_size`` plus ``n_shared_experts`` shared ones, which are one shared expert of
``n_shared_experts * moe_intermediate_size`` (``--moe-shared-expert-intermediate-size``, no gate).
The router (``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``, our
``mlp.router.weight`` and ``mlp.router.expert_bias``) is ``--moe-router-score-function sigmoid
--moe-router-enable-expert-bias``, with ``routed_scaling_factor`` as
``--moe-router-topk-scaling-factor`` and ``n_group`` / ``topk_group`` as
``--moe-router-num-groups`` / ``--moe-router-group-topk``. transformers scores a group by its best
two experts, ours by its best ``topk / group_topk``: grouped routing needs ``num_experts_per_tok
= 2 topk_group``. Ours renormalises the chosen sigmoid weights when k > 1, so ``norm_topk_prob``
must be true (or k 1).

The router's weight and expert bias are written in float32, as transformers keeps them (our
expert bias is float32 too; our router weight has the model's dtype, so a bfloat16 Megatron
checkpoint rounds it).

Multi-token prediction (``--mtp-num-layers``; ``num_nextn_predict_layers`` in config.json):
DeepSeek's folders hold depth K as extra layer ``model.layers.{num_hidden_layers + K}.``: our
``enorm`` / ``hnorm`` / ``eh_proj`` under the same names, our MTP ``final_layernorm`` as
``shared_head.norm``, its transformer layer under the decoder layers' names (an MoE layer, as
the last decoder layer is), plus copies of the input embedding (``embed_tokens``) and the
output layer (``shared_head.head``), which our model shares with the main model: they are
written from the main tensors and, when read, must equal them. transformers' model has no MTP
and skips those weights; a folder whose config promises depths its weights lack (what
transformers saves) imports without them.
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.convert import hf_llama, hf_qwen2_moe
from megatron.convert.hf_common import ConfigView
from megatron.convert.schema import ModelMeta

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
ROPE_SCALING = True
# What transformers keeps in float32 whatever the model's dtype: the router's weight and bias.
KEEP_FLOAT32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf

# Our attention tensor (after ``self_attention.``) -> transformers' (after ``self_attn.``).
ATTENTION_NAMES = {"linear_q_proj.weight": "q_proj.weight",
                   "linear_q_down_proj.weight": "q_a_proj.weight",
                   "q_layernorm.weight": "q_a_layernorm.weight",
                   "linear_q_up_proj.weight": "q_b_proj.weight",
                   "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
                   "kv_layernorm.weight": "kv_a_layernorm.weight",
                   "linear_kv_up_proj.weight": "kv_b_proj.weight",
                   "linear_proj.weight": "o_proj.weight"}


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model DeepSeek-V3 cannot express, each naming its flag."""
    problems = [p for p in hf_llama.unsupported_features(meta)
                if not p.startswith(("--hidden-size", "--add-qkv-bias"))]
    source = meta.source_args or {}
    if not meta.qk_layernorm:
        problems.append("no --qk-layernorm (DeepSeek-V3 normalises its latents)")
    if meta.add_bias_linear or meta.add_qkv_bias:
        problems.append("linear biases (DeepSeek-V3 has none; train with --disable-bias-linear)")
    if meta.mtp_num_layers and not meta.is_moe_layer(meta.num_layers - 1):
        problems.append(f"--mtp-num-layers {meta.mtp_num_layers} after a dense last layer "
                        "(DeepSeek-V3's MTP layers are MoE layers)")
    if meta.num_experts:
        problems += _moe_problems(meta)
    return problems


def _moe_problems(meta: ModelMeta) -> List[str]:
    problems = []
    if meta.moe_router_score_function != "sigmoid" or not meta.moe_router_enable_expert_bias:
        problems.append("a router other than --moe-router-score-function sigmoid "
                        "--moe-router-enable-expert-bias")
    if meta.moe_shared_expert_gate or not meta.moe_shared_expert_intermediate_size or (
            meta.moe_shared_expert_intermediate_size % meta.expert_ffn_size):
        problems.append("--moe-shared-expert-intermediate-size must be a multiple of "
                        "--moe-ffn-hidden-size, without --moe-shared-expert-gate")
    groups = meta.moe_router_num_groups
    if groups and meta.moe_router_topk != 2 * meta.moe_router_group_topk:
        problems.append(f"--moe-router-topk {meta.moe_router_topk} with "
                        f"--moe-router-group-topk {meta.moe_router_group_topk} (DeepSeek-V3 "
                        "scores a group by its best two experts: topk must be 2 x group-topk)")
    freq = [int(meta.is_moe_layer(i)) for i in range(meta.num_layers)]
    k = freq.index(1) if 1 in freq else meta.num_layers
    if freq != [0] * k + [1] * (meta.num_layers - k):
        problems.append(f"--moe-layer-freq {meta.moe_layer_freq} (DeepSeek-V3's dense layers "
                        "are the first ones only)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the DeepSeek-V3 folder for ``meta``."""
    config = hf_llama.hf_config(meta, bos_id, eos_id)
    for name in ("head_dim", "mlp_bias"):
        del config[name]
    moe = [meta.is_moe_layer(i) for i in range(meta.num_layers)]
    experts = meta.num_experts or 0
    config.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "q_lora_rank": meta.q_lora_rank, "kv_lora_rank": meta.kv_lora_rank,
        "qk_nope_head_dim": meta.qk_head_dim, "qk_rope_head_dim": meta.qk_pos_emb_head_dim,
        "v_head_dim": meta.v_head_dim, "rope_interleave": True,
        "first_k_dense_replace": moe.index(True) if True in moe else meta.num_layers,
        "n_routed_experts": experts or 1, "num_experts_per_tok": meta.moe_router_topk,
        "moe_intermediate_size": meta.expert_ffn_size,
        "n_shared_experts": (meta.moe_shared_expert_intermediate_size or 0)
        // meta.expert_ffn_size if experts else 1,
        "n_group": meta.moe_router_num_groups or 1,
        "topk_group": meta.moe_router_group_topk or 1, "norm_topk_prob": True,
        "routed_scaling_factor": meta.moe_router_topk_scaling_factor or 1.0,
        "num_nextn_predict_layers": meta.mtp_num_layers,
    })
    return config


def _swiglu_to_hf(prefix, fc1, fc2):
    return hf_qwen2_moe._swiglu_to_hf(prefix, fc1, fc2)


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    return _layer_to_hf(f"model.layers.{index}.", t, meta, meta.is_moe_layer(index))


def _layer_to_hf(p: str, t: Dict[str, torch.Tensor], meta: ModelMeta,
                 moe: bool) -> Dict[str, torch.Tensor]:
    out = {p + "input_layernorm.weight": t["input_layernorm.weight"],
           p + "post_attention_layernorm.weight": t["post_attention_layernorm.weight"]}
    for ours, theirs in ATTENTION_NAMES.items():
        if "self_attention." + ours in t:
            out[p + "self_attn." + theirs] = t["self_attention." + ours]
    if not moe:
        out.update(_swiglu_to_hf(p + "mlp.", t["mlp.dense_h_to_4h.weight"],
                                 t["mlp.dense_4h_to_h.weight"]))
        return out
    out[p + "mlp.gate.weight"] = t["mlp.router.weight"]
    out[p + "mlp.gate.e_score_correction_bias"] = t["mlp.router.expert_bias"]
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out.update(_swiglu_to_hf(f"{p}mlp.experts.{expert}.", t[ours + "linear_fc1.weight"],
                                 t[ours + "linear_fc2.weight"]))
    out.update(_swiglu_to_hf(p + "mlp.shared_experts.", t["mlp.shared_experts.linear_fc1.weight"],
                             t["mlp.shared_experts.linear_fc2.weight"]))
    return out


def _refuse(config: ConfigView, key: str, want, expected: str):
    value = config.get(key, want)
    if value != want:
        raise config.unsupported(key, value, expected)


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a DeepSeek-V3 config.json describes; refuses settings our model cannot
    compute, by key."""
    _refuse(config, "rope_interleave", True, "true (positions rotated as neighbouring pairs)")
    _refuse(config, "attention_bias", False, "false (--disable-bias-linear)")
    meta = hf_llama.meta_from_config(config)
    layers = meta.num_layers
    dense = config.need("first_k_dense_replace", default=0)
    if not 0 <= dense <= layers:
        raise config.unsupported("first_k_dense_replace", dense, f"0 to {layers}")
    meta = dataclasses.replace(
        meta, multi_latent_attention=True, qk_layernorm=True, kv_channels=meta.hidden_size
        // meta.num_attention_heads, num_query_groups=meta.num_attention_heads,
        q_lora_rank=config.get("q_lora_rank", None), kv_lora_rank=config.need("kv_lora_rank"),
        qk_head_dim=config.need("qk_nope_head_dim"),
        qk_pos_emb_head_dim=config.need("qk_rope_head_dim"),
        v_head_dim=config.need("v_head_dim"))
    if dense == layers:
        return meta
    return dataclasses.replace(meta, **_moe_from_config(config, dense, layers))


def _moe_from_config(config: ConfigView, dense: int, layers: int) -> dict:
    topk, experts = config.need("num_experts_per_tok"), config.need("n_routed_experts")
    groups, group_topk = config.need("n_group", default=1), config.need("topk_group", default=1)
    if groups < 1 or experts % groups or not 1 <= group_topk <= groups:
        raise config.unsupported("n_group / topk_group", (groups, group_topk),
                                 "n_group dividing n_routed_experts, 1 <= topk_group <= n_group")
    if groups > 1 and topk != 2 * group_topk:
        raise config.unsupported("num_experts_per_tok", topk, f"2 x topk_group = "
                                 f"{2 * group_topk} (a group's score is its best two experts)")
    if topk > 1 and not config.get("norm_topk_prob", True):
        raise config.unsupported("norm_topk_prob", False, "true (the chosen weights summing "
                                 "to 1), or num_experts_per_tok 1")
    moe_ffn = config.need("moe_intermediate_size")
    shared = config.need("n_shared_experts", default=1)
    if shared < 1:
        raise config.unsupported("n_shared_experts", shared, "at least 1")
    return dict(
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=[0] * dense + [1] * (layers - dense) if dense else 1,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(config.need("routed_scaling_factor", float,
                                                         default=1.0)),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_shared_expert_intermediate_size=shared * moe_ffn)


def _swiglu_from_hf(weights, prefix: str, ffn: int, h: int):
    return hf_qwen2_moe._swiglu_from_hf(weights, prefix, ffn, h)


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    return _layer_from_hf(weights, f"model.layers.{index}.", meta, meta.is_moe_layer(index))


def _layer_from_hf(weights, p: str, meta: ModelMeta, moe: bool) -> Dict[str, torch.Tensor]:
    from megatron.convert.megatron_layout import mla_tensor_shapes

    h = meta.hidden_size
    out = {name: weights.get(p + name, (h,))
           for name in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    for name, shape in mla_tensor_shapes(meta).items():
        ours = name[len("self_attention."):]
        out[name] = weights.get(p + "self_attn." + ATTENTION_NAMES[ours], shape)
    if not moe:
        out["mlp.dense_h_to_4h.weight"], out["mlp.dense_4h_to_h.weight"] = _swiglu_from_hf(
            weights, p + "mlp.", meta.ffn_hidden_size, h)
        return out
    out["mlp.router.weight"] = weights.get(p + "mlp.gate.weight", (meta.num_experts, h))
    out["mlp.router.expert_bias"] = weights.get(p + "mlp.gate.e_score_correction_bias",
                                                (meta.num_experts,))
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        out[ours + "linear_fc1.weight"], out[ours + "linear_fc2.weight"] = _swiglu_from_hf(
            weights, f"{p}mlp.experts.{expert}.", meta.expert_ffn_size, h)
    shared = "mlp.shared_experts."
    out[shared + "linear_fc1.weight"], out[shared + "linear_fc2.weight"] = _swiglu_from_hf(
        weights, p + "mlp.shared_experts.", meta.moe_shared_expert_intermediate_size, h)
    return out


# Our MTP depth's own tensors (an ``mtp`` piece) -> theirs, after ``model.layers.{L + K}.``.
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "eh_proj.weight",
             "final_layernorm.weight": "shared_head.norm.weight"}
# The copies of the main model's tables each depth carries: theirs -> the main model's key.
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}
_LAYER = "transformer_layer."


def mtp_prefix(depth: int, meta: ModelMeta) -> str:
    return f"model.layers.{meta.num_layers + depth}."


def mtp_to_hf(depth: int, t: Dict[str, torch.Tensor], meta: ModelMeta,
              main: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """MTP depth ``depth`` as DeepSeek stores it; ``main`` holds the main model's HF
    ``model.embed_tokens.weight`` and ``lm_head.weight``, copied into the depth."""
    p = mtp_prefix(depth, meta)
    out = {p + theirs: t[ours] for ours, theirs in MTP_NAMES.items()}
    layer = {name[len(_LAYER):]: tensor for name, tensor in t.items() if name.startswith(_LAYER)}
    out.update(_layer_to_hf(p, layer, meta, moe=True))
    out.update({p + theirs: main[key].clone() for theirs, key in MTP_SHARED.items()})
    return out


def mtp_depths_in(weights, config: ConfigView, num_layers: int) -> int:
    """The MTP depths a folder holds: ``num_nextn_predict_layers`` when every depth's
    ``eh_proj`` is there, 0 when none is (transformers' own folders); partial is refused."""
    depths = config.get("num_nextn_predict_layers", 0) or 0
    found = [weights.has(f"model.layers.{num_layers + k}.eh_proj.weight") for k in range(depths)]
    if any(found) and not all(found):
        raise config.unsupported("num_nextn_predict_layers", depths,
                                 f"{sum(found)} (the depths whose eh_proj.weight the weights "
                                 "hold)")
    return depths if all(found) else 0


def mtp_from_hf(weights, depth: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{L + K}.*`` as one canonical ``mtp`` piece; the depth's copies of the
    embedding and output tables must equal the main model's (ours shares them)."""
    from megatron.convert.schema import ConversionError

    h, p = meta.hidden_size, mtp_prefix(depth, meta)
    out = {ours: weights.get(p + theirs, (h, 2 * h) if ours == "eh_proj.weight" else (h,))
           for ours, theirs in MTP_NAMES.items()}
    out.update({_LAYER + name: tensor for name, tensor in
                _layer_from_hf(weights, p, meta, moe=True).items()})
    rows = (meta.vocab_size, h)
    for theirs, key in MTP_SHARED.items():
        if key == "lm_head.weight" and not meta.untie_embeddings_and_output_weights:
            key = "model.embed_tokens.weight"
        if weights.has(p + theirs) and not torch.equal(weights.get(p + theirs, rows),
                                                      weights.get(key, rows)):
            raise ConversionError(f"{weights.folder}: {p + theirs} differs from {key}; the "
                                  "MTP layers here share the main model's tables")
    return out

"""Llama (``LlamaForCausalLM``, model_type ``llama``) to and from the canonical stream.

The models this architecture expresses exactly: rotary positions over the whole head
(``--rotary-percent 1``), pre-RMSNorm, SwiGLU, grouped-query attention, tied or untied embeddings,
and either no biases (``--disable-bias-linear``) or biases in every linear layer.

Layout differences:

- HF keeps separate ``q_proj`` ``[np hn, h]``, ``k_proj`` and ``v_proj`` ``[ng hn, h]``;
  Megatron's fused ``query_key_value`` rows are ordered per query group as
  ``[group heads' q; k; v]``. Query head ``j`` uses key/value head ``j // (np / ng)`` on both
  sides, so splitting each group's rows keeps the heads in order.
- ``gate_proj`` / ``up_proj`` are the two halves ``[gate; value]`` of ``dense_h_to_4h``.
- Both sides rotate channel pairs ``(i, i + hn/2)`` (rotate-half) by ``p * theta^(-2i/hn)``,
  so q/k rows need no permutation. ``--use-rope-scaling`` is transformers' ``llama3`` rope type
  and ``--position-embedding-type yarn`` its ``yarn`` type
  (:func:`megatron.convert.hf_common.rope_scaling_from_hf` maps the keys onto the flags).
"""

from typing import Dict, List, Optional

import torch

from megatron.convert.hf_common import (ConfigView, dtype_name, join_qkv,
                                         rope_parameters_to_hf, rope_scaling_from_hf,
                                         rope_settings, split_qkv)
from megatron.convert.schema import ModelMeta, fit_vocab_rows

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
# Rotary rescalings transformers computes as Megatron does: --use-rope-scaling (llama3) and
# --position-embedding-type yarn (read by megatron.convert.hf.family_for_meta).
ROPE_SCALING = True


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Llama cannot express, each naming its flag (empty: all fine)."""
    problems = []
    if meta.normalization != "RMSNorm":
        problems.append(f"--normalization {meta.normalization} (Llama uses RMSNorm)")
    if not meta.swiglu:
        problems.append("GeLU MLP without --swiglu (Llama's MLP is SwiGLU)")
    if meta.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {meta.rotary_percent} (Llama rotates the whole head)")
    if float(meta.rotary_base) != float(int(meta.rotary_base)):
        problems.append(f"--rotary-base {meta.rotary_base} (not an integer)")
    if meta.add_qkv_bias and not meta.add_bias_linear:
        problems.append("--add-qkv-bias without the other linear biases (Llama's "
                        "attention_bias covers q, k, v and o together)")
    if meta.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (Llama's residual "
                        "bypasses the norm)")
    if meta.hidden_size % meta.num_attention_heads != 0:
        problems.append(f"--hidden-size {meta.hidden_size} not divisible by "
                        f"--num-attention-heads {meta.num_attention_heads} (transformers "
                        "refuses such a Llama config)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Llama folder for ``meta``.

    The rotary base is written both as ``rope_theta`` (read by older transformers) and inside
    ``rope_parameters`` (newer ones); a rescaled rotary (llama3, yarn) also as ``rope_scaling``,
    the key older transformers and Llama 3.1's own files use.
    """
    source = meta.source_args or {}
    theta = float(meta.rotary_base)
    rope = rope_parameters_to_hf(meta)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": meta.vocab_size,
        "hidden_size": meta.hidden_size,
        "intermediate_size": meta.ffn_hidden_size,
        "num_hidden_layers": meta.num_layers,
        "num_attention_heads": meta.num_attention_heads,
        "num_key_value_heads": meta.num_query_groups,
        "head_dim": meta.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": meta.max_position_embeddings,
        "rms_norm_eps": meta.norm_epsilon,
        "rope_theta": theta,
        "rope_parameters": rope,
        **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),
        "attention_bias": bool(meta.add_bias_linear),
        "mlp_bias": bool(meta.add_bias_linear),
        "attention_dropout": source.get("attention_dropout", 0.0),
        "initializer_range": source.get("init_method_std", 0.02),
        "tie_word_embeddings": not meta.untie_embeddings_and_output_weights,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name(meta.params_dtype),
    }


# ---- canonical -> HF ---------------------------------------------------------------------------


def embeddings_to_hf(tensors: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """Word embeddings trimmed to the tokenizer's ``vocab_size`` rows (padding dropped)."""
    return {"model.embed_tokens.weight": fit_vocab_rows(tensors["word_embeddings"],
                                                        meta.vocab_size, meta.vocab_size)}


def attention_to_hf(p: str, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """A canonical layer's norms and attention under HF layer prefix ``p`` (shared with
    Mixtral, whose layers differ from Llama's only in the MLP)."""
    q, k, v = split_qkv(t["self_attention.query_key_value.weight"], meta)
    out = {
        p + "input_layernorm.weight": t["input_layernorm.weight"],
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": t["self_attention.dense.weight"],
        p + "post_attention_layernorm.weight": t["post_attention_layernorm.weight"],
    }
    if meta.add_bias_linear:
        qb, kb, vb = split_qkv(t["self_attention.query_key_value.bias"], meta)
        out.update({
            p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
            p + "self_attn.v_proj.bias": vb,
            p + "self_attn.o_proj.bias": t["self_attention.dense.bias"],
        })
    return out


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    p = f"model.layers.{index}."
    ffn = meta.ffn_hidden_size
    fc = t["mlp.dense_h_to_4h.weight"]                                   # [2 ffn, h]
    out = attention_to_hf(p, t, meta)
    out.update({
        p + "mlp.gate_proj.weight": fc[:ffn],
        p + "mlp.up_proj.weight": fc[ffn:],
        p + "mlp.down_proj.weight": t["mlp.dense_4h_to_h.weight"],
    })
    if meta.add_bias_linear:
        fc_bias = t["mlp.dense_h_to_4h.bias"]
        out.update({
            p + "mlp.gate_proj.bias": fc_bias[:ffn], p + "mlp.up_proj.bias": fc_bias[ffn:],
            p + "mlp.down_proj.bias": t["mlp.dense_4h_to_h.bias"],
        })
    return out


def final_norm_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"model.norm.weight": t["weight"]}


def output_layer_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"lm_head.weight": fit_vocab_rows(t["weight"], meta.vocab_size, meta.vocab_size)}


# ---- HF -> canonical ---------------------------------------------------------------------------


def _rope_theta(config: ConfigView) -> int:
    """The rotary base; only rotary embeddings over the whole head are accepted."""
    theta, factor = rope_settings(config, "rope_theta", "partial_rotary_factor", 1.0,
                                  scaled=("llama3", "yarn"))
    if factor != 1.0:
        raise config.unsupported("partial_rotary_factor", factor, "1.0")
    return theta


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Llama config.json describes; refuses settings our model cannot compute."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise config.unsupported("hidden_act", act, "'silu' (SwiGLU)")
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise config.unsupported("attention_bias / mlp_bias", (attention_bias, mlp_bias),
                                 "equal values (--disable-bias-linear covers both)")
    hidden = config.need("hidden_size")
    heads = config.need("num_attention_heads")
    positions = config.need("max_position_embeddings")
    vocab = config.need("vocab_size")
    return ModelMeta(
        num_layers=config.need("num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=config.need("intermediate_size"), num_attention_heads=heads,
        num_query_groups=config.need("num_key_value_heads", default=heads),
        kv_channels=config.need("head_dim", default=hidden // heads),
        max_position_embeddings=positions, vocab_size=vocab, padded_vocab_size=vocab,
        rotary_percent=1.0, rotary_base=_rope_theta(config),
        **rope_scaling_from_hf(config, positions),
        normalization="RMSNorm", norm_epsilon=config.need("rms_norm_eps", float, default=1e-6),
        swiglu=True, add_bias_linear=attention_bias,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        params_dtype=config.params_dtype(), seq_length=positions)


def embeddings_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"word_embeddings": weights.get("model.embed_tokens.weight",
                                           (meta.vocab_size, meta.hidden_size))}


def attention_from_hf(get, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """A layer's norms and attention in canonical form; ``get(name, shape)`` reads one tensor
    of the HF layer (shared with Mixtral)."""
    h, hn = meta.hidden_size, meta.kv_channels
    q_rows, kv_rows = meta.num_attention_heads * hn, meta.num_query_groups * hn
    out = {
        "input_layernorm.weight": get("input_layernorm.weight", (h,)),
        "self_attention.query_key_value.weight": join_qkv(
            get("self_attn.q_proj.weight", (q_rows, h)),
            get("self_attn.k_proj.weight", (kv_rows, h)),
            get("self_attn.v_proj.weight", (kv_rows, h)), meta),
        "self_attention.dense.weight": get("self_attn.o_proj.weight", (h, q_rows)),
        "post_attention_layernorm.weight": get("post_attention_layernorm.weight", (h,)),
    }
    if meta.add_bias_linear:
        out["self_attention.query_key_value.bias"] = join_qkv(
            get("self_attn.q_proj.bias", (q_rows,)), get("self_attn.k_proj.bias", (kv_rows,)),
            get("self_attn.v_proj.bias", (kv_rows,)), meta)
        out["self_attention.dense.bias"] = get("self_attn.o_proj.bias", (h,))
    return out


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, ffn = meta.hidden_size, meta.ffn_hidden_size
    p = f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = attention_from_hf(get, meta)
    out["mlp.dense_h_to_4h.weight"] = torch.cat([get("mlp.gate_proj.weight", (ffn, h)),
                                                 get("mlp.up_proj.weight", (ffn, h))])
    out["mlp.dense_4h_to_h.weight"] = get("mlp.down_proj.weight", (h, ffn))
    if meta.add_bias_linear:
        out["mlp.dense_h_to_4h.bias"] = torch.cat([get("mlp.gate_proj.bias", (ffn,)),
                                                   get("mlp.up_proj.bias", (ffn,))])
        out["mlp.dense_4h_to_h.bias"] = get("mlp.down_proj.bias", (h,))
    return out


def final_norm_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"weight": weights.get("model.norm.weight", (meta.hidden_size,))}


def output_layer_from_hf(weights, meta: ModelMeta) -> Optional[Dict[str, torch.Tensor]]:
    if not meta.untie_embeddings_and_output_weights:
        return None
    return {"weight": weights.get("lm_head.weight", (meta.vocab_size, meta.hidden_size))}

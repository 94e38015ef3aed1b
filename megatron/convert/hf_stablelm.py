"""StableLM (``StableLmForCausalLM``, model_type ``stablelm``) to and from the canonical stream.

The models this architecture expresses exactly: rotary positions over all or the first
``--rotary-percent`` of each head, pre-LayerNorm with the sequential residual
(``use_parallel_residual: false``), SwiGLU, grouped-query attention, tied or untied embeddings,
no linear biases (``--disable-bias-linear``) except, optionally, those of q, k and v
(``--add-qkv-bias``: ``use_qkv_bias``). StableLM's ``o_proj`` and MLP never have biases, so a
model with ``--add-bias-linear`` (the default) is refused.

Layout differences:

- q / k / v are split from the fused ``query_key_value`` per query group, as for Llama
  (:func:`megatron.convert.hf_common.split_qkv`); ``gate_proj`` / ``up_proj`` are the halves
  ``[gate; value]`` of ``dense_h_to_4h``.
- Partial rotary: both sides rotate channel pairs ``(i, i + d/2)`` of the first
  ``d = int(hn * rotary_percent)`` channels (rotate-half) by ``p * theta^(-2i/d)`` and pass the
  rest through.
"""

from typing import Dict, List, Optional

import torch

from megatron.convert.hf_common import (ConfigView, dtype_name, join_qkv, rope_settings,
                                         split_qkv)
from megatron.convert.schema import ConversionError, ModelMeta, fit_vocab_rows

MODEL_TYPE = "stablelm"
ARCHITECTURE = "StableLmForCausalLM"


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model StableLM cannot express, each naming its flag (empty: all
    fine)."""
    problems = []
    if meta.normalization != "LayerNorm":
        problems.append(f"--normalization {meta.normalization} (StableLM uses LayerNorm)")
    if not meta.swiglu:
        problems.append("GeLU MLP without --swiglu (StableLM's MLP is SwiGLU)")
    if meta.add_bias_linear:
        problems.append("linear biases without --disable-bias-linear (StableLM's o_proj and MLP "
                        "have none; only q, k, v biases, --add-qkv-bias, can be written)")
    if meta.kv_channels * meta.num_attention_heads != meta.hidden_size:
        problems.append(f"--kv-channels {meta.kv_channels} x --num-attention-heads "
                        f"{meta.num_attention_heads} != --hidden-size {meta.hidden_size} "
                        "(StableLM's head size is hidden / heads)")
    if meta.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (StableLM's residual "
                        "bypasses the layer norm)")
    if float(meta.rotary_base) != float(int(meta.rotary_base)):
        problems.append(f"--rotary-base {meta.rotary_base} (not an integer)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the StableLM folder for ``meta``.

    The rotary settings are written both as ``rope_theta`` / ``partial_rotary_factor`` (read by
    older transformers) and inside ``rope_parameters`` (newer ones); the factor must be written
    even for 1.0, since transformers' default is 0.25.
    """
    source = meta.source_args or {}
    theta, percent = float(meta.rotary_base), float(meta.rotary_percent)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": meta.vocab_size,
        "hidden_size": meta.hidden_size,
        "intermediate_size": meta.ffn_hidden_size,
        "num_hidden_layers": meta.num_layers,
        "num_attention_heads": meta.num_attention_heads,
        "num_key_value_heads": meta.num_query_groups,
        "hidden_act": "silu",
        "max_position_embeddings": meta.max_position_embeddings,
        "layer_norm_eps": meta.norm_epsilon,
        "rope_theta": theta,
        "partial_rotary_factor": percent,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                            "partial_rotary_factor": percent},
        "use_qkv_bias": bool(meta.add_qkv_bias),
        "qk_layernorm": False,
        "use_parallel_residual": False,
        "hidden_dropout": source.get("hidden_dropout", 0.0),
        "attention_dropout": source.get("attention_dropout", 0.0),
        "initializer_range": source.get("init_method_std", 0.02),
        "tie_word_embeddings": not meta.untie_embeddings_and_output_weights,
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


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    p = f"model.layers.{index}."
    ffn = meta.ffn_hidden_size
    q, k, v = split_qkv(t["self_attention.query_key_value.weight"], meta)
    fc = t["mlp.dense_h_to_4h.weight"]                                   # [2 ffn, h]
    out = {
        p + "input_layernorm.weight": t["input_layernorm.weight"],
        p + "input_layernorm.bias": t["input_layernorm.bias"],
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": t["self_attention.dense.weight"],
        p + "post_attention_layernorm.weight": t["post_attention_layernorm.weight"],
        p + "post_attention_layernorm.bias": t["post_attention_layernorm.bias"],
        p + "mlp.gate_proj.weight": fc[:ffn],
        p + "mlp.up_proj.weight": fc[ffn:],
        p + "mlp.down_proj.weight": t["mlp.dense_4h_to_h.weight"],
    }
    if meta.add_qkv_bias:
        qb, kb, vb = split_qkv(t["self_attention.query_key_value.bias"], meta)
        out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb})
    return out


def final_norm_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"model.norm.weight": t["weight"], "model.norm.bias": t["bias"]}


def output_layer_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"lm_head.weight": fit_vocab_rows(t["weight"], meta.vocab_size, meta.vocab_size)}


# ---- HF -> canonical ---------------------------------------------------------------------------


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a StableLM config.json describes; refuses settings our model cannot compute."""
    for key, allowed, why in (
            ("hidden_act", "silu", "'silu' (SwiGLU)"),
            ("use_parallel_residual", False, "false (this project's layers add attention, then "
                                             "the MLP)"),
            ("qk_layernorm", False, "false (StableLM's per-head q/k norms have no equivalent "
                                    "here)")):
        value = config.get(key, allowed)
        if value != allowed or type(value) is not type(allowed):
            raise config.unsupported(key, value, why)
    hidden = config.need("hidden_size")
    heads = config.need("num_attention_heads")
    if hidden % heads != 0:
        raise ConversionError(f"{config.path}: hidden_size {hidden} is not divisible by "
                              f"num_attention_heads {heads}")
    base, percent = rope_settings(config, "rope_theta", "partial_rotary_factor", 0.25)
    positions = config.need("max_position_embeddings")
    vocab = config.need("vocab_size")
    return ModelMeta(
        num_layers=config.need("num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=config.need("intermediate_size"), num_attention_heads=heads,
        num_query_groups=config.need("num_key_value_heads"), kv_channels=hidden // heads,
        max_position_embeddings=positions, vocab_size=vocab, padded_vocab_size=vocab,
        position_embedding_type="rope", rotary_percent=percent, rotary_base=base,
        normalization="LayerNorm", norm_epsilon=config.need("layer_norm_eps", float, default=1e-5),
        swiglu=True, add_bias_linear=False, add_qkv_bias=bool(config.get("use_qkv_bias", False)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        params_dtype=config.params_dtype(), seq_length=positions)


def embeddings_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"word_embeddings": weights.get("model.embed_tokens.weight",
                                           (meta.vocab_size, meta.hidden_size))}


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, hn, ffn = meta.hidden_size, meta.kv_channels, meta.ffn_hidden_size
    q_rows, kv_rows = meta.num_attention_heads * hn, meta.num_query_groups * hn
    p = f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = {
        "input_layernorm.weight": get("input_layernorm.weight", (h,)),
        "input_layernorm.bias": get("input_layernorm.bias", (h,)),
        "self_attention.query_key_value.weight": join_qkv(
            get("self_attn.q_proj.weight", (q_rows, h)),
            get("self_attn.k_proj.weight", (kv_rows, h)),
            get("self_attn.v_proj.weight", (kv_rows, h)), meta),
        "self_attention.dense.weight": get("self_attn.o_proj.weight", (h, q_rows)),
        "post_attention_layernorm.weight": get("post_attention_layernorm.weight", (h,)),
        "post_attention_layernorm.bias": get("post_attention_layernorm.bias", (h,)),
        "mlp.dense_h_to_4h.weight": torch.cat([get("mlp.gate_proj.weight", (ffn, h)),
                                               get("mlp.up_proj.weight", (ffn, h))]),
        "mlp.dense_4h_to_h.weight": get("mlp.down_proj.weight", (h, ffn)),
    }
    if meta.add_qkv_bias:
        out["self_attention.query_key_value.bias"] = join_qkv(
            get("self_attn.q_proj.bias", (q_rows,)), get("self_attn.k_proj.bias", (kv_rows,)),
            get("self_attn.v_proj.bias", (kv_rows,)), meta)
    return out


def final_norm_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    h = meta.hidden_size
    return {"weight": weights.get("model.norm.weight", (h,)),
            "bias": weights.get("model.norm.bias", (h,))}


def output_layer_from_hf(weights, meta: ModelMeta) -> Optional[Dict[str, torch.Tensor]]:
    if not meta.untie_embeddings_and_output_weights:
        return None
    return {"weight": weights.get("lm_head.weight", (meta.vocab_size, meta.hidden_size))}

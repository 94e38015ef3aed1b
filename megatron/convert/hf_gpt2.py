"""GPT-2 (``GPT2LMHeadModel``, model_type ``gpt2``) to and from the canonical stream.

The models this architecture expresses exactly: learned absolute positions, pre-LayerNorm, GeLU,
biases everywhere, tied input and output embeddings, one key/value head per query head.

Layout differences:

- GPT-2's linear layers are ``Conv1D`` with weights ``[in, out]``, the transpose of Megatron's
  ``[out, in]``.
- Its fused ``c_attn`` output is ``[q | k | v]``, each ``[np, hn]``; Megatron's
  ``query_key_value`` rows are ordered per head as ``[np, 3, hn]``.
- GeLU: the tanh form with or without ``--openai-gelu`` is ``gelu_new`` / ``gelu_pytorch_tanh``
  (see :data:`megatron.convert.hf_common.ACTIVATION_BY_OPENAI_GELU`); HF's ``gelu`` (erf) is
  another function and is refused on loading.
"""

from typing import Dict, List, Optional

import torch

from megatron.convert.hf_common import (ACTIVATION_BY_OPENAI_GELU, OPENAI_GELU_BY_ACTIVATION,
                                         ConfigView, dtype_name)
from megatron.convert.schema import ConversionError, ModelMeta, fit_vocab_rows

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model GPT-2 cannot express, each naming its flag (empty: all fine)."""
    problems = []
    if meta.normalization != "LayerNorm":
        problems.append(f"--normalization {meta.normalization} (GPT-2 uses LayerNorm)")
    if meta.swiglu:
        problems.append("--swiglu (GPT-2's MLP is GeLU)")
    if meta.untie_embeddings_and_output_weights:
        problems.append("--untie-embeddings-and-output-weights (GPT-2 ties lm_head to wte)")
    if not meta.add_bias_linear:
        problems.append("--disable-bias-linear (GPT-2 has biases in every linear layer)")
    if meta.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (GPT-2's residual "
                        "bypasses the layer norm)")
    if meta.group_query_attention:
        problems.append(f"--group-query-attention --num-query-groups {meta.num_query_groups} "
                        f"with {meta.num_attention_heads} heads (GPT-2 has one key/value head "
                        "per query head)")
    if meta.kv_channels * meta.num_attention_heads != meta.hidden_size:
        problems.append(f"--kv-channels {meta.kv_channels} x --num-attention-heads "
                        f"{meta.num_attention_heads} != --hidden-size {meta.hidden_size} "
                        "(GPT-2's head size is hidden / heads)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the GPT-2 folder for ``meta``."""
    source = meta.source_args or {}
    hidden_dropout = source.get("hidden_dropout", 0.1)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": meta.vocab_size,
        "n_positions": meta.max_position_embeddings,
        "n_embd": meta.hidden_size,
        "n_layer": meta.num_layers,
        "n_head": meta.num_attention_heads,
        "n_inner": meta.ffn_hidden_size,
        "activation_function": ACTIVATION_BY_OPENAI_GELU[bool(meta.openai_gelu)],
        "layer_norm_epsilon": meta.norm_epsilon,
        "resid_pdrop": hidden_dropout,
        "embd_pdrop": hidden_dropout,
        "attn_pdrop": source.get("attention_dropout", 0.1),
        "initializer_range": source.get("init_method_std", 0.02),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name(meta.params_dtype),
    }


# ---- canonical -> HF ---------------------------------------------------------------------------


def embeddings_to_hf(tensors: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """Word embeddings trimmed to the tokenizer's ``vocab_size`` rows (padding dropped)."""
    return {
        "transformer.wte.weight": fit_vocab_rows(tensors["word_embeddings"], meta.vocab_size,
                                                 meta.vocab_size),
        "transformer.wpe.weight": tensors["position_embeddings"],
    }


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``transformer.h.{index}.*``."""
    heads, hn, h = meta.num_attention_heads, meta.kv_channels, meta.hidden_size
    qkv = t["self_attention.query_key_value.weight"].view(heads, 3, hn, h)
    qkv = qkv.transpose(0, 1).reshape(3 * heads * hn, h)                  # [q | k | v] rows
    qkv_bias = t["self_attention.query_key_value.bias"].view(heads, 3, hn)
    p = f"transformer.h.{index}."
    return {
        p + "ln_1.weight": t["input_layernorm.weight"],
        p + "ln_1.bias": t["input_layernorm.bias"],
        p + "attn.c_attn.weight": qkv.t(),                                  # [h, 3h]
        p + "attn.c_attn.bias": qkv_bias.transpose(0, 1).reshape(-1),
        p + "attn.c_proj.weight": t["self_attention.dense.weight"].t(),     # [h, h]
        p + "attn.c_proj.bias": t["self_attention.dense.bias"],
        p + "ln_2.weight": t["post_attention_layernorm.weight"],
        p + "ln_2.bias": t["post_attention_layernorm.bias"],
        p + "mlp.c_fc.weight": t["mlp.dense_h_to_4h.weight"].t(),           # [h, ffn]
        p + "mlp.c_fc.bias": t["mlp.dense_h_to_4h.bias"],
        p + "mlp.c_proj.weight": t["mlp.dense_4h_to_h.weight"].t(),         # [ffn, h]
        p + "mlp.c_proj.bias": t["mlp.dense_4h_to_h.bias"],
    }


def final_norm_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"transformer.ln_f.weight": t["weight"], "transformer.ln_f.bias": t["bias"]}


def output_layer_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    raise ConversionError("GPT-2 has no separate output layer "
                          "(--untie-embeddings-and-output-weights)")


# ---- HF -> canonical ---------------------------------------------------------------------------


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a GPT-2 config.json describes; refuses settings our model cannot compute."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in OPENAI_GELU_BY_ACTIVATION:
        raise config.unsupported("activation_function", activation,
                                 "the tanh-approximated GeLU ("
                                 + ", ".join(OPENAI_GELU_BY_ACTIVATION) + ")")
    for key, allowed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("add_cross_attention", False)):
        value = config.get(key, allowed)
        if value != allowed:
            raise config.unsupported(key, value, repr(allowed))
    hidden = config.need("n_embd")
    heads = config.need("n_head")
    if hidden % heads != 0:
        raise ConversionError(f"{config.path}: n_embd {hidden} is not divisible by "
                              f"n_head {heads}")
    positions = config.need("n_positions")
    vocab = config.need("vocab_size")
    return ModelMeta(
        num_layers=config.need("n_layer"), hidden_size=hidden,
        ffn_hidden_size=config.need("n_inner", default=4 * hidden),
        num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads,
        max_position_embeddings=positions, vocab_size=vocab, padded_vocab_size=vocab,
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        norm_epsilon=config.need("layer_norm_epsilon", float, default=1e-5), swiglu=False,
        openai_gelu=OPENAI_GELU_BY_ACTIVATION[activation], add_bias_linear=True,
        untie_embeddings_and_output_weights=False, params_dtype=config.params_dtype(),
        seq_length=positions)


def _prefix(weights) -> str:
    """``transformer.`` for GPT2LMHeadModel files; none for the original GPT2Model files."""
    return "transformer." if weights.has("transformer.wte.weight") else ""


def embeddings_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    p, h = _prefix(weights), meta.hidden_size
    return {"word_embeddings": weights.get(p + "wte.weight", (meta.vocab_size, h)),
            "position_embeddings": weights.get(p + "wpe.weight",
                                               (meta.max_position_embeddings, h))}


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``h.{index}.*`` as one canonical layer."""
    h, heads, hn, ffn = (meta.hidden_size, meta.num_attention_heads, meta.kv_channels,
                         meta.ffn_hidden_size)
    p = f"{_prefix(weights)}h.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    qkv = get("attn.c_attn.weight", (h, 3 * h)).t().reshape(3, heads, hn, h)   # [3, np, hn, h]
    qkv_bias = get("attn.c_attn.bias", (3 * h,)).view(3, heads, hn)
    return {
        "input_layernorm.weight": get("ln_1.weight", (h,)),
        "input_layernorm.bias": get("ln_1.bias", (h,)),
        "self_attention.query_key_value.weight": qkv.transpose(0, 1).reshape(3 * h, h),
        "self_attention.query_key_value.bias": qkv_bias.transpose(0, 1).reshape(3 * h),
        "self_attention.dense.weight": get("attn.c_proj.weight", (h, h)).t(),
        "self_attention.dense.bias": get("attn.c_proj.bias", (h,)),
        "post_attention_layernorm.weight": get("ln_2.weight", (h,)),
        "post_attention_layernorm.bias": get("ln_2.bias", (h,)),
        "mlp.dense_h_to_4h.weight": get("mlp.c_fc.weight", (h, ffn)).t(),
        "mlp.dense_h_to_4h.bias": get("mlp.c_fc.bias", (ffn,)),
        "mlp.dense_4h_to_h.weight": get("mlp.c_proj.weight", (ffn, h)).t(),
        "mlp.dense_4h_to_h.bias": get("mlp.c_proj.bias", (h,)),
    }


def final_norm_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    p, h = _prefix(weights), meta.hidden_size
    return {"weight": weights.get(p + "ln_f.weight", (h,)),
            "bias": weights.get(p + "ln_f.bias", (h,))}


def output_layer_from_hf(weights, meta: ModelMeta) -> Optional[Dict[str, torch.Tensor]]:
    return None          # tied: lm_head is wte

"""GPT-NeoX (``GPTNeoXForCausalLM``, model_type ``gpt_neox``) to and from the canonical stream.

The models this architecture expresses exactly: rotary positions over all or the first
``--rotary-percent`` of each head, pre-LayerNorm with the sequential residual
(``use_parallel_residual: false``), the tanh GeLU MLP (no ``--swiglu``), one key/value head per
query head, tied or untied embeddings, and biases everywhere or (``--disable-bias-linear``) none.

Layout differences:

- The fused ``query_key_value`` rows are ordered per head as ``[np, 3, hn]`` on both sides
  (GPT-NeoX views its output as ``[.., np, 3 hn]`` and chunks the last dim into q, k, v), and
  both use ``nn.Linear`` ``[out, in]`` weights, so every tensor is copied as it is.
- Partial rotary: both sides rotate channel pairs ``(i, i + d/2)`` of the first
  ``d = int(hn * rotary_percent)`` channels (rotate-half) by ``p * theta^(-2i/d)`` and pass the
  rest through.
- ``attention_bias`` switches the biases of ``query_key_value`` and ``dense`` only; GPT-NeoX's
  MLP always has biases. A model without biases is written with zero MLP biases (adding zero
  changes nothing), and reading ``attention_bias: false`` requires them to be zero.
- The untied output layer is written as ``embed_out.weight``, the name GPT-NeoX checkpoints use
  (newer transformers rename it ``lm_head`` on loading); both names are read.
- GeLU: see :data:`megatron.convert.hf_common.ACTIVATION_BY_OPENAI_GELU`. GPT-NeoX's default
  ``hidden_act`` is the erf ``gelu``, another function, so it is always written and the erf
  form is refused on loading.
"""

from typing import Dict, List, Optional

import torch

from megatron.convert.hf_common import (ACTIVATION_BY_OPENAI_GELU, OPENAI_GELU_BY_ACTIVATION,
                                         ConfigView, dtype_name, rope_settings)
from megatron.convert.schema import ConversionError, ModelMeta, fit_vocab_rows

MODEL_TYPE = "gpt_neox"
ARCHITECTURE = "GPTNeoXForCausalLM"
_OUTPUT_NAMES = ("embed_out.weight", "lm_head.weight")


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model GPT-NeoX cannot express, each naming its flag (empty: all
    fine)."""
    problems = []
    if meta.normalization != "LayerNorm":
        problems.append(f"--normalization {meta.normalization} (GPT-NeoX uses LayerNorm)")
    if meta.swiglu:
        problems.append("--swiglu (GPT-NeoX's MLP is GeLU)")
    if meta.group_query_attention:
        problems.append(f"--group-query-attention --num-query-groups {meta.num_query_groups} "
                        f"with {meta.num_attention_heads} heads (GPT-NeoX has one key/value "
                        "head per query head)")
    if meta.kv_channels * meta.num_attention_heads != meta.hidden_size:
        problems.append(f"--kv-channels {meta.kv_channels} x --num-attention-heads "
                        f"{meta.num_attention_heads} != --hidden-size {meta.hidden_size} "
                        "(GPT-NeoX's head size is hidden / heads)")
    if meta.add_qkv_bias and not meta.add_bias_linear:
        problems.append("--add-qkv-bias without the other linear biases (GPT-NeoX's "
                        "attention_bias covers query_key_value and dense together)")
    if meta.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (GPT-NeoX's residual "
                        "bypasses the layer norm)")
    if float(meta.rotary_base) != float(int(meta.rotary_base)):
        problems.append(f"--rotary-base {meta.rotary_base} (not an integer)")
    return problems


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the GPT-NeoX folder for ``meta``.

    The rotary settings are written both as ``rotary_emb_base`` / ``rotary_pct`` (read by older
    transformers) and inside ``rope_parameters`` (newer ones); ``rotary_pct`` must be written
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
        "hidden_act": ACTIVATION_BY_OPENAI_GELU[bool(meta.openai_gelu)],
        "max_position_embeddings": meta.max_position_embeddings,
        "layer_norm_eps": meta.norm_epsilon,
        "rotary_emb_base": theta,
        "rotary_pct": percent,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                            "partial_rotary_factor": percent},
        "use_parallel_residual": False,
        "attention_bias": bool(meta.add_bias_linear),
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
    return {"gpt_neox.embed_in.weight": fit_vocab_rows(tensors["word_embeddings"],
                                                       meta.vocab_size, meta.vocab_size)}


# canonical name -> GPT-NeoX name inside ``gpt_neox.layers.{i}.``; the biases are ".bias".
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "attention.query_key_value",
    "self_attention.dense": "attention.dense",
    "post_attention_layernorm": "post_attention_layernorm",
    "mlp.dense_h_to_4h": "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h": "mlp.dense_4h_to_h",
}
_NORMS = ("input_layernorm", "post_attention_layernorm")
_MLP = ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``gpt_neox.layers.{index}.*``."""
    p = f"gpt_neox.layers.{index}."
    out = {}
    for ours, theirs in _LAYER_NAMES.items():
        out[p + theirs + ".weight"] = t[ours + ".weight"]
        if ours in _NORMS or meta.add_bias_linear:
            out[p + theirs + ".bias"] = t[ours + ".bias"]
        elif ours in _MLP:
            out[p + theirs + ".bias"] = t[ours + ".weight"].new_zeros(t[ours + ".weight"].size(0))
    return out


def final_norm_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"gpt_neox.final_layer_norm.weight": t["weight"],
            "gpt_neox.final_layer_norm.bias": t["bias"]}


def output_layer_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {_OUTPUT_NAMES[0]: fit_vocab_rows(t["weight"], meta.vocab_size, meta.vocab_size)}


# ---- HF -> canonical ---------------------------------------------------------------------------


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a GPT-NeoX config.json describes; refuses settings our model cannot compute."""
    activation = config.get("hidden_act", "gelu")
    if activation not in OPENAI_GELU_BY_ACTIVATION:
        raise config.unsupported("hidden_act", activation, "the tanh-approximated GeLU ("
                                 + ", ".join(OPENAI_GELU_BY_ACTIVATION) + ")")
    parallel = config.get("use_parallel_residual", True)
    if parallel is not False:
        raise config.unsupported("use_parallel_residual", parallel,
                                 "false (this project's layers add attention, then the MLP)")
    hidden = config.need("hidden_size")
    heads = config.need("num_attention_heads")
    if hidden % heads != 0:
        raise ConversionError(f"{config.path}: hidden_size {hidden} is not divisible by "
                              f"num_attention_heads {heads}")
    base, percent = rope_settings(config, "rotary_emb_base", "rotary_pct", 0.25)
    positions = config.need("max_position_embeddings")
    vocab = config.need("vocab_size")
    return ModelMeta(
        num_layers=config.need("num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=config.need("intermediate_size"), num_attention_heads=heads,
        num_query_groups=heads, kv_channels=hidden // heads,
        max_position_embeddings=positions, vocab_size=vocab, padded_vocab_size=vocab,
        position_embedding_type="rope", rotary_percent=percent, rotary_base=base,
        normalization="LayerNorm", norm_epsilon=config.need("layer_norm_eps", float, default=1e-5),
        swiglu=False, openai_gelu=OPENAI_GELU_BY_ACTIVATION[activation],
        add_bias_linear=bool(config.get("attention_bias", True)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        params_dtype=config.params_dtype(), seq_length=positions)


def embeddings_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    return {"word_embeddings": weights.get("gpt_neox.embed_in.weight",
                                           (meta.vocab_size, meta.hidden_size))}


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``gpt_neox.layers.{index}.*`` as one canonical layer."""
    h, ffn = meta.hidden_size, meta.ffn_hidden_size
    out_dim = {"input_layernorm": h, "self_attention.query_key_value": 3 * h,
               "self_attention.dense": h, "post_attention_layernorm": h,
               "mlp.dense_h_to_4h": ffn, "mlp.dense_4h_to_h": h}
    in_dim = {"self_attention.query_key_value": h, "self_attention.dense": h,
              "mlp.dense_h_to_4h": h, "mlp.dense_4h_to_h": ffn}
    p = f"gpt_neox.layers.{index}."
    out = {}
    for ours, theirs in _LAYER_NAMES.items():
        rows = out_dim[ours]
        shape = (rows,) if ours in _NORMS else (rows, in_dim[ours])
        out[ours + ".weight"] = weights.get(p + theirs + ".weight", shape)
        if ours in _NORMS or meta.add_bias_linear:
            out[ours + ".bias"] = weights.get(p + theirs + ".bias", (rows,))
        elif ours in _MLP:
            bias = weights.get(p + theirs + ".bias", (rows,))
            if bias.any():
                raise ConversionError(
                    f"{weights.folder}: {p + theirs}.bias is not zero while config.json has "
                    "'attention_bias': false; our model has MLP biases only together with "
                    "attention biases (--disable-bias-linear covers both)")
    return out


def final_norm_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    h = meta.hidden_size
    return {"weight": weights.get("gpt_neox.final_layer_norm.weight", (h,)),
            "bias": weights.get("gpt_neox.final_layer_norm.bias", (h,))}


def output_layer_from_hf(weights, meta: ModelMeta) -> Optional[Dict[str, torch.Tensor]]:
    if not meta.untie_embeddings_and_output_weights:
        return None
    name = next((n for n in _OUTPUT_NAMES if weights.has(n)), _OUTPUT_NAMES[0])
    return {"weight": weights.get(name, (meta.vocab_size, meta.hidden_size))}

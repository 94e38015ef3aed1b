"""gpt-oss (``GptOssForCausalLM``, model_type ``gpt_oss``) to and from the canonical stream.

A gpt-oss layer is a Llama-style layer (rotary positions over the whole head, pre-RMSNorm,
grouped-query attention) with biases on q, k, v and o, a learned attention sink per head and a
mixture of experts on every layer. In our flags: ``--softmax-type learnable`` (the sinks are
``self_attn.sinks`` ``[heads]`` = our ``self_attention.core_attention.softmax_offset``),
``--add-bias-linear`` (attention, router and expert biases), ``--quick-geglu
--glu-linear-offset 1 --activation-func-clamp-value swiglu_limit`` (each expert computes
``quick_gelu(min(gate, L)) * (clamp(linear, -L, L) + 1)``; transformers' ``swiglu_alpha`` must be
the quick GeLU's 1.702), and alternating windows: ``layer_types`` names each layer
``sliding_attention`` (our window ``--window-size W-1,0`` for ``sliding_window`` W) or
``full_attention``, which is ``--window-attn-skip-freq`` as one 1 / 0 per layer.

Routing: ``mlp.router.weight`` ``[E, h]`` and ``mlp.router.bias`` ``[E]`` are ours; transformers
takes the top-k logits and a softmax over them, our default router.

Experts are stored fused over the expert axis and transposed (``x @ W``):
``mlp.experts.gate_up_proj`` ``[E, h, 2 f]`` holds gate and linear columns interleaved (column
``2j`` is gate unit j, ``2j + 1`` its linear unit), ``gate_up_proj_bias`` ``[E, 2 f]`` likewise;
``down_proj`` ``[E, f, h]`` and ``down_proj_bias`` ``[E, h]``. Ours are per expert:
``linear_fc1`` ``[2 f, h]`` = ``[gate; linear]`` and ``linear_fc2`` ``[h, f]``.
"""

from typing import Dict, List, Optional, Tuple

import torch

from megatron.convert import hf_llama, hf_mistral, hf_mixtral
from megatron.convert.hf_common import (ConfigView, dtype_name, rope_parameters_to_hf,
                                         rope_scaling_from_hf)
from megatron.convert.schema import ConversionError, ModelMeta

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
ROPE_SCALING = True
QUICK_GELU_ALPHA = 1.702   # the quick GeLU's fixed factor (--quick-geglu)
SLIDING, FULL = "sliding_attention", "full_attention"
_SINKS = "self_attention.core_attention.softmax_offset"

embeddings_to_hf = hf_llama.embeddings_to_hf
final_norm_to_hf = hf_llama.final_norm_to_hf
output_layer_to_hf = hf_llama.output_layer_to_hf
embeddings_from_hf = hf_llama.embeddings_from_hf
final_norm_from_hf = hf_llama.final_norm_from_hf
output_layer_from_hf = hf_llama.output_layer_from_hf

# Mixtral's objections that gpt-oss lifts: its quick GeGLU, its biases, its per-layer windows,
# its YaRN rotary.
_LIFTED = ("GeLU MLP without --swiglu", "linear biases", "--window-attn-skip-freq",
           "--position-embedding-type yarn")


def is_gpt_oss(meta: ModelMeta) -> bool:
    """Whether ``meta``'s model is to be written as gpt-oss (an MoE model with quick GeGLU)."""
    return bool(meta.num_experts) and meta.quick_geglu


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model gpt-oss cannot express, each naming its flag."""
    problems = [p.replace("Mixtral", "GptOss") for p in hf_mixtral.unsupported_features(meta)
                if not p.startswith(_LIFTED)]
    if not meta.quick_geglu:
        problems.append("no --quick-geglu (gpt-oss's experts are quick GeGLU)")
    if meta.glu_linear_offset != 1.0:
        problems.append(f"--glu-linear-offset {meta.glu_linear_offset} (gpt-oss adds 1)")
    if meta.activation_func_clamp_value is None:
        problems.append("no --activation-func-clamp-value (gpt-oss clamps, swiglu_limit)")
    if not meta.add_bias_linear:
        problems.append("--disable-bias-linear (gpt-oss has attention, router and expert "
                        "biases)")
    if meta.softmax_type != "learnable":
        problems.append(f"--softmax-type {meta.softmax_type} (gpt-oss has learned attention "
                        "sinks: --softmax-type learnable)")
    if meta.qk_layernorm:
        problems.append("--qk-layernorm (gpt-oss has no query/key norms)")
    return problems


def layer_types(meta: ModelMeta) -> List[str]:
    """config.json's ``layer_types``: which layers look through the window."""
    layers = range(1, meta.num_layers + 1)
    if not hf_mistral.windowed(meta):
        return [FULL for _ in layers]
    freq = meta.window_attn_skip_freq
    if freq is None:
        return [SLIDING for _ in layers]
    if isinstance(freq, int):
        return [FULL if n % freq == 0 else SLIDING for n in layers]
    return [SLIDING if freq[n - 1] else FULL for n in layers]


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the gpt-oss folder for ``meta``."""
    source = meta.source_args or {}
    window = hf_mistral.sliding_window(meta)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": meta.vocab_size, "hidden_size": meta.hidden_size,
        "intermediate_size": meta.expert_ffn_size, "num_hidden_layers": meta.num_layers,
        "num_attention_heads": meta.num_attention_heads,
        "num_key_value_heads": meta.num_query_groups, "head_dim": meta.kv_channels,
        "num_local_experts": meta.num_experts, "num_experts_per_tok": meta.moe_router_topk,
        # Unused when no layer is windowed, but transformers builds the windowed mask anyway.
        "sliding_window": window or meta.max_position_embeddings,
        "layer_types": layer_types(meta),
        "max_position_embeddings": meta.max_position_embeddings,
        "rms_norm_eps": meta.norm_epsilon, "rope_parameters": rope_parameters_to_hf(meta),
        "attention_bias": True, "hidden_act": "silu",
        "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": meta.activation_func_clamp_value,
        "attention_dropout": source.get("attention_dropout", 0.0),
        "initializer_range": source.get("init_method_std", 0.02),
        "router_aux_loss_coef": hf_mixtral.aux_loss_coef_to_hf(meta),
        "output_router_logits": False,
        "tie_word_embeddings": not meta.untie_embeddings_and_output_weights,
        "use_cache": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": dtype_name(meta.params_dtype),
    }


def _interleave(gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """``[f, ...]`` gate and linear rows -> ``[2 f, ...]`` rows gate 0, linear 0, gate 1 ..."""
    return torch.stack([gate, linear], dim=1).reshape(-1, *gate.shape[1:])


def _expert_names(index: int) -> Tuple[str, str, str, str]:
    p = f"model.layers.{index}.mlp.experts."
    return (p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias")


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``model.layers.{index}.*``."""
    p, f = f"model.layers.{index}.", meta.expert_ffn_size
    out = hf_llama.attention_to_hf(p, t, meta)
    out[p + "self_attn.sinks"] = t[_SINKS]
    out[p + "mlp.router.weight"] = t["mlp.router.weight"]
    out[p + "mlp.router.bias"] = t["mlp.router.bias"]
    fc1_w, fc1_b, fc2_w, fc2_b = [], [], [], []
    for expert in range(meta.num_experts):
        ours = f"mlp.experts.local_experts.{expert}."
        w, b = t[ours + "linear_fc1.weight"], t[ours + "linear_fc1.bias"]  # [2 f, h], [2 f]
        fc1_w.append(_interleave(w[:f], w[f:]).t())                        # [h, 2 f]
        fc1_b.append(_interleave(b[:f], b[f:]))
        fc2_w.append(t[ours + "linear_fc2.weight"].t())                    # [f, h]
        fc2_b.append(t[ours + "linear_fc2.bias"])
    names = _expert_names(index)
    for name, tensors in zip(names, (fc1_w, fc1_b, fc2_w, fc2_b)):
        out[name] = torch.stack(tensors)
    return out


def _windows(config: ConfigView, layers: int):
    """``(--window-size, --window-attn-skip-freq)`` for ``layer_types`` and
    ``sliding_window``."""
    types = config.get("layer_types", None)
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(
            kind not in (SLIDING, FULL) for kind in types):
        raise config.unsupported("layer_types", types, f"a list of {layers} "
                                 f"'{SLIDING}' / '{FULL}'")
    if SLIDING not in types:
        return None, None
    window = hf_mistral.window_from_config(config)
    if window is None:
        raise config.unsupported("sliding_window", None, "a positive integer (layer_types "
                                 "has sliding layers)")
    return window, tuple(1 if kind == SLIDING else 0 for kind in types)


def _activation(config: ConfigView) -> float:
    """The clamp value (``swiglu_limit``); ``swiglu_alpha`` must be the quick GeLU's."""
    alpha = config.need("swiglu_alpha", float, default=QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise config.unsupported("swiglu_alpha", alpha, f"{QUICK_GELU_ALPHA} (--quick-geglu)")
    limit = config.need("swiglu_limit", float, default=7.0)
    if not limit > 0:
        raise config.unsupported("swiglu_limit", limit, "a positive number")
    return limit


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a gpt-oss config.json describes; refuses settings our model cannot compute."""
    if not config.get("attention_bias", True):
        raise config.unsupported("attention_bias", False, "true (--add-bias-linear covers the "
                                 "attention's biases with the experts')")
    layers = config.need("num_hidden_layers")
    hidden, heads = config.need("hidden_size"), config.need("num_attention_heads")
    positions, vocab = config.need("max_position_embeddings"), config.need("vocab_size")
    ffn = config.need("intermediate_size")
    window, skip = _windows(config, layers)
    return ModelMeta(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=config.need("num_key_value_heads", default=heads),
        kv_channels=config.need("head_dim", default=hidden // heads),
        max_position_embeddings=positions, vocab_size=vocab, padded_vocab_size=vocab,
        rotary_percent=1.0, rotary_base=hf_llama._rope_theta(config),
        **rope_scaling_from_hf(config, positions),
        normalization="RMSNorm", norm_epsilon=config.need("rms_norm_eps", float, default=1e-5),
        quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=_activation(config), add_bias_linear=True,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        window_size=window, window_attn_skip_freq=skip, softmax_type="learnable",
        num_experts=config.need("num_local_experts"),
        moe_router_topk=config.need("num_experts_per_tok"), moe_ffn_hidden_size=ffn,
        moe_aux_loss_coeff=hf_mixtral.aux_loss_coef_from_config(config),
        params_dtype=config.params_dtype(), seq_length=positions)


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``model.layers.{index}.*`` as one canonical layer."""
    h, f, experts = meta.hidden_size, meta.expert_ffn_size, meta.num_experts
    p = f"model.layers.{index}."

    def get(name, shape):
        return weights.get(p + name, shape)

    out = hf_llama.attention_from_hf(get, meta)
    out[_SINKS] = get("self_attn.sinks", (meta.num_attention_heads,))
    out["mlp.router.weight"] = get("mlp.router.weight", (experts, h))
    out["mlp.router.bias"] = get("mlp.router.bias", (experts,))
    names = _expert_names(index)
    gate_up = weights.get(names[0], (experts, h, 2 * f))
    gate_up_bias = weights.get(names[1], (experts, 2 * f))
    down, down_bias = weights.get(names[2], (experts, f, h)), weights.get(names[3], (experts, h))
    for expert in range(experts):
        ours = f"mlp.experts.local_experts.{expert}."
        rows, bias = gate_up[expert].t(), gate_up_bias[expert]            # [2 f, h], [2 f]
        out[ours + "linear_fc1.weight"] = torch.cat([rows[0::2], rows[1::2]]).contiguous()
        out[ours + "linear_fc1.bias"] = torch.cat([bias[0::2], bias[1::2]])
        out[ours + "linear_fc2.weight"] = down[expert].t().contiguous()
        out[ours + "linear_fc2.bias"] = down_bias[expert].clone()
    return out


def refuse_elsewhere(meta: ModelMeta) -> None:
    """The gated-unit flags only gpt-oss carries, refused for every other architecture."""
    for value, flag, harmless in ((meta.quick_geglu, "--quick-geglu", False),
                                  (meta.glu_linear_offset, "--glu-linear-offset", 0.0),
                                  (meta.activation_func_clamp_value,
                                   "--activation-func-clamp-value", None)):
        if value != harmless:
            raise ConversionError(
                f"{flag}: only GptOssForCausalLM computes it here (an MoE model with "
                "--num-experts and --quick-geglu); convert it to Megatron checkpoints only")


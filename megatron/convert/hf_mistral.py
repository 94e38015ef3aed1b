"""Mistral (``MistralForCausalLM``, model_type ``mistral``) to and from the canonical stream,
and the window / softmax checks every Hugging Face export goes through.

Mistral is Llama (:mod:`megatron.convert.hf_llama`: same tensors, same names, no biases) whose
every layer attends through a sliding window: in transformers a query at position ``i`` sees
key ``j`` when ``i - sliding_window < j <= i``, i.e. ``sliding_window`` keys counting its own.
Our ``--window-size left,right`` counts the keys besides the query's own on each side, so
``sliding_window = W`` is ``--window-size W-1,0`` (and a ``null`` window is plain causal
attention). Mistral has no per-layer pattern, so ``--window-attn-skip-freq`` cannot be
expressed, nor a softmax offset (``--softmax-type``). Mixtral's ``sliding_window`` means the
same; :mod:`megatron.convert.hf_mixtral` uses the window helpers here.
"""

import dataclasses
from typing import List, Optional, Tuple

from megatron.convert import hf_llama
from megatron.convert.hf_common import ConfigView
from megatron.convert.hf_llama import (embeddings_from_hf, embeddings_to_hf,  # noqa: F401
                                       final_norm_from_hf, final_norm_to_hf, layer_from_hf,
                                       layer_to_hf, output_layer_from_hf, output_layer_to_hf)
from megatron.convert.schema import ConversionError, ModelMeta

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"


def windowed(meta: ModelMeta) -> bool:
    """Whether ``meta``'s model limits how far back any layer looks."""
    return meta.window_size is not None and meta.window_size[0] >= 0


def check_attention(meta: ModelMeta) -> None:
    """Refuse, for every Hugging Face export, a softmax offset (no architecture written here
    has one) and a window on a model that would be written as neither Mistral nor Mixtral."""
    if meta.softmax_type != "vanilla":
        raise ConversionError(f"--softmax-type {meta.softmax_type}: no Hugging Face "
                              "architecture written here but GptOssForCausalLM has attention "
                              "sinks (an MoE model with --quick-geglu); convert it to Megatron "
                              "checkpoints only")
    if windowed(meta) and (meta.model_type != "GPT" or meta.position_embedding_type != "rope"
                           or meta.moe_shared_expert_intermediate_size
                           or (not meta.num_experts and meta.normalization != "RMSNorm")):
        raise ConversionError(
            f"--window-size {meta.window_size[0]},{meta.window_size[1]}: of the Hugging Face "
            "architectures written here only MistralForCausalLM and MixtralForCausalLM have "
            "sliding windows; they need a GPT with --position-embedding-type rope and "
            "--normalization RMSNorm, without a shared expert")


def window_problems(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s window a Mistral-style ``sliding_window`` (every layer, looking back
    only) cannot express, each naming its flag."""
    if not windowed(meta):
        return []
    problems = []
    left, right = meta.window_size
    if right != 0:
        problems.append(f"--window-size {left},{right} (the window looks back only; the "
                        "right side must be 0)")
    freq = meta.window_attn_skip_freq
    if freq is not None and not (not isinstance(freq, int) and all(freq)):
        problems.append(f"--window-attn-skip-freq {freq} (sliding_window applies to every "
                        "layer)")
    return problems


def sliding_window(meta: ModelMeta) -> Optional[int]:
    """config.json's ``sliding_window`` for ``meta`` (null: full causal attention)."""
    return meta.window_size[0] + 1 if windowed(meta) else None


def window_from_config(config: ConfigView) -> Optional[Tuple[int, int]]:
    """``--window-size`` for config.json's ``sliding_window`` (None for null)."""
    window = config.get("sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise config.unsupported("sliding_window", window, "a positive integer or null")
    return window - 1, 0


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s model Mistral cannot express, each naming its flag."""
    problems = hf_llama.unsupported_features(meta)
    if meta.add_bias_linear or meta.add_qkv_bias:
        problems.append("linear biases (Mistral has none; add --disable-bias-linear)")
    return problems + window_problems(meta)


def hf_config(meta: ModelMeta, bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    """config.json of the Mistral folder for ``meta`` (Llama's fields, no bias switches, and
    ``sliding_window``)."""
    config = hf_llama.hf_config(meta, bos_id, eos_id)
    for name in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[name]
    config.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                   "sliding_window": sliding_window(meta)})
    return config


def meta_from_config(config: ConfigView) -> ModelMeta:
    """The model a Mistral config.json describes: Llama's, with every layer windowed."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key, False):
            raise config.unsupported(key, config.get(key), "false (Mistral has no biases)")
    meta = hf_llama.meta_from_config(config)
    return dataclasses.replace(meta, window_size=window_from_config(config))

"""Helpers the Hugging Face architecture modules share: reading ``config.json`` with errors that
name the file and key, dtype and GeLU names, rotary settings, splitting the fused
``query_key_value`` into q / k / v, and the canonical tensor shapes a layer must have."""

from typing import Any, Dict, Optional, Tuple

import torch

from megatron.convert.megatron_layout import layer_tensor_shapes
from megatron.convert.schema import ConversionError, ModelMeta

# config.json's dtype names (``torch_dtype``, ``dtype`` in newer transformers) and ours.
DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

# This project's GeLU is the tanh approximation with and without ``--openai-gelu`` (the two
# differ only in how sqrt(2/pi) is rounded, 1e-9 relative). HF names the same function
# ``gelu_new`` and ``gelu_pytorch_tanh``; the first stands for ``--openai-gelu``, the second for
# the default, so the flag survives a round trip. HF's ``gelu`` (erf) is another function.
ACTIVATION_BY_OPENAI_GELU = {True: "gelu_new", False: "gelu_pytorch_tanh"}
OPENAI_GELU_BY_ACTIVATION = {"gelu_new": True, "gelu_pytorch_tanh": False, "gelu_fast": False}

_MISSING = object()


class ConfigView:
    """Read access to a parsed ``config.json`` whose errors name the file and the key.

    Args:
        values: the parsed JSON object.
        path: the file it came from (for messages).
    """

    def __init__(self, values: Dict[str, Any], path: str):
        self.values = values
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        """``values[key]``, or ``default`` when the key is absent or null."""
        value = self.values.get(key)
        return default if value is None else value

    def need(self, key: str, kind: type = int, default: Any = _MISSING) -> Any:
        """``values[key]`` checked to be a ``kind`` (an int is accepted for a float)."""
        value = self.values.get(key)
        if value is None:
            if default is not _MISSING:
                return default
            raise ConversionError(f"{self.path}: {key!r} is missing; a {kind.__name__} is needed")
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConversionError(f"{self.path}: {key!r} is {value!r}; expected a "
                                  f"{kind.__name__}")
        return value

    def unsupported(self, key: str, value: Any, expected: str) -> ConversionError:
        """The error for a key whose value the conversion cannot represent."""
        return ConversionError(f"{self.path}: {key!r} is {value!r}; only {expected} can be "
                               "converted")

    def params_dtype(self) -> torch.dtype:
        """The weights' dtype (``dtype`` or the older ``torch_dtype``); float32 when absent."""
        name = self.values.get("dtype") or self.values.get("torch_dtype") or "float32"
        if name not in DTYPE_BY_NAME:
            raise self.unsupported("torch_dtype", name, " / ".join(DTYPE_BY_NAME))
        return DTYPE_BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's name for ``dtype``."""
    if dtype not in NAME_BY_DTYPE:
        raise ConversionError(f"params dtype {dtype} has no Hugging Face equivalent; expected "
                              f"one of {', '.join(DTYPE_BY_NAME)}")
    return NAME_BY_DTYPE[dtype]


def rope_settings(config: ConfigView, theta_key: str, factor_key: str,
                  factor_default: float) -> Tuple[int, float]:
    """``(--rotary-base, --rotary-percent)`` of a config: values inside ``rope_parameters`` (or
    the older ``rope_scaling``) first, then the architecture's own top-level keys ``theta_key`` /
    ``factor_key``, then transformers' defaults (10000, ``factor_default``), the order in which
    transformers itself reads them. Only plain (unscaled) rotary embeddings are accepted."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise config.unsupported("rope_parameters", params, "a dict")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise config.unsupported("rope_parameters.rope_type", rope_type, "'default' (no scaling)")
    factor = params.get("partial_rotary_factor", config.get(factor_key, factor_default))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise config.unsupported(factor_key, factor, "a fraction in (0, 1] (--rotary-percent)")
    theta = params.get("rope_theta", config.get(theta_key, 10000.0))
    if float(theta) != int(theta):
        raise config.unsupported(theta_key, theta, "an integer (--rotary-base)")
    return int(theta), float(factor)


def split_qkv(qkv: torch.Tensor, meta: ModelMeta):
    """Fused rows ``[ng, np/ng + 2, hn, ...]`` -> q ``[np hn, ...]``, k and v ``[ng hn, ...]``.

    Query head ``j`` uses key/value head ``j // (np / ng)`` in Megatron and in the HF classes
    with separate projections, so splitting each group's rows keeps the heads in order."""
    groups, hn = meta.num_query_groups, meta.kv_channels
    per_group = meta.num_attention_heads // groups
    rest = tuple(qkv.shape[1:])
    grouped = qkv.view(groups, per_group + 2, hn, *rest)
    q = grouped[:, :per_group].reshape(groups * per_group * hn, *rest)
    k = grouped[:, per_group].reshape(groups * hn, *rest)
    v = grouped[:, per_group + 1].reshape(groups * hn, *rest)
    return q, k, v


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ModelMeta) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    groups, hn = meta.num_query_groups, meta.kv_channels
    per_group = meta.num_attention_heads // groups
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape(groups, per_group, hn, *rest),
                         k.reshape(groups, 1, hn, *rest),
                         v.reshape(groups, 1, hn, *rest)], dim=1)   # [ng, np/ng + 2, hn, ...]
    return grouped.reshape(-1, *rest)


def canonical_layer_shapes(meta: ModelMeta, index: int = 0) -> Dict[str, Tuple[int, ...]]:
    """Every tensor the canonical ``layer`` piece ``index`` of ``meta``'s model holds, with its
    shape."""
    if meta.num_experts:
        return layer_tensor_shapes(meta, index)
    h, ffn, hn = meta.hidden_size, meta.ffn_hidden_size, meta.kv_channels
    heads, groups = meta.num_attention_heads, meta.num_query_groups
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attention.query_key_value.weight": ((heads + 2 * groups) * hn, h),
        "self_attention.dense.weight": (h, heads * hn),
        "post_attention_layernorm.weight": (h,),
        "mlp.dense_h_to_4h.weight": (2 * ffn if meta.swiglu else ffn, h),
        "mlp.dense_4h_to_h.weight": (h, ffn),
    }
    if meta.normalization == "LayerNorm":
        shapes["input_layernorm.bias"] = (h,)
        shapes["post_attention_layernorm.bias"] = (h,)
    if meta.add_bias_linear or meta.add_qkv_bias:
        shapes["self_attention.query_key_value.bias"] = ((heads + 2 * groups) * hn,)
    if meta.add_bias_linear:
        shapes["self_attention.dense.bias"] = (h,)
        shapes["mlp.dense_h_to_4h.bias"] = (shapes["mlp.dense_h_to_4h.weight"][0],)
        shapes["mlp.dense_4h_to_h.bias"] = (h,)
    return shapes

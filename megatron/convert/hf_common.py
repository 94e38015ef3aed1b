"""Helpers the Hugging Face architecture modules share: reading ``config.json`` with errors that
name the file and key, dtype names, and the canonical tensor shapes a layer must have."""

from typing import Any, Dict, Tuple

import torch

from megatron.convert.schema import ConversionError, ModelMeta

# config.json's dtype names (``torch_dtype``, ``dtype`` in newer transformers) and ours.
DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

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


def canonical_layer_shapes(meta: ModelMeta) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a canonical ``layer`` piece of ``meta``'s model holds, with its shape."""
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

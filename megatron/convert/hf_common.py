"""Helpers the Hugging Face architecture modules share: reading ``config.json`` with errors that
name the file and key, dtype and GeLU names, rotary settings (and the ``llama3`` / ``yarn``
rescalings as Megatron's flags), splitting the fused
``query_key_value`` into q / k / v, and the canonical tensor shapes a layer must have."""

import math
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.convert.megatron_layout import layer_tensor_shapes
from megatron.convert.schema import ConversionError, ModelMeta
from megatron.model.rotary_pos_embedding import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                                 LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS,
                                                 YarnSettings)

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


def _rope_parameters(config: ConfigView) -> Tuple[str, dict]:
    """``(key, dict)``: the rotary parameters of a config, under ``rope_parameters`` or the
    older ``rope_scaling`` (which transformers reads first)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if params:
            if not isinstance(params, dict):
                raise config.unsupported(key, params, "a dict")
            return key, params
    return "rope_parameters", {}


def rope_settings(config: ConfigView, theta_key: str, factor_key: str,
                  factor_default: float, scaled: Tuple[str, ...] = ()) -> Tuple[int, float]:
    """``(--rotary-base, --rotary-percent)`` of a config: values inside ``rope_parameters`` (or
    the older ``rope_scaling``) first, then the architecture's own top-level keys ``theta_key`` /
    ``factor_key``, then transformers' defaults (10000, ``factor_default``), the order in which
    transformers itself reads them. Rotary types other than ``default`` are refused unless named
    in ``scaled`` (see :func:`rope_scaling_from_hf`)."""
    key, params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" and rope_type not in scaled:
        expected = " or ".join(repr(t) for t in ("default",) + scaled)
        raise config.unsupported(f"{key}.rope_type", rope_type, expected)
    factor = params.get("partial_rotary_factor", config.get(factor_key, factor_default))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise config.unsupported(factor_key, factor, "a fraction in (0, 1] (--rotary-percent)")
    theta = params.get("rope_theta", config.get(theta_key, 10000.0))
    if float(theta) != int(theta):
        raise config.unsupported(theta_key, theta, "an integer (--rotary-base)")
    return int(theta), float(factor)


def _number(config: ConfigView, key: str, params: dict, name: str, default=_MISSING) -> float:
    value = params.get(name, default)
    if value is _MISSING:
        raise ConversionError(f"{config.path}: {key}.{name} is missing; rope_type "
                              f"{params.get('rope_type')!r} needs it")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise config.unsupported(f"{key}.{name}", value, "a number > 0")
    return float(value)


def _original_positions(config: ConfigView, params: dict, max_positions: int) -> int:
    """transformers' pretraining length of a scaled rotary: the top-level key first, then the
    one inside the rotary parameters, then ``max_position_embeddings``."""
    value = config.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_positions))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise config.unsupported("original_max_position_embeddings", value, "an integer > 0")
    return value


def rope_scaling_from_hf(config: ConfigView, max_positions: int) -> dict:
    """The ModelMeta fields (``position_embedding_type`` and the rotary rescaling flags) of a
    config's ``llama3``, ``yarn`` or ``default`` rotary; anything Megatron's flags cannot
    express is refused, naming the key and its value."""
    key, params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        return _llama3_from_hf(config, key, params, max_positions)
    if rope_type == "yarn":
        return _yarn_from_hf(config, key, params, max_positions)
    return {"position_embedding_type": "rope"}


def _llama3_from_hf(config, key, params, max_positions) -> dict:
    fixed = (("low_freq_factor", LLAMA3_LOW_FREQ_FACTOR),
             ("high_freq_factor", LLAMA3_HIGH_FREQ_FACTOR))
    for name, megatron_value in fixed:
        value = _number(config, key, params, name)
        if value != megatron_value:
            raise config.unsupported(f"{key}.{name}", params[name],
                                     f"{megatron_value} (fixed in Megatron's --use-rope-scaling)")
    original = _original_positions(config, params, max_positions)
    if original != LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS:
        raise config.unsupported(
            f"{key}.original_max_position_embeddings", original,
            f"{LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS} (fixed in Megatron's --use-rope-scaling)")
    return {"position_embedding_type": "rope", "use_rope_scaling": True,
            "rope_scaling_factor": _number(config, key, params, "factor")}


def _yarn_from_hf(config, key, params, max_positions) -> dict:
    original = _original_positions(config, params, max_positions)
    factor = params.get("factor")
    factor = max_positions / original if factor is None else _number(config, key, params,
                                                                     "factor")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise config.unsupported(f"{key}.truncate", truncate, "true or false")
    mscale, mscale_all_dim = _yarn_mscales(config, key, params, factor)
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": factor,
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            "yarn_correction_range_round_to_int": truncate}


def _yarn_mscales(config, key, params, factor) -> Tuple[float, float]:
    """``(--mscale, --mscale-all-dim)`` giving the cos / sin factor transformers computes:
    ``attention_factor`` when set, else ``m(mscale) / m(mscale_all_dim)`` when both are set
    (non-zero), else ``m(1)``."""
    mscale, mscale_all_dim = (
        _number(config, key, params, name, None) if params.get(name) else None
        for name in ("mscale", "mscale_all_dim"))
    both = bool(mscale) and bool(mscale_all_dim)
    pair = (mscale, mscale_all_dim) if both else (1.0, 0.0)
    attention = params.get("attention_factor")
    if attention is None:
        return pair
    attention = _number(config, key, params, "attention_factor")
    for candidate in ((mscale or 0.0, mscale_all_dim or 0.0), pair):
        if math.isclose(_concentration(factor, *candidate), attention, rel_tol=1e-12):
            return candidate
    if factor > 1:
        # m(k) / m(0) = 0.1 k ln(s) + 1 takes any value for some k.
        return (attention - 1.0) / (0.1 * math.log(factor)), 0.0
    raise config.unsupported(f"{key}.attention_factor", params["attention_factor"],
                             "1.0 when factor <= 1 (Megatron's --mscale has no effect then)")


def _concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    return YarnSettings(scaling_factor=factor, mscale=mscale,
                        mscale_all_dim=mscale_all_dim).concentration


def rope_parameters_to_hf(meta: ModelMeta) -> dict:
    """transformers' ``rope_parameters`` of ``meta``'s rotary (default, llama3 or yarn)."""
    theta = float(meta.rotary_base)
    if meta.position_embedding_type == "yarn":
        fields = meta.rope_scaling_fields
        yarn = YarnSettings(**{name: fields[flag] for name, flag in _YARN_FLAGS.items()
                               if fields[flag] is not None})
        return {"rope_type": "yarn", "rope_theta": theta, "factor": yarn.scaling_factor,
                "original_max_position_embeddings": yarn.original_max_position_embeddings,
                "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
                "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim,
                "attention_factor": yarn.concentration,
                "truncate": yarn.correction_range_round_to_int}
    if meta.use_rope_scaling:
        return {"rope_type": "llama3", "rope_theta": theta,
                "factor": float(meta.rope_scaling_factor),
                "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS}
    return {"rope_type": "default", "rope_theta": theta}


# YarnSettings field -> ModelMeta field (the flag's dest).
_YARN_FLAGS = {"scaling_factor": "rotary_scaling_factor",
               "original_max_position_embeddings": "yarn_original_max_position_embeddings",
               "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
               "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
               "correction_range_round_to_int": "yarn_correction_range_round_to_int"}


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
    if meta.num_experts or meta.multi_latent_attention:
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
    if meta.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            shapes[f"self_attention.{norm}.weight"] = (hn,)
            if meta.normalization == "LayerNorm":
                shapes[f"self_attention.{norm}.bias"] = (hn,)
    if meta.add_bias_linear or meta.add_qkv_bias:
        shapes["self_attention.query_key_value.bias"] = ((heads + 2 * groups) * hn,)
    if meta.add_bias_linear:
        shapes["self_attention.dense.bias"] = (h,)
        shapes["mlp.dense_h_to_4h.bias"] = (shapes["mlp.dense_h_to_4h.weight"][0],)
        shapes["mlp.dense_4h_to_h.bias"] = (h,)
    return shapes

"""Heterogeneous (per-layer) transformer blocks: ``--heterogeneous-layers-config-path`` and
``--heterogeneous-layers-config-encoded-json``.

The layers are described by a Hugging Face style JSON config (NVIDIA's Llama-Nemotron /
Nemotron-NAS "DeciLM" models) holding ``block_configs``, one entry per layer::

    {"block_configs": [
        {"attention": {"n_heads_in_group": 2, "no_op": false, "replace_with_linear": false},
         "ffn": {"ffn_mult": 2.625, "no_op": false, "replace_with_linear": false}},
        {"attention": {"n_heads_in_group": null, "no_op": true, "replace_with_linear": false},
         "ffn": {"intermediate_size": 96, "no_op": false, "replace_with_linear": true}}]}

How a block maps onto layer ``i`` (as Megatron-Core's heterogeneous GPT layer spec builds it):

* ``attention.no_op``: no input norm, no attention, no residual add: the layer's input passes
  on unchanged to the MLP half. ``ffn.no_op`` likewise for the MLP half.
* ``replace_with_linear``: the norm stays; the attention (or MLP) is one ``[h, h]`` linear
  layer (column-parallel, its output gathered; bias with ``--add-bias-linear``) whose output is
  added to the residual.
* ``attention.num_query_groups`` (or Hugging Face's ``n_heads_in_group``, heads per group:
  groups = heads / n_heads_in_group): the layer's key/value groups; null keeps
  ``--num-query-groups``.
* ``ffn.ffn_hidden_size`` (or ``intermediate_size``, or ``ffn_mult``: ``int(2 ffn_mult h / 3)``
  rounded up to a multiple of 256, the DeciLM rule): the layer's MLP size; null keeps
  ``--ffn-hidden-size``. The MLP block may also be spelled ``mlp``.

Fields DeciLM configs carry that this project does not build (``sparsify``, ``window_length``,
``num_sink_tokens``, ``unshifted_sink``, ``use_prefill_window_in_sink_attention``) are
accepted only at their "off" value (null, false, empty); Megatron-Core drops them silently,
which would train another model than the file describes. Unknown keys are refused too.
"""

import dataclasses
import json
import math
from typing import Any, Dict, Optional, Tuple

from megatron.core.config import ConfigError

# Hugging Face fields accepted only when off (null / false / empty).
_OFF_ONLY = {
    "attention": ("sparsify", "window_length", "num_sink_tokens", "unshifted_sink",
                  "use_prefill_window_in_sink_attention"),
    "ffn": ("sparsify",),
}
_ATTENTION_KEYS = ("no_op", "replace_with_linear", "num_query_groups", "n_heads_in_group")
_FFN_KEYS = ("no_op", "replace_with_linear", "ffn_hidden_size", "intermediate_size", "ffn_mult")


class HeterogeneousConfigError(ConfigError):
    """A block config that cannot be built; the message names the source and the key."""


@dataclasses.dataclass(frozen=True)
class AttentionBlock:
    """The attention half of one layer."""

    no_op: bool = False
    replace_with_linear: bool = False
    num_query_groups: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class MLPBlock:
    """The MLP half of one layer."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_hidden_size: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One layer of a heterogeneous model."""

    attention: AttentionBlock
    mlp: MLPBlock


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's MLP size: ``int(2 * ffn_mult * h / 3)`` rounded up to a multiple of 256."""
    size = int(2 * ffn_mult * hidden_size / 3)
    return int(math.ceil(size / 256) * 256)


class _Where:
    """Names the source (file or flag) and the key path in every error."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, message: str):
        raise HeterogeneousConfigError(f"{self.source}: {key}: {message}")


def _flag(where: _Where, part: Dict[str, Any], key: str, name: str) -> bool:
    value = part.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        where.fail(f"{key}.{name}", f"expected true or false, got {value!r}")
    return value


def _positive_int(where: _Where, key: str, value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where.fail(key, f"expected a positive integer or null, got {value!r}")
    return value


def _check_keys(where: _Where, part, key: str, kind: str, known) -> None:
    if not isinstance(part, dict):
        where.fail(key, f"expected an object, got {type(part).__name__}")
    for name, value in part.items():
        if name in _OFF_ONLY[kind]:
            if value not in (None, False, [], {}, ""):
                where.fail(f"{key}.{name}", f"{value!r} is not built (only null or false)")
        elif name not in known:
            where.fail(f"{key}.{name}", f"unknown field (known: "
                       f"{', '.join(known + _OFF_ONLY[kind])})")


def _one_of(where: _Where, part, key: str, names) -> Optional[str]:
    given = [n for n in names if part.get(n) is not None]
    if len(given) > 1:
        where.fail(key, f"give one of {', '.join(given)}, not several")
    return given[0] if given else None


def _attention(where: _Where, part, key: str, num_heads: int) -> AttentionBlock:
    _check_keys(where, part, key, "attention", _ATTENTION_KEYS)
    no_op, linear = _flag(where, part, key, "no_op"), _flag(where, part, key, "replace_with_linear")
    name = _one_of(where, part, key, ("num_query_groups", "n_heads_in_group"))
    groups = None
    if name is not None:
        value = _positive_int(where, f"{key}.{name}", part[name])
        if name == "n_heads_in_group":
            if num_heads % value:
                where.fail(f"{key}.{name}", f"--num-attention-heads ({num_heads}) must be a "
                           f"multiple of it ({value})")
            value = num_heads // value
        elif num_heads % value:
            where.fail(f"{key}.{name}", f"must divide --num-attention-heads ({num_heads}), "
                       f"got {value}")
        groups = value
    if no_op and linear:
        where.fail(key, "no_op and replace_with_linear cannot both be true")
    if groups is not None and (no_op or linear):
        where.fail(f"{key}.{name}", "a no-op or linear attention has no query groups: "
                   "set it to null")
    return AttentionBlock(no_op, linear, groups)


def _mlp(where: _Where, part, key: str, hidden_size: int) -> MLPBlock:
    _check_keys(where, part, key, "ffn", _FFN_KEYS)
    no_op, linear = _flag(where, part, key, "no_op"), _flag(where, part, key, "replace_with_linear")
    name = _one_of(where, part, key, ("ffn_hidden_size", "intermediate_size", "ffn_mult"))
    size = None
    if name == "ffn_mult":
        mult = part[name]
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
            where.fail(f"{key}.ffn_mult", f"expected a positive number, got {mult!r}")
        size = ffn_mult_to_intermediate_size(mult, hidden_size)
    elif name is not None:
        size = _positive_int(where, f"{key}.{name}", part[name])
    if no_op and linear:
        where.fail(key, "no_op and replace_with_linear cannot both be true")
    if size is not None and (no_op or linear):
        where.fail(f"{key}.{name}", "a no-op or linear MLP has no size: set it to null")
    return MLPBlock(no_op, linear, size)


def parse_block_configs(text: str, source: str, num_layers: int, num_attention_heads: int,
                        hidden_size: int) -> Tuple[BlockConfig, ...]:
    """The layers' blocks from the JSON ``text`` (read from ``source``: a file name, or the
    flag that held it), one per layer of ``--num-layers``.

    Raises:
        HeterogeneousConfigError: naming ``source`` and the offending key.
    """
    where = _Where(source)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise HeterogeneousConfigError(f"{source}: not valid JSON: {err}") from None
    if not isinstance(data, dict) or "block_configs" not in data:
        where.fail("block_configs", "missing: the config must be an object holding "
                   "\"block_configs\", one entry per layer")
    blocks = data["block_configs"]
    if not isinstance(blocks, list) or len(blocks) != num_layers:
        count = len(blocks) if isinstance(blocks, list) else type(blocks).__name__
        where.fail("block_configs", f"expected a list of --num-layers ({num_layers}) "
                   f"entries, got {count}")
    parsed = []
    for i, block in enumerate(blocks):
        key = f"block_configs[{i}]"
        if not isinstance(block, dict):
            where.fail(key, f"expected an object, got {type(block).__name__}")
        mlp_name = _one_of(where, block, key, ("ffn", "mlp")) or "ffn"
        for name in block:
            if name not in ("attention", "ffn", "mlp"):
                where.fail(f"{key}.{name}", "unknown field (known: attention, ffn or mlp)")
        for name in ("attention", mlp_name):
            if name not in block:
                where.fail(f"{key}.{name}", "missing")
        parsed.append(BlockConfig(
            _attention(where, block["attention"], f"{key}.attention", num_attention_heads),
            _mlp(where, block[mlp_name], f"{key}.{mlp_name}", hidden_size)))
    return tuple(parsed)


def layer_config(config, blocks: Optional[Tuple[BlockConfig, ...]], layer_number: int):
    """``config`` with 1-based ``layer_number``'s query groups and MLP size (``config`` itself
    for a homogeneous model, or past the last layer: multi-token prediction's)."""
    if not blocks or layer_number > len(blocks):
        return config
    block = blocks[layer_number - 1]
    changes = {}
    if block.attention.num_query_groups is not None:
        changes["num_query_groups"] = block.attention.num_query_groups
    if block.mlp.ffn_hidden_size is not None:
        changes["ffn_hidden_size"] = block.mlp.ffn_hidden_size
    return dataclasses.replace(config, **changes) if changes else config


def check_blocks_splittable(blocks: Tuple[BlockConfig, ...], tp_size: int,
                            hidden_size: int) -> None:
    """Reject per-layer sizes that ``tp_size`` tensor-parallel ranks cannot split."""
    for i, block in enumerate(blocks):
        if (block.attention.replace_with_linear or block.mlp.replace_with_linear) and \
                hidden_size % tp_size:
            raise HeterogeneousConfigError(
                f"block_configs[{i}]: a linear replacement needs --hidden-size ({hidden_size}) "
                f"divisible by --tensor-model-parallel-size ({tp_size})")
        for what, value in (("attention query groups", block.attention.num_query_groups),
                            ("ffn size", block.mlp.ffn_hidden_size)):
            if value is not None and value % tp_size:
                raise HeterogeneousConfigError(
                    f"block_configs[{i}]: {what} ({value}) must be divisible by "
                    f"--tensor-model-parallel-size ({tp_size})")

"""Where each tensor of this project's GPT model state sits in a Megatron-Core ``torch_dist``
checkpoint: its global key, the global shape, and the offsets of a rank's local piece.

A model chunk's state (``GPTModel.state_dict_for_save_checkpoint``, flattened to dotted names)
uses the legacy names of FORMATS.md section 6, with layer numbers local to the chunk. In a
``torch_dist`` checkpoint (section 8) every tensor is stored once, whole, under Megatron-Core's
module names, and the per-layer tensors of all pipeline stages are stacked on a leading axis of
length ``num_layers`` indexed by the global layer number:

=================================================  ==========================================
legacy name (in a chunk's state)                   Megatron-Core key, global shape
=================================================  ==========================================
language_model.embedding.word_embeddings.weight    embedding.word_embeddings.weight [V, h]
language_model.embedding.position_embeddings...    embedding.position_embeddings.weight [P, h]
...encoder.layers.N.input_layernorm.{w,b}          decoder.layers.self_attention.linear_qkv.
                                                   layer_norm_{weight,bias} [L, h]
...encoder.layers.N.self_attention.query_key_value decoder.layers.self_attention.linear_qkv
                                                   [L, (np + 2 ng) hn, h] (bias [L, ...])
...encoder.layers.N.self_attention.dense           decoder.layers.self_attention.linear_proj
...encoder.layers.N.post_attention_layernorm       decoder.layers.mlp.linear_fc1.layer_norm_*
...encoder.layers.N.mlp.dense_h_to_4h              decoder.layers.mlp.linear_fc1
...encoder.layers.N.mlp.dense_4h_to_h              decoder.layers.mlp.linear_fc2
language_model.encoder.final_layernorm.{w,b}       decoder.final_layernorm.{weight,bias}
language_model.output_layer.weight                 output_layer.weight (untied only)
word_embeddings_for_head.weight                    embedding.word_embeddings.weight (read
                                                   only: tied, so never stored twice)
=================================================  ==========================================

How a TP rank's local tensor maps into the global one follows the tensor-parallel split of
:func:`megatron.convert.megatron_layout.tp_split_rule`: rows (vocabulary, fused QKV whole
query groups, fc1), columns (linear_proj and linear_fc2 weights), or replicated. SwiGLU's fc1 is
``[gate_r; value_r]`` on rank r; globally it is ``[gate; value]`` (all gates, then all values),
so the local tensor is two pieces, at rows ``r * f`` and ``ffn + r * f`` (``f = ffn / tp``),
which is how Megatron-Core stores it too.

A replicated tensor (norms, position embeddings, row-parallel biases) is written by one rank
only: TP rank 0 of DP rank 0 (:attr:`ChunkLayout.writes_replicated`).
"""

import dataclasses
import re
from typing import List, Optional, Tuple

LAYER_PREFIX = "decoder.layers."

# Legacy per-layer name -> Megatron-Core name (under ``decoder.layers.``).
LAYER_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}

# Legacy name outside the layers -> Megatron-Core key.
OTHER_KEYS = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight":
        "embedding.position_embeddings.weight",
    "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
    "word_embeddings_for_head.weight": "embedding.word_embeddings.weight",
}

# The layers' linear modules, whose (empty, for non-TransformerEngine layers) extra state
# Megatron-Core stores as a byte entry per global layer.
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv",
                       "mlp.linear_fc1", "mlp.linear_fc2")

# Split along (dim) of each tensor over TP ranks; a name absent here is replicated.
_SPLIT_DIM = {
    "self_attention.query_key_value.weight": 0, "self_attention.query_key_value.bias": 0,
    "self_attention.dense.weight": 1,
    "mlp.dense_h_to_4h.weight": 0, "mlp.dense_h_to_4h.bias": 0,
    "mlp.dense_4h_to_h.weight": 1,
    "language_model.embedding.word_embeddings.weight": 0,
    "language_model.output_layer.weight": 0,
    "word_embeddings_for_head.weight": 0,
}
_SWIGLU_SPLIT = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_LAYER_NAME = re.compile(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)")

# Prefixes of the optimizer's per-parameter tensors (Adam moments) in Megatron-Core's files
# (non-distributed optimizer): ``optimizer.state.exp_avg.<model key>``, same sharding.
OPTIMIZER_STATE_PREFIX = "optimizer.state."


class KeyMappingError(ValueError):
    """A tensor name that has no place in Megatron-Core's layout; the message names it."""


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where one model chunk sits: a TP rank's part of one pipeline stage (or virtual chunk).

    Args:
        num_layers: layers of the whole model (the length of the stacked layer axis).
        layer_offset: global number of the chunk's first layer (its local layer 0).
        tp_rank, tp_size: the chunk's tensor-parallel rank and size.
        dp_rank: its data-parallel rank; only DP rank 0 writes (the others hold copies).
        swiglu: ``--swiglu`` (fc1 holds gate and value halves).
    """

    num_layers: int
    layer_offset: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    swiglu: bool = False

    @property
    def writes_split(self) -> bool:
        """Whether this chunk writes its pieces of TP-split tensors."""
        return self.dp_rank == 0

    @property
    def writes_replicated(self) -> bool:
        """Whether this chunk writes the tensors every TP rank holds whole."""
        return self.dp_rank == 0 and self.tp_rank == 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """One piece of a local tensor inside a global tensor of the checkpoint.

    ``local_rows`` (``(start, stop)`` on dim 0 of the local tensor, None: all of it) selects
    the piece; it sits at ``global_offset`` in the tensor ``key`` of ``global_shape``. With a
    stacked layer axis the piece gets a leading axis of size 1 (``stacked``). ``written``: this
    chunk writes the piece (False for copies held elsewhere: replicas, the tied head).
    """

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    local_rows: Optional[Tuple[int, int]]
    stacked: bool
    written: bool

    def sizes(self, local_shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The piece's sizes in the global tensor (leading 1 when stacked)."""
        shape = list(local_shape)
        if self.local_rows is not None:
            shape[0] = self.local_rows[1] - self.local_rows[0]
        return ((1,) if self.stacked else ()) + tuple(shape)

    def with_prefix(self, prefix: str) -> "Placement":
        """The same piece of another tensor keyed ``prefix + key`` (an optimizer moment)."""
        return dataclasses.replace(self, key=prefix + self.key)


def layer_key(legacy_layer_name: str) -> str:
    """``decoder.layers.<name>`` for a per-layer legacy name (``mlp.dense_h_to_4h.weight``)."""
    if legacy_layer_name not in LAYER_KEYS:
        raise KeyMappingError(f"layer tensor {legacy_layer_name!r} has no Megatron-Core key "
                              f"(known: {', '.join(sorted(LAYER_KEYS))})")
    return LAYER_PREFIX + LAYER_KEYS[legacy_layer_name]


def mcore_key(name: str) -> Tuple[str, Optional[int]]:
    """The Megatron-Core key of a legacy dotted name, and its local layer number (None for a
    tensor outside the layers)."""
    match = _LAYER_NAME.fullmatch(name)
    if match:
        return layer_key(match.group(2)), int(match.group(1))
    if name in OTHER_KEYS:
        return OTHER_KEYS[name], None
    raise KeyMappingError(f"{name!r} has no Megatron-Core key: only GPT models (embeddings, "
                          "layers, final norm, output layer) are stored in torch_dist")


def placements(name: str, local_shape: Tuple[int, ...], layout: ChunkLayout) -> List[Placement]:
    """Where the local tensor ``name`` (a legacy dotted name of the chunk's state) of shape
    ``local_shape`` sits in the checkpoint, as one piece (two for SwiGLU's fc1)."""
    key, local_layer = mcore_key(name)
    inner = name if local_layer is None else _LAYER_NAME.fullmatch(name).group(2)
    local_shape = tuple(local_shape)
    dim = _SPLIT_DIM.get(inner)
    global_shape = list(local_shape)
    offset = [0] * len(local_shape)
    written = layout.writes_split if dim is not None else layout.writes_replicated
    if name == "word_embeddings_for_head.weight":
        written = False
    pieces = []
    if dim is not None and layout.swiglu and inner in _SWIGLU_SPLIT:
        if local_shape[0] % 2:
            raise KeyMappingError(f"{name}: a SwiGLU fc1 needs an even number of rows, has "
                                  f"{local_shape[0]}")
        half = local_shape[0] // 2
        global_shape[0] = local_shape[0] * layout.tp_size
        ffn = half * layout.tp_size
        for k in range(2):
            offset[0] = k * ffn + layout.tp_rank * half
            pieces.append((tuple(offset), (k * half, (k + 1) * half)))
    else:
        if dim is not None:
            global_shape[dim] = local_shape[dim] * layout.tp_size
            offset[dim] = local_shape[dim] * layout.tp_rank
        pieces.append((tuple(offset), None))
    stacked = local_layer is not None
    if stacked:
        global_layer = layout.layer_offset + local_layer
        if not 0 <= global_layer < layout.num_layers:
            raise KeyMappingError(f"{name}: global layer {global_layer} is outside the model's "
                                  f"{layout.num_layers} layers (layer offset "
                                  f"{layout.layer_offset})")
        global_shape = [layout.num_layers] + global_shape
        pieces = [((global_layer,) + off, rows) for off, rows in pieces]
    return [Placement(key, tuple(global_shape), off, rows, stacked, written)
            for off, rows in pieces]


def object_key(key: str, offset: Tuple[int, ...] = (0,), shape: Tuple[int, ...] = (1,)) -> str:
    """The storage name of a byte entry (Megatron-Core's sharded object): ``key/shard_<offset>_
    <shape>``, each joined with dots: ``common_state/shard_0_1``, ``rng_state/shard_0.1_1.2``."""
    if len(offset) != len(shape):
        raise ValueError(f"{key}: offset {offset} and shape {shape} differ in length")
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def extra_state_keys(global_layer: int, num_layers: int) -> List[str]:
    """The byte entries of one layer's linear modules' extra state."""
    return [object_key(f"{LAYER_PREFIX}{module}._extra_state", (global_layer,), (num_layers,))
            for module in EXTRA_STATE_MODULES]

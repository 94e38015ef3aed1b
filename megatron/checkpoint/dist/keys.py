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
                                                   only: a copy of the first stage's table,
                                                   tied or for MTP, never stored twice)
=================================================  ==========================================

Mixture-of-experts layers (``--num-experts``). In a chunk's state (``--ckpt-format torch``
too) the MoE MLP keeps Megatron-Core's module names under the legacy layer prefix:
``language_model.encoder.layers.N.mlp.router.weight`` [E, h],
``...layers.N.mlp.experts.local_experts.J.linear_fc1.weight`` [ffn/etp, h] and
``...linear_fc2.weight`` [h, ffn/etp] (J: the expert's number on this expert-parallel rank),
``...layers.N.mlp.shared_experts.linear_fc{1,2}.weight`` and ``...shared_experts.gate_weight``.
(Megatron-LM's own legacy model had no router of this kind, so no older legacy spelling exists
to follow; the Megatron-Core module names under the legacy prefix keep the mapping one to one.)
In ``torch_dist``:

=================================================  ==========================================
...layers.N.mlp.router.weight                      decoder.layers.mlp.router.weight [L, E, h]
...layers.N.mlp.router.bias                        decoder.layers.mlp.router.bias [L, E]
                                                   (with ``--add-bias-linear``)
...layers.N.mlp.router.expert_bias                 decoder.layers.mlp.router.expert_bias
                                                   [L, E] (fp32 buffer, with
                                                   ``--moe-router-enable-expert-bias``)
...layers.N.mlp.router.qb_beta                     decoder.layers.mlp.router.qb_beta [L, E]
                                                   (fp32 buffer, with quantile_balancing)
...layers.N.mlp.experts.local_experts.J.           decoder.layers.mlp.experts.experts.
linear_fc1.{weight,bias}                           linear_fc1.{weight,bias} [L, E, ffn, h]
...layers.N.mlp.experts.local_experts.J.           decoder.layers.mlp.experts.experts.
linear_fc2.{weight,bias}                           linear_fc2.{weight,bias} [L, E, h, ffn]
...layers.N.mlp.shared_experts.linear_fc{1,2}...   decoder.layers.mlp.shared_experts.(same)
...layers.N.mlp.fc{1,2}_latent_proj.{weight,bias}  decoder.layers.mlp.fc{1,2}_latent_proj.(same)
                                                   [L, latent, h] / [L, h, latent], replicated
                                                   (with ``--moe-latent-size``)
=================================================  ==========================================

With ``--moe-mlp-glu-interleave-size`` (``--moe-shared-expert-glu-interleave-size``) a rank
holds its fc1 rows interleaved in blocks; ``ChunkLayout.glu_interleaved`` names those tensors,
whose placement is then each (expert-)TP rank's rows as one contiguous run of the whole
interleaved weight (what a loader reads). Saves write them as Megatron-Core does, split in two
halves like a SwiGLU fc1 at the saving TP size (``glu_interleaved=()``), and
:mod:`megatron.checkpoint.dist.glu_interleave` reads such a file back as the whole weight.

Megatron-Core's grouped-linear spellings of a chunk's expert tensors (``--moe-single-grouped-
weight`` / ``--moe-single-grouped-bias``): ``...layers.N.mlp.experts.linear_fc1.weight``
``[El, ffn/etp, h]`` (all local experts) and per GEMM ``...linear_fc1.weight<J>`` /
``bias<J>`` map to the same keys as the loop's ``local_experts.<J>.`` names, the stacked
leading axis onto the expert axis at the chunk's first expert.

Expert tensors are stacked on the layer axis, then on the GLOBAL expert axis
(``ChunkLayout.expert_offset + J``), whatever the expert-parallel size. Expert tensor
parallelism (``--expert-tensor-parallel-size``, which may differ from TP) splits an expert's
fc1 by rows (SwiGLU: stride 2, as below) and its fc2 weight by columns, as TP splits the dense
MLP, but by the expert-TP rank and size (``ChunkLayout.expert_tp_rank`` / ``expert_tp_size``);
its fc2 bias is whole on every expert-TP rank. The router and the shared experts are laid out
by TP like every dense tensor. Only local shapes depend on the layout, never keys or global
shapes, so a file saved at any (TP, expert TP, EP, PP) loads at any other. The pre-MLP norm
of an MoE layer keeps its key ``decoder.layers.mlp.linear_fc1.layer_norm_*``.

Per-layer keys. When ``--moe-layer-freq`` is an integer above 1 or a list (any list, even all
ones), Megatron-Core calls the block "non-homogeneous" and drops the stacked layer axis: every
per-layer tensor, attention and dense MLP ones too, is stored under
``decoder.layers.<g>.<rest>`` (g: the global 0-based layer number) with the shape of one
layer, e.g. ``decoder.layers.3.self_attention.linear_qkv.weight`` [(np + 2 ng) hn, h] and
``decoder.layers.2.mlp.experts.experts.linear_fc1.weight`` [E, ffn, h] (the expert axis
stays). The extra-state entries follow: ``decoder.layers.<g>.<module>._extra_state/shard_0_1``
(an object without sharding axes) and ``decoder.layers.<g>.mlp.experts.experts.linear_fc1.
_extra_state/shard_<e>_<E>``. :attr:`ChunkLayout.per_layer` (from
:func:`per_layer_keys`) selects this layout; the default (``--moe-layer-freq 1``) stacks.

Multi-token prediction (``--mtp-num-layers``): depth K's ``mtp.layers.K.{enorm,hnorm,
final_layernorm}.weight`` [h] and ``mtp.layers.K.eh_proj.weight`` [h, 2h] (split by rows over
TP) keep their names; its transformer layer, ``mtp.layers.K.transformer_layer.<legacy layer
name>`` in a chunk's state, is stored as one layer of the per-layer layout under
``mtp.layers.K.transformer_layer.<Megatron-Core name>`` (no layer axis; the expert axis
stays), with its extra-state entries likewise, plus ``mtp.layers.K.eh_proj._extra_state``.

How a TP rank's local tensor maps into the global one follows the tensor-parallel split of
:func:`megatron.convert.megatron_layout.tp_split_rule`: rows (vocabulary, fused QKV whole
query groups, fc1), columns (linear_proj and linear_fc2 weights), or replicated. SwiGLU's fc1 is
``[gate_r; value_r]`` on rank r; globally it is ``[gate; value]`` (all gates, then all values),
so the local tensor is two pieces, at rows ``r * f`` and ``ffn + r * f`` (``f = ffn / tp``),
which is how Megatron-Core stores it too.

A replicated tensor (norms, position embeddings, row-parallel biases) is written by one rank
only: TP rank 0 of DP rank 0 (:attr:`ChunkLayout.writes_replicated`); an expert's fc2 bias by
expert-TP rank 0 of expert-DP rank 0 (:attr:`ChunkLayout.writes_expert_replicated`).
"""

import dataclasses
import re
from typing import List, Optional, Tuple

from megatron.model.module import flatten_state_dict

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
    # --softmax-type learnable: one offset per head, split over TP like the heads.
    "self_attention.core_attention.softmax_offset": "self_attention.core_attention.softmax_offset",
    # --qk-layernorm: one norm over the head size, shared by every head (replicated over TP).
    "self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias": "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias": "self_attention.k_layernorm.bias",
}
# --enable-mhc-connections: the hyper-connection mappings keep Megatron-Core's names
# (replicated over TP).
LAYER_KEYS.update({f"{site}.{name}": f"{site}.{name}"
                   for site in ("self_attention_hyper_connection", "mlp_hyper_connection")
                   for name in ("mapping_proj.weight", "alpha_pre", "alpha_post", "alpha_res",
                                "bias")})

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
    "self_attention.core_attention.softmax_offset": 0,
    "mlp.dense_h_to_4h.weight": 0, "mlp.dense_h_to_4h.bias": 0,
    "mlp.dense_4h_to_h.weight": 1,
    "language_model.embedding.word_embeddings.weight": 0,
    "language_model.output_layer.weight": 0,
    "word_embeddings_for_head.weight": 0,
}
_SWIGLU_SPLIT = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_LAYER_NAME = re.compile(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)")
LAYER_NAME = _LAYER_NAME   # a chunk's layer tensor name: (local layer number, name in the layer)

# Mixture-of-experts layer tensors (the legacy name is Megatron-Core's module name).
_MOE_KEYS = ("mlp.router.weight", "mlp.router.bias", "mlp.router.expert_bias",
             "mlp.router.qb_beta",
             "mlp.shared_experts.linear_fc1.weight",
             "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.gate_weight",
             # --moe-latent-size: whole on every tensor-parallel rank (replicated)
             "mlp.fc1_latent_proj.weight", "mlp.fc1_latent_proj.bias",
             "mlp.fc2_latent_proj.weight", "mlp.fc2_latent_proj.bias")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))")
# Megatron-Core's grouped-linear spellings of the same tensors (--moe-single-grouped-weight /
# --moe-single-grouped-bias, megatron/model/moe/grouped_tensor.py): per GEMM
# ``mlp.experts.linear_fc1.weight<J>`` (local expert J), or stacked ``mlp.experts.linear_fc1.
# weight`` [El, ...] (all local experts on a leading axis, which lands on the expert axis).
_GROUPED_NAME = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d*)")
_EXPERT_PREFIX = "mlp.experts.experts."
# The keys of the routed experts' tensors (split by the expert-TP layout).
EXPERT_KEY_PREFIX = LAYER_PREFIX + _EXPERT_PREFIX
_MOE_SPLIT_DIM = {"mlp.shared_experts.linear_fc1.weight": 0,
                  "mlp.shared_experts.linear_fc2.weight": 1,
                  "linear_fc1.weight": 0, "linear_fc1.bias": 0, "linear_fc2.weight": 1}
_MOE_SWIGLU_SPLIT = ("mlp.shared_experts.linear_fc1.weight", "linear_fc1.weight",
                     "linear_fc1.bias")

# Prefixes of the optimizer's per-parameter tensors (Adam moments) in Megatron-Core's files
# (non-distributed optimizer): ``optimizer.state.exp_avg.<model key>``, same sharding.
OPTIMIZER_STATE_PREFIX = "optimizer.state."

# --- Multi-latent attention (--multi-latent-attention) ---------------------------------------
# A chunk's MLA tensors carry Megatron-Core's MLASelfAttention names under the legacy layer
# prefix and keep them in torch_dist; the input norm and the latents' norms take the names of
# Megatron-Core's TransformerEngine spec (its default), where the latent norms are fused into
# the up projections. Its local spec's spellings (``self_attention.q_layernorm.weight``,
# ``self_attention.kv_layernorm.weight``) are read too (MLA_LOAD_ALIASES). The up projections
# and linear_q_proj split by rows (whole heads), linear_proj by columns; the down projections
# and the norms are replicated.
_MLA_LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                "linear_kv_down_proj", "linear_kv_up_proj")
MLA_LAYER_KEYS = {f"self_attention.{m}.weight": f"self_attention.{m}.weight"
                  for m in _MLA_LINEARS}
MLA_LAYER_KEYS.update({
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.q_layernorm.bias": "self_attention.linear_q_up_proj.layer_norm_bias",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.bias": "self_attention.linear_kv_up_proj.layer_norm_bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias": "self_attention.linear_proj.bias",
})
# DSA's indexer (--experimental-attention-variant dsa) sits inside MLA's core attention under
# the same names as in Megatron-Core; all of it is replicated.
_DSA_INDEXER = "self_attention.core_attention.indexer."
_DSA_LINEARS = ("linear_wq_b", "linear_wk", "linear_weights_proj")
MLA_LAYER_KEYS.update({f"{_DSA_INDEXER}{m}": f"{_DSA_INDEXER}{m}" for m in (
    "linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias",
    "linear_weights_proj.weight")})
_MLA_SPLIT_DIM = {"self_attention.linear_q_proj.weight": 0,
                  "self_attention.linear_q_up_proj.weight": 0,
                  "self_attention.linear_kv_up_proj.weight": 0,
                  "self_attention.linear_proj.weight": 1}
MLA_LOAD_ALIASES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
}


# --mla-down-proj-fusion: a chunk's ``self_attention.linear_qkv_down_proj.weight`` ``[q + c + r,
# h]`` is stored as Megatron-Core's FusedMLASelfAttention stores it, under the two unfused keys
# (rows ``:q`` as linear_q_down_proj, the rest as linear_kv_down_proj), so fused and unfused
# models read each other's files; each of the two modules keeps its extra-state entry.
MLA_FUSED_DOWN_PROJ = "self_attention.linear_qkv_down_proj.weight"
_MLA_FUSED_PARTS = ("self_attention.linear_q_down_proj.weight",
                    "self_attention.linear_kv_down_proj.weight")


def mla_attention_modules(names) -> Tuple[str, ...]:
    """The MLA linear modules (with extra state) among a layer's legacy tensor names."""
    names = list(names)
    if any(MLA_FUSED_DOWN_PROJ in n for n in names):
        names += list(_MLA_FUSED_PARTS)
    present = tuple(f"self_attention.{m}" for m in _MLA_LINEARS
                    if any(f"self_attention.{m}." in n for n in names))
    indexer = tuple(f"{_DSA_INDEXER}{m}" for m in _DSA_LINEARS
                    if any(f"{_DSA_INDEXER}{m}." in n for n in names))
    return ("self_attention.linear_proj",) + present + indexer


def stored_key(key: str, present) -> str:
    """``key``, or the Megatron-Core local-spec spelling of an MLA norm when only that one is
    ``present`` (a container of the checkpoint's keys)."""
    if key in present:
        return key
    for te_name, local_name in MLA_LOAD_ALIASES.items():
        if key.endswith(te_name):
            alias = key[:-len(te_name)] + local_name
            if alias in present:
                return alias
    return key
# --- end of multi-latent attention -----------------------------------------------------------


def per_layer_keys(moe_layer_freq) -> bool:
    """Whether a model with ``--moe-layer-freq`` ``moe_layer_freq`` is stored with per-layer
    keys: as Megatron-Core's ``TransformerBlock.sharded_state_dict`` decides, for an integer
    above 1 or any list (even all ones); None and 1 stack."""
    if moe_layer_freq is None:
        return False
    if isinstance(moe_layer_freq, int):
        return moe_layer_freq > 1
    return isinstance(moe_layer_freq, (list, tuple))


def per_layer_prefix(global_layer: int) -> str:
    """``decoder.layers.<g>.``: where layer ``global_layer``'s tensors sit in the per-layer
    layout."""
    return f"{LAYER_PREFIX}{global_layer}."


_PER_LAYER_KEY = re.compile(r"(?:.*\.)?decoder\.layers\.\d+\.")


def is_per_layer_key(key: str) -> bool:
    """Whether ``key`` (a model key, or an optimizer one ``optimizer.state.<field>.<key>``) is
    one of the per-layer layout's."""
    return _PER_LAYER_KEY.match(key) is not None


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
        num_experts: ``--num-experts`` (None: a dense model).
        expert_offset: global number of this rank's first local expert (expert parallelism).
        expert_dp_rank: its expert-data-parallel rank; only expert-DP rank 0 writes the expert
            tensors (with EP > 1 the DP ranks hold different experts; at EP 1 it equals
            ``dp_rank``).
        expert_tp_rank, expert_tp_size: its expert-tensor-parallel rank and size, which split
            the experts' tensors; None (the default) takes ``tp_rank`` / ``tp_size``, so a
            layout built without them places experts by TP as before. (They are filled in at
            construction: ``dataclasses.replace`` of ``tp_size`` alone keeps the old ones.)
        per_layer: per-layer keys without the layer axis (Megatron-Core's non-homogeneous
            block, :func:`per_layer_keys`); False: every layer tensor stacked over
            ``num_layers``.
        mla: the layers are multi-latent attention ones (``MLA_LAYER_KEYS``).
        blocks: a heterogeneous model's blocks, one per global layer
            (:mod:`megatron.core.heterogeneous`; with ``per_layer``), None otherwise.
        glu_interleaved: the MoE fc1 tensors (names in the layer, as in ``_MOE_SPLIT_DIM``)
            whose rows are GLU-interleaved (:func:`glu_interleaved_names`): split into
            contiguous rows, not in SwiGLU halves.
        mla_q_lora_rank: ``--q-lora-rank`` of an MLA model (where a fused
            ``linear_qkv_down_proj`` of ``--mla-down-proj-fusion`` splits into Megatron-Core's
            two down-projection keys); None without one.
        weight_shards, weight_shard_rank: the weight-shard group's size ``g`` and this chunk's
            place ``k`` in it (``--tensor-parallel-num-weight-shards``; 1 and 0: none).
        weight_shard_names: the names in the layer (``self_attention.dense.weight``) of the
            tensors kept as weight shards: each holds rows ``k`` of ``g`` of its TP piece
            (:func:`megatron.core.tensor_parallel.weight_shards.checkpoint_box`) and is
            written by the data-parallel ranks of the first weight-shard group.
        expert_weight_shards, expert_weight_shard_rank: the same for the routed experts'
            weight-shard group (``--expert-tensor-parallel-num-weight-shards``); their
            shards (in ``weight_shard_names`` too) are written by the expert-data-parallel
            ranks of the first expert weight-shard group.
    """

    num_layers: int
    layer_offset: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    swiglu: bool = False
    num_experts: Optional[int] = None
    expert_offset: int = 0
    expert_dp_rank: int = 0
    expert_tp_rank: Optional[int] = None
    expert_tp_size: Optional[int] = None
    per_layer: bool = False
    mla: bool = False
    blocks: Optional[tuple] = None
    glu_interleaved: Tuple[str, ...] = ()
    mla_q_lora_rank: Optional[int] = None
    weight_shards: int = 1
    weight_shard_rank: int = 0
    weight_shard_names: Tuple[str, ...] = ()
    expert_weight_shards: int = 1
    expert_weight_shard_rank: int = 0

    def __post_init__(self):
        if self.expert_tp_size is None:
            object.__setattr__(self, "expert_tp_size", self.tp_size)
        if self.expert_tp_rank is None:
            object.__setattr__(self, "expert_tp_rank", self.tp_rank)
        for what, rank, size in (("tp", self.tp_rank, self.tp_size),
                                 ("expert_tp", self.expert_tp_rank, self.expert_tp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"ChunkLayout: {what}_rank {rank} is outside {what}_size "
                                 f"{size}")

    @property
    def writes_split(self) -> bool:
        """Whether this chunk writes its pieces of TP-split tensors."""
        return self.dp_rank == 0

    @property
    def writes_replicated(self) -> bool:
        """Whether this chunk writes the tensors every TP rank holds whole."""
        return self.dp_rank == 0 and self.tp_rank == 0

    @property
    def writes_expert_split(self) -> bool:
        """Whether this chunk writes its pieces of its experts' expert-TP-split tensors."""
        return self.expert_dp_rank == 0

    @property
    def writes_expert_replicated(self) -> bool:
        """Whether this chunk writes its experts' tensors every expert-TP rank holds whole."""
        return self.expert_dp_rank == 0 and self.expert_tp_rank == 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """One piece of a local tensor inside a global tensor of the checkpoint.

    ``local_rows`` (``(start, stop)`` on dim 0 of the local tensor, None: all of it) selects
    the piece; it sits at ``global_offset`` in the tensor ``key`` of ``global_shape``. With
    stacked axes (``stacked``: 0; 1 for the layer axis, or for the expert axis of per-layer
    keys; 2 for layer and expert axes) the piece gets that many leading axes of size 1.
    ``written``: this
    chunk writes the piece (False for copies held elsewhere: replicas, the tied head).
    """

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    local_rows: Optional[Tuple[int, int]]
    stacked: int
    written: bool

    def sizes(self, local_shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The piece's sizes in the global tensor (leading 1 when stacked)."""
        shape = list(local_shape)
        if self.local_rows is not None:
            shape[0] = self.local_rows[1] - self.local_rows[0]
        return (1,) * int(self.stacked) + tuple(shape)

    def with_prefix(self, prefix: str) -> "Placement":
        """The same piece of another tensor keyed ``prefix + key`` (an optimizer moment)."""
        return dataclasses.replace(self, key=prefix + self.key)


def layer_key(legacy_layer_name: str, global_layer: Optional[int] = None,
              mla: bool = False) -> str:
    """``decoder.layers.<name>`` for a per-layer legacy name (``mlp.dense_h_to_4h.weight``;
    an expert's ``mlp.experts.local_experts.J.linear_fc1.weight`` gives the key of all
    experts); with ``global_layer``, that layer's key of the per-layer layout
    (``decoder.layers.<g>.<name>``)."""
    prefix = LAYER_PREFIX if global_layer is None else per_layer_prefix(global_layer)
    if mla and legacy_layer_name in MLA_LAYER_KEYS:
        return prefix + MLA_LAYER_KEYS[legacy_layer_name]
    if legacy_layer_name in _MOE_KEYS:
        return prefix + legacy_layer_name
    expert = _EXPERT_NAME.fullmatch(legacy_layer_name)
    if expert:
        return prefix + _EXPERT_PREFIX + expert.group(2)
    grouped = _GROUPED_NAME.fullmatch(legacy_layer_name)
    if grouped:
        return f"{prefix}{_EXPERT_PREFIX}{grouped.group(1)}.{grouped.group(2)}"
    if legacy_layer_name not in LAYER_KEYS:
        raise KeyMappingError(f"layer tensor {legacy_layer_name!r} has no Megatron-Core key "
                              f"(known: {', '.join(sorted(LAYER_KEYS))})")
    return prefix + LAYER_KEYS[legacy_layer_name]


# Multi-token prediction (``--mtp-num-layers``): depth K's own tensors keep their keys; its
# transformer layer is stored like one layer of the per-layer layout, without a layer axis.
MTP_PREFIX = "mtp.layers."
_MTP_OWN = re.compile(r"mtp\.layers\.(\d+)\.(enorm|hnorm|final_layernorm|eh_proj)\.(weight|bias)")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.transformer_layer\.(.+)")
_MTP_SPLIT_DIM = {"eh_proj": 0}


def mtp_layer_prefix(depth: int) -> str:
    """``mtp.layers.<K>.transformer_layer.``: where MTP depth K's transformer layer sits."""
    return f"{MTP_PREFIX}{depth}.transformer_layer."


def _mtp_placements(name: str, local_shape: Tuple[int, ...],
                    layout: ChunkLayout) -> Optional[List[Placement]]:
    """The placements of an MTP tensor, or None if ``name`` is not one."""
    own = _MTP_OWN.fullmatch(name)
    if own:
        dim = _MTP_SPLIT_DIM.get(own.group(2))
        shape, offset = list(local_shape), [0] * len(local_shape)
        if dim is not None:
            shape[dim], offset[dim] = local_shape[dim] * layout.tp_size, \
                local_shape[dim] * layout.tp_rank
        written = layout.writes_split if dim is not None else layout.writes_replicated
        return [Placement(name, tuple(shape), tuple(offset), None, 0, written)]
    inner = _MTP_LAYER.fullmatch(name)
    if not inner:
        return None
    as_layer = dataclasses.replace(layout, num_layers=1, layer_offset=0, per_layer=True)
    prefix = mtp_layer_prefix(int(inner.group(1)))
    pieces = placements(f"language_model.encoder.layers.0.{inner.group(2)}", local_shape,
                        as_layer)
    return [dataclasses.replace(p, key=prefix + p.key[len(per_layer_prefix(0)):])
            for p in pieces]


def mtp_extra_state_keys(depth: int, experts: Optional[range] = None,
                         num_experts: Optional[int] = None, dense: bool = True,
                         shared_expert: bool = False,
                         attention_modules: Optional[Tuple[str, ...]] = None) -> List[str]:
    """The byte entries of MTP depth ``depth``'s linear modules: its ``eh_proj`` and its
    transformer layer's (as one layer of the per-layer layout; ``shared_expert`` and
    ``attention_modules`` as for :func:`extra_state_keys`)."""
    own = [object_key(f"{MTP_PREFIX}{depth}.eh_proj._extra_state")] if dense else []
    layer = extra_state_keys(0, 1, experts, num_experts, shared_expert, dense=dense,
                             per_layer=True, attention_modules=attention_modules)
    return own + [mtp_layer_prefix(depth) + key[len(per_layer_prefix(0)):] for key in layer]


def is_expert_key(key: str) -> bool:
    """Whether the model key ``key`` (either layout, or an MTP layer's) is a routed expert's
    tensor."""
    for prefix in (LAYER_PREFIX, MTP_PREFIX):
        if key.startswith(prefix) and f".{_EXPERT_PREFIX}" in f".{key[len(prefix):]}":
            return True
    return False


def mcore_key(name: str, mla: bool = False) -> Tuple[str, Optional[int]]:
    """The Megatron-Core key of a legacy dotted name, and its local layer number (None for a
    tensor outside the layers); ``mla``: the layers are multi-latent attention ones."""
    match = _LAYER_NAME.fullmatch(name)
    if match:
        return layer_key(match.group(2), mla=mla), int(match.group(1))
    if name in OTHER_KEYS:
        return OTHER_KEYS[name], None
    raise KeyMappingError(f"{name!r} has no Megatron-Core key: only GPT models (embeddings, "
                          "layers, final norm, output layer) are stored in torch_dist")


# --- Heterogeneous blocks (--heterogeneous-layers-config-path) ---------------------------------
# Layers differ in shape, so they are stored per layer (``decoder.layers.<g>.``), as
# Megatron-Core does for a heterogeneous block. A ``replace_with_linear`` half is one
# column-parallel linear module named after the half it replaces, its norm fused into it as in
# Megatron-Core's heterogeneous layer specs:
#   ...layers.N.self_attention.{weight,bias}       decoder.layers.<g>.self_attention.{weight,bias}
#   ...layers.N.input_layernorm.{weight,bias}      decoder.layers.<g>.self_attention.layer_norm_*
#   ...layers.N.mlp.{weight,bias}                  decoder.layers.<g>.mlp.{weight,bias}
#   ...layers.N.post_attention_layernorm.*         decoder.layers.<g>.mlp.layer_norm_*
# (weight and bias split by rows over TP, norms replicated). A no-op half has no tensors.
_REPLACED_NORM = {"self_attention": "input_layernorm", "mlp": "post_attention_layernorm"}


def _replaced_halves(block) -> Tuple[str, ...]:
    return tuple(half for half, part in (("self_attention", block.attention),
                                         ("mlp", block.mlp)) if part.replace_with_linear)


def _linear_replacement_placements(name: str, local_shape: Tuple[int, ...],
                                   layout: ChunkLayout) -> Optional[List[Placement]]:
    """The placement of a linear replacement's tensor (or its norm's), or None."""
    match = _LAYER_NAME.fullmatch(name) if layout.blocks else None
    if not match:
        return None
    global_layer, inner = layout.layer_offset + int(match.group(1)), match.group(2)
    if not 0 <= global_layer < len(layout.blocks):
        raise KeyMappingError(f"{name}: global layer {global_layer} is outside the model's "
                              f"{len(layout.blocks)} blocks")
    for half in _replaced_halves(layout.blocks[global_layer]):
        module, field = inner.rsplit(".", 1) if "." in inner else (inner, "")
        shape, offset = list(local_shape), [0] * len(local_shape)
        if module == half:
            shape[0], offset[0] = local_shape[0] * layout.tp_size, local_shape[0] * layout.tp_rank
            key, written = f"{half}.{field}", layout.writes_split
        elif module == _REPLACED_NORM[half]:
            key, written = f"{half}.layer_norm_{field}", layout.writes_replicated
        else:
            continue
        return [Placement(per_layer_prefix(global_layer) + key, tuple(shape), tuple(offset),
                          None, 0, written)]
    return None


def heterogeneous_extra_state_modules(block) -> Tuple[str, ...]:
    """The linear modules (with an extra-state entry) of a heterogeneous layer."""
    modules = []
    for half, part, standard in (("self_attention", block.attention, EXTRA_STATE_MODULES[:2]),
                                 ("mlp", block.mlp, EXTRA_STATE_MODULES[2:])):
        if not part.no_op:
            modules += [half] if part.replace_with_linear else list(standard)
    return tuple(modules)
# --- end of heterogeneous blocks -------------------------------------------------------------


def placements(name: str, local_shape: Tuple[int, ...], layout: ChunkLayout) -> List[Placement]:
    """Where the local tensor ``name`` (a legacy dotted name of the chunk's state) of shape
    ``local_shape`` sits in the checkpoint, as one piece (two for SwiGLU's fc1)."""
    if layout.weight_shards > 1 or layout.expert_weight_shards > 1:
        layer = _LAYER_NAME.fullmatch(name)
        if layer is not None and layer.group(2) in layout.weight_shard_names:
            return _weight_shard_placements(name, tuple(local_shape), layout)
    mtp = _mtp_placements(name, tuple(local_shape), layout)
    if mtp is not None:
        return mtp
    replacement = _linear_replacement_placements(name, tuple(local_shape), layout)
    if replacement is not None:
        return replacement
    if layout.mla and name.endswith("." + MLA_FUSED_DOWN_PROJ):
        return _fused_down_proj_placements(name, tuple(local_shape), layout)
    key, local_layer = mcore_key(name, layout.mla)
    inner = name if local_layer is None else _LAYER_NAME.fullmatch(name).group(2)
    local_shape = tuple(local_shape)
    grouped = _GROUPED_NAME.fullmatch(inner) if local_layer is not None else None
    if grouped:
        return _grouped_expert_placements(name, inner, grouped, local_shape, layout)
    expert = _EXPERT_NAME.fullmatch(inner) if local_layer is not None else None
    local_expert = None
    if expert:
        local_expert, inner = int(expert.group(1)), expert.group(2)
        dim, swiglu_split = _MOE_SPLIT_DIM.get(inner), _MOE_SWIGLU_SPLIT
    elif inner in _MOE_KEYS:
        dim, swiglu_split = _MOE_SPLIT_DIM.get(inner), _MOE_SWIGLU_SPLIT
    elif layout.mla and inner in _MLA_SPLIT_DIM:
        dim, swiglu_split = _MLA_SPLIT_DIM[inner], ()
    else:
        dim, swiglu_split = _SPLIT_DIM.get(inner), _SWIGLU_SPLIT
    global_shape = list(local_shape)
    offset = [0] * len(local_shape)
    if local_expert is not None:  # split over the expert-TP ranks
        written = layout.writes_expert_split if dim is not None else \
            layout.writes_expert_replicated
        rank, size = layout.expert_tp_rank, layout.expert_tp_size
    else:
        written = layout.writes_split if dim is not None else layout.writes_replicated
        rank, size = layout.tp_rank, layout.tp_size
    if name == "word_embeddings_for_head.weight":
        written = False
    pieces = []
    if (dim is not None and layout.swiglu and inner in swiglu_split
            and inner not in layout.glu_interleaved):
        if local_shape[0] % 2:
            raise KeyMappingError(f"{name}: a SwiGLU fc1 needs an even number of rows, has "
                                  f"{local_shape[0]}")
        half = local_shape[0] // 2
        global_shape[0] = local_shape[0] * size
        ffn = half * size
        for k in range(2):
            offset[0] = k * ffn + rank * half
            pieces.append((tuple(offset), (k * half, (k + 1) * half)))
    else:
        if dim is not None:
            global_shape[dim] = local_shape[dim] * size
            offset[dim] = local_shape[dim] * rank
        pieces.append((tuple(offset), None))
    stacked = int(local_layer is not None)
    if local_expert is not None:
        if layout.num_experts is None:
            raise KeyMappingError(f"{name}: an expert tensor, but the layout has no "
                                  "num_experts (--num-experts)")
        global_expert = layout.expert_offset + local_expert
        if not 0 <= global_expert < layout.num_experts:
            raise KeyMappingError(f"{name}: global expert {global_expert} is outside the "
                                  f"model's {layout.num_experts} experts")
        global_shape = [layout.num_experts] + global_shape
        pieces = [((global_expert,) + off, rows) for off, rows in pieces]
        stacked = 2
    if local_layer is not None:
        global_layer = layout.layer_offset + local_layer
        if not 0 <= global_layer < layout.num_layers:
            raise KeyMappingError(f"{name}: global layer {global_layer} is outside the model's "
                                  f"{layout.num_layers} layers (layer offset "
                                  f"{layout.layer_offset})")
        if layout.per_layer:  # the layer is in the key, not on an axis
            key = layer_key(inner if local_expert is None else expert.group(0), global_layer,
                            layout.mla)
            stacked -= 1
        else:
            global_shape = [layout.num_layers] + global_shape
            pieces = [((global_layer,) + off, rows) for off, rows in pieces]
    return [Placement(key, tuple(global_shape), off, rows, stacked, written)
            for off, rows in pieces]


def _weight_shard_placements(name: str, local_shape: Tuple[int, ...],
                             layout: ChunkLayout) -> List[Placement]:
    """A weight shard's piece: its TP piece's placement (the shard's rows times ``g``), moved
    down by ``k`` shards along the rows; Megatron's offsets (see ``checkpoint_box``)."""
    inner = _LAYER_NAME.fullmatch(name).group(2)
    expert = bool(_EXPERT_NAME.fullmatch(inner) or _GROUPED_NAME.fullmatch(inner))
    if expert:
        g, k, dp_rank = (layout.expert_weight_shards, layout.expert_weight_shard_rank,
                         layout.expert_dp_rank)
        flag = "--expert-tensor-parallel-num-weight-shards"
    else:
        g, k, dp_rank = layout.weight_shards, layout.weight_shard_rank, layout.dp_rank
        flag = "--tensor-parallel-num-weight-shards"
    rows = local_shape[0]
    whole = placements(name, (rows * g,) + local_shape[1:],
                       dataclasses.replace(layout, weight_shards=1, expert_weight_shards=1))
    if len(whole) != 1:
        whole = _contiguous_rows(whole, len(local_shape), rows * g)
    if len(whole) != 1:
        raise KeyMappingError(f"{name}: a SwiGLU / GeGLU fc1 cut into weight shards "
                              f"({flag}) has no single piece in a torch_dist checkpoint")
    place = whole[0]
    offset = list(place.global_offset)
    offset[len(offset) - len(local_shape)] += k * rows
    # The ranks of the first (expert) weight-shard group are (expert-)data-parallel ranks
    # 0 .. g-1.
    return [dataclasses.replace(place, global_offset=tuple(offset), written=dp_rank < g)]


def _contiguous_rows(pieces: List[Placement], ndim: int, rows: int) -> List[Placement]:
    """``pieces`` as one placement when they lie end to end along the rows both in the local
    tensor (of ``rows`` rows) and in the global one (e.g. a GLU-interleaved fc1 at one TP rank,
    whose two halves follow each other), else unchanged."""
    ordered = sorted(pieces, key=lambda p: (p.local_rows or (0, rows))[0])
    first = ordered[0]
    axis = len(first.global_offset) - ndim
    local_next, global_next = 0, first.global_offset[axis]
    for piece in ordered:
        start, stop = piece.local_rows or (0, rows)
        offset = piece.global_offset
        if (start != local_next or offset[axis] != global_next or piece.key != first.key
                or offset[:axis] + offset[axis + 1:] != first.global_offset[:axis]
                + first.global_offset[axis + 1:]):
            return pieces
        local_next, global_next = stop, global_next + stop - start
    if local_next != rows:
        return pieces
    return [dataclasses.replace(first, local_rows=None)]


def glu_interleaved_names(moe_config) -> Tuple[str, ...]:
    """The MoE fc1 tensors an ``MoEConfig`` lays out GLU-interleaved."""
    names: Tuple[str, ...] = ()
    if moe_config is None:
        return names
    if moe_config.moe_mlp_glu_interleave_size is not None:
        names += ("linear_fc1.weight", "linear_fc1.bias")
    if moe_config.moe_shared_expert_glu_interleave_size is not None:
        names += ("mlp.shared_experts.linear_fc1.weight",)
    return names


def _fused_down_proj_placements(name: str, local_shape: Tuple[int, ...],
                                layout: ChunkLayout) -> List[Placement]:
    """The two pieces of a fused MLA down projection: rows ``:q`` and ``q:``, each placed as
    the unfused projection's whole (replicated) tensor."""
    q = layout.mla_q_lora_rank
    if q is None or not 0 < q < local_shape[0]:
        raise KeyMappingError(f"{name}: a fused MLA down projection of {local_shape[0]} rows "
                              f"needs the layout's --q-lora-rank below that, got {q}")
    base = name[:-len(MLA_FUSED_DOWN_PROJ)]
    pieces = []
    for part, rows in zip(_MLA_FUSED_PARTS, ((0, q), (q, local_shape[0]))):
        shape = (rows[1] - rows[0],) + local_shape[1:]
        pieces += [dataclasses.replace(p, local_rows=rows)
                   for p in placements(base + part, shape, layout)]
    return pieces


def _grouped_expert_placements(name: str, inner: str, grouped, local_shape: Tuple[int, ...],
                               layout: ChunkLayout) -> List[Placement]:
    """The placements of a grouped-linear expert tensor: those of the loop's spelling for a
    per-GEMM one; for a stacked one ``[El, ...]``, local expert 0's piece with the expert axis
    widened to El (its leading dim is the local tensor's first)."""
    linear, kind, gemm = grouped.groups()
    as_loop = f"{name[:-len(inner)]}mlp.experts.local_experts.{gemm or 0}.{linear}.{kind}"
    if gemm:
        return placements(as_loop, local_shape, layout)
    pieces = placements(as_loop, local_shape[1:], layout)
    if len(pieces) == 2 and layout.expert_tp_size == 1:   # SwiGLU's halves, contiguous
        pieces = [dataclasses.replace(pieces[0], local_rows=None)]
    if len(pieces) != 1:
        raise KeyMappingError(f"{name}: a stacked SwiGLU fc1 split over "
                              f"--expert-tensor-parallel-size {layout.expert_tp_size} is not "
                              "stored in torch_dist here; drop --moe-single-grouped-weight "
                              "(per-GEMM weights, the same computation)")
    return [dataclasses.replace(pieces[0], stacked=pieces[0].stacked - 1)]


def expert_names(tree: dict) -> List[str]:
    """The dotted names of a chunk's state with every grouped-linear expert tensor spelled per
    local expert (``mlp.experts.local_experts.<J>.linear_fc1.weight``), as the loop names them:
    what counting a layer's local experts reads."""
    names = []
    for name, tensor in flatten_state_dict(tree).items():
        match = _GROUPED_NAME.search(name)
        if match is None or not name.endswith(match.group(0)):
            names.append(name)
            continue
        head = name[:-len(match.group(0))]
        linear, kind, gemm = match.groups()
        gemms = [gemm] if gemm else range(tensor.shape[0])
        names += [f"{head}mlp.experts.local_experts.{j}.{linear}.{kind}" for j in gemms]
    return names


def object_key(key: str, offset: Tuple[int, ...] = (0,), shape: Tuple[int, ...] = (1,)) -> str:
    """The storage name of a byte entry (Megatron-Core's sharded object): ``key/shard_<offset>_
    <shape>``, each joined with dots: ``common_state/shard_0_1``, ``rng_state/shard_0.1_1.2``."""
    if len(offset) != len(shape):
        raise ValueError(f"{key}: offset {offset} and shape {shape} differ in length")
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def extra_state_keys(global_layer: int, num_layers: int, experts: Optional[range] = None,
                     num_experts: Optional[int] = None, shared_expert: bool = False,
                     dense: bool = True, per_layer: bool = False,
                     attention_modules: Optional[Tuple[str, ...]] = None,
                     latent: bool = False) -> List[str]:
    """The byte entries of one layer's linear modules' extra state (``latent``: an MoE layer's
    ``fc{1,2}_latent_proj`` too, TransformerEngine linears in Megatron-Core). For an MoE layer
    (``experts``: the global numbers of this rank's experts, of ``num_experts``) the MLP's are
    one per expert, ``decoder.layers.mlp.experts.experts.linear_fc{1,2}._extra_state/
    shard_<layer>.<expert>_<L>.<E>`` (as Megatron-Core writes them), and the shared expert's;
    ``dense`` False leaves out all but the experts' (written by another rank at EP > 1).
    ``per_layer``: the per-layer layout's entries, ``decoder.layers.<g>.<module>._extra_state/
    shard_0_1`` (no sharding axis: Megatron-Core's offset ``(0,)`` of shape ``(1,)``) and
    ``decoder.layers.<g>.mlp.experts.experts.linear_fc1._extra_state/shard_<expert>_<E>``.
    ``attention_modules``: the attention's linear modules (None: ``linear_proj`` and
    ``linear_qkv``; multi-latent attention's come from :func:`mla_attention_modules`)."""
    attention = EXTRA_STATE_MODULES[:2] if attention_modules is None else attention_modules
    if experts is None:
        modules = attention + EXTRA_STATE_MODULES[2:]
    elif not dense:
        modules = ()
    else:
        modules = attention + (
            ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
            if shared_expert else ()) + (
            ("mlp.fc1_latent_proj", "mlp.fc2_latent_proj") if latent else ())
    if per_layer:
        prefix, layer_offset, layer_shape = per_layer_prefix(global_layer), (), ()
    else:
        prefix, layer_offset, layer_shape = LAYER_PREFIX, (global_layer,), (num_layers,)
    keys = [object_key(f"{prefix}{module}._extra_state", layer_offset or (0,),
                       layer_shape or (1,))
            for module in modules]
    for expert in experts or ():
        for fc in ("linear_fc1", "linear_fc2"):
            keys.append(object_key(f"{prefix}{_EXPERT_PREFIX}{fc}._extra_state",
                                   layer_offset + (expert,), layer_shape + (num_experts,)))
    return keys


# -- TransformerEngine layer specs (--transformer-impl) ---------------------------------------
#
# Megatron-Core's TransformerEngine spec fuses each dense layer's input norm into
# ``self_attention.linear_qkv`` (a LayerNorm + linear module: ``layer_norm_weight`` /
# ``layer_norm_bias``) and its pre-MLP norm into ``mlp.linear_fc1``; its local spec keeps
# ``input_layernorm`` / ``pre_mlp_layernorm`` modules but maps them onto the same fused names
# when it writes torch_dist, so both specs' dense files carry the fused names above. Files
# written without that mapping (older or hand-made ones, and the TransformerEngine spec's MoE
# layers, whose pre-MLP norm stays a module of its own) hold the unfused names; a reader takes
# either (:func:`fused_norm_aliases`). The specs differ in the linear modules' extra state:
# None for local layers, an empty uint8 tensor for TransformerEngine ones without fp8 state
# (:func:`extra_state_value`).

TRANSFORMER_ENGINE = "transformer_engine"

# Unfused module name -> (fused module name, the attention module a standard layer has).
_UNFUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_"}
_UNFUSED_NORM_KEY = re.compile(r"(.*(?:decoder\.layers\.(?:\d+\.)?|\.transformer_layer\.))"
                               r"(input_layernorm|pre_mlp_layernorm)\.(weight|bias)")


def extra_state_value(transformer_impl: str = "local"):
    """What a linear module's ``_extra_state`` byte entry holds for ``--transformer-impl``:
    None (local layers) or TransformerEngine's empty uint8 tensor (no fp8 state to keep)."""
    if transformer_impl == TRANSFORMER_ENGINE:
        import torch

        return torch.empty(0, dtype=torch.uint8)
    return None


def fused_norm_aliases(saved_keys) -> dict:
    """``{fused key: saved key}`` for every unfused layer-norm tensor key among ``saved_keys``
    (model keys, or optimizer ones under a prefix) whose layer has a standard fused-QKV
    attention (``<layer>self_attention.linear_qkv.weight`` saved under the same prefix), so
    that a file with either spelling loads. A multi-latent attention layer keeps a separate
    ``input_layernorm`` in every spec, so only its ``pre_mlp_layernorm`` is renamed (which
    Megatron-Core's local MLA spec writes unfused, its TransformerEngine spec fused)."""
    saved = set(saved_keys)
    aliases = {}
    for key in saved:
        match = _UNFUSED_NORM_KEY.fullmatch(key)
        if not match:
            continue
        layer, module, field = match.groups()
        mla = (module == "pre_mlp_layernorm"
               and f"{layer}self_attention.linear_kv_down_proj.weight" in saved)
        if f"{layer}self_attention.linear_qkv.weight" not in saved and not mla:
            continue
        fused = f"{layer}{_UNFUSED_NORMS[module]}{field}"
        if fused not in saved:
            aliases[fused] = key
    return aliases


_FUSED_PRE_MLP_NORM = re.compile(r"(.*decoder\.layers\.(?:(\d+)\.)?)mlp\.linear_fc1\."
                                 r"layer_norm_(weight|bias)")


def te_moe_norm_key(key: str, moe_layers) -> str:
    """The key Megatron-Core's TransformerEngine spec gives ``key`` (a model or optimizer key):
    an MoE layer's pre-MLP norm is a module of its own there, ``<layer>pre_mlp_layernorm.*``;
    every other key is unchanged. ``moe_layers``: the global numbers of the MoE layers, or
    True when the stacked layer axis holds MoE layers only."""
    match = _FUSED_PRE_MLP_NORM.fullmatch(key)
    if not match:
        return key
    layer, number, field = match.groups()
    is_moe = moe_layers is True if number is None else (
        moe_layers is not True and int(number) in moe_layers)
    return f"{layer}pre_mlp_layernorm.{field}" if is_moe else key

"""The canonical, layout-free form a checkpoint passes through on its way between formats.

A *loader* turns a checkpoint (Megatron at any TP / PP, or a Hugging Face folder) into a stream
of :class:`Piece` objects; a *saver* consumes the stream and writes another format. Only one
layer is in flight at a time, so converting needs memory for about one layer plus the embeddings.

The stream is, in order::

    Piece("meta", meta=ModelMeta)
    Piece("embeddings", {"word_embeddings": [V_rows, h], "position_embeddings": [P, h]?})
    Piece("layer", {...}, index=0) ... Piece("layer", {...}, index=L-1)
    Piece("final_norm", {"weight": [h], "bias": [h]?})
    Piece("output_layer", {"weight": [V_rows, h]})          (untied embeddings only)
    Piece("mtp", {...}, index=0) ... Piece("mtp", {...}, index=K-1)  (``meta.mtp_num_layers``)

An ``mtp`` piece is one multi-token prediction depth, named as in the model's ``mtp.layers.K``
state: ``enorm.weight`` [h], ``hnorm.weight`` [h], ``eh_proj.weight`` [h, 2h] (columns:
embedding half first), ``final_layernorm.weight`` [h] (and each norm's ``bias`` with
LayerNorm), and ``transformer_layer.<layer tensor>`` for every tensor of a layer (the table
below), MoE or dense as the last decoder layer is.

A BERT (``meta.model_type == "BERT"``) has no output layer (its LM head is tied to the word
embeddings); its embeddings piece carries ``"tokentype_embeddings": [T, h]`` when
``meta.num_tokentypes`` > 0, and the heads follow the final norm, as :func:`bert_head_shapes`
lists them::

    Piece("pooler", {"dense.weight": [h, h], "dense.bias": [h]})          (with the binary head)
    Piece("lm_head", {"dense.weight": [h, h], "dense.bias": [h], "layernorm.weight": [h],
                      "layernorm.bias": [h], "bias": [V_rows]})
    Piece("binary_head", {"weight": [2, h], "bias": [2]})                 (with the binary head)

Tensors are whole (tensor-parallel shards already joined) and named as in Megatron's layer
state dict, in Megatron's unsharded layout:

====================================  ============================================================
key                                   shape and layout
====================================  ============================================================
input_layernorm.weight / .bias        [h] (no bias with RMSNorm)
self_attention.query_key_value.weight [(np + 2 ng) hn, h]; rows per query group g as
                                      [q heads of g (np/ng x hn); k (hn); v (hn)]; ng = np
                                      without GQA, i.e. Megatron's [np, 3, hn] order
self_attention.query_key_value.bias   [(np + 2 ng) hn] same order (with --add-bias-linear or
                                      --add-qkv-bias)
self_attention.dense.weight / .bias   [h, np hn], [h]
post_attention_layernorm.weight/.bias [h]
mlp.dense_h_to_4h.weight / .bias      [ffn, h] (GeLU) or [2 ffn, h] = [gate; value] (SwiGLU)
mlp.dense_4h_to_h.weight / .bias      [h, ffn], [h]
mlp.router.weight                     [E, h] (MoE models, in place of the two above)
mlp.router.expert_bias                [E] float32 (--moe-router-enable-expert-bias)
mlp.experts.local_experts.J.          [moe_ffn, h] or [2 moe_ffn, h] = [gate; value] (SwiGLU),
  linear_fc1.weight / .bias           expert J of E (global number; the stream is at EP 1)
mlp.experts.local_experts.J.          [h, moe_ffn], [h]
  linear_fc2.weight / .bias
mlp.shared_experts.linear_fc1.weight  [S, h] or [2 S, h] = [gate; value] (SwiGLU); S =
                                      --moe-shared-expert-intermediate-size
mlp.shared_experts.linear_fc2.weight  [h, S]
mlp.shared_experts.gate_weight        [1, h] (--moe-shared-expert-gate)
self_attention.core_attention.        [np] one extra softmax logit per head (--softmax-type
  softmax_offset                      learnable)
====================================  ============================================================

With ``meta.multi_latent_attention`` the attention tensors are instead, as the model names them
(H heads, d / r / dv / c / q the qk, rotary, value, kv-latent and q-latent sizes):
``self_attention.linear_q_proj.weight`` [H (d + r), h] or, with a q rank,
``linear_q_down_proj.weight`` [q, h], ``q_layernorm.weight`` [q] and ``linear_q_up_proj.weight``
[H (d + r), q]; ``linear_kv_down_proj.weight`` [c + r, h], ``kv_layernorm.weight`` [c],
``linear_kv_up_proj.weight`` [H (d + dv), c], ``linear_proj.weight`` [h, H dv] (the norms with
``qk_layernorm``).

Word embeddings (and an untied output layer, and BERT's ``lm_head`` bias) keep the rows the
source has: ``V_rows`` is the source's padded vocabulary size for a Megatron checkpoint
(``meta.padded_vocab_size``), the tokenizer's size for a Hugging Face folder.
``meta.vocab_size`` is always the tokenizer's true size; savers trim to it or pad from it as
their format requires (see :func:`fit_vocab_rows`).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple, Union

import torch


class ConversionError(RuntimeError):
    """A checkpoint that cannot be converted; the message names the file, flag or feature."""


@dataclasses.dataclass
class ModelMeta:
    """Everything about the model a saver needs besides the tensors.

    Field names and values follow the training flags (``--position-embedding-type``,
    ``--normalization`` ...), so a Megatron saver can write them straight into ``args``.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    max_position_embeddings: int
    vocab_size: int                      # the tokenizer's size (no padding)
    padded_vocab_size: int               # rows the source's embedding table has
    position_embedding_type: str = "learned_absolute"   # or "rope", "yarn"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    # Rotary rescalings, as the flags of the same names: Llama 3.1's (with rope) and YaRN's
    # (position_embedding_type "yarn"; None: Megatron-Core's default).
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: Optional[float] = None
    yarn_beta_slow: Optional[float] = None
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: Optional[bool] = None
    normalization: str = "LayerNorm"     # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False
    # --quick-geglu, --glu-linear-offset, --activation-func-clamp-value (gpt-oss's MLP).
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    apply_residual_connection_post_layernorm: bool = False
    qk_layernorm: bool = False           # --qk-layernorm: q_layernorm / k_layernorm per layer
    # --window-size (left, right) and --window-attn-skip-freq (int, or one 0/1 per layer), as
    # the flags hold them (None: full attention); --softmax-type.
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, Tuple[int, ...]]] = None
    softmax_type: str = "vanilla"
    # --multi-latent-attention and its sizes (the attention tensors are then those of
    # :mod:`megatron.model.multi_latent_attention`; kv_channels is unused).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    params_dtype: torch.dtype = torch.float32
    seq_length: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    # Tokenizer: the training flag values and the files they name (absolute paths or None).
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    # Training position of the source (0 for a Hugging Face folder).
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    # "GPT" or "BERT" (``--model-type`` of tools/checkpoint/convert.py). BERT only: rows of the
    # token-type table (0: none) and whether the pooler and binary head exist (Megatron's
    # ``args.bert_binary_head``; ``--bert-no-binary-head`` clears it).
    model_type: str = "GPT"
    num_tokentypes: int = 0
    bert_binary_head: bool = False
    # Mixture of experts (``--num-experts`` ...; None: a dense model). The MoE layers are
    # those ``--moe-layer-freq`` marks (:meth:`is_moe_layer`), with a shared expert when its
    # size is set (gated with ``--moe-shared-expert-gate``); the other layers are dense
    # (``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h`` of ``ffn_hidden_size``).
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None            # None: ffn_hidden_size
    moe_router_score_function: str = "softmax"           # or "sigmoid"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False          # mlp.router.expert_bias [E], float32
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    # ``--moe-aux-loss-coeff`` of the ``aux_loss`` balancing type, from a Hugging Face config's
    # ``router_aux_loss_coef`` (None: the config has none, or the source is a Megatron
    # checkpoint, whose saved args carry their own balancing flags in ``source_args``).
    moe_aux_loss_coeff: Optional[float] = None
    # ``--moe-layer-freq`` in Megatron's own form: an int N (layers 0, N, 2N, ... 0-based) or
    # a list of one 0/1 per layer (what Megatron-LM's args hold, so a target's saved args
    # read back the same).
    moe_layer_freq: Union[int, List[int]] = 1
    # --mtp-num-layers (0: none): multi-token prediction depths after the decoder, streamed as
    # ``mtp`` pieces (see the module docstring).
    mtp_num_layers: int = 0
    # The source's full argument namespace as a dict (Megatron sources only): a Megatron saver
    # starts from it so that flags unrelated to the shape (optimizer, data ...) survive.
    source_args: Optional[dict] = None
    # Megatron sources with Adam state that can be carried (megatron.checkpoint.optimizer_state):
    # {"step", "hparams" by (wd_mult, lr_mult), "has_main", "grad_scaler"}; else None, and
    # ``optimizer_note`` says why.
    optimizer: Optional[dict] = None
    optimizer_note: str = ""

    @property
    def rope_scaling_fields(self) -> Dict[str, object]:
        """The rotary rescaling fields above, by name (= the flags' dests)."""
        return {name: getattr(self, name) for name in ROPE_SCALING_FIELDS}

    @property
    def gated_linear_unit(self) -> bool:
        """Whether fc1 holds ``[gate; linear]`` halves (SwiGLU or quick GeGLU)."""
        return self.swiglu or self.quick_geglu

    @property
    def group_query_attention(self) -> bool:
        return self.num_query_groups != self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer ``index`` (0-based) has an MoE MLP."""
        if not self.num_experts:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return index % freq == 0
        return bool(freq[index])

    @property
    def expert_ffn_size(self) -> int:
        """Hidden size of one expert's MLP (``--moe-ffn-hidden-size``, else
        ``--ffn-hidden-size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


ROPE_SCALING_FIELDS = ("use_rope_scaling", "rope_scaling_factor", "rotary_scaling_factor",
                       "yarn_original_max_position_embeddings", "yarn_beta_fast",
                       "yarn_beta_slow", "mscale", "mscale_all_dim",
                       "yarn_correction_range_round_to_int")


@dataclasses.dataclass
class Piece:
    """One item of the stream: ``kind`` is meta, embeddings, layer, final_norm, output_layer or
    (BERT) pooler, lm_head, binary_head."""

    kind: str
    tensors: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    index: Optional[int] = None           # layer number (0-based, global) for kind == "layer"
    meta: Optional[ModelMeta] = None      # for kind == "meta"


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: the smallest multiple of ``divisible_by * tp_size`` >= vocab_size."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def fit_vocab_rows(table: torch.Tensor, vocab_size: int, rows: int) -> torch.Tensor:
    """``table`` with exactly ``rows`` rows: rows past the source's are zeros, and rows past
    ``rows`` are dropped, which is only allowed for padding (index >= ``vocab_size``)."""
    if rows < vocab_size:
        raise ConversionError(f"cannot fit a vocabulary of {vocab_size} tokens into {rows} rows")
    have = table.size(0)
    if have >= rows:
        return table[:rows].clone()
    out = table.new_zeros((rows,) + tuple(table.shape[1:]))
    out[:have] = table
    return out


# The one BERT head tensor with a row per vocabulary entry (split over TP like the embeddings).
BERT_VOCAB_TENSOR = ("lm_head", "bias")
Shapes = Dict[str, Tuple[int, ...]]


def bert_head_shapes(meta: ModelMeta, vocab_rows: int) -> List[Tuple[str, Shapes]]:
    """``(kind, {tensor name: shape})`` of every BERT head piece, in stream order, with
    ``vocab_rows`` rows for the ``lm_head`` bias. The pooler and binary head exist only with
    ``meta.bert_binary_head``. The LM head's norm is a LayerNorm (with bias) and its linear
    layers have biases whatever ``--normalization`` / ``--disable-bias-linear`` say."""
    h = meta.hidden_size
    lm_head = {"dense.weight": (h, h), "dense.bias": (h,), "layernorm.weight": (h,),
               "layernorm.bias": (h,), "bias": (vocab_rows,)}
    pieces = []
    if meta.bert_binary_head:
        pieces.append(("pooler", {"dense.weight": (h, h), "dense.bias": (h,)}))
    pieces.append(("lm_head", lm_head))
    if meta.bert_binary_head:
        pieces.append(("binary_head", {"weight": (2, h), "bias": (2,)}))
    return pieces

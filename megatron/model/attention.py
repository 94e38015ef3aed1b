"""Self-attention split over tensor-parallel ranks by heads (or query groups).

``query_key_value`` is a column-parallel projection whose output rows are ordered per query
group as ``[groups, heads_per_group + 2, head_dim]`` (queries of the group's heads, then its key,
then its value). Without grouped-query attention a group is one head and this is Megatron's
``[heads, 3, head_dim]`` layout. With ``--attention-output-gate`` each group also holds its
heads' gate rows, after its queries: ``[queries, gates, key, value]`` (Megatron-Core's order).
Because the rows of one group are contiguous, the column split
hands each tensor-parallel rank whole groups, and no communication is needed until ``dense``, a
row-parallel projection that sums the ranks' partial outputs.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.context_parallel import context_parallel_attention, window_mask_rows
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import divide
from megatron.core.mup import attention_scale as mup_attention_scale
from megatron.core.utils import init_method_normal
from megatron.fused_kernels.softmax import (FusedScaleMaskSoftmax, attention_mask_func,
                                            causal_mask, sliding_window_mask)
from megatron.model import block_causal
from megatron.model.enums import AttnMaskType
from megatron.model.module import MegatronModule
from megatron.model.norms import L2Norm, get_norm
from megatron.model.rotary_pos_embedding import apply_rotary_pos_emb, rotary_attention_scale


# Elements of one block of logits computed apart from scaled_dot_product_attention for
# --qk-clip / --log-max-attention-logit (16 Mi fp32 values: 64 MiB).
MAX_LOGIT_BLOCK_ELEMENTS = 1 << 24


def dropout_rng_context(active: bool):
    """The tensor-parallel RNG fork when a dropout will draw random numbers, else nothing.

    Dropout that is off (evaluation, or probability 0) draws nothing, so skipping the fork then
    changes no result and lets models run without a seeded tracker.
    """
    if not active:
        return contextlib.nullcontext()
    return tensor_parallel.get_cuda_rng_tracker().fork()


def qk_clip_eta(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """QK-clip's ``eta = min(1, threshold / max logit)`` per entry (1 where the maximum is
    at or under the threshold, so a head whose logits are all negative is left alone), in
    fp64: the factors are rounded once, to the dtype of the weight they scale."""
    max_logits = max_logits.double()
    return torch.where(max_logits > threshold, threshold / max_logits,
                       torch.ones_like(max_logits))


def head_row_factors(columns) -> torch.Tensor:
    """One factor per output row of a projection whose rows are ordered per head (or query
    group): ``columns`` lists ``(factor [n], rows)`` in the order of each head's rows, and the
    result is ``[n * sum(rows)]``."""
    return torch.cat([f[:, None].expand(-1, rows) for f, rows in columns], dim=1).reshape(-1)


class CoreAttention(MegatronModule):
    """``softmax(q k^T / sqrt(d) + mask) v`` for this rank's heads.

    Two bodies computing the same function: the explicit one (``baddbmm``, scaled masked softmax,
    dropout, ``bmm``) and, with ``--use-flash-attn``,
    ``torch.nn.functional.scaled_dot_product_attention`` (flash or memory-efficient kernels where
    the device has them). Attention dropout draws from the tensor-parallel RNG stream, since each
    rank holds different heads.

    A windowed layer (``config.layer_window``) adds the banded mask of
    :func:`~megatron.fused_kernels.softmax.sliding_window_mask` to whatever mask it is given;
    both bodies take it. ``--softmax-type off-by-one|learnable`` adds one logit per head to the
    softmax denominator (``softmax_offset``: zeros, or a parameter of this rank's heads, split
    over tensor-parallel ranks like the heads); scaled_dot_product_attention has no such term,
    so those layers always take the explicit body.

    With ``--qk-clip`` or ``--log-max-attention-logit`` a training forward also keeps each
    head's largest unmasked logit in ``current_max_attn_logits`` (read off the explicit body's
    scores; computed apart, in blocks, for scaled_dot_product_attention, which never
    materialises them), for :mod:`megatron.optimizer.qk_clip`.

    Args:
        config: the transformer config.
        layer_number: 1-based global layer number (query-key layer scaling divides by it; the
            window pattern is read by it).
        num_heads: attention heads on this rank.
        attn_mask_type: causal for GPT (a missing mask then means causal).
        tp_group: the tensor-parallel group (for a learnable softmax offset).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, num_heads: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, tp_group=None,
                 softmax_scale: Optional[float] = None):
        super().__init__(config)
        self.attn_mask_type = attn_mask_type
        self.num_heads = num_heads
        self.hidden_size_per_head = config.kv_channels
        self.use_flash_attn = config.use_flash_attn
        self.attention_dropout_p = config.attention_dropout
        self.window_size = config.layer_window(layer_number)
        if (self.window_size is not None and attn_mask_type == AttnMaskType.causal
                and self.window_size[1] != 0):
            raise ConfigError(f"--window-size {self.window_size[0]},{self.window_size[1]}: "
                              "causal attention (GPT) sees no later key; the right side "
                              "must be 0")
        coeff = None
        # softmax_scale: multi-latent attention's own (its query/key head dim and YaRN's mscale).
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_head) if softmax_scale is None
                              else softmax_scale)
        self.norm_factor = (math.sqrt(self.hidden_size_per_head) if softmax_scale is None
                            else 1.0 / softmax_scale)
        if config.use_mup and softmax_scale is None:
            self.softmax_scale, self.norm_factor = mup_attention_scale(
                self.hidden_size_per_head, config.mup_base_head_dim, config.mup_attn_scale_power)
        softmax_in_fp32 = config.attention_softmax_in_fp32
        if config.apply_query_key_layer_scaling:
            # Scores are divided by the layer number before the half-precision matmul output
            # (avoiding overflow) and multiplied back inside the fp32 softmax.
            coeff = max(1, layer_number)
            self.norm_factor *= coeff
            softmax_in_fp32 = True
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            config.fp16, config.bf16, attn_mask_type, config.masked_softmax_fusion,
            attention_mask_func, softmax_in_fp32, coeff)
        self.attention_dropout = torch.nn.Dropout(config.attention_dropout)
        self._make_softmax_offset(config, tp_group)
        # --qk-clip / --log-max-attention-logit: each head's largest logit over the training
        # forwards since the last optimizer step (``[num_heads]`` fp32, Megatron-Core's name);
        # not a buffer: it is never saved, and the step that reads it resets it to None.
        self.track_max_logits = config.tracks_max_attention_logit
        self.layer_scaling_coeff = coeff or 1
        self.current_max_attn_logits: Optional[torch.Tensor] = None

    def _make_softmax_offset(self, config: TransformerConfig, tp_group) -> None:
        """``softmax_offset`` ``[num_heads]`` (Megatron-Core's name): absent for vanilla, a
        zero buffer (not saved) for off-by-one, a parameter for learnable: N(0,
        --init-method-std^2) for all heads (also with --init-method-xavier-uniform, which has
        no meaning for a vector), split over ``tp_group`` like them."""
        if config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(
                self.num_heads, dtype=config.params_dtype), persistent=False)
        elif config.softmax_type == "learnable":
            # Drawn for all heads on the CPU (as the linear layers' weights are), then this
            # rank's contiguous block of heads kept, so any TP split holds the same values.
            every_head = torch.empty(config.num_attention_heads,
                                     dtype=torch.promote_types(config.params_dtype,
                                                               torch.float32))
            if config.perform_initialization:
                init_method_normal(config.init_method_std)(every_head)
            else:
                every_head.zero_()
            first = get_group_rank(tp_group) * self.num_heads
            self.softmax_offset = torch.nn.Parameter(
                every_head[first:first + self.num_heads].to(config.params_dtype).clone())
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        else:
            self.softmax_offset = None

    def _with_window(self, attention_mask: Optional[torch.Tensor], sq: int, sk: int,
                     device) -> Optional[torch.Tensor]:
        """The mask with this layer's window added (None means causal, or nothing with a
        padding mask type)."""
        if self.window_size is None:
            return attention_mask
        band = sliding_window_mask(sq, sk, self.window_size, device=device)   # [sq, sk]
        if attention_mask is None:
            if self.attn_mask_type == AttnMaskType.causal:
                band = band | causal_mask(sq, sk, device=device)
            return band[None, None]                                           # [1, 1, sq, sk]
        return attention_mask | band

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """``[sq, b, np, hn]`` query, ``[sk, b, np, hn]`` key and value -> ``[sq, b, np * hn]``.

        ``attention_mask``: bool broadcastable to ``[b, np, sq, sk]``, True = masked; None means
        causal.
        """
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        attention_mask = self._with_window(attention_mask, sq, sk, query.device)
        if self.use_flash_attn and self.softmax_offset is None:
            return self._sdpa_forward(query, key, value, attention_mask)
        if self._in_blocks(query, attention_mask, sq, sk):
            hv = value.size(-1)
            q, k, v = (t.reshape(t.size(0), b * np_, t.size(-1)).transpose(0, 1)
                       for t in (query, key, value))                     # [b*np, s, h]
            context = block_causal.block_causal_attention(q, k, v, 1.0 / self.norm_factor)
            context = context.view(b, np_, sq, hv).permute(2, 0, 1, 3)   # [sq, b, np, hv]
            return context.reshape(sq, b, np_ * hv)
        q = query.reshape(sq, b * np_, hn).transpose(0, 1)               # [b*np, sq, hn]
        k = key.reshape(sk, b * np_, hn).permute(1, 2, 0)                # [b*np, hn, sk]
        scores = torch.baddbmm(
            torch.empty(b * np_, sq, sk, dtype=query.dtype, device=query.device), q, k,
            beta=0.0, alpha=1.0 / self.norm_factor)                      # [b*np, sq, sk]
        if self.track_max_logits and self.training:
            # Query-key layer scaling divided the scores by its coefficient; the logit is
            # the product (the softmax multiplies it back).
            self._record_max_logits(scores.view(b, np_, sq, sk), attention_mask,
                                    self.layer_scaling_coeff)
        probs = self.scale_mask_softmax(scores.view(b, np_, sq, sk), attention_mask,
                                        self.softmax_offset)
        with dropout_rng_context(self.training and self.attention_dropout_p > 0):
            probs = self.attention_dropout(probs)                        # [b, np, sq, sk]
        hv = value.size(-1)                 # the value head dim (MLA's may differ from hn)
        v = value.reshape(sk, b * np_, hv).transpose(0, 1)               # [b*np, sk, hv]
        context = torch.bmm(probs.view(b * np_, sq, sk), v)              # [b*np, sq, hv]
        context = context.view(b, np_, sq, hv).permute(2, 0, 1, 3)       # [sq, b, np, hv]
        return context.reshape(sq, b, np_ * hv)                          # [sq, b, np*hv]

    def _in_blocks(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], sq: int,
                   sk: int) -> bool:
        """Whether the explicit body runs as :mod:`megatron.model.block_causal` (the same
        function, skipping the masked blocks): plain causal self-attention (no mask, window,
        softmax offset or layer-scaling coefficient), nothing reading the full probabilities
        (active attention dropout, the max-logit record), and a shape and device it applies
        to."""
        return (attention_mask is None and self.attn_mask_type == AttnMaskType.causal
                and self.softmax_offset is None and self.layer_scaling_coeff == 1
                and not (self.training and (self.attention_dropout_p > 0
                                            or self.track_max_logits))
                and block_causal.applies(query, sq, sk))

    def _record_max_logits(self, logits: torch.Tensor, attention_mask: Optional[torch.Tensor],
                           coeff: float = 1) -> None:
        """Fold the largest unmasked entry of each head of ``logits`` ``[b, np, sq, sk]``
        (times ``coeff``) into ``current_max_attn_logits``."""
        sq, sk = logits.shape[-2:]
        if attention_mask is None and self.attn_mask_type == AttnMaskType.causal:
            attention_mask = causal_mask(sq, sk, device=logits.device)[None, None]
        logits = logits.detach()
        if attention_mask is not None:                   # one copy of the scores, in their dtype
            logits = logits.masked_fill(attention_mask, float("-inf"))
        batch_max = logits.amax(dim=(0, 2, 3)).float() * coeff            # [np]
        if self.current_max_attn_logits is None:
            self.current_max_attn_logits = batch_max
        else:
            self.current_max_attn_logits = torch.maximum(self.current_max_attn_logits,
                                                         batch_max)

    @torch.no_grad()
    def _record_max_logits_apart(self, query: torch.Tensor, key: torch.Tensor,
                                 attention_mask: Optional[torch.Tensor]) -> None:
        """The logits scaled_dot_product_attention never materialises, computed for the
        maximum alone: ``[b, np, rows, sk]`` blocks of query rows (fp32), so memory stays
        bounded on long sequences. ``query`` ``[sq, b, np, hn]``, ``key`` ``[sk, b, np, hn]``."""
        sq, sk = query.size(0), key.size(0)
        if attention_mask is None and self.attn_mask_type == AttnMaskType.causal:
            attention_mask = causal_mask(sq, sk, device=query.device)[None, None]
        q = query.permute(1, 2, 0, 3).float()                            # [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0).float()                              # [b, np, hn, sk]
        rows = max(1, MAX_LOGIT_BLOCK_ELEMENTS // max(1, sk * q.size(0) * q.size(1)))
        for start in range(0, sq, rows):
            block = torch.matmul(q[:, :, start:start + rows], k) * self.softmax_scale
            mask = attention_mask
            if mask is not None and mask.size(-2) > 1:     # else broadcast over query rows
                mask = mask[..., start:start + rows, :]
            self._record_max_logits(block, mask)

    def _sdpa_forward(self, query, key, value, attention_mask):
        if self.track_max_logits and self.training:
            self._record_max_logits_apart(query, key, attention_mask)
        sq, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, np, s, hn]
        is_causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal
        keep = None if attention_mask is None else ~attention_mask
        dropout_p = self.attention_dropout_p if self.training else 0.0
        with dropout_rng_context(dropout_p > 0):
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale)                                # [b, np, sq, hv]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)            # [sq, b, np*hv]


@dataclass(frozen=True)
class ContextParallelSetup:
    """How one attention layer runs under context parallelism: the cp group, this layer's
    ``--cp-comm-type`` and, for ``a2a+p2p``, the hierarchical subgroups."""

    group: object
    comm_type: str
    hierarchical_groups: Optional[Tuple[object, object]] = None

    @classmethod
    def build(cls, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
              cp_group, hierarchical_cp_groups=None) -> Optional["ContextParallelSetup"]:
        """None without context parallelism (a cp group of one rank)."""
        if get_group_size(cp_group) == 1:
            return None
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError("--context-parallel-size > 1 supports causal self-attention "
                             "(GPT) only")
        comm_type = config.layer_cp_comm_type(layer_number)
        if comm_type == "a2a+p2p" and hierarchical_cp_groups is None:
            raise ConfigError(f"--cp-comm-type a2a+p2p (layer {layer_number}) needs "
                              "--hierarchical-context-parallel-sizes")
        return cls(cp_group, comm_type, hierarchical_cp_groups)

    def attend(self, core_attention: CoreAttention, query, key, value, attention_mask,
               training: bool, softmax_scale: float):
        """This rank's queries over the whole sequence, with the layer's window (a mask by
        global position), softmax offset and dropout (on the tensor-parallel RNG stream, as
        in :class:`CoreAttention`): ``[s/cp, b, np * hv]``."""
        dropout_p = core_attention.attention_dropout_p if training else 0.0
        window = core_attention.window_size
        if window is not None:
            cp = get_group_size(self.group)
            band = window_mask_rows(query.size(0) * cp, cp, get_group_rank(self.group),
                                    window, device=query.device)         # [1, 1, s/cp, s]
            attention_mask = band if attention_mask is None else attention_mask | band
        with dropout_rng_context(dropout_p > 0):
            return context_parallel_attention(
                query, key, value, cp_group=self.group, comm_type=self.comm_type,
                attention_mask=attention_mask, dropout_p=dropout_p, softmax_scale=softmax_scale,
                softmax_offset=core_attention.softmax_offset,
                hierarchical_groups=self.hierarchical_groups)


class ParallelAttention(MegatronModule):
    """Self-attention: fused QKV projection, optional query/key norms (``--qk-layernorm``, named
    ``q_layernorm`` / ``k_layernorm`` as in Megatron-Core; ``--qk-l2-norm``: a weightless
    :class:`~megatron.model.norms.L2Norm` there instead), optional rotary embedding (not on the
    layers ``--no-rope-freq`` names), core attention, an optional sigmoid output gate
    (``--attention-output-gate``: ``context * sigmoid(gate)`` per head channel, the gate
    projected with the queries), ``dense``.

    Args:
        config: the transformer config.
        layer_number: 1-based global layer number.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        tp_size: its size.
        sequence_parallel: input and output are ``[s/tp, b, h]``.
        init_method: initialiser of ``query_key_value``.
        output_layer_init_method: initialiser of ``dense``.
        attn_mask_type: ``causal`` (GPT) or ``padding`` (BERT: bidirectional; the mask passed
            to :meth:`forward` hides padding, and a missing mask hides nothing).
        cp_group: the context-parallel group (None: whole sequences on this rank). With more
            than one rank, the input holds this rank's tokens of every sequence
            (:func:`~megatron.core.context_parallel.chunk_positions`) and core attention runs
            over the whole sequence by this layer's ``config.cp_comm_type`` exchanges.
        hierarchical_cp_groups: the (inner all-to-all, outer ring) subgroups of ``cp_group``
            for ``--cp-comm-type a2a+p2p``.
        weight_shard_group: the weight-shard group of ``query_key_value`` and ``dense``
            (:mod:`megatron.core.tensor_parallel.weight_shards`; None: none).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group, tp_size: int,
                 sequence_parallel: bool, init_method, output_layer_init_method,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_group=None,
                 hierarchical_cp_groups=None, weight_shard_group=None):
        super().__init__(config)
        self.cp = ContextParallelSetup.build(config, layer_number, attn_mask_type, cp_group,
                                             hierarchical_cp_groups)
        self.cp_group = None if self.cp is None else self.cp.group
        hn = config.kv_channels
        self.num_heads = divide(config.num_attention_heads, tp_size,
                                "--num-attention-heads over --tensor-model-parallel-size")
        self.num_groups = divide(config.num_query_groups, tp_size,
                                 "--num-query-groups over --tensor-model-parallel-size")
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.hidden_size_per_head = hn
        self.layer_number = layer_number
        self.checkpoint_core_attention = config.recomputes("core_attn")
        self.output_gate = config.attention_output_gate
        self.use_rope = config.layer_uses_rope(layer_number)
        gate_heads = config.num_attention_heads if self.output_gate else 0
        qkv_size = (config.num_attention_heads + gate_heads + 2 * config.num_query_groups) * hn
        self.query_key_value = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, qkv_size, init_method=init_method, tp_group=tp_group,
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
            sequence_parallel=sequence_parallel, params_dtype=config.params_dtype,
            weight_shard_group=weight_shard_group)
        self.attn_mask_type = attn_mask_type
        self.core_attention = CoreAttention(config, layer_number, self.num_heads,
                                            attn_mask_type, tp_group)
        self.dense = tensor_parallel.RowParallelLinear(
            config.num_attention_heads * hn, config.hidden_size,
            init_method=output_layer_init_method, tp_group=tp_group,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=sequence_parallel, params_dtype=config.params_dtype,
            weight_shard_group=weight_shard_group)
        self.rotary_interleaved = config.rotary_interleaved
        self.rotary_mscale = rotary_attention_scale(config)    # YaRN's concentration, else 1
        self.q_layernorm = self.k_layernorm = None
        if config.qk_l2_norm:   # Megatron-Core's spec puts it in place of --qk-layernorm
            self.q_layernorm = L2Norm(config.layernorm_epsilon)
            self.k_layernorm = L2Norm(config.layernorm_epsilon)
        elif config.qk_layernorm:
            self.q_layernorm = get_norm(config, hidden_size=hn)
            self.k_layernorm = get_norm(config, hidden_size=hn)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                # Replicated over TP ranks, but each rank normalises only its own heads: the
                # gradients are partial sums, added over the TP group before the step.
                param.sum_grad_over_tp = True

    def qk_clip_row_factors(self, threshold: float, alpha: float):
        """``[(query_key_value.weight, factor per row)]`` for QK-clip, or ``[]`` when no head
        of this rank exceeded ``threshold`` since the last step.

        As Megatron-Core: one ``eta`` per query group, from the largest logit of the group's
        heads (they share its key); the group's query rows are scaled by ``eta ** alpha``, its
        key rows by ``eta ** (1 - alpha)``; gate and value rows, and biases, are untouched.
        """
        maxima = self.core_attention.current_max_attn_logits
        if maxima is None:
            return []
        group_max = maxima.view(self.num_groups, self.heads_per_group).amax(dim=1)   # [ng]
        if not bool((group_max > threshold).any()):
            return []
        eta = qk_clip_eta(group_max, threshold)
        ones, hn = torch.ones_like(eta), self.hidden_size_per_head
        gate_rows = self.heads_per_group * hn if self.output_gate else 0
        factors = head_row_factors([(eta.pow(alpha), self.heads_per_group * hn),
                                    (ones, gate_rows), (eta.pow(1.0 - alpha), hn), (ones, hn)])
        return [(self.query_key_value.weight, factors)]

    def split_qkv(self, mixed: torch.Tensor):
        """``[s, b, groups * (heads_per_group (x2 with the gate) + 2) * hn]`` -> query
        ``[s, b, np, hn]``, key and value ``[s, b, groups, hn]``, gate ``[s, b, np * hn]``
        (None without ``--attention-output-gate``)."""
        s, b = mixed.shape[:2]
        hn, per_group = self.hidden_size_per_head, self.heads_per_group
        gate_rows = per_group * hn if self.output_gate else 0
        mixed = mixed.view(s, b, self.num_groups, (per_group + 2) * hn + gate_rows)
        query, gate, key, value = torch.split(mixed, [per_group * hn, gate_rows, hn, hn], dim=3)
        gate = gate.reshape(s, b, self.num_heads * hn) if self.output_gate else None
        return query.reshape(s, b, self.num_heads, hn), key, value, gate

    def _gated(self, context: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """``context * sigmoid(gate)`` (the sigmoid in fp32 at least, as Megatron-Core), or the
        context unchanged without a gate; both ``[s, b, np * hn]``."""
        if gate is None:
            return context
        gate = gate.to(torch.promote_types(gate.dtype, torch.float32))
        return (context * torch.sigmoid(gate)).to(context.dtype)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_params=None):
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> (output, bias) of the
        same shape; the bias is returned unadded for the bias-dropout-add that follows.

        With ``inference_params`` (a
        :class:`~megatron.text_generation.inference_params.InferenceParams`) the ``s`` tokens
        are the ones at positions ``sequence_len_offset ..``: their keys and values join the
        cache and the queries attend over all cached positions (causally, when
        ``attention_mask`` is None). ``rotary_pos_emb`` must then hold those positions' angles.
        """
        mixed, _ = self.query_key_value(hidden_states)       # [s, b, ng*(np/ng+2)*hn] local
        query, key, value, gate = self.split_qkv(mixed)
        if not self.use_rope:
            rotary_pos_emb = None
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)                  # over hn, per head
            key = self.k_layernorm(key)
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, self.rotary_interleaved,
                                         self.rotary_mscale)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.rotary_interleaved,
                                       self.rotary_mscale)
        if inference_params is not None:
            key, value = self._update_kv_cache(key, value, inference_params)  # [sk, b, ng, hn]
            if attention_mask is None and self.attn_mask_type == AttnMaskType.causal:
                # Query i sits at position offset + i: the causal mask is aligned bottom-right.
                attention_mask = causal_mask(query.size(0), key.size(0),
                                             device=query.device)[None, None]  # [1, 1, sq, sk]
        if self.cp_group is not None and inference_params is None:
            # Keys and values travel between cp ranks unexpanded (one per query group).
            if self.checkpoint_core_attention and torch.is_grad_enabled():
                context = tensor_parallel.checkpoint(
                    lambda q, k, v: self._context_parallel_attention(q, k, v, attention_mask),
                    False, query, key, value)
            else:
                context = self._context_parallel_attention(query, key, value, attention_mask)
            return self.dense(self._gated(context, gate))    # context: [s/cp, b, np*hn]
        if self.heads_per_group > 1:
            key = key.repeat_interleave(self.heads_per_group, dim=2)       # [s, b, np, hn]
            value = value.repeat_interleave(self.heads_per_group, dim=2)
        if self.checkpoint_core_attention and torch.is_grad_enabled():
            context = self._checkpointed_attention_forward(query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)  # [s, b, np*hn]
        return self.dense(self._gated(context, gate))

    def _context_parallel_attention(self, query, key, value, attention_mask):
        """This rank's queries ``[s/cp, b, np, hn]`` over the whole sequence's keys and values
        (``[s/cp, b, ng, hn]`` each) -> ``[s/cp, b, np * hn]``."""
        return self.cp.attend(self.core_attention, query, key, value, attention_mask,
                              self.training, self.core_attention.softmax_scale)

    def _update_kv_cache(self, key: torch.Tensor, value: torch.Tensor, inference_params):
        """Write this step's ``[s, b, ng, hn]`` keys and values into the layer's cache at
        ``sequence_len_offset`` and return every cached position up to them,
        ``[offset + s, b, ng, hn]``."""
        cache = inference_params.key_value_memory_dict
        if self.layer_number not in cache:
            shape = (inference_params.max_sequence_length, inference_params.max_batch_size,
                     self.num_groups, self.hidden_size_per_head)
            cache[self.layer_number] = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=value.dtype, device=value.device))
        key_memory, value_memory = cache[self.layer_number]
        seq_start = inference_params.sequence_len_offset
        seq_end = seq_start + key.size(0)
        batch_start = inference_params.batch_size_offset
        batch_end = batch_start + key.size(1)
        if seq_end > key_memory.size(0) or batch_end > key_memory.size(1):
            raise ValueError(
                f"key/value cache of layer {self.layer_number} holds "
                f"{key_memory.size(0)} positions x {key_memory.size(1)} sequences; this step "
                f"needs positions up to {seq_end} and sequences up to {batch_end}")
        key_memory[seq_start:seq_end, batch_start:batch_end] = key
        value_memory[seq_start:seq_end, batch_start:batch_end] = value
        return (key_memory[:seq_end, batch_start:batch_end],
                value_memory[:seq_end, batch_start:batch_end])

    def _checkpointed_attention_forward(self, query, key, value, attention_mask):
        """Core attention without keeping its ``[b, np, s, s]`` intermediates (selective
        recomputation): they are recomputed, with the same dropout mask, in backward."""
        def custom_forward(q, k, v):
            return self.core_attention(q, k, v, attention_mask)
        return tensor_parallel.checkpoint(custom_forward, False, query, key, value)

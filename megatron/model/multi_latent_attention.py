"""Multi-latent attention (``--multi-latent-attention``, DeepSeek-V2/V3), split over
tensor-parallel ranks by heads.

With ``H`` heads, ``d = --qk-head-dim``, ``r = --qk-pos-emb-head-dim``, ``dv = --v-head-dim``:

- query: ``linear_q_proj`` ``[H (d + r), h]``, or with ``--q-lora-rank q`` the bottleneck
  ``linear_q_down_proj`` ``[q, h]`` -> ``q_layernorm`` -> ``linear_q_up_proj`` ``[H (d + r), q]``;
  each head's rows are ``[d no-position | r rotary]``.
- key/value: ``linear_kv_down_proj`` ``[c + r, h]`` (``c = --kv-lora-rank``) gives the latent
  ``c`` and one rotary key part ``r`` shared by every head; ``kv_layernorm`` normalises the
  latent and ``linear_kv_up_proj`` ``[H (d + dv), c]`` makes each head's ``[d key | dv value]``.
- the rotary angles turn only the ``r`` position channels, taken as neighbouring pairs
  ``(2i, 2i + 1)`` (DeepSeek's layout: de-interleaved to halves, then rotated);
  the scores are scaled by ``m^2 / sqrt(d + r)``, ``m`` YaRN's ``0.1 --mscale-all-dim ln s + 1``
  (1 without YaRN); ``linear_proj`` ``[h, H dv]`` is row-parallel.

The norms exist with ``--qk-layernorm`` (as Megatron-Core builds them; DeepSeek sets it). The
down projections are replicated on every tensor-parallel rank and the up projections split by
heads. Under sequence parallelism each rank projects its own tokens down and the small latents
are all-gathered; the replicated weights' gradients are then partial sums (marked
``sequence_parallel`` for the tensor-parallel all-reduce).

Under context parallelism each rank projects its own tokens (chunks ``r`` and ``2 cp - 1 - r``)
and rotates their position channels by their global positions (the angles the model hands in
are already this rank's); the whole heads' keys ``[d + r]`` and values ``[dv]`` then go to
:func:`~megatron.core.context_parallel.context_parallel_attention` by the layer's
``--cp-comm-type``, as for standard attention.

``--mla-down-proj-fusion`` (needs ``--q-lora-rank``) makes the two down projections one
replicated ``linear_qkv_down_proj`` ``[q + c + r, h]`` (rows ``[query | latent | rotary key]``),
drawn as the two separate ones would be, so a fused model computes the unfused one's function.
Its ``torch_dist`` checkpoint keeps Megatron-Core's separate ``linear_q_down_proj`` /
``linear_kv_down_proj`` keys (either model loads the other's); a ``--ckpt-format torch`` state
holds ``linear_qkv_down_proj.weight``, and either spelling loads into either model.

``--cache-mla-latents`` (generation only): the key/value cache of a layer holds, per token, the
normalised latent and the rotated shared key ``[c + r]`` instead of every head's expanded key
and value. The key half of ``linear_kv_up_proj`` is absorbed into the query (``q_nope W_uk``,
``[c]`` per head, beside the rotary ``[r]``), attention runs over the cached ``[c + r]`` with the
latent ``[c]`` as value, and the value half ``W_uv`` maps each head's context back to ``[dv]``:
``q_nope . (W_uk l) = (W_uk^T q_nope) . l`` and ``sum_j p_j W_uv l_j = W_uv sum_j p_j l_j``, so the
logits are those of the expanded cache up to rounding.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import device, tensor_parallel
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import divide
from megatron.fused_kernels.softmax import causal_mask
from megatron.model.attention import (ContextParallelSetup, CoreAttention, head_row_factors,
                                      qk_clip_eta)
from megatron.model.dsa import DSAttention
from megatron.model.enums import AttnMaskType
from megatron.model.module import MegatronModule
from megatron.model.norms import get_norm
from megatron.model.recompute import recomputed
from megatron.model.rotary_pos_embedding import (YarnSettings, apply_rotary_pos_emb,
                                                 rotary_attention_scale, yarn_get_mscale)


def mla_softmax_scale(config: TransformerConfig) -> float:
    """``m^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, ``m`` YaRN's all-dim mscale of
    ``--rotary-scaling-factor`` and ``--mscale-all-dim`` (1 at factor 1), whichever rotary
    ``--rope-type`` picks, as Megatron-Core computes it."""
    yarn = YarnSettings.from_config(config)
    mscale = yarn_get_mscale(yarn.scaling_factor, yarn.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class ReplicatedLinear(torch.nn.Module):
    """``y = x W^T`` with the whole ``W`` ``[out, in]`` on every tensor-parallel rank, drawn on
    the CPU from the default generator (as the parallel layers draw their full weights).

    ``sequence_parallel``: each rank sees its own tokens, so the gradient is a partial sum.
    """

    def __init__(self, input_size: int, output_size: int, init_method, params_dtype,
                 sequence_parallel: bool):
        super().__init__()
        master = torch.empty(output_size, input_size, dtype=torch.promote_types(
            params_dtype, torch.float32))
        init_method(master)
        self.weight = torch.nn.Parameter(master.to(params_dtype).to(
            device.current_device()))
        set_tensor_model_parallel_attributes(self.weight, False, 0, 1)
        self.weight.sequence_parallel = sequence_parallel

    @classmethod
    def fused(cls, parts, sequence_parallel: bool) -> "ReplicatedLinear":
        """One replicated linear whose weight stacks the rows of ``parts`` (in order)."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        with torch.no_grad():
            weight = torch.cat([part.weight for part in parts], dim=0)
        module.weight = torch.nn.Parameter(weight)
        set_tensor_model_parallel_attributes(module.weight, False, 0, 1)
        module.weight.sequence_parallel = sequence_parallel
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


FUSED_DOWN_PROJ = "linear_qkv_down_proj.weight"
SPLIT_DOWN_PROJS = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Channels ``[x0, x1, x2, x3, ..]`` -> ``[x0, x2, .., x1, x3, ..]``."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


class MultiLatentAttention(MegatronModule):
    """Megatron-Core's ``MLASelfAttention`` (module and parameter names), for this rank's
    heads. Takes the arguments of :class:`~megatron.model.attention.ParallelAttention`."""

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group, tp_size: int,
                 sequence_parallel: bool, init_method, output_layer_init_method,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_group=None,
                 hierarchical_cp_groups=None):
        super().__init__(config)
        self.cp = ContextParallelSetup.build(config, layer_number, attn_mask_type, cp_group,
                                             hierarchical_cp_groups)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.layer_number = layer_number
        self.num_heads = divide(config.num_attention_heads, tp_size,
                                "--num-attention-heads over --tensor-model-parallel-size")
        self.qk_head_dim, self.pos_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        q_head = self.qk_head_dim + self.pos_dim
        heads = config.num_attention_heads
        dtype, sp = config.params_dtype, self.sequence_parallel

        def up(in_size, out_size):
            return tensor_parallel.ColumnParallelLinear(
                in_size, out_size, init_method=init_method, tp_group=tp_group, bias=False,
                gather_output=False, sequence_parallel=False, params_dtype=dtype)

        self.q_layernorm = self.kv_layernorm = None
        if config.q_lora_rank is None:
            self.linear_q_proj = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, heads * q_head, init_method=init_method, tp_group=tp_group,
                bias=False, gather_output=False, sequence_parallel=sequence_parallel,
                params_dtype=dtype)
        else:
            self.linear_q_down_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank,
                                                       init_method, dtype, sp)
            if config.qk_layernorm:
                self.q_layernorm = get_norm(config, hidden_size=config.q_lora_rank)
            self.linear_q_up_proj = up(config.q_lora_rank, heads * q_head)
        self.linear_kv_down_proj = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.pos_dim, init_method, dtype, sp)
        if config.qk_layernorm:
            self.kv_layernorm = get_norm(config, hidden_size=self.kv_lora_rank)
        self.linear_kv_up_proj = up(self.kv_lora_rank,
                                    heads * (self.qk_head_dim + self.v_head_dim))
        self.q_lora_rank = config.q_lora_rank
        if config.mla_down_proj_fusion:
            self.linear_qkv_down_proj = ReplicatedLinear.fused(
                (self.linear_q_down_proj, self.linear_kv_down_proj), sp)
            del self.linear_q_down_proj, self.linear_kv_down_proj
        self.cache_mla_latents = config.cache_mla_latents
        self.dsa = config.experimental_attention_variant == "dsa"
        if self.dsa:
            self.core_attention = DSAttention(config, layer_number, init_method,
                                              mla_softmax_scale(config),
                                              rotary_attention_scale(config), tp_group, tp_size)
        else:
            self.core_attention = CoreAttention(config, layer_number, self.num_heads,
                                                attn_mask_type, tp_group,
                                                softmax_scale=mla_softmax_scale(config))
        self.linear_proj = tensor_parallel.RowParallelLinear(
            heads * self.v_head_dim, config.hidden_size, init_method=output_layer_init_method,
            tp_group=tp_group, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, sequence_parallel=sequence_parallel, params_dtype=dtype)
        self.rotary_interleaved = config.rotary_interleaved
        self.rotary_mscale = rotary_attention_scale(config)
        self.checkpoint_core_attention = config.recomputes("core_attn")
        self.recompute_up_proj = config.recomputes("mla_up_proj")

    def qk_clip_row_factors(self, threshold: float, alpha: float):
        """``[(query weight, factor per row), (linear_kv_up_proj.weight, factor per row)]``
        for QK-clip, or ``[]`` when no head of this rank exceeded ``threshold``.

        As Megatron-Core: per head ``eta``, the query's no-position rows scaled by
        ``eta ** alpha`` and its rotary rows by ``eta`` (the rotary key is shared by all heads
        and stays as it is), the key rows of ``linear_kv_up_proj`` by ``eta ** (1 - alpha)``,
        the value rows untouched.
        """
        maxima = self.core_attention.current_max_attn_logits
        if maxima is None or not bool((maxima > threshold).any()):
            return []
        eta = qk_clip_eta(maxima, threshold)                               # [np]
        d, r = self.qk_head_dim, self.pos_dim
        query = (self.linear_q_proj if hasattr(self, "linear_q_proj")
                 else self.linear_q_up_proj).weight
        return [(query, head_row_factors([(eta.pow(alpha), d), (eta, r)])),
                (self.linear_kv_up_proj.weight,
                 head_row_factors([(eta.pow(1.0 - alpha), d),
                                   (torch.ones_like(eta), self.v_head_dim)]))]

    def _down(self, proj: ReplicatedLinear, hidden_states: torch.Tensor) -> torch.Tensor:
        """A replicated down projection of ``[s(/tp), b, h]`` -> ``[s, b, rank]`` (this rank's
        tokens' latents gathered under sequence parallelism; the gather's backward keeps this
        rank's slice, the up projection having summed the heads' gradients already)."""
        latent = proj(hidden_states)
        if self.sequence_parallel:
            latent = tensor_parallel.gather_from_sequence_parallel_region(
                latent, self.tp_group, tensor_parallel_output_grad=False)
        return latent

    def _rotate(self, t: torch.Tensor, rotary_pos_emb: torch.Tensor) -> torch.Tensor:
        """Rotate position channels ``[s, b, n, r]`` as neighbouring pairs."""
        if not self.rotary_interleaved:
            t = _deinterleave(t)
        return apply_rotary_pos_emb(t, rotary_pos_emb, self.rotary_interleaved,
                                    self.rotary_mscale)

    def _whole(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The detached hidden states of the whole sequence (gathered under sequence
        parallelism), for the indexer."""
        x = hidden_states.detach()
        if self.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, self.tp_group, tensor_parallel_output_grad=False)
        return x

    def _down_latents(self, hidden_states: torch.Tensor):
        """``[s(/tp), b, h]`` -> (query latent ``[s, b, q]``, None without --q-lora-rank;
        key/value latent with the rotary key ``[s, b, c + r]``), fused or not."""
        if hasattr(self, "linear_qkv_down_proj"):
            fused = self._down(self.linear_qkv_down_proj, hidden_states)    # [s, b, q+c+r]
            return torch.split(fused, [self.q_lora_rank, self.kv_lora_rank + self.pos_dim],
                               dim=-1)
        q_latent = None
        if not hasattr(self, "linear_q_proj"):
            q_latent = self._down(self.linear_q_down_proj, hidden_states)   # [s, b, q]
        return q_latent, self._down(self.linear_kv_down_proj, hidden_states)

    def _query(self, hidden_states: torch.Tensor,
               latent: Optional[torch.Tensor]) -> torch.Tensor:
        """``[s(/tp), b, h]`` (or its query ``latent`` ``[s, b, q]``) -> ``[s, b, np, d + r]``
        before rotation. Under DSA keeps the indexer's inputs: the whole sequence's hidden
        states and query latent."""
        if hasattr(self, "linear_q_proj"):
            query, _ = self.linear_q_proj(hidden_states)
            if self.dsa:
                self._dsa_inputs = (self._whole(hidden_states),) * 2
        else:
            if self.q_layernorm is not None:
                latent = self.q_layernorm(latent)
            if self.dsa:
                self._dsa_inputs = (self._whole(hidden_states), latent)
            query, _ = self.linear_q_up_proj(latent)
        s, b = query.shape[:2]
        return query.view(s, b, self.num_heads, self.qk_head_dim + self.pos_dim)

    def _rotated_parts(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor):
        """``[s(/tp), b, h]`` -> the query's parts ``[s, b, np, d]`` and rotated ``[s, b, np, r]``,
        the normed key/value latent ``[s, b, c]`` and the rotated shared key ``[s, b, 1, r]``."""
        q_latent, kv = self._down_latents(hidden_states)                    # kv: [s, b, c+r]
        return self._up_parts(hidden_states, q_latent, kv, rotary_pos_emb)

    def _up_parts(self, hidden_states: Optional[torch.Tensor], q_latent: Optional[torch.Tensor],
                  kv: torch.Tensor, rotary_pos_emb: torch.Tensor):
        """:meth:`_rotated_parts` from the down projections' outputs (the hidden states are
        read only without --q-lora-rank, or by DSA's indexer)."""
        d, r = self.qk_head_dim, self.pos_dim
        query = self._query(hidden_states, q_latent)                        # [s, b, np, d+r]
        q_nope, q_pos = torch.split(query, [d, r], dim=-1)
        latent, k_pos = torch.split(kv, [self.kv_lora_rank, r], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        # This rank's heads use the shared rotary key: its gradient is summed over the ranks.
        k_pos = tensor_parallel.copy_to_tensor_model_parallel_region(k_pos, self.tp_group)
        return (q_nope, self._rotate(q_pos, rotary_pos_emb), latent,
                self._rotate(k_pos.unsqueeze(2), rotary_pos_emb))

    def qkv_projection(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor):
        """``[s(/tp), b, h]`` -> query, key ``[s, b, np, d + r]`` and value ``[s, b, np, dv]``:
        the down and up projections with the rotary parts applied (Megatron-Core's
        ``get_query_key_value_tensors``, the span ``--offload-modules qkv_linear`` covers)."""
        q_latent, kv = self._down_latents(hidden_states)                    # kv: [s, b, c+r]
        if self.recompute_up_proj and torch.is_grad_enabled():
            # --recompute-modules mla_up_proj: only the projections' inputs are kept.
            if q_latent is None:
                return recomputed(lambda h, c: self._expanded(h, None, c, rotary_pos_emb),
                                  hidden_states, kv)
            return recomputed(lambda q, c: self._expanded(None, q, c, rotary_pos_emb),
                              q_latent, kv)
        return self._expanded(hidden_states, q_latent, kv, rotary_pos_emb)

    def _expanded(self, hidden_states: Optional[torch.Tensor], q_latent: Optional[torch.Tensor],
                  kv: torch.Tensor, rotary_pos_emb: torch.Tensor):
        """The down projections' outputs -> query, key and value (:meth:`qkv_projection` after
        the down projections)."""
        d = self.qk_head_dim
        q_nope, q_pos, latent, k_pos = self._up_parts(hidden_states, q_latent, kv,
                                                      rotary_pos_emb)
        kv, _ = self.linear_kv_up_proj(latent)                              # [s, b, np*(d+dv)]
        s, b = kv.shape[:2]
        kv = kv.view(s, b, self.num_heads, d + self.v_head_dim)
        k_nope, value = torch.split(kv, [d, self.v_head_dim], dim=-1)
        query = torch.cat((q_nope, q_pos), dim=-1)                           # [s, b, np, d+r]
        key = torch.cat((k_nope, k_pos.expand(-1, -1, self.num_heads, -1)), dim=-1)
        return query, key, value.contiguous()

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_params=None):
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> (output, bias), as
        :meth:`~megatron.model.attention.ParallelAttention.forward`."""
        if rotary_pos_emb is None:
            raise ConfigError("--multi-latent-attention needs rotary positions "
                              "(--position-embedding-type rope or yarn)")
        if self.cache_mla_latents and self.training:
            raise ConfigError("--cache-mla-latents is for generation (a model in eval mode); "
                              "it conflicts with training: drop it from training runs")
        if inference_params is not None and self.cache_mla_latents:
            q_nope, q_pos, latent, k_pos = self._rotated_parts(hidden_states, rotary_pos_emb)
            return self._latent_cache_attention(q_nope, q_pos, latent, k_pos, attention_mask,
                                                inference_params)
        query, key, value = self.qkv_projection(hidden_states, rotary_pos_emb)
        if inference_params is not None:
            if self.dsa:
                raise ConfigError("--experimental-attention-variant dsa: generation with a "
                                  "key/value cache is not built yet")
            key, value = self._update_kv_cache(key, value, inference_params)
            if attention_mask is None:   # query i sits at position offset + i
                attention_mask = causal_mask(query.size(0), key.size(0),
                                             device=query.device)[None, None]
        if self.cp is not None and inference_params is None:
            def attend(q, k, v):                                         # -> [s/cp, b, np*dv]
                return self.cp.attend(self.core_attention, q, k, v, attention_mask,
                                      self.training, self.core_attention.softmax_scale)
        elif self.dsa:
            x, qr = self._dsa_inputs
            self._dsa_inputs = None

            def attend(q, k, v):                                         # -> [s, b, np*dv]
                return self.core_attention(q, k, v, attention_mask, x, qr, rotary_pos_emb)
        else:
            def attend(q, k, v):                                         # -> [s, b, np*dv]
                return self.core_attention(q, k, v, attention_mask)
        if self.checkpoint_core_attention and torch.is_grad_enabled():
            context = tensor_parallel.checkpoint(attend, False, query, key, value)
        else:
            context = attend(query, key, value)
        return self.linear_proj(context)

    def _update_kv_cache(self, key: torch.Tensor, value: torch.Tensor, inference_params):
        """Write this step's expanded keys ``[s, b, np, d + r]`` and values ``[s, b, np, dv]``
        into the layer's cache at ``sequence_len_offset`` and return every cached position up
        to them (without --cache-mla-latents: the expanded keys and values)."""
        cache = inference_params.key_value_memory_dict
        if self.layer_number not in cache:
            def empty(t):
                return torch.empty((inference_params.max_sequence_length,
                                    inference_params.max_batch_size) + tuple(t.shape[2:]),
                                   dtype=t.dtype, device=t.device)
            cache[self.layer_number] = (empty(key), empty(value))
        keys, values = cache[self.layer_number]
        s0, b0 = inference_params.sequence_len_offset, inference_params.batch_size_offset
        s1, b1 = s0 + key.size(0), b0 + key.size(1)
        if s1 > keys.size(0) or b1 > keys.size(1):
            raise ValueError(f"key/value cache of layer {self.layer_number} holds "
                             f"{keys.size(0)} positions x {keys.size(1)} sequences; this step "
                             f"needs positions up to {s1} and sequences up to {b1}")
        keys[s0:s1, b0:b1] = key
        values[s0:s1, b0:b1] = value
        return keys[:s1, b0:b1], values[:s1, b0:b1]

    def _latent_cache_attention(self, q_nope, q_pos, latent, k_pos, attention_mask,
                                inference_params):
        """Attention over the latent cache (``--cache-mla-latents``): ``q_nope`` ``[s, b, np,
        d]``, rotated ``q_pos`` ``[s, b, np, r]``, normalised ``latent`` ``[s, b, c]``, rotated
        ``k_pos`` ``[s, b, 1, r]`` -> (output, bias) as :meth:`forward`."""
        if self.dsa:
            raise ConfigError("--experimental-attention-variant dsa: generation with a "
                              "key/value cache is not built yet")
        d, c, dv, np_ = self.qk_head_dim, self.kv_lora_rank, self.v_head_dim, self.num_heads
        cached = self._update_latent_cache(torch.cat((latent, k_pos.squeeze(2)), dim=-1),
                                           inference_params)                # [sk, b, c+r]
        up = self.linear_kv_up_proj.weight.view(np_, d + dv, c)
        up_k, up_v = up[:, :d], up[:, d:]                                   # [np, d|dv, c]
        q_latent = torch.einsum("sbhd,hdc->sbhc", q_nope, up_k)             # [s, b, np, c]
        query = torch.cat((q_latent, q_pos), dim=-1)                        # [s, b, np, c+r]
        key = cached.unsqueeze(2).expand(-1, -1, np_, -1)                   # [sk, b, np, c+r]
        value = cached[..., :c].unsqueeze(2).expand(-1, -1, np_, -1)        # [sk, b, np, c]
        if attention_mask is None:   # query i sits at position offset + i
            attention_mask = causal_mask(query.size(0), key.size(0), device=query.device)[
                None, None]
        context = self.core_attention(query, key, value, attention_mask)    # [s, b, np*c]
        s, b = context.shape[:2]
        context = torch.einsum("sbhc,hvc->sbhv", context.view(s, b, np_, c), up_v)
        return self.linear_proj(context.reshape(s, b, np_ * dv))

    def _update_latent_cache(self, latents: torch.Tensor, inference_params) -> torch.Tensor:
        """Write this step's ``[s, b, c + r]`` (latent, rotated key) at ``sequence_len_offset``
        into the layer's one-tensor cache entry and return every cached position up to it."""
        cache = inference_params.key_value_memory_dict
        if self.layer_number not in cache:
            cache[self.layer_number] = (torch.empty(
                (inference_params.max_sequence_length, inference_params.max_batch_size,
                 latents.size(-1)), dtype=latents.dtype, device=latents.device),)
        (held,) = cache[self.layer_number]
        s0, b0 = inference_params.sequence_len_offset, inference_params.batch_size_offset
        s1, b1 = s0 + latents.size(0), b0 + latents.size(1)
        if s1 > held.size(0) or b1 > held.size(1):
            raise ValueError(f"latent cache of layer {self.layer_number} holds "
                             f"{held.size(0)} positions x {held.size(1)} sequences; this step "
                             f"needs positions up to {s1} and sequences up to {b1}")
        held[s0:s1, b0:b1] = latents
        return held[:s1, b0:b1]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Either spelling of the down projections loads: the separate ``linear_q_down_proj``
        / ``linear_kv_down_proj`` weights into a fused model (rows stacked), a fused
        ``linear_qkv_down_proj`` weight into an unfused one (rows split at --q-lora-rank)."""
        fused = prefix + FUSED_DOWN_PROJ
        q_key, kv_key = (prefix + k for k in SPLIT_DOWN_PROJS)
        if hasattr(self, "linear_qkv_down_proj"):
            if fused not in state_dict and q_key in state_dict and kv_key in state_dict:
                state_dict[fused] = torch.cat((state_dict.pop(q_key), state_dict.pop(kv_key)))
        elif fused in state_dict and self.q_lora_rank is not None:
            weight = state_dict.pop(fused)
            if weight.size(0) != self.q_lora_rank + self.kv_lora_rank + self.pos_dim:
                raise ValueError(f"{fused}: {weight.size(0)} rows, the model needs "
                                 f"--q-lora-rank + --kv-lora-rank + --qk-pos-emb-head-dim = "
                                 f"{self.q_lora_rank + self.kv_lora_rank + self.pos_dim}")
            state_dict[q_key], state_dict[kv_key] = torch.split(
                weight, [self.q_lora_rank, self.kv_lora_rank + self.pos_dim])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

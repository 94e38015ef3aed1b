"""DeepSeek sparse attention (``--experimental-attention-variant dsa``, DeepSeek-V3.2) for
multi-latent attention: a small "lightning indexer" scores every earlier key for each query,
and the attention sees only the ``--dsa-indexer-topk`` best-scored keys.

With ``H = --dsa-indexer-n-heads``, ``D = --dsa-indexer-head-dim``, ``r = --qk-pos-emb-head-dim``
(module and parameter names as Megatron-Core's ``DSAIndexer``, which lives at
``self_attention.core_attention.indexer``):

- ``linear_wq_b`` ``[H D, q]`` maps the query latent (after ``q_layernorm``; the hidden state
  when there is no ``--q-lora-rank``) to ``H`` query heads; ``linear_wk`` ``[D, h]`` maps the
  hidden state to one key, normalised by ``k_norm`` (a LayerNorm, ``--dsa-indexer-k-norm-epsilon``,
  in fp32 with ``--dsa-indexer-k-norm-fp32``); ``linear_weights_proj`` ``[H, h]`` gives a weight
  per head and token, scaled by ``H^-1/2 D^-1/2``.
- the first ``r`` channels of each query and key rotate by the model's rotary angles (as
  halves; ``--dsa-indexer-rope-interleaved`` takes them as neighbouring pairs first, as MLA).
- ``--dsa-indexer-rotate-activation`` (on by default) multiplies queries and keys by the
  normalised Hadamard matrix ``H_D / sqrt(D)`` (``D`` a power of two).
- score ``I[t, s] = sum_j w[t, j] relu(q[t, j] . k[s])`` (the ReLU off with
  ``--no-dsa-indexer-scoring-relu``); masked keys score ``-inf``; the ``topk`` best keys per
  query are kept (index ``-1`` marks a slot whose key is masked).
- the main attention adds ``-inf`` to every score outside the chosen keys (on top of the causal
  mask), in fp32, without dropout (as Megatron-Core's unfused path).

The indexer sees detached inputs: the model's gradients never pass through it. In training,
with ``--dsa-indexer-loss-coeff c > 0``, it learns from the KL loss
``c * mean_t KL(p_t || softmax(I_t))``, ``p_t`` the attention probabilities of query ``t``
summed over all heads (every tensor-parallel rank's) and renormalised, computed from detached
queries and keys; ``--dsa-indexer-use-sparse-loss`` restricts both distributions to the chosen
keys. The loss is attached to the attention output (its gradient starts with the main loss's
scale) and logged as ``indexer loss``.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.collectives import all_reduce
from megatron.core.config import TransformerConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.fused_kernels.layer_norm import FusedLayerNorm
from megatron.fused_kernels.softmax import causal_mask
from megatron.model.moe.tracker import MoELossTracker, attach_aux_loss
from megatron.model.rotary_pos_embedding import apply_rotary_pos_emb

INDEXER_LOSS_NAME = "indexer loss"
_EPS = 1e-10


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or wider if it is (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x H / sqrt(n)`` over the last dim ``n`` (a power of two), ``H`` Sylvester's Hadamard
    matrix (``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``), by the fast butterfly."""
    n = x.size(-1)
    if n & (n - 1):
        raise ValueError(f"--dsa-indexer-head-dim must be a power of two for the Hadamard "
                         f"rotation (got {n}); or pass --no-dsa-indexer-rotate-activation")
    shape = x.shape
    y = _wide(x).reshape(-1, n)                     # sums in fp32 even for bf16 inputs
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(shape) * n ** -0.5).to(x.dtype)


class ReplicatedProj(torch.nn.Module):
    """``y = x W^T``, the whole ``W`` ``[out, in]`` on every tensor-parallel rank (its inputs
    are detached and whole, so every rank computes the same gradient)."""

    def __init__(self, input_size: int, output_size: int, init_method, params_dtype):
        super().__init__()
        master = torch.empty(output_size, input_size,
                             dtype=torch.promote_types(params_dtype, torch.float32))
        init_method(master)
        self.weight = torch.nn.Parameter(master.to(params_dtype).to(device.current_device()))
        set_tensor_model_parallel_attributes(self.weight, False, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DSAIndexer(torch.nn.Module):
    """The lightning indexer: ``(q [s, b, H, D], k [s, b, D], weights [s, b, H])``."""

    def __init__(self, config: TransformerConfig, init_method):
        super().__init__()
        self.n_heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.pos_dim = config.qk_pos_emb_head_dim
        q_in = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        dtype = config.params_dtype
        self.linear_wq_b = ReplicatedProj(q_in, self.n_heads * self.head_dim, init_method, dtype)
        self.linear_wk = ReplicatedProj(config.hidden_size, self.head_dim, init_method, dtype)
        eps = config.dsa_indexer_k_norm_epsilon
        self.k_norm = FusedLayerNorm(self.head_dim,
                                     eps=config.layernorm_epsilon if eps is None else eps,
                                     params_dtype=dtype,
                                     apply_layernorm_1p=config.apply_layernorm_1p)
        self.linear_weights_proj = ReplicatedProj(config.hidden_size, self.n_heads,
                                                  init_method, dtype)
        self.k_norm_fp32 = config.dsa_indexer_k_norm_fp32
        self.rope_interleaved = config.dsa_indexer_rope_interleaved
        self.rotary_interleaved = config.rotary_interleaved
        self.rotate_activation = config.dsa_indexer_rotate_activation

    def _rope(self, t: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float):
        """Rotate the first ``r`` channels of ``[s, b, n, D]``."""
        pos, rest = torch.split(t, [self.pos_dim, self.head_dim - self.pos_dim], dim=-1)
        if self.rope_interleaved:
            pos = torch.cat((pos[..., 0::2], pos[..., 1::2]), dim=-1)
        pos = apply_rotary_pos_emb(pos, rotary_pos_emb, self.rotary_interleaved, mscale)
        return torch.cat((pos, rest), dim=-1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rotary_pos_emb: torch.Tensor,
                mscale: float = 1.0):
        """``x`` hidden states ``[s, b, h]``, ``qr`` query latent ``[s, b, q]``."""
        s, b = x.shape[:2]
        q = self.linear_wq_b(qr).view(s, b, self.n_heads, self.head_dim)
        q = self._rope(q, rotary_pos_emb, mscale)                         # [s, b, H, D]
        k = self.linear_wk(x)
        k = (self.k_norm(k.float()).to(k.dtype) if self.k_norm_fp32 else self.k_norm(k))
        k = self._rope(k.unsqueeze(2), rotary_pos_emb, mscale).squeeze(2)  # [s, b, D]
        if self.rotate_activation:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        weights = self.linear_weights_proj(x) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, k, weights


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                 masked: torch.Tensor, use_relu: bool = True) -> torch.Tensor:
    """``[b, sq, sk]`` scores ``sum_j w[t, j] act(q[t, j] . k[s])`` in fp32 (fp64 for fp64
    inputs), ``-inf`` where ``masked`` (bool, broadcastable to ``[b, sq, sk]``) is True."""
    dots = torch.einsum("sbhd,tbd->bsht", _wide(q), _wide(k))          # [b, sq, H, sk]
    if use_relu:
        dots = torch.relu(dots)
    scores = (dots * _wide(weights).permute(1, 0, 2).unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(masked, float("-inf"))


def select_topk(scores: torch.Tensor, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(indices [b, sq, k], chosen [b, sq, sk] bool)``: the ``min(topk, sk)`` best keys per
    query; masked keys (score ``-inf``) are never chosen and their slots hold ``-1``."""
    values, indices = scores.topk(min(topk, scores.size(-1)), dim=-1)
    valid = values > float("-inf")
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(-1, indices, valid)
    return indices.masked_fill(~valid, -1), chosen


def sparse_attention(query, key, value, allowed: torch.Tensor, softmax_scale: float):
    """Attention of ``query`` ``[sq, b, np, d]`` on ``key``/``value`` ``[sk, b, np, *]`` where
    ``allowed`` ``[b, sq, sk]`` is True: -> ``[sq, b, np * dv]``, in fp32 then cast back."""
    scores = torch.einsum("sbnd,tbnd->bnst", _wide(query), _wide(key)) * softmax_scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                # empty rows -> 0
    context = torch.einsum("bnst,tbnd->sbnd", probs, _wide(value)).to(value.dtype)
    sq, b = context.shape[:2]
    return context.reshape(sq, b, -1)


def indexer_kl_loss(scores: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    valid: torch.Tensor, chosen: torch.Tensor, softmax_scale: float,
                    coeff: float, sparse: bool, tp_group=None) -> torch.Tensor:
    """``coeff * mean over [b, sq] of KL(target || softmax(scores))``.

    ``target``: each head's attention probabilities (detached ``query``/``key``, keys where
    ``valid``; with ``sparse`` only the ``chosen`` ones) summed over the heads of every rank of
    ``tp_group``, renormalised. ``scores`` ``[b, sq, sk]`` carries the indexer's gradient."""
    keep = valid & chosen if sparse else valid                            # [b, sq, sk]
    with torch.no_grad():
        logits = torch.einsum("sbnd,tbnd->bnst", _wide(query), _wide(key)) * softmax_scale
        logits = logits.masked_fill(~keep.unsqueeze(1), float("-inf"))
        target = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=1)  # [b, sq, sk]
        if tp_group is not None:
            all_reduce(target, tp_group)
        target = target / target.sum(dim=-1, keepdim=True).clamp_min(_EPS)
    safe = scores.masked_fill(~keep, float("-inf"))
    log_pred = torch.log_softmax(safe, dim=-1).masked_fill(~keep, 0.0)
    kl = (target * (torch.log(target.clamp_min(_EPS)) - log_pred)).masked_fill(~keep, 0.0)
    return kl.sum(dim=-1).mean() * coeff


class DSAttention(torch.nn.Module):
    """MLA's core attention under DSA: the indexer picks each query's keys, the attention sees
    only them. ``tracker`` (set by the model) records and back-propagates the indexer loss."""

    def __init__(self, config: TransformerConfig, layer_number: int, init_method,
                 softmax_scale: float, rotary_mscale: float, tp_group=None, tp_size: int = 1):
        super().__init__()
        self.indexer = DSAIndexer(config, init_method)
        self.layer_number = layer_number
        self.topk = config.dsa_indexer_topk
        self.loss_coeff = config.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = config.dsa_indexer_use_sparse_loss
        self.use_relu = config.dsa_indexer_scoring_relu
        self.softmax_scale = softmax_scale
        self.rotary_mscale = rotary_mscale
        self.tp_group = tp_group if tp_size > 1 else None
        self.tracker = None
        self.current_max_attn_logits = None

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor], x, qr,
                rotary_pos_emb):
        """``query``/``key`` ``[s, b, np, d + r]``, ``value`` ``[s, b, np, dv]``, ``x`` the
        layer's input ``[s, b, h]`` and ``qr`` the query latent, both whole sequences ->
        ``[s, b, np * dv]``."""
        sq, b = query.shape[:2]
        sk = key.size(0)
        masked = causal_mask(sq, sk, device=query.device).unsqueeze(0)  # [1, sq, sk]
        if attention_mask is not None:
            masked = masked | attention_mask.reshape(-1, *attention_mask.shape[-2:])
        masked = masked.expand(b, sq, sk)
        with_loss = self.training and torch.is_grad_enabled() and self.loss_coeff > 0
        with torch.enable_grad() if with_loss else torch.no_grad():
            q, k, weights = self.indexer(x.detach(), qr.detach(), rotary_pos_emb,
                                         self.rotary_mscale)
            scores = index_scores(q, k, weights, masked, self.use_relu)   # [b, sq, sk]
        _, chosen = select_topk(scores.detach(), self.topk)
        context = sparse_attention(query, key, value, chosen & ~masked, self.softmax_scale)
        if with_loss:
            loss = indexer_kl_loss(scores, query.detach(), key.detach(), ~masked, chosen,
                                   self.softmax_scale, self.loss_coeff, self.sparse_loss,
                                   self.tp_group)
            if self.tracker is not None:
                self.tracker.record(INDEXER_LOSS_NAME, self.layer_number, loss)
            context = attach_aux_loss(context, loss, self.tracker)
        return context


def attach_dsa_tracker(model: torch.nn.Module, num_layers: int) -> Optional[MoELossTracker]:
    """One tracker of the indexer losses for the DSA layers of ``model`` (None without them):
    each layer records its loss into it, and its ``backward_scale`` is the main loss's."""
    layers = [m for m in model.modules() if isinstance(m, DSAttention)]
    if not layers:
        return None
    tracker = MoELossTracker(num_layers)
    for layer in layers:
        layer.tracker = tracker
    return tracker

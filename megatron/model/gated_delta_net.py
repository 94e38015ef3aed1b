"""Gated delta net linear attention (``--experimental-attention-variant gdn``, Qwen3-Next's
linear layers), split over tensor-parallel ranks by heads.

With ``nk = --linear-num-key-heads``, ``nv = --linear-num-value-heads`` (a multiple of nk),
``dk = --linear-key-head-dim``, ``dv = --linear-value-head-dim``, ``K = nk dk``, ``V = nv dv``:

- ``in_proj`` ``[2K + 2V + 2nv, h]`` (column-parallel, no bias) gives query, key, value, the
  output gate ``z`` ``[V]``, ``b`` ``[nv]`` and ``a`` ``[nv]``, in that order. On TP rank ``r``
  the local rows are ``[q_r; k_r; v_r; z_r; b_r; a_r]``, each section's r-th slice (as
  Megatron-Core lays out its shards); the full weight is drawn in the global order and then
  dealt out, so every split is the same model.
- ``conv1d``: a causal depthwise convolution (kernel ``--linear-conv-kernel-dim``, no bias)
  over the ``[q; k; v]`` channels, then the activation (SiLU with ``--swiglu``).
- query and key are L2-normalised per head (``x / sqrt(sum x^2 + 1e-6)``); with nv > nk each
  key head serves ``nv / nk`` consecutive value heads.
- per value head: decay ``g = -exp(A_log) softplus(a + dt_bias)`` (fp32), ``beta = sigmoid(b)``;
  the gated delta rule, state ``S`` ``[dk, dv]`` starting at zero::

      S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T q_t / sqrt(dk)

- ``out_norm`` over ``dv`` (``--normalization``; weight shared by all heads), times
  ``act(z)``, then ``out_proj`` ``[h, V]`` (row-parallel, no bias).

Init (Megatron-Core's): the projections from ``--init-method-std``; ``conv1d`` uniform in
``+-1/sqrt(kernel)`` (``torch.nn.Conv1d``'s default); ``dt_bias`` ones; ``A_log = log(U(1, 16))``.
The recurrence here is a plain per-token loop in fp32 (no fused kernel): exact, slow on long
sequences. Context parallelism, packed sequences and generation caches are refused.
"""

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.core import device, tensor_parallel
from megatron.core.collectives import get_group_rank
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import divide
from megatron.model.module import MegatronModule
from megatron.model.norms import get_norm

GDN_VARIANTS = ("gdn", "gated_delta_net")   # gated_delta_net: Megatron's deprecated spelling


def is_gdn(variant: Optional[str]) -> bool:
    """Whether ``--experimental-attention-variant`` selects the gated delta net."""
    return variant in GDN_VARIANTS


def linear_attention_pattern(freq, num_layers: int) -> List[int]:
    """One entry per layer, 1 = gated delta net, 0 = standard attention, from
    ``--linear-attention-freq``: an int N makes every N-th layer (N, 2N, ...) standard
    attention and the rest linear; a list is taken as it is (Megatron-Core's rule)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"--linear-attention-freq {freq}: expected an integer >= 1 or "
                              "a 0/1 list")
        return [0 if (i + 1) % freq == 0 else 1 for i in range(num_layers)]
    pattern = list(freq)
    if len(pattern) != num_layers:
        raise ConfigError(f"--linear-attention-freq has {len(pattern)} entries, expected one "
                          f"per layer (--num-layers {num_layers})")
    return pattern


def gdn_activation(config: TransformerConfig):
    """Megatron-Core's GDN uses the model's activation function: SiLU with --swiglu, GeLU with
    the default MLP; other activations are refused."""
    if config.swiglu:
        return F.silu
    if config.openai_gelu or config.squared_relu or config.quick_geglu:
        raise ConfigError("--experimental-attention-variant gdn is built with --swiglu (SiLU) "
                          "or the default GeLU activation only")
    return F.gelu


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta):
    """The gated delta rule, one token at a time, in fp32 (fp64 for fp64 inputs).

    Args: q, k ``[b, s, H, dk]`` (L2-normalised), v ``[b, s, H, dv]``, g, beta ``[b, s, H]``.
    Returns ``[b, s, H, dv]`` in v's dtype.
    """
    out_dtype = v.dtype
    work = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    q = q / math.sqrt(q.shape[-1])
    b, s, heads, dk = k.shape
    state = q.new_zeros(b, heads, dk, v.shape[-1])                      # [b, H, dk, dv]
    outputs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])        # [b, H, dv]
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1).to(out_dtype)                    # [b, s, H, dv]


def _sectioned_init(init_method, sections: List[int], tp_size: int):
    """An initialiser that draws the full weight in the global section order, then reorders its
    rows so that cutting it into ``tp_size`` equal blocks gives rank r each section's r-th slice."""
    def init(master: torch.Tensor) -> torch.Tensor:
        init_method(master)
        starts = [sum(sections[:i]) for i in range(len(sections))]
        order = []
        for r in range(tp_size):
            for start, size in zip(starts, sections):
                piece = size // tp_size
                order.extend(range(start + r * piece, start + (r + 1) * piece))
        with torch.no_grad():
            master.copy_(master[torch.tensor(order)])
        return master
    return init


class GatedDeltaNet(MegatronModule):
    """The gated delta net mixer of one layer: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallelism) -> (output, None), as the attention modules return."""

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group, tp_size: int,
                 sequence_parallel: bool, init_method, output_layer_init_method):
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = tp_group
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.nk_local = divide(nk, tp_size, f"--linear-num-key-heads ({nk}) over "
                               f"--tensor-model-parallel-size ({tp_size})")
        self.nv_local = divide(nv, tp_size, f"--linear-num-value-heads ({nv}) over "
                               f"--tensor-model-parallel-size ({tp_size})")
        key_dim, value_dim = nk * self.dk, nv * self.dv
        self.act = gdn_activation(config)
        sections = [key_dim, key_dim, value_dim, value_dim, nv, nv]
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, sum(sections), tp_group=tp_group, bias=False,
            init_method=_sectioned_init(init_method, sections, tp_size),
            sequence_parallel=sequence_parallel, params_dtype=config.params_dtype)
        self._build_conv(config, [key_dim, key_dim, value_dim], tp_size, tp_group)
        self._build_decay(config, nv, tp_size, tp_group)
        self.out_norm = get_norm(config, False, hidden_size=self.dv)
        for param in self.out_norm.parameters():
            param.sum_grad_over_tp = True   # each rank's heads add to the shared weight's grad
        self.out_proj = tensor_parallel.RowParallelLinear(
            value_dim, config.hidden_size, tp_group=tp_group, bias=False,
            init_method=output_layer_init_method, input_is_parallel=True,
            skip_bias_add=True, sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype)

    def _local_rows(self, full: torch.Tensor, tp_size: int, tp_group) -> torch.Tensor:
        rank = get_group_rank(tp_group) if tp_size > 1 else 0
        return torch.chunk(full, tp_size, dim=0)[rank]

    def _build_conv(self, config, sections: List[int], tp_size: int, tp_group) -> None:
        kernel = config.linear_conv_kernel_dim
        channels = sum(sections)
        full = torch.empty(channels, 1, kernel)
        bound = 1.0 / math.sqrt(kernel)
        init = _sectioned_init(lambda w: torch.nn.init.uniform_(w, -bound, bound),
                               sections, tp_size)
        init(full)
        local = channels // tp_size
        # Built on the meta device so that it draws nothing from the generator (the draws must
        # not depend on the split); the weight is this rank's rows of the full one above.
        self.conv1d = torch.nn.Conv1d(local, local, kernel, groups=local, padding=kernel - 1,
                                      bias=False, device="meta")
        self.conv1d.weight = torch.nn.Parameter(self._local_rows(full, tp_size, tp_group).to(
            dtype=config.params_dtype, device=device.current_device()))
        set_tensor_model_parallel_attributes(self.conv1d.weight, True, 0, 1)

    def _build_decay(self, config, nv: int, tp_size: int, tp_group) -> None:
        a_log = torch.empty(nv).uniform_(1, 16).log()
        dt_bias = torch.ones(nv)
        for name, full in (("A_log", a_log), ("dt_bias", dt_bias)):
            local = self._local_rows(full, tp_size, tp_group)
            param = torch.nn.Parameter(local.to(config.params_dtype).to(
                device.current_device()))
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            self.register_parameter(name, param)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, rotary_pos_emb=None,
                inference_params=None):
        if inference_params is not None:
            raise ConfigError("--experimental-attention-variant gdn: generation with a "
                              "key/value cache is not built")
        projected, _ = self.in_proj(hidden_states)                    # [s, b, local rows]
        projected = projected.transpose(0, 1)                         # [b, s, local rows]
        b, s, _ = projected.shape
        kd, vd = self.nk_local * self.dk, self.nv_local * self.dv
        qkv, z, beta, alpha = torch.split(projected, [2 * kd + vd, vd, self.nv_local,
                                                      self.nv_local], dim=-1)
        qkv = self.act(self.conv1d(qkv.transpose(1, 2))[..., :s]).transpose(1, 2)
        q, k, v = torch.split(qkv, [kd, kd, vd], dim=-1)
        work = torch.promote_types(hidden_states.dtype, torch.float32)
        q = l2_normalize(q.reshape(b, s, self.nk_local, self.dk).to(work))
        k = l2_normalize(k.reshape(b, s, self.nk_local, self.dk).to(work))
        ratio = self.nv_local // self.nk_local
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        g = -self.A_log.to(work).exp() * F.softplus(alpha.to(work) + self.dt_bias.to(work))
        out = gated_delta_rule(q, k, v.reshape(b, s, self.nv_local, self.dv), g,
                               beta.to(work).sigmoid())               # [b, s, H, dv]
        normed = self.out_norm(out)
        gate = self.act(z.reshape(b, s, self.nv_local, self.dv).to(work))
        gated = (normed.to(work) * gate).to(projected.dtype)
        gated = gated.reshape(b, s, vd).transpose(0, 1).contiguous()  # [s, b, V / tp]
        return self.out_proj(gated)                                   # ([s, b, h], None)

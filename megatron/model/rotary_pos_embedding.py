"""Rotary position embeddings (``--position-embedding-type rope`` or ``yarn``).

Channel pair ``(i, i + d/2)`` of query and key at position ``p`` is rotated by the angle
``p * f_i`` with ``f_i = base^(-2i/d)``, ``d = kv_channels * rotary_percent`` (the remaining
channels pass through unrotated). Attention scores then depend only on the distance between
positions.

With ``--rotary-interleaved`` the pairs are the neighbours ``(2i, 2i + 1)`` instead (the layout
of the original Llama and GPT-J weights); with ``--rotary-seq-len-interpolation-factor f`` the
positions are divided by ``f`` before the angles are taken (position interpolation, for running
at ``f`` times the trained sequence length).

Two frequency rescalings stretch a model trained at one length to a longer one, as
Megatron-Core computes them:

- ``--use-rope-scaling`` (Llama 3.1): with wavelength ``w_i = 2 pi / f_i`` and the fixed
  constants ``L = 8192`` (original positions), low / high frequency factors 1 / 4: ``f_i`` is
  kept where ``w_i < L / 4``, divided by ``--rope-scaling-factor s`` where ``w_i > L / 1``, and
  in between blended as ``(1 - a) f_i / s + a f_i`` with ``a = (L / w_i - 1) / (4 - 1)``.
- YaRN (``--position-embedding-type yarn``): with ``s = --rotary-scaling-factor`` and
  ``L = --yarn-original-max-position-embeddings``, the channel index ``c(r) = d ln(L / (2 pi r))
  / (2 ln base)`` at which a frequency turns ``r`` times over ``L`` positions bounds a ramp
  between ``lo = c(beta_fast)`` and ``hi = c(beta_slow)`` (floored / ceiled unless
  ``--no-yarn-correction-range-round-to-int``, clamped to ``[0, d - 1]``); channel ``i`` keeps
  the share ``1 - clamp((i - lo) / (hi - lo), 0, 1)`` of ``f_i`` and takes the rest from
  ``f_i / s``. cos and sin are multiplied by the concentration factor
  ``m(s, --mscale) / m(s, --mscale-all-dim)``, ``m(s, k) = 0.1 k ln s + 1`` (1 for ``s <= 1``),
  so attention logits grow by its square.
"""

import dataclasses
import math
from typing import Optional

import torch

from megatron.core import device

# Megatron-Core's fixed Llama 3.1 constants (only the factor is a flag).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS = 8192


@dataclasses.dataclass(frozen=True)
class YarnSettings:
    """The YaRN flags, with Megatron-Core's defaults for those left unset (None)."""

    scaling_factor: float = 1.0                      # --rotary-scaling-factor
    original_max_position_embeddings: int = 4096     # --yarn-original-max-position-embeddings
    beta_fast: float = 32.0                          # --yarn-beta-fast
    beta_slow: float = 1.0                           # --yarn-beta-slow
    mscale: float = 1.0                              # --mscale
    mscale_all_dim: float = 0.0                      # --mscale-all-dim
    correction_range_round_to_int: bool = True       # --[no-]yarn-correction-range-round-to-int

    @classmethod
    def from_config(cls, config) -> "YarnSettings":
        """The settings a TransformerConfig's ``yarn_*`` fields give (None: the default)."""
        given = dict(
            scaling_factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow,
            mscale=config.yarn_mscale, mscale_all_dim=config.yarn_mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int)
        return cls(**{k: v for k, v in given.items() if v is not None})

    @property
    def concentration(self) -> float:
        """The factor cos and sin are multiplied by."""
        return (yarn_get_mscale(self.scaling_factor, self.mscale)
                / yarn_get_mscale(self.scaling_factor, self.mscale_all_dim))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(scale) + 1``, or 1 when ``scale <= 1``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(yarn: YarnSettings, dim: int, base: float):
    """``(lo, hi)``: the channel indices where the frequencies turn ``beta_fast`` and
    ``beta_slow`` times over the original positions, clamped to ``[0, dim - 1]``."""
    def channel(rotations):
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = channel(yarn.beta_fast), channel(yarn.beta_slow)
    if yarn.correction_range_round_to_int:
        lo, hi = math.floor(lo), math.ceil(hi)
    return max(lo, 0), min(hi, dim - 1)


def yarn_inv_freq(dim: int, base: float, yarn: YarnSettings) -> torch.Tensor:
    """YaRN's ``dim / 2`` frequencies (float64)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    lo, hi = yarn_correction_range(yarn, dim, base)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1.0 - ramp                                  # share of the unscaled frequency
    return inv_freq / yarn.scaling_factor * (1 - keep) + inv_freq * keep


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's rescaling of ``inv_freq`` by ``factor`` with Megatron-Core's constants."""
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    old_len = LLAMA3_ORIGINAL_MAX_POSITION_EMBEDDINGS
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rotary_attention_scale(config) -> float:
    """What cos and sin are multiplied by in attention: YaRN's concentration factor, else 1."""
    if config.position_embedding_type != "yarn":
        return 1.0
    return YarnSettings.from_config(config).concentration


def build_rotary_embedding(config) -> Optional["RotaryEmbedding"]:
    """The rotary embedding a TransformerConfig asks for, or None (no rotary positions)."""
    dim = int(config.kv_channels * config.rotary_percent)
    if getattr(config, "multi_latent_attention", False):
        dim = config.qk_pos_emb_head_dim        # only the decoupled position channels rotate
    if config.position_embedding_type == "yarn":
        return RotaryEmbedding(dim, config.rotary_base, config.rotary_interleaved,
                               yarn=YarnSettings.from_config(config))
    if config.position_embedding_type != "rope":
        return None
    return RotaryEmbedding(
        dim, config.rotary_base, config.rotary_interleaved,
        config.rotary_seq_len_interpolation_factor,
        rope_scaling_factor=config.rope_scaling_factor if config.use_rope_scaling else None)


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for positions ``0 .. s-1``.

    Args:
        dim: number of rotated channels per head (even).
        rotary_base: ``--rotary-base``.
        rotary_interleaved: ``--rotary-interleaved``: angles laid out for neighbouring pairs.
        seq_len_interpolation_factor: ``--rotary-seq-len-interpolation-factor`` (None: 1).
        rope_scaling_factor: ``--rope-scaling-factor`` with ``--use-rope-scaling`` (None: off).
        yarn: YaRN's settings (``--position-embedding-type yarn``; None: off).
    """

    def __init__(self, dim: int, rotary_base: int = 10000, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None,
                 rope_scaling_factor: Optional[float] = None,
                 yarn: Optional[YarnSettings] = None):
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"rotary dimension (kv_channels x --rotary-percent) must be even, "
                             f"got {dim}")
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        if yarn is not None:
            inv_freq = yarn_inv_freq(dim, rotary_base, yarn)
        else:
            exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
            inv_freq = 1.0 / (rotary_base ** exponents)
            if rope_scaling_factor is not None:
                inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        # A plain float64 attribute, not a buffer: derived from the config (nothing to save) and
        # never cast to half precision by ``model.half()``, which would bend the angles. Being
        # no model state, it stays on the run's device when the model is built on the meta
        # device (--init-model-with-meta-device fills only parameters and buffers).
        with device.placing_tensors_on(None):
            self.inv_freq = inv_freq.to(device.current_device())

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles ``[s, 1, 1, dim]``: each of the ``dim / 2`` frequencies written twice, as
        ``[f0, f1, .., f0, f1, ..]`` (halves) or ``[f0, f0, f1, f1, ..]`` (interleaved)."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device,
                           dtype=self.inv_freq.dtype) + offset
        return self._angles(seq)[:, None, None, :]                   # [s, 1, 1, dim]

    def at_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Angles ``[s, b, 1, dim]`` of the positions ``position_ids`` ``[b, s]``: each token
        its own (packed sequences, whose positions restart at 0 for every sequence). Equal,
        value for value, to :meth:`forward`'s angles at the same positions."""
        seq = position_ids.t().to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        return self._angles(seq).unsqueeze(2)                        # [s, b, 1, dim]

    def _angles(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq`` ``[...]`` positions -> ``[..., dim]`` angles."""
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1.0 / self.seq_len_interpolation_factor)
        freqs = seq.unsqueeze(-1) * self.inv_freq                    # [..., dim/2]
        if self.rotary_interleaved:
            return freqs.repeat_interleave(2, dim=-1)                # [..., dim]
        return torch.cat((freqs, freqs), dim=-1)                     # [..., dim]


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every channel, negated where the rotation subtracts it."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)             # [.., -x1, x0, -x3, x2, ..]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                         rotary_interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, np, hn]``; ``freqs``
    must come from a :class:`RotaryEmbedding` with the same ``rotary_interleaved``. ``mscale``
    multiplies cos and sin (YaRN's concentration factor, :func:`rotary_attention_scale`)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = (freqs.cos() * mscale).to(t.dtype)
    sin = (freqs.sin() * mscale).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)

"""Rotary position embeddings (``--position-embedding-type rope``).

Channel pair ``(i, i + d/2)`` of query and key at position ``p`` is rotated by the angle
``p * base^(-2i/d)``, with ``d = kv_channels * rotary_percent`` (the remaining channels pass
through unrotated). Attention scores then depend only on the distance between positions.

With ``--rotary-interleaved`` the pairs are the neighbours ``(2i, 2i + 1)`` instead (the layout
of the original Llama and GPT-J weights); with ``--rotary-seq-len-interpolation-factor f`` the
positions are divided by ``f`` before the angles are taken (position interpolation, for running
at ``f`` times the trained sequence length).
"""

from typing import Optional

import torch

from megatron.core import device


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for positions ``0 .. s-1``.

    Args:
        dim: number of rotated channels per head (even).
        rotary_base: ``--rotary-base``.
        rotary_interleaved: ``--rotary-interleaved``: angles laid out for neighbouring pairs.
        seq_len_interpolation_factor: ``--rotary-seq-len-interpolation-factor`` (None: 1).
    """

    def __init__(self, dim: int, rotary_base: int = 10000, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None):
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"rotary dimension (kv_channels x --rotary-percent) must be even, "
                             f"got {dim}")
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        # A plain float64 attribute, not a buffer: derived from the config (nothing to save) and
        # never cast to half precision by ``model.half()``, which would bend the angles.
        self.inv_freq = (1.0 / (rotary_base ** exponents)).to(device.current_device())

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles ``[s, 1, 1, dim]``: each of the ``dim / 2`` frequencies written twice, as
        ``[f0, f1, .., f0, f1, ..]`` (halves) or ``[f0, f0, f1, f1, ..]`` (interleaved)."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device,
                           dtype=self.inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1.0 / self.seq_len_interpolation_factor)
        freqs = torch.outer(seq, self.inv_freq)                      # [s, dim/2]
        if self.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)                 # [s, dim]
        else:
            emb = torch.cat((freqs, freqs), dim=-1)                  # [s, dim]
        return emb[:, None, None, :]                                 # [s, 1, 1, dim]


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every channel, negated where the rotation subtracts it."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)             # [.., -x1, x0, -x3, x2, ..]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                         rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, np, hn]``; ``freqs``
    must come from a :class:`RotaryEmbedding` with the same ``rotary_interleaved``."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = freqs.cos().to(t.dtype)
    sin = freqs.sin().to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)

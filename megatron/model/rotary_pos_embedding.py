"""Rotary position embeddings (``--position-embedding-type rope``).

Channel pair ``(i, i + d/2)`` of query and key at position ``p`` is rotated by the angle
``p * base^(-2i/d)``, with ``d = kv_channels * rotary_percent`` (the remaining channels pass
through unrotated). Attention scores then depend only on the distance between positions.
"""

import torch

from megatron.core import device


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for positions ``0 .. s-1``.

    Args:
        dim: number of rotated channels per head (even).
        rotary_base: ``--rotary-base``.
    """

    def __init__(self, dim: int, rotary_base: int = 10000):
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"rotary dimension (kv_channels x --rotary-percent) must be even, "
                             f"got {dim}")
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        # A plain float64 attribute, not a buffer: derived from the config (nothing to save) and
        # never cast to half precision by ``model.half()``, which would bend the angles.
        self.inv_freq = (1.0 / (rotary_base ** exponents)).to(device.current_device())

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles ``[s, 1, 1, dim]``, each of the ``dim / 2`` frequencies written twice."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device,
                           dtype=self.inv_freq.dtype) + offset
        freqs = torch.outer(seq, self.inv_freq)          # [s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)          # [s, dim]
        return emb[:, None, None, :]                     # [s, 1, 1, dim]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, np, hn]``."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = freqs.cos().to(t.dtype)
    sin = freqs.sin().to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return torch.cat((t_rot, t_pass), dim=-1)

"""Shifting token-aligned tensors one place left along the sequence, as multi-token prediction
does with its inputs, labels and (``--mtp-hsm``) hidden states: over the whole sequence under
context parallelism, and inside each packed sequence with ``--sft``."""

from typing import Optional

import torch

from megatron.core.collectives import all_gather_into_tensor, get_group_rank, get_group_size


def roll_left(tensor: torch.Tensor, cp_group=None,
              ends: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tensor [..., s]`` shifted left by one place along its last dim, the last place of the
    whole sequence 0. With a ``cp_group`` of size > 1 the last dim holds this rank's chunks
    ``r`` and ``2 cp - 1 - r`` (:func:`~megatron.core.context_parallel.chunk_positions`) and
    the shift is over the whole sequence; every rank of the group must call it. ``ends``
    (bool, the shape of ``tensor``; :func:`sequence_ends`): the last place of each packed
    sequence, which takes 0 instead of the next sequence's first value."""
    rolled = _roll_left(tensor, cp_group)
    return rolled if ends is None else rolled.masked_fill(ends, 0)


def sequence_ends(position_ids: torch.Tensor, cp_group=None) -> torch.Tensor:
    """The last place of each sequence packed in ``position_ids [b, s]`` (--sft: each
    conversation's positions start at 0): where the next place's position is 0, and the last
    place of the whole sequence. Rolling with them keeps every shift inside its own sequence,
    as Megatron-Core rolls packed sequences (each by its ``cu_seqlens``)."""
    return _roll_left(position_ids, cp_group) == 0


def _roll_left(tensor: torch.Tensor, cp_group=None) -> torch.Tensor:
    cp_size = get_group_size(cp_group)
    if cp_size == 1:
        rolled = torch.roll(tensor, shifts=-1, dims=-1)
        rolled[..., -1] = 0
        return rolled
    cp_rank = get_group_rank(cp_group)
    first, second = tensor.chunk(2, dim=-1)                                 # [..., s/2cp]
    heads = torch.stack([first[..., 0], second[..., 0]]).contiguous()      # [2, ...]
    every = torch.empty((cp_size,) + tuple(heads.shape), dtype=heads.dtype,
                        device=heads.device)
    all_gather_into_tensor(every, heads, cp_group)                         # [cp, 2, ...]

    def head_of_chunk(chunk: int) -> torch.Tensor:
        if chunk == 2 * cp_size:
            return torch.zeros_like(heads[0])
        if chunk < cp_size:
            return every[chunk, 0]
        return every[2 * cp_size - 1 - chunk, 1]

    pieces = []
    for part, chunk in ((first, cp_rank), (second, 2 * cp_size - 1 - cp_rank)):
        rolled = torch.roll(part, shifts=-1, dims=-1)
        rolled[..., -1] = head_of_chunk(chunk + 1)
        pieces.append(rolled)
    return torch.cat(pieces, dim=-1)

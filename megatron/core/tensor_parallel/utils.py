"""Arithmetic and slicing helpers for tensor parallelism."""

from typing import Tuple

import torch

from megatron.core.collectives import all_gather_into_tensor, get_group_rank, get_group_size
from megatron.core.utils import init_method_normal, scaled_init_method_normal  # noqa: F401


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    """Raise a ValueError naming ``what`` unless ``denominator`` divides ``numerator``."""
    if denominator <= 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator / denominator`` when it is exact, else a ValueError naming ``what``."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal pieces along its last dim.

    Args:
        tensor: the tensor to split.
        num_partitions: how many pieces; must divide the last dim.
        contiguous_split_chunks: return contiguous copies instead of views.
    """
    last = tensor.dim() - 1
    size = divide(tensor.size(last), num_partitions,
                  f"last dim of shape {tuple(tensor.shape)} split {num_partitions} ways")
    chunks = torch.split(tensor, size, dim=last)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group,
                                      new_buffer: bool = False) -> torch.Tensor:
    """This rank's equal share of ``tensor`` flattened (dim-0 major).

    Args:
        tensor: the full tensor, the same on every rank of ``group``.
        group: the ranks sharing it.
        new_buffer: return a copy, so the full tensor can be freed.
    """
    world = get_group_size(group)
    part = divide(tensor.numel(), world,
                  f"elements of a tensor of shape {tuple(tensor.shape)} shared by {world} ranks")
    start = part * get_group_rank(group)
    piece = tensor.reshape(-1)[start:start + part]
    return piece.clone() if new_buffer else piece


def gather_split_1d_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: the flat full tensor."""
    world = get_group_size(group)
    out = torch.empty(tensor.numel() * world, dtype=tensor.dtype, device=tensor.device)
    return all_gather_into_tensor(out, tensor.reshape(-1), group)


class VocabUtility:
    """Which slice ``[first, last)`` of the vocabulary a tensor-parallel rank owns.

    The vocabulary is split in contiguous, equal blocks in rank order, so rank ``r`` of ``world``
    owns ids ``[r * V / world, (r + 1) * V / world)``.
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        del world_size  # the range depends only on the block size and the rank
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> Tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size,
                               f"padded vocab size ({global_vocab_size}) over "
                               f"--tensor-model-parallel-size ({world_size})")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size)


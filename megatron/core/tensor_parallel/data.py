"""Broadcast a batch from the tensor-parallel source rank to the rest of its group.

Only one rank per tensor-parallel group reads data; the others receive it. Two broadcasts: first
the shapes of every tensor (a small int64 table), then all tensors flattened into one buffer.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import get_group_size

_MAX_DATA_DIM = 5


def _is_source(group, src_rank: int) -> bool:
    if group is None or not dist.is_initialized():
        return True
    return dist.get_rank() == src_rank


def _check_data_types(keys: Sequence[str], data: Dict[str, torch.Tensor],
                      target_dtype: torch.dtype) -> None:
    for key in keys:
        if key not in data:
            raise KeyError(f"broadcast_data: key {key!r} is missing from the data "
                           f"(has {sorted(data)})")
        if data[key].dtype != target_dtype:
            raise TypeError(f"broadcast_data: {key!r} has dtype {data[key].dtype}, "
                            f"expected {target_dtype}")
        if data[key].dim() > _MAX_DATA_DIM:
            raise ValueError(f"broadcast_data: {key!r} has {data[key].dim()} dims, "
                             f"at most {_MAX_DATA_DIM} are supported")


def _broadcast_shapes(keys: Sequence[str], data: Optional[Dict[str, torch.Tensor]], group,
                      src_rank: int) -> List[Tuple[int, ...]]:
    """Every key's shape, as the source rank sees it."""
    # Row per key: [ndim, d0, d1, ..., d_{MAX-1}] (ndim first, so zero-sized dims survive).
    table = torch.zeros((len(keys), 1 + _MAX_DATA_DIM), dtype=torch.int64)
    if _is_source(group, src_rank):
        for row, key in enumerate(keys):
            shape = data[key].shape
            table[row, 0] = len(shape)
            table[row, 1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    if get_group_size(group) > 1:
        table = table.to(device.current_device())
        dist.broadcast(table, src_rank, group=group)
    table = table.cpu()
    return [tuple(int(d) for d in row[1:1 + int(row[0])]) for row in table]


def broadcast_data(keys: Sequence[str], data: Optional[Dict[str, torch.Tensor]],
                   datatype: torch.dtype, tp_group, src_rank: int) -> Dict[str, torch.Tensor]:
    """Give every rank of ``tp_group`` the tensors ``data[key]`` held by global rank ``src_rank``.

    Args:
        keys: the names to send, in the same order on every rank.
        data: ``{key: tensor}`` on the source rank (every tensor of dtype ``datatype``); ignored
            (may be None) on the others.
        datatype: dtype of every tensor.
        tp_group: the tensor-parallel group (None: a single process; the data is only moved).
        src_rank: GLOBAL rank of the source (tensor-parallel rank 0 of this group, in Megatron).

    Returns:
        ``{key: tensor}`` on the current device, views into one flat buffer.
    """
    if not keys:
        return {}
    is_source = _is_source(tp_group, src_rank)
    if is_source:
        if data is None:
            raise ValueError(f"broadcast_data: rank {src_rank} is the source but has no data")
        _check_data_types(keys, data, datatype)
    shapes = _broadcast_shapes(keys, data, tp_group, src_rank)
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    if is_source:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(
            device.current_device())                                   # [sum of numels]
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device.current_device())
    if get_group_size(tp_group) > 1:
        dist.broadcast(flat, src_rank, group=tp_group)
    output = {}
    offset = 0
    for key, shape, numel in zip(keys, shapes, numels):
        output[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return output

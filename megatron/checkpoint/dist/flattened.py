"""The distributed optimizer's state in the layout of Megatron-Core before 0.14
(``--dist-ckpt-save-pre-mcore-014``; its sharding type ``fully_sharded_model_space``).

Each parameter's state keeps the key of today's layout (``optimizer.state.exp_avg.<model key>``,
``exp_avg_sq``, ``fp32_param``), but is stored "N-D flattened": a model tensor of global shape
``[X, Y, Z]`` whose local piece (one TP rank's piece of one layer) has shape ``[x, y, z]`` is
stored as a tensor of shape ``[X // x, Y // y, Z // z, x * y * z]``. The leading axes count the
pieces (stacked layer and expert axes count as pieces of size 1); the last axis holds a piece's
elements in row-major order, and every data-parallel rank writes its own range of them
(``[1, 1, 1, end - start]`` at ``(i, j, k, start)``). The model tensors themselves are stored
as in today's layout, which is how a reader finds a piece's shape: ``x = X // (X // x)``.
Megatron-Core finds it in the DCP metadata instead: ``Metadata.mcore_data[key]
["nd_reformulated_orig_global_shape"]`` holds ``[X, Y, Z]`` for each such key, and its loader
refuses a flattened key without it. The state always includes ``fp32_param`` (the parameter
itself when the model trains in fp32), which its loader asks for. The common state nests the
param groups as the distributed optimizer's own state dict does: ``{"optimizer":
{"param_groups": [..., each with "step"]}, "param_state_sharding_type": ...}``.

:func:`flat_range_shards` writes that layout; :class:`FlattenedStateView` reads it back as if
it were today's layout, so every loader of this project reads both.
"""

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint.dist.keys import OPTIMIZER_STATE_PREFIX, ChunkLayout, placements
from megatron.checkpoint.dist.reader import DistCheckpointError
from megatron.checkpoint.dist.writer import TensorShard

SHARDING_TYPE = "fully_sharded_model_space"
GATHERED_TYPE = "dp_zero_gather_scatter"
STATE_FIELDS = ("exp_avg", "exp_avg_sq", "fp32_param")


def _numel(shape: Sequence[int]) -> int:
    return int(torch.Size(tuple(shape)).numel())


def flat_range_shards(name: str, local_shape: Tuple[int, ...], start: int,
                      values: torch.Tensor, layout: ChunkLayout,
                      prefix: str) -> List[TensorShard]:
    """The elements ``start:start + len(values)`` of the local tensor ``name`` (row-major over
    ``local_shape``), stored N-D flattened under ``prefix + <model key>``: what one rank of the
    distributed optimizer writes of one parameter's state field.

    Raises:
        DistCheckpointError: a local tensor this layout splits over several global pieces (a
            piece of rows), which the pre-0.14 layout has no place for.
    """
    local_shape = tuple(local_shape)
    values = values.reshape(-1)
    shards = []
    for place in placements(name, local_shape, dataclasses.replace(layout, dp_rank=0,
                                                                   expert_dp_rank=0)):
        if not place.written:
            continue
        if place.local_rows is not None and place.local_rows != (0, local_shape[0]):
            raise DistCheckpointError(
                f"--dist-ckpt-save-pre-mcore-014: {name} is stored in pieces of rows "
                f"({place.key}), which the pre-0.14 optimizer layout cannot hold; drop the flag")
        block = (1,) * int(place.stacked) + local_shape
        counts = tuple(g // b for g, b in zip(place.global_shape, block))
        index = tuple(o // b for o, b in zip(place.global_offset, block))
        piece = values.view((1,) * len(counts) + (values.numel(),))
        shards.append(TensorShard(prefix + place.key, piece, counts + (_numel(local_shape),),
                                  index + (start,),
                                  nd_orig_global_shape=tuple(place.global_shape)))
    return shards


class FlattenedStateView:
    """A :class:`~megatron.checkpoint.dist.reader.DistCheckpointReader` whose N-D flattened
    optimizer tensors read as today's layout: same key, the model tensor's global shape, any
    slice. Everything else goes to the wrapped reader unchanged."""

    def __init__(self, reader, flattened: dict):
        self._reader = reader
        self._flat = flattened   # key -> (global shape, piece shape)

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def __contains__(self, key: str) -> bool:
        return key in self._reader

    def shape(self, key: str) -> Tuple[int, ...]:
        if key in self._flat:
            return self._flat[key][0]
        return self._reader.shape(key)

    def chunks(self, key: str):
        if key in self._flat:
            shape, block = self._flat[key]
            return [(tuple(i * b for i, b in zip(idx, block)), block)
                    for idx in itertools.product(*(range(s // b) for s, b in zip(shape, block)))]
        return self._reader.chunks(key)

    def read(self, key: str, offset: Optional[Sequence[int]] = None,
             size: Optional[Sequence[int]] = None, out: Optional[torch.Tensor] = None,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if key not in self._flat:
            return self._reader.read(key, offset, size, out=out, dtype=dtype)
        shape, block = self._flat[key]
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        size = tuple(size) if size is not None else tuple(s - o for s, o in zip(shape, offset))
        if len(offset) != len(shape) or len(size) != len(shape) or any(
                o < 0 or z < 0 or o + z > s for o, z, s in zip(offset, size, shape)):
            raise DistCheckpointError(f"{self._reader.path}: slice at {list(offset)} of size "
                                      f"{list(size)} is outside {key!r} of shape {list(shape)}")
        if out is None:
            out = torch.empty(size, dtype=dtype or self._reader.dtype(key))
        first = [o // b for o, b in zip(offset, block)]
        last = [(o + z - 1) // b for o, z, b in zip(offset, size, block)]
        if any(z == 0 for z in size):
            return out
        for idx in itertools.product(*(range(a, b + 1) for a, b in zip(first, last))):
            stored = self._reader.read(key, tuple(idx) + (0,), (1,) * len(idx) + (_numel(block),))
            piece = stored.reshape(block)
            lo = [max(o, i * b) for o, i, b in zip(offset, idx, block)]
            hi = [min(o + z, (i + 1) * b) for o, z, i, b in zip(offset, size, idx, block)]
            src = tuple(slice(a - i * b, c - i * b) for a, c, i, b in zip(lo, hi, idx, block))
            dst = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, offset))
            out[dst].copy_(piece[src])
        return out


def nest_common(optimizer: dict) -> dict:
    """Today's common optimizer state (``{"state": {"common_step": s}, "param_groups": [...],
    "grad_scaler"?}``) in the distributed optimizer's pre-0.14 form."""
    step = float(optimizer.get("state", {}).get("common_step", 0))
    nested = {"optimizer": {"param_groups": [dict(g, step=step)
                                             for g in optimizer["param_groups"]]},
              "param_state_sharding_type": SHARDING_TYPE}
    if "grad_scaler" in optimizer:
        nested["grad_scaler"] = optimizer["grad_scaler"]
    return nested


def unnest_common(optimizer):
    """The inverse of :func:`nest_common`, for a common state written either way (what it is
    not is returned unchanged). The step is the groups' ``step``, which must agree."""
    if not isinstance(optimizer, dict) or "param_groups" in optimizer:
        return optimizer
    inner = optimizer.get("optimizer")
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        return optimizer
    groups = inner["param_groups"]
    steps = {float(g["step"]) for g in groups if isinstance(g, dict) and "step" in g}
    if len(steps) > 1:
        raise DistCheckpointError(f"the optimizer's param groups disagree on the step "
                                  f"({sorted(steps)})")
    plain = {k: v for k, v in optimizer.items() if k != "optimizer"}
    plain["state"] = {"common_step": torch.tensor(steps.pop() if steps else 0.0)}
    plain["param_groups"] = [{k: v for k, v in g.items() if k != "step"} for g in groups]
    return plain


def _model_key(key: str) -> Optional[str]:
    for field in STATE_FIELDS:
        head = f"{OPTIMIZER_STATE_PREFIX}{field}."
        if key.startswith(head):
            return key[len(head):]
    return None


def flattened_keys(reader) -> dict:
    """The reader's N-D flattened optimizer tensors: ``{key: (global shape, piece shape)}``.
    A key counts when its model tensor is stored, with one axis fewer, and the leading axes
    divide the model tensor's shape into pieces whose element count is the last axis."""
    found = {}
    present = set(reader.tensor_keys())
    for key in present:
        model = _model_key(key)
        if model is None or model not in present:
            continue
        stored, shape = reader.shape(key), reader.shape(model)
        if len(stored) != len(shape) + 1:
            continue
        if any(c <= 0 or s % c for c, s in zip(stored[:-1], shape)):
            raise DistCheckpointError(
                f"{reader.path}: {key!r} of shape {list(stored)} does not divide {model!r} of "
                f"shape {list(shape)} into pieces (a damaged pre-0.14 optimizer layout)")
        block = tuple(s // c for c, s in zip(stored[:-1], shape))
        if _numel(block) != stored[-1]:
            raise DistCheckpointError(
                f"{reader.path}: {key!r} holds {stored[-1]} elements per piece, but {model!r} "
                f"of shape {list(shape)} has pieces of shape {list(block)}")
        found[key] = (tuple(shape), block)
    return found


def open_view(reader):
    """``reader`` itself, or a :class:`FlattenedStateView` of it when it holds the pre-0.14
    optimizer layout."""
    flat = flattened_keys(reader)
    return FlattenedStateView(reader, flat) if flat else reader

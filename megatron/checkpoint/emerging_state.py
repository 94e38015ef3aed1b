"""SOAP's and adaptive Muon's matrix state (``--optimizer soap`` / ``adaptive_muon``) in
``torch_dist`` checkpoints.

Keys follow Megatron-Core's optimizer-state scheme ``optimizer.state.<state name>.<model key>``
(its non-distributed optimizer layout, chained optimizers' prefix avoided, as for Muon:
:mod:`megatron.checkpoint.muon_state`); the AdamW part, the fp32 main copies and the common
step are Muon's. What each matrix weight (of local shape ``m/tp x n`` or ``m x n/tp``, whole
``m x n``) writes:

==========================  ===============  ===============================================
state                       global shape     how it is laid out
==========================  ===============  ===============================================
adaptive Muon
``momentum_buffer``         like the weight  this rank's piece: split like the weight
``moment2_buffer`` adamuon  like the weight  the whole matrix's: each TP rank writes the
                                             piece its weight holds, so it is split like the
                                             weight (any TP reads it back whole)
``moment2_buffer`` normuon  ``[L, m, 1]`` or one value per row (or column) of the whole
                            ``[L, 1, n]``    matrix: replicated over TP, written once
SOAP
``exp_avg``, ``exp_avg_sq`` like the weight  the whole matrix's (in the eigenbasis), written
                                             split like the weight, as adamuon's moment
``L``, ``Q_L``              ``[L, m, m]``    Shampoo's left factor and its eigenbasis, whole:
                                             replicated over TP, written once
``R``, ``Q_R``              ``[L, n, n]``    the right ones, the same way
==========================  ===============  ===============================================

(``L`` in the shapes is the stacked layer axis of the weight's key, absent for per-layer keys.)
SOAP's per-matrix ``step`` equals AdamW's, so both travel as the common step.

Megatron-Core's emerging optimizers keep each TP shard's own state; its generic mapping
(one tensor per state name, shaped like the local parameter) gives the param-shaped entries
above the same keys and global shapes, and has no sharded layout for the square factors, which
here are the whole matrix's and so written once with the layer axis of their weight.

The whole matrix is the TP pieces concatenated in rank order; with ``--swiglu`` the fc1 weight's
global rows are ``[gate | value]``, not that order, so the row-indexed factors are permuted to
the global order on save and back to this layout's on load (which is what lets a checkpoint
saved at one TP size load at another).
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint.dist import TensorShard, placements
from megatron.checkpoint.dist.keys import OPTIMIZER_STATE_PREFIX, is_expert_key, stored_key

# A field's kind: "local" (this rank's piece, shaped like the local weight), "whole" (the
# whole matrix's, shaped like the whole weight), or a pair saying which weight dimension
# (0: rows, 1: columns, None: size 1) each of its two axes runs over (replicated over TP).
LEFT, RIGHT = (0, 0), (1, 1)
SOAP_KINDS = {"exp_avg": "whole", "exp_avg_sq": "whole", "L": LEFT, "R": RIGHT,
              "Q_L": LEFT, "Q_R": RIGHT}


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One matrix weight of the optimizer: where it sits and how it is split.

    ``group``/``dim``: the tensor-parallel group and dimension its pieces are cut along (None:
    not split); ``expert``: split over the expert-TP ranks.
    """

    chunk: int
    name: str
    local_shape: Tuple[int, int]
    group: object
    dim: Optional[int]
    expert: bool

    @property
    def parts(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def whole_shape(self) -> Tuple[int, int]:
        shape = list(self.local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.parts
        return tuple(shape)


def inner_optimizer(optimizer):
    """The torch optimizer inside a Megatron wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def is_emerging(optimizer) -> bool:
    """Whether ``optimizer`` (a Megatron wrapper) runs SOAP or adaptive Muon."""
    from megatron.optimizer.adaptive_muon import AdaptiveMuon
    from megatron.optimizer.soap import SOAP

    return isinstance(inner_optimizer(optimizer), (SOAP, AdaptiveMuon))


def field_kinds(optimizer, matrix: Matrix) -> Dict[str, object]:
    """``{state name: kind}`` of one matrix weight (see the module's table)."""
    from megatron.optimizer.soap import SOAP

    inner = inner_optimizer(optimizer)
    if isinstance(inner, SOAP):
        return dict(SOAP_KINDS)
    if inner.moment2_method == "adamuon":
        return {"momentum_buffer": "local", "moment2_buffer": "whole"}
    rows, cols = matrix.whole_shape
    return {"momentum_buffer": "local", "moment2_buffer": (0, None) if rows >= cols else
            (None, 1)}


def matrices(optimizer, members) -> Dict[Tuple[int, str], Matrix]:
    """Every matrix weight of ``optimizer``'s matrix groups by ``(chunk, name)``;
    ``members``: :func:`muon_state.param_members` of the same optimizer."""
    inner = inner_optimizer(optimizer)
    out = {}
    for group, row in zip(optimizer.param_groups, members):
        if not group.get("use_muon"):
            continue
        for p, (chunk, name, shape) in zip(group["params"], row):
            shard, dim = inner._shard_group(p)
            out[(chunk, name)] = Matrix(chunk, name, tuple(shape), shard, dim,
                                        not getattr(p, "allreduce", True))
    return out


def _at_rank(layout, matrix: Matrix, rank: int):
    if matrix.expert:
        return dataclasses.replace(layout, expert_tp_rank=rank)
    return dataclasses.replace(layout, tp_rank=rank)


def _whole_to_global(matrix: Matrix, layout) -> torch.Tensor:
    """``index[i]``: the global position, along the split dimension, of position ``i`` of the
    whole matrix as the TP pieces concatenated (identity unless SwiGLU's fc1)."""
    local = matrix.local_shape[matrix.dim]
    index = torch.empty(local * matrix.parts, dtype=torch.long)
    for rank in range(matrix.parts):
        for place in placements(matrix.name, matrix.local_shape, _at_rank(layout, matrix, rank)):
            first, stop = place.local_rows if (matrix.dim == 0 and place.local_rows) else \
                (0, local)
            at = place.global_offset[place.stacked + matrix.dim]
            index[rank * local + first:rank * local + stop] = torch.arange(at, at + stop - first)
    return index


def _permuted(tensor: torch.Tensor, kind, matrix: Matrix, layout, to_global: bool):
    """``tensor`` with each axis that runs over the split dimension reordered between the
    concatenated pieces' order and the global one."""
    if matrix.dim is None or matrix.dim not in kind:
        return tensor
    index = _whole_to_global(matrix, layout)
    if to_global:
        index = torch.argsort(index)
    for axis, dim in enumerate(kind):
        if dim == matrix.dim:
            tensor = tensor.index_select(axis, index)
    return tensor


def _replicated_place(matrix: Matrix, layout, kind) -> Tuple[str, tuple, tuple, int, bool]:
    """(key without prefix, global shape, offset, stacked axes, written) of a replicated field."""
    place = placements(matrix.name, matrix.local_shape, layout)[0]
    lead = place.stacked
    whole = matrix.whole_shape
    shape = tuple(1 if dim is None else whole[dim] for dim in kind)
    if is_expert_key(place.key):
        written = layout.writes_expert_replicated
    else:
        written = layout.writes_replicated
    return (place.key, tuple(place.global_shape[:lead]) + shape,
            tuple(place.global_offset[:lead]) + (0, 0), lead, written)


def field_shards(matrix: Matrix, kinds: Dict[str, object], fields: Dict[str, torch.Tensor],
                 layout) -> List[TensorShard]:
    """What this rank writes of one matrix's state ``fields``: the local and whole ones as its
    piece of the weight (where the weight's piece goes), the replicated ones once (TP rank 0
    of DP rank 0), in the global order."""
    from megatron.checkpoint.dist import tensor_shards
    from megatron.optimizer.muon import own_shard

    shards = []
    for field, tensor in fields.items():
        kind = kinds[field]
        prefix = f"{OPTIMIZER_STATE_PREFIX}{field}."
        if kind in ("local", "whole"):
            piece = tensor if kind == "local" else own_shard(tensor, matrix.group, matrix.dim)
            shards += tensor_shards(matrix.name, piece.contiguous(), layout, prefix)
            continue
        key, shape, offset, lead, written = _replicated_place(matrix, layout, kind)
        if written:
            value = _permuted(tensor, kind, matrix, layout, to_global=True)
            shards.append(TensorShard(prefix + key, value.reshape((1,) * lead + value.shape)
                                      .contiguous(), shape, offset))
    return shards


def zero_fields(kinds: Dict[str, object], matrix: Matrix) -> Dict[str, torch.Tensor]:
    """Zeros of every field's shape: what a weight that has not stepped yet writes."""
    whole = matrix.whole_shape
    shapes = {"local": matrix.local_shape, "whole": whole}
    return {field: torch.zeros(shapes[kind] if kind in shapes else
                               tuple(1 if dim is None else whole[dim] for dim in kind))
            for field, kind in kinds.items()}


def read_fields(reader, matrix: Matrix, kinds: Dict[str, object], layout,
                read_local: Callable) -> Dict[str, torch.Tensor]:
    """One matrix's state at this layout: ``read_local(prefix, layout)`` reads this rank's
    piece of a field split like the weight (at another rank's layout for the whole ones)."""
    from megatron.checkpoint.dist.reader import DistCheckpointError

    out = {}
    for field, kind in kinds.items():
        prefix = f"{OPTIMIZER_STATE_PREFIX}{field}."
        if kind == "local":
            out[field] = read_local(prefix, layout)
            continue
        if kind == "whole":
            pieces = [read_local(prefix, _at_rank(layout, matrix, r))
                      for r in range(matrix.parts)]
            out[field] = torch.cat(pieces, dim=matrix.dim) if matrix.dim is not None \
                else pieces[0]
            continue
        key, shape, offset, lead, _ = _replicated_place(matrix, layout, kind)
        key = stored_key(prefix + key, reader)
        if key not in reader:
            raise DistCheckpointError(f"{reader.path}: no {key!r} (for {matrix.name})")
        if tuple(reader.shape(key)) != shape:
            raise DistCheckpointError(f"{reader.path}: {key!r} has global shape "
                                      f"{list(reader.shape(key))}; this model needs "
                                      f"{list(shape)} (for {matrix.name})")
        value = reader.read(key, offset, (1,) * lead + shape[lead:]).reshape(shape[lead:])
        out[field] = _permuted(value.float(), kind, matrix, layout, to_global=False)
    return out

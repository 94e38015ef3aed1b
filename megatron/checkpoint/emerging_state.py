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
``moment2_buffer`` normuon  ``[*, m, 1]`` or one value per row (or column) of the whole
                            ``[*, 1, n]``    matrix: replicated over TP, written once
SOAP
``exp_avg``, ``exp_avg_sq`` like the weight  the whole matrix's, in the eigenbasis (axes:
                                             eigenvectors of L, of R), written split like
                                             the weight, each axis in its own order
``L``, ``Q_L``              ``[*, m, m]``    Shampoo's left factor and its eigenvectors (one
                                             per column), whole: replicated over TP,
                                             written once
``R``, ``Q_R``              ``[*, n, n]``    the right ones, the same way
==========================  ===============  ===============================================

(``*``: the weight's stacked layer axis, and expert axis, absent for per-layer keys.)
SOAP's per-matrix ``step`` equals AdamW's, so both travel as the common step.

Megatron-Core's emerging optimizers keep each TP shard's own state; its generic mapping
(one tensor per state name, shaped like the local parameter) gives the param-shaped entries
above the same keys and global shapes, and has no sharded layout for the square factors, which
here are the whole matrix's and so written once with the layer axis of their weight.

The whole matrix is the TP pieces concatenated in rank order; with ``--swiglu`` the fc1 weight's
global rows are ``[gate | value]``, not that order. So the factors' weight-indexed axes are
put in the global order on save and back in this layout's on load, and the eigenbasis moments'
axes, which index eigenvectors, are kept in their own order whatever the weight's split does
to their rows: what the file holds does not depend on the TP size it was saved at, and any
TP size loads it.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint.dist import TensorShard, placements, tensor_shards
from megatron.checkpoint.dist.keys import OPTIMIZER_STATE_PREFIX, is_expert_key, stored_key


@dataclasses.dataclass(frozen=True)
class Field:
    """How one state tensor of a matrix weight is laid out.

    ``kind``: ``"local"`` (this rank's piece, shaped like its piece of the weight), ``"split"``
    (the whole matrix's, shaped like the whole weight, written in the weight's pieces) or
    ``"replicated"`` (the whole matrix's, written once). ``sizes``: per axis, the weight
    dimension (0: rows, 1: columns) whose length it has, None for 1. ``indexed``: per axis,
    whether position ``i`` is the weight's row (or column) ``i``, False for an index of its own
    (an eigenvector's), which keeps its order in the file.
    """

    kind: str
    sizes: Tuple[Optional[int], Optional[int]] = (0, 1)
    indexed: Tuple[bool, bool] = (True, True)


LOCAL = Field("local")
EIGEN_MOMENT = Field("split", (0, 1), (False, False))
SOAP_FIELDS = {"exp_avg": EIGEN_MOMENT, "exp_avg_sq": EIGEN_MOMENT,
               "L": Field("replicated", (0, 0)), "R": Field("replicated", (1, 1)),
               "Q_L": Field("replicated", (0, 0), (True, False)),
               "Q_R": Field("replicated", (1, 1), (True, False))}


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One matrix weight of the optimizer: where it sits and how it is split.

    ``dim``: the dimension its tensor-parallel pieces are cut along (None: not split), into
    ``parts``, of which this rank holds number ``rank``; ``expert``: split over the expert-TP
    ranks.
    """

    chunk: int
    name: str
    local_shape: Tuple[int, int]
    dim: Optional[int] = None
    parts: int = 1
    rank: int = 0
    expert: bool = False

    @property
    def whole_shape(self) -> Tuple[int, int]:
        shape = list(self.local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.parts
        return tuple(shape)

    def shape_of(self, field: Field) -> Tuple[int, ...]:
        if field.kind == "local":
            return self.local_shape
        whole = self.whole_shape
        return tuple(1 if dim is None else whole[dim] for dim in field.sizes)


def inner_optimizer(optimizer):
    """The torch optimizer inside a Megatron wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def is_emerging(optimizer) -> bool:
    """Whether ``optimizer`` (a Megatron wrapper) runs SOAP or adaptive Muon."""
    from megatron.optimizer.adaptive_muon import AdaptiveMuon
    from megatron.optimizer.soap import SOAP

    return isinstance(inner_optimizer(optimizer), (SOAP, AdaptiveMuon))


def field_kinds(optimizer, matrix: Matrix) -> Dict[str, Field]:
    """``{state name: Field}`` of one matrix weight (see the module's table)."""
    from megatron.optimizer.soap import SOAP

    inner = inner_optimizer(optimizer)
    if isinstance(inner, SOAP):
        return dict(SOAP_FIELDS)
    if inner.moment2_method == "adamuon":
        return {"momentum_buffer": LOCAL, "moment2_buffer": Field("split")}
    rows, cols = matrix.whole_shape
    per = Field("replicated", (0, None), (True, True)) if rows >= cols else \
        Field("replicated", (None, 1), (True, True))
    return {"momentum_buffer": LOCAL, "moment2_buffer": per}


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
            parts, rank = (1, 0) if shard is None else (dist.get_world_size(shard),
                                                       dist.get_rank(shard))
            out[(chunk, name)] = Matrix(chunk, name, tuple(shape), dim, parts, rank,
                                        not getattr(p, "allreduce", True))
    return out


def _at_rank(layout, matrix: Matrix, rank: int):
    if matrix.expert:
        return dataclasses.replace(layout, expert_tp_rank=rank)
    return dataclasses.replace(layout, tp_rank=rank)


def whole_to_global(matrix: Matrix, layout) -> torch.Tensor:
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


def _reorder(tensor: torch.Tensor, axes, matrix: Matrix, layout, inverse: bool):
    """``tensor`` with each axis in ``axes`` reordered by :func:`whole_to_global`
    (``inverse``: by its inverse)."""
    if matrix.dim is None or not axes:
        return tensor
    index = whole_to_global(matrix, layout)
    if inverse:
        index = torch.argsort(index)
    for axis in axes:
        tensor = tensor.index_select(axis, index)
    return tensor


def _file_order(field: Field, matrix: Matrix, layout, tensor, to_file: bool):
    """A whole-matrix ``tensor`` between this layout's order (the TP pieces concatenated) and
    the file's: weight-indexed axes of replicated fields take the global order, own-indexed
    axes of split fields keep theirs (the weight's split moves them, this undoes it)."""
    if field.kind == "replicated":
        axes = [a for a, dim in enumerate(field.sizes)
                if field.indexed[a] and dim == matrix.dim]
        return _reorder(tensor, axes, matrix, layout, inverse=to_file)
    axes = [a for a in range(2) if not field.indexed[a] and a == matrix.dim]
    return _reorder(tensor, axes, matrix, layout, inverse=not to_file)


def _replicated_place(matrix: Matrix, layout, field: Field):
    """(key without prefix, global shape, offset, stacked axes, written) of a replicated
    field: the weight's key and leading (layer, expert) axes, then the field's own shape."""
    place = placements(matrix.name, matrix.local_shape, layout)[0]
    lead = place.stacked
    written = (layout.writes_expert_replicated if is_expert_key(place.key)
               else layout.writes_replicated)
    return (place.key, tuple(place.global_shape[:lead]) + matrix.shape_of(field),
            tuple(place.global_offset[:lead]) + (0, 0), lead, written)


def field_shards(matrix: Matrix, kinds: Dict[str, Field], fields: Dict[str, torch.Tensor],
                 layout) -> List[TensorShard]:
    """What this rank writes of one matrix's state ``fields``: the local and split ones as its
    piece of the weight (where the weight's piece goes), the replicated ones once (TP rank 0
    of DP rank 0)."""
    shards = []
    for name, tensor in fields.items():
        field = kinds[name]
        prefix = f"{OPTIMIZER_STATE_PREFIX}{name}."
        if field.kind == "local":
            shards += tensor_shards(matrix.name, tensor.contiguous(), layout, prefix)
            continue
        tensor = _file_order(field, matrix, layout, tensor, to_file=True)
        if field.kind == "split":
            piece = tensor if matrix.dim is None else \
                tensor.chunk(matrix.parts, dim=matrix.dim)[matrix.rank]
            shards += tensor_shards(matrix.name, piece.contiguous(), layout, prefix)
            continue
        key, shape, offset, lead, written = _replicated_place(matrix, layout, field)
        if written:
            shards.append(TensorShard(prefix + key, tensor.reshape((1,) * lead + tensor.shape)
                                      .contiguous(), shape, offset))
    return shards


def zero_fields(kinds: Dict[str, Field], matrix: Matrix) -> Dict[str, torch.Tensor]:
    """Zeros of every field's shape: what a weight that has not stepped yet writes."""
    return {name: torch.zeros(matrix.shape_of(field)) for name, field in kinds.items()}


def read_fields(reader, matrix: Matrix, kinds: Dict[str, Field], layout,
                read_local: Callable) -> Dict[str, torch.Tensor]:
    """One matrix's state at this layout: ``read_local(prefix, layout)`` reads this rank's
    piece of a field split like the weight (at another rank's layout for the whole ones)."""
    from megatron.checkpoint.dist.reader import DistCheckpointError

    out = {}
    for name, field in kinds.items():
        prefix = f"{OPTIMIZER_STATE_PREFIX}{name}."
        if field.kind == "local":
            out[name] = read_local(prefix, layout)
            continue
        if field.kind == "split":
            pieces = [read_local(prefix, _at_rank(layout, matrix, r))
                      for r in range(matrix.parts)]
            value = pieces[0] if matrix.dim is None else torch.cat(pieces, dim=matrix.dim)
        else:
            key, shape, offset, lead, _ = _replicated_place(matrix, layout, field)
            key = stored_key(prefix + key, reader)
            if key not in reader:
                raise DistCheckpointError(f"{reader.path}: no {key!r} (for {matrix.name})")
            if tuple(reader.shape(key)) != shape:
                raise DistCheckpointError(f"{reader.path}: {key!r} has global shape "
                                          f"{list(reader.shape(key))}; this model needs "
                                          f"{list(shape)} (for {matrix.name})")
            value = reader.read(key, offset, (1,) * lead + shape[lead:]).reshape(
                shape[lead:]).float()
        out[name] = _file_order(field, matrix, layout, value, to_file=False)
    return out

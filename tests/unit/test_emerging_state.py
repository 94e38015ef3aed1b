"""SOAP's and adaptive Muon's matrix state through the ``torch_dist`` layout
(:mod:`megatron.checkpoint.emerging_state`), written by every TP rank into an in-memory file
and read back at another TP size.

Reference: the relation between the states two layouts hold for the same training, written
out by hand for a SwiGLU fc1 weight (the one whose TP pieces in rank order are not its global
rows): the factor L and its eigenvectors' rows follow the weight's rows, the eigenvectors'
order (Q_L's columns, the eigenbasis moments' rows) does not depend on the layout.
"""

import pytest
import torch

from megatron.checkpoint.dist import ChunkLayout, read_local
from megatron.checkpoint.emerging_state import (SOAP_FIELDS, Field, Matrix, LOCAL,
                                                field_shards, read_fields, whole_to_global)

FC1 = "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"
FC2 = "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"
FFN, H = 4, 3   # fc1: [2 * FFN, H] whole, [gate | value] rows


class MemoryFile:
    """The slice-reading part of :class:`DistCheckpointReader`, over global tensors that the
    written shards are pasted into (each element written exactly once)."""

    path = "memory"

    def __init__(self, shards):
        self.tensors, counts = {}, {}
        for shard in shards:
            full = self.tensors.setdefault(shard.key, torch.full(shard.global_shape, float("nan")))
            count = counts.setdefault(shard.key, torch.zeros(shard.global_shape))
            where = tuple(slice(o, o + s) for o, s in zip(shard.global_offset, shard.tensor.shape))
            full[where] = shard.tensor
            count[where] += 1
        for key, count in counts.items():
            assert torch.all(count == 1), key

    def __contains__(self, key):
        return key in self.tensors

    def shape(self, key):
        return tuple(self.tensors[key].shape)

    def read(self, key, offset=None, size=None, out=None, dtype=None):
        offset = offset or (0,) * len(self.shape(key))
        size = size or self.shape(key)
        value = self.tensors[key][tuple(slice(o, o + s) for o, s in zip(offset, size))]
        if out is not None:
            out.copy_(value)
            return out
        return value.clone()


def _layout(tp, rank):
    return ChunkLayout(num_layers=1, tp_rank=rank, tp_size=tp, swiglu=True)


def _matrix(name, whole, dim, tp, rank):
    local = list(whole)
    local[dim] //= tp
    return Matrix(0, name, tuple(local), dim if tp > 1 else None, tp, rank)


def _save(name, whole, dim, kinds, states_by_rank, tp):
    shards = []
    for rank in range(tp):
        shards += field_shards(_matrix(name, whole, dim, tp, rank), kinds,
                               states_by_rank[rank], _layout(tp, rank))
    return MemoryFile(shards)


def _load(file, name, whole, dim, kinds, tp, rank):
    matrix = _matrix(name, whole, dim, tp, rank)
    like = torch.empty(matrix.local_shape)
    return read_fields(file, matrix, kinds, _layout(tp, rank),
                       lambda prefix, layout: read_local(file, name, like, layout, prefix))


def test_fc1_rows_of_the_pieces_in_rank_order_map_to_gate_then_value_rows():
    # TP 2, FFN 4: rank 0 holds gate rows 0-1 and value rows 4-5, rank 1 gate 2-3, value 6-7.
    index = whole_to_global(_matrix(FC1, (2 * FFN, H), 0, 2, 0), _layout(2, 0))
    assert index.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def _soap_state(gen, rows, cols):
    sym = lambda n: (lambda a: a @ a.mT)(torch.randn(n, n, generator=gen))  # noqa: E731
    return {"exp_avg": torch.randn(rows, cols, generator=gen),
            "exp_avg_sq": torch.rand(rows, cols, generator=gen),
            "L": sym(rows), "R": sym(cols), "Q_L": torch.randn(rows, rows, generator=gen),
            "Q_R": torch.randn(cols, cols, generator=gen)}


def _as_tp2(state, perm):
    """The state a TP 2 run holds where a TP 1 run holds ``state``; ``perm[i]``: the global
    row of row ``i`` of its pieces in rank order."""
    return dict(state, L=state["L"][perm][:, perm], Q_L=state["Q_L"][perm])


@pytest.mark.parametrize("direction", ["tp2_to_tp1", "tp1_to_tp2"])
def test_soap_state_of_swiglu_fc1_moves_between_tp_sizes(direction):
    gen = torch.Generator().manual_seed(0)
    whole = (2 * FFN, H)
    one = _soap_state(gen, *whole)
    two = _as_tp2(one, torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]))
    kinds = dict(SOAP_FIELDS)
    if direction == "tp2_to_tp1":
        file = _save(FC1, whole, 0, kinds, [two, two], tp=2)
        loaded, expected = [_load(file, FC1, whole, 0, kinds, 1, 0)], [one]
    else:
        file = _save(FC1, whole, 0, kinds, [one], tp=1)
        loaded = [_load(file, FC1, whole, 0, kinds, 2, r) for r in range(2)]
        expected = [two, two]
    assert file.shape("optimizer.state.L." + "decoder.layers.mlp.linear_fc1.weight") == (
        1, 2 * FFN, 2 * FFN)
    for got, want in zip(loaded, expected):
        assert set(got) == set(want)
        for field in want:
            assert torch.equal(got[field], want[field]), field


def test_adaptive_muon_state_of_a_row_parallel_weight_moves_between_tp_sizes():
    """fc2 splits its columns (contiguous): the momentum is each rank's piece, the adamuon
    second moment the whole matrix's, a normuon one (a value per column) replicated."""
    gen = torch.Generator().manual_seed(1)
    whole = (H, 2 * FFN)
    moment2 = torch.rand(*whole, generator=gen)
    per_column = torch.rand(1, 2 * FFN, generator=gen)
    momentum = torch.randn(*whole, generator=gen)
    kinds = {"momentum_buffer": LOCAL, "moment2_buffer": Field("split"),
             "per_column": Field("replicated", (None, 1))}
    pieces = momentum.chunk(2, dim=1)
    file = _save(FC2, whole, 1, kinds, [
        {"momentum_buffer": pieces[r], "moment2_buffer": moment2, "per_column": per_column}
        for r in range(2)], tp=2)
    assert file.shape("optimizer.state.per_column.decoder.layers.mlp.linear_fc2.weight") == (
        1, 1, 2 * FFN)
    got = _load(file, FC2, whole, 1, kinds, 1, 0)
    assert torch.equal(got["momentum_buffer"], momentum)
    assert torch.equal(got["moment2_buffer"], moment2)
    assert torch.equal(got["per_column"], per_column)

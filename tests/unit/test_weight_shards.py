"""Weight shards without processes: the checkpoint boxes tile the full weight exactly as the
layers cut it, the groups follow Megatron's rank order, and bad sizes name the flag."""

import pytest
import torch

from megatron.core.tensor_parallel import weight_shards as ws


def _tp_piece(full, dim, tp_rank, tp):
    """Rank ``tp_rank``'s tensor-parallel block (stride 1), cut independently of the layers."""
    size = full.size(dim) // tp
    return full.narrow(dim, tp_rank * size, size)


def _rows(t, k, g):
    size = t.size(0) // g
    return t[k * size:(k + 1) * size]


@pytest.mark.parametrize("dim,tp,g", [(d, tp, g) for d in (0, 1)
                                       for tp, g in ((1, 2), (2, 2), (2, 3), (4, 2), (3, 1))]
                         + [(-1, 1, 2), (-1, 1, 4)])
def test_checkpoint_boxes_tile_the_full_weight(dim, tp, g):
    full = torch.arange(24 * 36, dtype=torch.float64).reshape(24, 36)
    rebuilt = torch.full_like(full, float("nan"))
    for t in range(tp):
        local = _tp_piece(full, dim, t, tp) if dim >= 0 else full
        for k in range(g):
            shard = _rows(local, k, g)
            shape, offset = ws.checkpoint_box(tuple(shard.shape), dim, t, tp, k, g)
            assert shape == tuple(full.shape)
            box = rebuilt[offset[0]:offset[0] + shard.size(0), offset[1]:offset[1] + shard.size(1)]
            assert torch.isnan(box).all(), "two shards claim the same place"
            box.copy_(shard)
    assert torch.equal(rebuilt, full)


def test_column_offsets_follow_megatrons_composite_index():
    # tp 2 x g 2: tp rank 1, shard 0 of a column weight is chunk 1 * 2 + 0 = 2 of 4
    assert ws.checkpoint_box((3, 8), 0, 1, 2, 0, 2) == ((12, 8), (6, 0))
    # row-parallel: dim 0 by the shard only, dim 1 by the tensor-parallel rank
    assert ws.checkpoint_box((3, 4), 1, 1, 2, 1, 2) == ((6, 8), (3, 4))


def test_strided_weight_has_no_box():
    with pytest.raises(ValueError, match="interleaved"):
        ws.checkpoint_box((3, 8), 0, 0, 2, 0, 2, stride=3)


def test_groups_in_megatrons_order():
    # Megatron's example: world 64 with tp 2 and 2 shards per tp rank, so rank 0 is with rank 2
    groups = ws.weight_shard_ranks(64, 2, 4)
    assert groups[0] == [0, 2] and groups[1] == [1, 3] and groups[2] == [4, 6]
    assert sorted(r for grp in groups for r in grp) == list(range(64))
    assert ws.weight_shard_ranks(8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ws.weight_shard_ranks(4, 2, None) == [[0], [1], [2], [3]]


def test_expert_groups_in_megatrons_order():
    # Megatron's example: world 64, expert tp 2, ep 4, 2 shards per expert-tp rank (pp 2):
    # rank 0's expert weight-shard group is [0, 8]
    groups = ws.expert_weight_shard_ranks(64, 2, 4, 4)
    assert groups[0] == [0, 8] and groups[1] == [1, 9] and groups[8] == [16, 24]
    assert sorted(r for grp in groups for r in grp) == list(range(64))
    with pytest.raises(ValueError, match="--expert-tensor-parallel-num-weight-shards"):
        ws.expert_weight_shard_ranks(8, 2, 4, 3)


@pytest.mark.parametrize("tp,n", [(4, 6), (4, 2)])
def test_shards_must_be_a_multiple_of_tp(tp, n):
    with pytest.raises(ValueError, match=r"--tensor-parallel-num-weight-shards \(%d\)" % n):
        ws.weight_shards_per_tp_rank(tp, n)


def test_world_must_hold_whole_groups():
    with pytest.raises(ValueError, match="world size"):
        ws.weight_shard_ranks(6, 1, 4)


def test_without_a_group_nothing_changes():
    w = torch.randn(4, 3, requires_grad=True)
    assert ws.gather_weight_shards(w, None) is w
    assert ws.shard_rows(w, None) is w

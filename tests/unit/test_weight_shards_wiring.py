"""--tensor-parallel-num-weight-shards without processes: the layout's weight-shard groups
follow Megatron's rank order (the core module's own group list is the reference), validation
accepts what is wired and refuses the rest in one line, and a shard's torch_dist placement is
Megatron's offset (``checkpoint_box``) inside the stacked layer tensor."""

import dataclasses

import pytest

from megatron.checkpoint.dist.keys import ChunkLayout, placements
from megatron.core.parallel_state import LayoutError, compute_rank_layout
from megatron.core.tensor_parallel import weight_shards as ws
from megatron.training.arguments import ArgumentsError, parse_args, validate_args


@pytest.mark.parametrize("world,tp,pp,n", [(2, 1, 1, 2), (8, 2, 1, 4), (8, 1, 1, 4),
                                           (16, 2, 2, 4), (12, 3, 1, 6)])
def test_layout_groups_follow_megatron_order(world, tp, pp, n):
    layout = compute_rank_layout(world, tp, pp, num_weight_shards=n)
    g = n // tp
    assert layout.weight_shards == g
    assert sorted(layout.weight_shard_groups) == sorted(ws.weight_shard_ranks(world, tp, n))
    # The weight-shard data-parallel groups: the ranks of one data-parallel group at the same
    # place of their weight-shard groups.
    place = {r: (tuple(dp), grp.index(r)) for grp in layout.weight_shard_groups
             for dp in layout.dp_groups if grp[0] in dp for r in grp}
    for group in layout.weight_shard_dp_groups:
        assert len(group) == layout.dp_size // g
        assert len({place[r] for r in group}) == 1
    assert sorted(r for grp in layout.weight_shard_dp_groups for r in grp) == list(range(world))


def test_layout_docstring_example():
    layout = compute_rank_layout(8, 2, num_weight_shards=4)
    assert layout.weight_shard_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.weight_shard_dp_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert compute_rank_layout(8, 2).weight_shard_groups == []


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(world_size=8, tp_size=2, num_weight_shards=3), "multiple of the tensor-parallel"),
    (dict(world_size=6, tp_size=1, num_weight_shards=4), "must divide the data-parallel"),
    (dict(world_size=8, tp_size=1, cp_size=2, num_weight_shards=2), "context-parallel"),
])
def test_layout_refuses_bad_sizes(kwargs, pattern):
    with pytest.raises(LayoutError, match=pattern):
        compute_rank_layout(**kwargs)


BASE = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3
--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data""".split()


def _validate(extra, world):
    args = parse_args(argv=BASE + extra)
    args.world_size = world
    return validate_args(args)


def test_flag_is_accepted_and_read():
    args = _validate(["--tensor-parallel-num-weight-shards", "4",
                      "--tensor-model-parallel-size", "2"], world=8)
    assert args.tensor_parallel_num_weight_shards == 4 and args.data_parallel_size == 4
    assert _validate([], world=2).tensor_parallel_num_weight_shards is None


@pytest.mark.parametrize("extra,world,pattern", [
    (["--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "3"], 6,
     "multiple of --tensor-model-parallel-size"),
    (["--tensor-parallel-num-weight-shards", "4"], 2, "must divide the data-parallel size"),
    (["--tensor-parallel-num-weight-shards", "2", "--use-distributed-optimizer"], 2,
     "--use-distributed-optimizer yet"),
    (["--tensor-parallel-num-weight-shards", "2", "--pipeline-model-parallel-size", "2"], 4,
     "--pipeline-model-parallel-size > 1 yet"),
    (["--tensor-parallel-num-weight-shards", "2", "--context-parallel-size", "2"], 4,
     "--context-parallel-size > 1 yet"),
    (["--tensor-parallel-num-weight-shards", "2", "--use-torch-fsdp2"], 2, "fsdp"),
    (["--tensor-parallel-num-weight-shards", "2", "--optimizer", "muon"], 2, "muon"),
    (["--tensor-parallel-num-weight-shards", "2", "--save", "ckpt", "--ckpt-format", "torch"],
     2, "--ckpt-format torch_dist only"),
    (["--tensor-parallel-num-weight-shards", "2", "--save", "ckpt", "--ckpt-format",
      "torch_dist", "--swiglu"], 2, "gated MLP"),
])
def test_validation_refuses_what_is_not_wired(extra, world, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validate(extra, world)


@pytest.mark.parametrize("inner,dim", [("self_attention.query_key_value.weight", 0),
                                       ("self_attention.dense.weight", 1),
                                       ("mlp.dense_h_to_4h.weight", 0),
                                       ("mlp.dense_4h_to_h.weight", 1)])
@pytest.mark.parametrize("tp_rank,tp,k,g", [(0, 1, 1, 2), (1, 2, 0, 2), (1, 2, 2, 3)])
def test_shard_placement_is_megatrons_offset(inner, dim, tp_rank, tp, k, g):
    shard = (6, 10)
    names = ("self_attention.query_key_value.weight", "self_attention.dense.weight",
             "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")
    dp_rank = k + g    # in the second weight-shard group: holds a copy another rank writes
    layout = ChunkLayout(num_layers=3, layer_offset=1, tp_rank=tp_rank, tp_size=tp,
                         dp_rank=dp_rank, weight_shards=g, weight_shard_rank=k,
                         weight_shard_names=names)
    name = f"language_model.encoder.layers.0.{inner}"
    [place] = placements(name, shard, layout)
    shape, offset = ws.checkpoint_box(shard, dim, tp_rank, tp, k, g)
    assert place.global_shape == (3,) + shape and place.global_offset == (1,) + offset
    assert not place.written
    [first] = placements(name, shard, dataclasses.replace(layout, dp_rank=k))
    assert first.written and first.global_offset == place.global_offset
    # Not named a shard (a bias, or a layout without shards): the plain TP placement.
    [plain] = placements(name, shard, dataclasses.replace(layout, weight_shard_names=()))
    assert plain.global_shape[1 + dim] == shard[dim] * tp

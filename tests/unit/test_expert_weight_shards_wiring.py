"""--expert-tensor-parallel-num-weight-shards without processes: the layout's expert weight-shard
groups against the plain rank formula, the flag's validation, and the torch_dist placement of
an expert's weight shard against Megatron's box."""

import dataclasses

import pytest

from megatron.checkpoint.dist.keys import ChunkLayout, placements
from megatron.core.parallel_state import LayoutError, compute_rank_layout
from megatron.core.tensor_parallel import weight_shards as ws
from megatron.training.arguments import ArgumentsError, parse_args, validate_args


@pytest.mark.parametrize("world,tp,etp,ep,n", [(2, 1, 1, 1, 2), (4, 1, 1, 2, 2), (8, 2, 1, 2, 2),
                                               (8, 2, 2, 1, 4), (8, 1, 1, 2, 4)])
def test_groups_follow_megatrons_expert_order(world, tp, etp, ep, n):
    layout = compute_rank_layout(world, tp, ep_size=ep, expert_tp_size=etp,
                                 expert_num_weight_shards=n)
    g = n // etp
    assert layout.expert_weight_shards == g
    assert sorted(layout.expert_weight_shard_groups) == sorted(
        ws.expert_weight_shard_ranks(world, etp, ep, n))
    # Each expert-data-parallel group is cut into shard groups and into the ranks holding the
    # same rows (one of each shard group): the two tile it crosswise.
    for edp in layout.expert_dp_groups:
        shards = [s for s in layout.expert_weight_shard_groups if s[0] in edp]
        rows = [d for d in layout.expert_weight_shard_dp_groups if d[0] in edp]
        assert sorted(r for s in shards for r in s) == sorted(edp)
        assert sorted(r for d in rows for r in d) == sorted(edp)
        assert all(len(set(s) & set(d)) == 1 for s in shards for d in rows)
    # The dense layout is untouched.
    assert layout.weight_shards == 1 and layout.weight_shard_groups == []


def test_megatrons_worked_example():
    # World 64, expert tp 2, ep 4, pp 2, N = 4: rank 0's expert weight-shard group is [0, 8].
    layout = compute_rank_layout(64, 2, 2, ep_size=4, expert_tp_size=2,
                                 expert_num_weight_shards=4)
    assert [0, 8] in layout.expert_weight_shard_groups


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(world_size=8, ep_size=2, expert_tp_size=2, expert_num_weight_shards=3),
     "multiple of the tensor-parallel"),
    (dict(world_size=4, ep_size=2, expert_num_weight_shards=4),
     "must divide the expert-data-parallel size"),
    (dict(world_size=8, cp_size=2, ep_size=2, expert_num_weight_shards=2), "context-parallel"),
])
def test_layout_refuses_bad_sizes(kwargs, pattern):
    with pytest.raises(LayoutError, match=pattern):
        compute_rank_layout(**kwargs)


BASE = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3
--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data""".split()
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
FLAG = "--expert-tensor-parallel-num-weight-shards"


def _validate(extra, world):
    args = parse_args(argv=BASE + extra)
    args.world_size = world
    return validate_args(args)


def test_flag_is_accepted_and_read():
    args = _validate([*MOE, FLAG, "2", "--expert-model-parallel-size", "2"], world=4)
    assert args.expert_tensor_parallel_num_weight_shards == 2
    assert _validate(MOE, world=2).expert_tensor_parallel_num_weight_shards is None
    # The dense flag runs with MoE now, and with the expert one.
    both = _validate([*MOE, FLAG, "2", "--tensor-parallel-num-weight-shards", "2"], world=2)
    assert both.tensor_parallel_num_weight_shards == 2


@pytest.mark.parametrize("extra,world,pattern", [
    ([FLAG, "2"], 2, "needs --num-experts"),
    ([*MOE, "--expert-tensor-parallel-size", "2", FLAG, "3"], 6,
     "multiple of --expert-tensor-parallel-size"),
    ([*MOE, "--expert-model-parallel-size", "2", FLAG, "2"], 2,
     "must divide the expert-data-parallel size"),
    ([*MOE, FLAG, "2", "--use-distributed-optimizer"], 2, "--use-distributed-optimizer yet"),
    ([*MOE, FLAG, "2", "--pipeline-model-parallel-size", "2"], 4,
     "--pipeline-model-parallel-size > 1 yet"),
    ([*MOE, FLAG, "2", "--moe-grouped-gemm", "--moe-single-grouped-weight"], 2,
     "--moe-single-grouped-weight"),
    ([*MOE, FLAG, "2", "--optimizer", "muon"], 2, "muon"),
    ([*MOE, FLAG, "2", "--save", "ckpt", "--ckpt-format", "torch"], 2,
     "--ckpt-format torch_dist only"),
    ([*MOE, FLAG, "2", "--save", "ckpt", "--ckpt-format", "torch_dist", "--swiglu"], 2,
     "gated expert fc1"),
])
def test_validation_refuses_what_is_not_wired(extra, world, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validate(extra, world)


@pytest.mark.parametrize("inner,dim", [("linear_fc1.weight", 0), ("linear_fc2.weight", 1)])
@pytest.mark.parametrize("etp_rank,etp,k,g", [(0, 1, 1, 2), (1, 2, 0, 2), (1, 2, 2, 3)])
def test_expert_shard_placement_is_megatrons_offset(inner, dim, etp_rank, etp, k, g):
    shard = (6, 10)
    name = f"language_model.encoder.layers.0.mlp.experts.local_experts.1.{inner}"
    names = tuple(f"mlp.experts.local_experts.{j}.linear_fc{i}.weight"
                  for j in range(2) for i in (1, 2))
    # Experts 2, 3 of 4 (EP rank 1); in the second expert weight-shard group, whose copy
    # another rank writes. The dense weight-shard fields must not matter to an expert.
    layout = ChunkLayout(num_layers=3, layer_offset=1, num_experts=4, expert_offset=2,
                         expert_tp_rank=etp_rank, expert_tp_size=etp, expert_dp_rank=k + g,
                         weight_shards=5, weight_shard_rank=4, expert_weight_shards=g,
                         expert_weight_shard_rank=k, weight_shard_names=names)
    [place] = placements(name, shard, layout)
    shape, offset = ws.checkpoint_box(shard, dim, etp_rank, etp, k, g)
    assert place.global_shape == (3, 4) + shape
    assert place.global_offset == (1, 3) + offset
    assert not place.written
    [first] = placements(name, shard, dataclasses.replace(layout, expert_dp_rank=k))
    assert first.written and first.global_offset == place.global_offset

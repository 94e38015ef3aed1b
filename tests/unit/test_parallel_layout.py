"""The parallel layout object: Megatron's rank assignment with context and expert parallelism,
its error messages, and the flags that size context parallelism."""

import dataclasses

import pytest

from megatron.training import memory_accounting as ma
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.core import parallel_state as ps
from megatron.core.config import TransformerConfig


def _covers_world(groups, world):
    return sorted(r for g in groups for r in g) == list(range(world))


def test_megatron_documented_example_without_cp():
    # Megatron's initialize_model_parallel docstring: 16 GPUs, tp 2, pp 4 -> 8 tp groups,
    # 8 dp groups and 4 pipeline groups.
    layout = ps.compute_rank_layout(16, 2, 4)
    assert layout.dp_size == 2
    assert layout.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                [14, 15]]
    assert layout.dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                [13, 15]]
    assert layout.pp_groups == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_megatron_documented_context_parallel_example():
    # Megatron's --context-parallel-size help: 8 GPUs, tp 4, cp 2 -> the sequence halves are
    # processed by GPUs 0-3 and 4-7, with cp groups [0, 4] [1, 5] [2, 6] [3, 7].
    layout = ps.compute_rank_layout(8, 4, 1, cp_size=2)
    assert layout.dp_size == 1
    assert layout.tp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.cp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_world8_tp2_cp4_hierarchical_2x2():
    # The module docstring's hierarchical table: inner all-to-all groups of neighbouring cp
    # ranks, outer rings of the cp ranks two apart, inside each context-parallel group.
    layout = ps.compute_rank_layout(8, 2, cp_size=4, hierarchical_cp_sizes=[2, 2])
    assert layout.cp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.cp_a2a_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.cp_p2p_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert layout.hierarchical_cp_sizes == (2, 2)
    assert _covers_world(layout.cp_a2a_groups, 8) and _covers_world(layout.cp_p2p_groups, 8)
    assert ps.compute_rank_layout(8, 2, cp_size=4).cp_a2a_groups == []
    with pytest.raises(ps.LayoutError, match="--hierarchical-context-parallel-sizes 2 3"):
        ps.compute_rank_layout(8, 2, cp_size=4, hierarchical_cp_sizes=[2, 3])


def test_world16_tp2_cp2_pp2():
    # rank = tp + 2 (cp + 2 (dp + 2 pp)): the module docstring's worked example.
    layout = ps.compute_rank_layout(16, 2, 2, cp_size=2)
    assert layout.dp_size == 2
    assert layout.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                [14, 15]]
    assert layout.cp_groups == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                [13, 15]]
    assert layout.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                [11, 15]]
    assert layout.dp_cp_groups == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                   [9, 11, 13, 15]]
    assert layout.pp_groups == [[r, r + 8] for r in range(8)]
    assert layout.model_parallel_groups == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13],
                                            [6, 7, 14, 15]]
    assert layout.embedding_groups == [[r, r + 8] for r in range(8)]
    assert layout.rank_coordinates(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    for name in ("tp_groups", "cp_groups", "dp_groups", "dp_cp_groups", "pp_groups",
                 "model_parallel_groups", "ep_groups", "expert_tp_groups", "expert_dp_groups",
                 "expert_model_parallel_groups"):
        assert _covers_world(getattr(layout, name), 16), name


def test_cp1_layout_is_the_classic_one():
    with_cp = ps.compute_rank_layout(8, 2, 2, cp_size=1)
    assert with_cp.dp_cp_groups == with_cp.dp_groups
    assert with_cp.cp_groups == [[r] for r in range(8)]


def test_expert_groups_fold_into_data_and_context_ranks():
    # world 8, tp 2, cp 2, ep 2, expert tp 1: dp 2; the 8 ranks of the stage re-cut as
    # expert tp 1 x ep 2 x expert dp 4.
    layout = ps.compute_rank_layout(8, 2, 1, cp_size=2, ep_size=2, expert_tp_size=1)
    assert (layout.dp_size, layout.expert_dp_size) == (2, 4)
    assert layout.expert_tp_groups == [[r] for r in range(8)]
    assert layout.ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.expert_dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.expert_model_parallel_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Expert tp 4 over tp 2 x pp 2 x dp 2, ep 2: each stage's 8 ranks hold one copy of the
    # experts; the groups span both stages.
    layout = ps.compute_rank_layout(16, 2, 2, ep_size=2, expert_tp_size=4)
    assert layout.expert_tp_groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                       [12, 13, 14, 15]]
    assert layout.ep_groups == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                [11, 15]]
    assert layout.expert_model_parallel_groups == [list(range(16))]
    # Expert tp defaults to tp; each pipeline stage is cut on its own.
    layout = ps.compute_rank_layout(16, 2, 2, cp_size=2, ep_size=2)
    assert layout.expert_tp_size == 2 and layout.expert_dp_size == 2
    assert layout.expert_tp_groups == layout.tp_groups
    assert layout.ep_groups == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                [13, 15]]
    assert layout.expert_dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13],
                                       [10, 14], [11, 15]]
    assert layout.expert_model_parallel_groups == [[0, 1, 2, 3, 8, 9, 10, 11],
                                                   [4, 5, 6, 7, 12, 13, 14, 15]]


def test_bad_products_name_the_flags():
    with pytest.raises(ps.LayoutError, match=r"world size \(12\) is not divisible by "
                       r"--tensor-model-parallel-size \(2\) x --context-parallel-size \(4\) x "
                       r"--pipeline-model-parallel-size \(1\) = 8"):
        ps.compute_rank_layout(12, 2, 1, cp_size=4)
    with pytest.raises(ps.LayoutError, match=r"--expert-tensor-parallel-size \(1\) x "
                       r"--expert-model-parallel-size \(3\) = 3"):
        ps.compute_rank_layout(8, 2, 1, cp_size=2, ep_size=3, expert_tp_size=1)
    with pytest.raises(ps.LayoutError, match=r"--context-parallel-size must be >= 1, got 0"):
        ps.compute_rank_layout(8, cp_size=0)


BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10").split()


def _validate(extra, world):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = world
    return validate_args(args)


def test_context_parallel_flags_derive_data_parallel_size():
    args = _validate(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                      "--cp-comm-type", "a2a"], 8)
    assert args.data_parallel_size == 2 and args.cp_comm_type == "a2a"
    # Every exchange takes the per-document mask (a2a gathers its rows).
    args = _validate(["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                      "--reset-attention-mask", "--reset-position-ids"], 2)
    assert args.reset_attention_mask and args.reset_position_ids


@pytest.mark.parametrize("extra,world,pattern", [
    (["--context-parallel-size", "3"], 4,
     r"world size \(4\) is not divisible by --tensor-model-parallel-size \(1\) x "
     r"--context-parallel-size \(3\)"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2,
     r"--seq-length \(30\) is not divisible by 2 x --context-parallel-size \(2\) = 4"),
    (["--context-parallel-size", "4", "--tensor-model-parallel-size", "4", "--cp-comm-type",
      "a2a"], 16, r"a2a splits the 2 attention heads per tensor-parallel rank .*"
     r"over --context-parallel-size 4"),
])
def test_context_parallel_errors(extra, world, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validate(extra, world)


def test_memory_accounting_divides_activations_by_cp():
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=128, max_position_embeddings=64, seq_length=64,
                            recompute_granularity="selective")
    one = ma.layer_activation_bytes(cfg, 2)
    assert ma.layer_activation_bytes(cfg, 2, cp_size=4) == one / 4
    # The scores of s/cp local queries over all s keys: a (s/cp) s b (2e + 1).
    full = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             padded_vocab_size=128, max_position_embeddings=64, seq_length=64)
    scores = 4 * 64 * 64 * 2 * 5
    assert ma.layer_activation_bytes(full, 2, cp_size=2) == \
        ma.layer_activation_bytes(cfg, 2) / 2 + scores / 2
    whole = ma.activation_bytes_on_rank(cfg, micro_batch_size=2, num_microbatches=1)
    quarter = ma.activation_bytes_on_rank(cfg, micro_batch_size=2, num_microbatches=1,
                                          cp_size=4)
    assert quarter == pytest.approx(whole / 4)


def _naive_groups(sizes, order, dims):
    """Every rank's coordinates by nested loops over Megatron's formula (first name of
    ``order`` fastest); a group per setting of the coordinates outside ``dims``."""
    import itertools
    names = order.split("-")
    found = {}
    for coords in itertools.product(*(range(sizes[n]) for n in names)):
        rank, scale = 0, 1
        for name, value in zip(names, coords):
            rank += value * scale
            scale *= sizes[name]
        key = tuple(v for n, v in zip(names, coords) if n not in dims)
        found.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in found.values())


@pytest.mark.parametrize("order", [ps.DEFAULT_ORDER, ps.TP_PP_DP_ORDER])
@pytest.mark.parametrize("tp,pp,cp,dp,ep", [
    (2, 2, 1, 2, 1), (1, 4, 1, 2, 1), (2, 2, 2, 2, 1), (4, 2, 1, 3, 1), (2, 3, 2, 1, 1),
    (1, 2, 2, 2, 2), (2, 2, 1, 2, 2), (1, 1, 2, 2, 2)])
def test_groups_match_a_naive_enumeration(order, tp, pp, cp, dp, ep):
    world = tp * pp * cp * dp
    # With experts, expert tp x ep = tp x cp keeps both orders' pipeline groups together.
    etp = tp * cp // ep if ep > 1 else tp
    layout = ps.compute_rank_layout(world, tp, pp, cp_size=cp, ep_size=ep,
                                    expert_tp_size=etp, order=order)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    for name, dims in (("tp_groups", ["tp"]), ("cp_groups", ["cp"]), ("dp_groups", ["dp"]),
                       ("pp_groups", ["pp"]), ("dp_cp_groups", ["cp", "dp"]),
                       ("model_parallel_groups", ["tp", "pp"])):
        assert getattr(layout, name) == _naive_groups(dense, order, dims), name
    assert layout.embedding_groups == [[g[0], g[-1]] if pp > 1 else [g[0]]
                                       for g in _naive_groups(dense, order, ["pp"])]
    for rank in range(world):
        expected, rest = {}, rank
        for name in order.split("-"):
            expected[name], rest = rest % dense[name], rest // dense[name]
        del expected["ep"]
        assert layout.rank_coordinates(rank) == expected
    if ep > 1:
        expert = {"tp": etp, "cp": 1, "ep": ep, "dp": world // pp // (etp * ep), "pp": pp}
        for name, dims in (("ep_groups", ["ep"]), ("expert_tp_groups", ["tp"]),
                           ("expert_dp_groups", ["dp"]),
                           ("expert_model_parallel_groups", ["tp", "ep", "pp"])):
            assert getattr(layout, name) == _naive_groups(expert, order, dims), name
        assert _naive_groups(expert, order, ["pp"]) == layout.pp_groups


def test_tp_pp_dp_mapping_documented_table():
    # The module docstring's table: world 8, tp 2, pp 2 numbered tp-cp-ep-pp-dp.
    layout = ps.compute_rank_layout(8, 2, 2, order="tp-cp-ep-pp-dp")
    assert layout.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.rank_coordinates(6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1}
    # Without pipeline parallelism the two orders are the same layout.
    assert ps.compute_rank_layout(8, 2, 1, cp_size=2, order="tp-cp-ep-pp-dp") == \
        dataclasses.replace(ps.compute_rank_layout(8, 2, 1, cp_size=2),
                            order="tp-cp-ep-pp-dp")


def test_tp_pp_dp_mapping_flag_and_its_errors():
    assert _validate(["--use-tp-pp-dp-mapping"], 2).use_tp_pp_dp_mapping
    with pytest.raises(ArgumentsError, match=r"--use-tp-pp-dp-mapping with pipeline "
                       r"parallelism needs --expert-tensor-parallel-size \(1\) x "
                       r"--expert-model-parallel-size \(4\) = --tensor-model-parallel-size "
                       r"\(2\) x --context-parallel-size \(1\)"):
        _validate(["--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2",
                   "--tensor-model-parallel-size", "2", "--num-experts", "4",
                   "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                   "--sequence-parallel"],
                  8)
    with pytest.raises(ps.LayoutError, match="rank order must be one of"):
        ps.compute_rank_layout(4, 2, 2, order="pp-dp-tp")

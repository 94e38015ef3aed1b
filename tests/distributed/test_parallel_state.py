"""Megatron's rank layout: against a hand-written table, and against groups created on 8 ranks."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.multiprocess import run_on_ranks

# world 8, tp 2, pp 2 -> dp 2, written out by hand from the rank order
# (tp fastest, then dp, then pp).
HAND_TABLE = {
    "tp_groups": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp_groups": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp_groups": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "model_parallel_groups": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "embedding_groups": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "position_embedding_groups": [[0], [1], [2], [3]],
}


def test_layout_matches_hand_table():
    layout = ps.compute_rank_layout(8, 2, 2)
    assert layout.dp_size == 2
    for name, groups in HAND_TABLE.items():
        assert getattr(layout, name) == groups, name


def test_layout_other_shapes():
    layout = ps.compute_rank_layout(8, 2, 1)
    assert layout.dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.embedding_groups == [[r] for r in range(8)]
    layout = ps.compute_rank_layout(8, 1, 4)
    assert layout.pp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.embedding_groups == [[0, 6], [1, 7]]
    # every kind of group partitions the world
    for tp, pp in [(1, 1), (2, 2), (4, 2), (1, 8), (8, 1)]:
        layout = ps.compute_rank_layout(8, tp, pp)
        for name in ("tp_groups", "dp_groups", "pp_groups", "model_parallel_groups"):
            flat = sorted(r for g in getattr(layout, name) for r in g)
            assert flat == list(range(8)), (tp, pp, name)


def test_layout_rejects_indivisible_world():
    with pytest.raises(ValueError, match=r"world size \(6\).*\(4\).*\(1\)"):
        ps.compute_rank_layout(6, 4, 1)


def _collect_groups():
    state = ps.initialize_model_parallel(2, 2)
    rank = dist.get_rank()
    members = {}
    for name, group in [("tp", state.tp_group), ("dp", state.dp_group), ("pp", state.pp_group),
                        ("mp", state.model_parallel_group), ("emb", state.embedding_group),
                        ("pos", state.position_embedding_group)]:
        if group is None:  # not a member (position embeddings live on the first stage only)
            members[name] = None
            continue
        # Who is really in the created group: all-gather the global rank over it.
        size = dist.get_world_size(group)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(out, torch.tensor([rank]), group=group)
        members[name] = [int(t) for t in out]
    return {
        "members": members,
        "ranks": (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                  ps.get_pipeline_model_parallel_rank()),
        "sizes": (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                  ps.get_pipeline_model_parallel_world_size()),
        "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage(),
        "src": ps.get_tensor_model_parallel_src_rank(),
        "next": ps.get_pipeline_model_parallel_next_rank(),
        "prev": ps.get_pipeline_model_parallel_prev_rank(),
    }


@pytest.mark.slow  # 8 processes on 2 cores; every multi-rank test builds these groups too
def test_groups_created_on_8_ranks():
    results = run_on_ranks(_collect_groups, 8)
    keys = {"tp": "tp_groups", "dp": "dp_groups", "pp": "pp_groups",
            "mp": "model_parallel_groups", "emb": "embedding_groups",
            "pos": "position_embedding_groups"}
    for rank, res in enumerate(results):
        for short, table_name in keys.items():
            expected = next((g for g in HAND_TABLE[table_name] if rank in g), None)
            assert res["members"][short] == expected, (rank, short)
        tp_rank, dp_rank, pp_rank = res["ranks"]
        assert (tp_rank, dp_rank, pp_rank) == (rank % 2, (rank // 2) % 2, rank // 4)
        assert res["sizes"] == (2, 2, 2)
        assert res["first"] == (rank < 4) and res["last"] == (rank >= 4)
        assert res["src"] == rank - rank % 2
        assert res["next"] == (rank + 4) % 8 and res["prev"] == (rank + 4) % 8


def _members(group):
    """The global ranks really in ``group`` (all-gathered over it); None when not a member."""
    if group is None:
        return None
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def _users_getters():
    """What a user's script reads through Megatron's getter names, on TP 2 x CP 2 with EP 2."""
    ps.initialize_model_parallel(2, 1, context_parallel_size=2, expert_model_parallel_size=2)
    return {
        "initialized": ps.model_parallel_is_initialized(),
        "tp": _members(ps.get_tensor_model_parallel_group()),
        "pp": _members(ps.get_pipeline_model_parallel_group()),
        "dp": _members(ps.get_data_parallel_group()),
        "dp_cp": _members(ps.get_data_parallel_group(with_context_parallel=True)),
        "cp": _members(ps.get_context_parallel_group()),
        "mp": _members(ps.get_model_parallel_group()),
        "emb": _members(ps.get_embedding_group()),
        "cp_rank_size": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "dp_cp_rank_size": (ps.get_data_parallel_rank(with_context_parallel=True),
                            ps.get_data_parallel_world_size(with_context_parallel=True)),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "vp": (ps.get_virtual_pipeline_model_parallel_rank(),
               ps.get_virtual_pipeline_model_parallel_world_size()),
    }


def test_users_getters_answer_from_the_layout():
    """The getters kept for users' scripts name the groups of Megatron's rank table
    (tp-cp-dp-pp: TP pairs {0,1} {2,3}, CP pairs {0,2} {1,3}, DP x CP = CP here)."""
    layout = ps.compute_rank_layout(4, 2, 1, cp_size=2, ep_size=2)
    results = run_on_ranks(_users_getters, 4)
    for rank, res in enumerate(results):
        def table(name):
            return next(g for g in getattr(layout, name) if rank in g)
        assert res["initialized"]
        assert res["tp"] == table("tp_groups") == [rank - rank % 2, rank - rank % 2 + 1]
        assert res["cp"] == table("cp_groups") == [rank % 2, rank % 2 + 2]
        assert res["dp"] == table("dp_groups") == [rank]
        assert res["dp_cp"] == table("dp_cp_groups") == res["cp"]
        assert res["pp"] == [rank] and res["mp"] == table("model_parallel_groups")
        assert res["emb"] == table("embedding_groups")
        assert res["cp_rank_size"] == (rank // 2, 2) == res["dp_cp_rank_size"]
        assert res["ep_size"] == 2 and res["vp"] == (None, None)


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        assert 1 + 1 == 3, "deliberate failure"
    dist.barrier()


def test_harness_reports_failing_rank():
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed(.|\n)*deliberate failure"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)

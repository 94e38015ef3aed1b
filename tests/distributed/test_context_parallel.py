"""Context-parallel attention (megatron/core/context_parallel.py) against naive full attention in
fp64: outputs and the gradients of queries, keys and values at every rank's tokens, for the ring
(p2p), all-gather, all-to-all and hierarchical (a2a+p2p) exchanges, with and without
grouped-query attention, with value heads narrower than key heads (multi-latent attention),
causal and with an explicit mask that leaves whole rows (and, at cp 4, whole chunks) masked (all-to-all
gathers the mask's rows: it attends for queries other ranks hold).

Every rank builds the whole sequence from fixed seeds, computes the reference itself, and compares
its own tokens (chunks r and 2cp-1-r) with what the exchanges produced.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import (ContextParallelError, check_sequence_length,
                                            chunk_positions, context_parallel_attention,
                                            get_batch_on_this_cp_rank, hierarchical_cp_groups,
                                            split_for_cp_rank)
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-10)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))  # every token exactly once
    with pytest.raises(ContextParallelError, match="--seq-length 20 .* 2 x "
                                                   "--context-parallel-size = 8"):
        check_sequence_length(20, 4)


def test_a_batch_is_split_by_tokens_and_the_mask_by_query_rows():
    tokens = torch.arange(16).view(2, 8)
    mask = torch.rand(2, 1, 8, 8) > 0.5
    part = get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens + 1,
                                      "attention_mask": mask, "loss_mask": None}, 2, 1)
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(part["attention_mask"], mask[:, :, 2:6, :])
    assert part["loss_mask"] is None
    assert torch.equal(split_for_cp_rank(tokens, 1, 1, 0), tokens)


def _naive(q, k, v, mask):
    """Full attention, fp64; a row that sees no key gives zeros. q [s, b, np, hn], k/v
    [s, b, ng, hn], mask bool [b, 1, s, s] True = masked."""
    heads = q.size(2)
    k = k.repeat_interleave(heads // k.size(2), dim=2)
    v = v.repeat_interleave(heads // v.size(2), dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.size(-1) ** 0.5
    scores = scores.masked_fill(mask, float("-inf"))
    empty = mask.all(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(empty, torch.zeros_like(scores), scores), dim=-1)
    probs = probs * (~empty)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(q.size(0), q.size(1), -1)


def _case(seq, batch, heads, groups, hn, masked_rows, seed, hv=None):
    hv = hn if hv is None else hv
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, hn, generator=gen, dtype=torch.float64)
    k = torch.randn(seq, batch, groups, hn, generator=gen, dtype=torch.float64)
    v = torch.randn(seq, batch, groups, hv, generator=gen, dtype=torch.float64)
    grad = torch.randn(seq, batch, heads * hv, generator=gen, dtype=torch.float64)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None].expand(batch, 1, seq,
                                                                              seq)
    mask = None
    if masked_rows:
        # padding-like: random extra masking, a fully masked row in each sample, and the
        # whole first chunk of sample 1 seeing nothing
        mask = causal | (torch.rand(batch, 1, seq, seq, generator=gen) > 0.7)
        mask = mask.clone()
        mask[0, :, 5] = True
        mask[1, :, :masked_rows] = True
    return q, k, v, grad, (causal if mask is None else mask), mask


def _check(cp, comm_type, heads, groups, masked_rows, seed, hv=None, hierarchical=None):
    rank = dist.get_rank()
    seq, batch, hn = 8 * cp, 2, 4
    q, k, v, grad, full_mask, mask = _case(seq, batch, heads, groups, hn, masked_rows, seed, hv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _naive(*leaves, full_mask)
    (ref * grad).sum().backward()
    pos = chunk_positions(seq, cp, rank)
    local = [t[pos].detach().clone().requires_grad_() for t in (q, k, v)]
    local_mask = None if mask is None else mask[:, :, pos, :]
    out = context_parallel_attention(*local, cp_group=dist.group.WORLD, comm_type=comm_type,
                                     attention_mask=local_mask, hierarchical_groups=hierarchical)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref[pos].detach(), **TOL)
    (out * grad[pos]).sum().backward()
    for name, mine, whole in zip("qkv", local, leaves):
        assert not torch.isnan(mine.grad).any(), name
        torch.testing.assert_close(mine.grad, whole.grad[pos], **TOL, msg=f"d{name}")
    if masked_rows:
        empty = full_mask.all(dim=-1)[:, 0].transpose(0, 1)[pos]         # [s_local, b]
        assert (out[empty] == 0).all()


def _all_cases(cp):
    cases = 0
    for comm_type in ("p2p", "all_gather", "a2a"):
        for heads, groups in ((4, 4), (4, 2), (8, 1)):
            for masked_rows in (0, 4):
                _check(cp, comm_type, heads, groups, masked_rows, seed=cases)
                cases += 1
        _check(cp, comm_type, 4, 4, 0, seed=cases, hv=3)   # value heads narrower than keys
        cases += 1
    q = torch.zeros(8, 1, 4, 4)
    for comm_type in ("p2p", "a2a"):
        with pytest.raises(ContextParallelError, match=r"must be \[b or 1, 1, 8, %d\]" % (8 * cp)):
            context_parallel_attention(q, q, q, cp_group=dist.group.WORLD, comm_type=comm_type,
                                       attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    if cp == 4:
        with pytest.raises(ContextParallelError, match="6 attention heads .* 4"):
            context_parallel_attention(torch.zeros(8, 1, 6, 4), q[:, :, :1], q[:, :, :1],
                                       cp_group=dist.group.WORLD, comm_type="a2a")
    return cases


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_full_attention(cp):
    assert run_on_ranks(_all_cases, cp, cp) == [21] * cp


def _my_groups(groups):
    mine = None
    for ranks in groups:
        handle = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = handle
    return mine


def _hierarchical_cases(sizes):
    cp = dist.get_world_size()
    inner, outer = hierarchical_cp_groups(list(range(cp)), sizes)
    groups = (_my_groups(inner), _my_groups(outer))
    cases = 0
    for heads, n_groups, hv in ((4, 4, None), (4, 2, 3), (8, 1, None)):
        for masked_rows in (0, 4):
            _check(cp, "a2a+p2p", heads, n_groups, masked_rows, seed=100 + cases, hv=hv,
                   hierarchical=groups)
            cases += 1
    q = torch.zeros(8, 1, 4, 4)
    with pytest.raises(ContextParallelError, match="needs --hierarchical-context-parallel-"):
        context_parallel_attention(q, q, q, cp_group=dist.group.WORLD, comm_type="a2a+p2p")
    return cases


def test_hierarchical_groups_are_neighbours_inside_and_strided_outside():
    assert hierarchical_cp_groups([0, 2, 4, 6], [2, 2]) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert hierarchical_cp_groups(range(8), [2, 4])[1] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ContextParallelError, match="2 3: expected two sizes whose product is "
                                                   "--context-parallel-size 4"):
        hierarchical_cp_groups([0, 1, 2, 3], [2, 3])


@pytest.mark.parametrize("sizes", [[2, 2], [1, 4], [4, 1]])
def test_a2a_plus_p2p_attention_equals_full_attention(sizes):
    assert run_on_ranks(_hierarchical_cases, 4, sizes) == [6] * 4


def test_cp_comm_type_is_one_type_or_one_per_layer():
    from megatron.core.config import ConfigError
    from tests.unit.test_gpt_model import make_config

    config = make_config(num_layers=3, cp_comm_type=["a2a", "p2p", "a2a+p2p"])
    assert [config.layer_cp_comm_type(n) for n in (1, 2, 3, 4)] == ["a2a", "p2p", "a2a+p2p",
                                                                     "a2a+p2p"]
    assert make_config(cp_comm_type="all_gather").layer_cp_comm_type(2) == "all_gather"
    with pytest.raises(ConfigError, match="one per layer: got 2 for --num-layers 3"):
        make_config(num_layers=3, cp_comm_type=["a2a", "p2p"])

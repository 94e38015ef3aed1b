"""The MoE router and capacity rules against formulas written here in fp64, token by token.

Top-k choices and probabilities (softmax after or before the top-k, sigmoid, scaling factor),
the load-balancing losses (``aux_loss``, ``seq_aux_loss``) and the z-loss as logged and as they
reach the gradients, Sinkhorn routing, input jitter, and capacity: dropping by probability or
position and padding each expert to capacity, against a plain loop over tokens. Everything is
float64, so two orderings of the same sums agree to ~1e-15; the tolerances (1e-12) still catch
any wrong formula by many orders of magnitude.
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import (MoEConfig, MoELossTracker, TopKRouter, drop_over_capacity,
                                expert_capacity, permute, sinkhorn, topk_routing, unpermute)

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN = 6, 3, 8


def _config():
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                             padded_vocab_size=16, max_position_embeddings=SEQ,
                             seq_length=SEQ, params_dtype=torch.float64)


def _router(tracker=None, **moe):
    moe.setdefault("num_moe_experts", 5)
    return TopKRouter(_config(), MoEConfig(**moe), layer_number=2, tracker=tracker)


def _logits(experts=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, experts, generator=gen, dtype=torch.float64)


# -- fp64 formulas, one token at a time -------------------------------------------------------

def naive_choice(row, topk, score, pre_softmax=False, scale=None):
    """One token's (expert ids best first, probabilities)."""
    row = [float(v) for v in row]
    order = sorted(range(len(row)), key=lambda e: -row[e])[:topk]
    if score == "softmax" and not pre_softmax:
        weights = [math.exp(row[e]) for e in order]
        probs = [w / sum(weights) for w in weights]
    elif score == "softmax":
        total = sum(math.exp(v) for v in row)
        probs = [math.exp(row[e]) / total for e in order]
    else:
        sig = [1.0 / (1.0 + math.exp(-row[e])) for e in order]
        probs = [v / sum(sig) for v in sig] if topk > 1 else sig
    return order, [p * (scale or 1.0) for p in probs]


def naive_scores(row, score):
    """One token's score of every expert, summing to 1."""
    row = [float(v) for v in row]
    if score == "softmax":
        weights = [math.exp(v) for v in row]
    else:
        weights = [1.0 / (1.0 + math.exp(-v)) for v in row]
    return [w / sum(weights) for w in weights]


def naive_switch_loss(rows, topk, score):
    """E * sum_e f_e P_e over the given tokens."""
    experts = len(rows[0])
    counts = [0] * experts
    mean_scores = [0.0] * experts
    for row in rows:
        for e in naive_choice(row, topk, "softmax")[0]:
            counts[e] += 1
        for e, s in enumerate(naive_scores(row, score)):
            mean_scores[e] += s / len(rows)
    return experts * sum(counts[e] / (topk * len(rows)) * mean_scores[e] for e in range(experts))


def naive_z_loss(rows):
    return sum(math.log(sum(math.exp(float(v)) for v in row)) ** 2 for row in rows) / len(rows)


def naive_keep(probs, routing_map, capacity, policy):
    """The kept (token, expert) pairs of a plain loop over each expert's tokens."""
    keep = torch.zeros_like(routing_map)
    for e in range(routing_map.size(1)):
        routed = [t for t in range(routing_map.size(0)) if routing_map[t, e]]
        if policy == "probs":
            routed = sorted(routed, key=lambda t: -float(probs[t, e]))
        for t in routed[:capacity]:
            keep[t, e] = True
    return keep


# -- top-k and probabilities -------------------------------------------------------------------

@pytest.mark.parametrize("score,pre_softmax,topk,scale", [
    ("softmax", False, 2, None), ("softmax", True, 2, None), ("softmax", False, 3, 2.5),
    ("softmax", True, 1, None), ("sigmoid", False, 2, None), ("sigmoid", False, 1, None),
    ("sigmoid", False, 3, 1.5)])
def test_topk_ids_and_probabilities_match_the_formula(score, pre_softmax, topk, scale):
    logits = _logits().view(-1, 5)
    probs, indices = topk_routing(logits, topk, score, pre_softmax, scale)
    router = _router(moe_router_topk=topk, moe_router_score_function=score,
                     moe_router_pre_softmax=pre_softmax, moe_router_topk_scaling_factor=scale,
                     moe_router_load_balancing_type="none").eval()
    dense, routing_map = router.route(logits.view(SEQ, BATCH, 5))
    for t, row in enumerate(logits):
        order, want = naive_choice(row, topk, score, pre_softmax, scale)
        assert indices[t].tolist() == order  # best first
        torch.testing.assert_close(probs[t], torch.tensor(want, dtype=torch.float64), **TOL)
        assert routing_map[t].nonzero().flatten().tolist() == sorted(order)
        torch.testing.assert_close(dense[t, order], probs[t], **TOL)
        assert float(dense[t].sum()) == pytest.approx(sum(want), abs=1e-12)


def test_low_precision_logits_are_scored_in_float32():
    logits = _logits().view(-1, 5).to(torch.bfloat16)
    probs, indices = topk_routing(logits, 2)
    assert probs.dtype == torch.bfloat16
    want = torch.softmax(torch.topk(logits.float(), 2).values, dim=-1)
    assert torch.equal(probs, want.to(torch.bfloat16))


# -- auxiliary losses --------------------------------------------------------------------------

@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_seq_aux_loss_and_z_loss_values(score):
    logits = _logits()
    rows = logits.view(-1, 5)
    for kind in ("aux_loss", "seq_aux_loss"):
        tracker = MoELossTracker(num_layers=3)
        router = _router(tracker, moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1,
                         moe_router_score_function=score, moe_z_loss_coeff=0.01).train()
        router.route(logits.clone().requires_grad_())
        logged = tracker.report(per_layer=True)
        if kind == "aux_loss":
            want = naive_switch_loss(rows.tolist(), 2, score)
        else:
            want = sum(naive_switch_loss(logits[:, j].tolist(), 2, score)
                       for j in range(BATCH)) / BATCH
        # Megatron's names: seq_aux_loss is logged as seq_load_balancing_loss
        name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
        assert logged[name] == pytest.approx(want, abs=1e-12)
        assert logged[f"{name}_layer_2"] == logged[name]
        assert set(logged) == {name, f"{name}_layer_2", "z_loss", "z_loss_layer_2"}
        assert logged["z_loss"] == pytest.approx(naive_z_loss(rows.tolist()), abs=1e-12)
    # a perfectly balanced router gives exactly 1
    flat = torch.zeros(SEQ, BATCH, 4, dtype=torch.float64)
    flat[..., 0] = flat[..., 1] = 1e-3  # ties broken the same way for every token
    tracker = MoELossTracker(num_layers=3)
    _router(tracker, num_moe_experts=4, moe_router_topk=4,
            moe_aux_loss_coeff=1.0).train().route(flat.requires_grad_())
    assert tracker.report()["load_balancing_loss"] == pytest.approx(1.0, abs=1e-3)


def _reference_objective(logits, weights, coeff, z_coeff, scale):
    """sum(probs * weights) + scale * (coeff * E sum_e f_e P_e + z_coeff * z-loss), softmax
    top-2, written with torch ops so it has gradients."""
    rows = logits.view(-1, logits.size(-1))
    total = rows.new_zeros(())
    counts = [0] * rows.size(1)
    for t in range(rows.size(0)):
        order, _ = naive_choice(rows[t].detach(), 2, "softmax")
        chosen = torch.softmax(rows[t, order], dim=0)
        total = total + (chosen * weights[t, order]).sum()
        for e in order:
            counts[e] += 1
    mean_scores = torch.softmax(rows, dim=-1).mean(dim=0)
    f = torch.tensor(counts, dtype=rows.dtype) / (2 * rows.size(0))
    balance = rows.size(1) * (f * mean_scores).sum()
    z = torch.logsumexp(rows, dim=-1).square().mean()
    return total + scale * (coeff * balance + z_coeff * z)


def test_aux_losses_reach_the_gradient_scaled_by_the_tracker():
    logits = _logits()
    weights = torch.randn(SEQ * BATCH, 5, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)
    tracker = MoELossTracker(num_layers=3)
    tracker.backward_scale = 0.25
    router = _router(tracker, moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.02).train()
    mine = logits.clone().requires_grad_()
    probs, _ = router.route(mine)
    torch.testing.assert_close(probs, router.eval().route(logits)[0], **TOL)  # forward unchanged
    (probs * weights).sum().backward()
    ref = logits.clone().requires_grad_()
    _reference_objective(ref, weights, 0.3, 0.02, 0.25).backward()
    torch.testing.assert_close(mine.grad, ref.grad, **TOL)


def test_no_aux_loss_in_eval_without_grad_or_with_type_none():
    for kind, train, grad in (("aux_loss", False, True), ("aux_loss", True, False),
                              ("none", True, True), ("sinkhorn", True, True)):
        tracker = MoELossTracker(num_layers=3)
        router = _router(tracker, moe_router_load_balancing_type=kind,
                         moe_aux_loss_coeff=0.0 if kind == "sinkhorn" else 0.1)
        router.train(train)
        with torch.set_grad_enabled(grad):
            router.route(_logits())
        assert "load_balancing_loss" not in tracker.report(), (kind, train, grad)


# -- sinkhorn ---------------------------------------------------------------------------------

def _naive_balanced(logits):
    """exp(logits) with rows normalised to 1/T and columns to 1/E, to convergence."""
    m = logits.exp()
    for _ in range(2000):
        m = m / (m.sum(1, keepdim=True) * m.size(0))
        m = m / (m.sum(0, keepdim=True) * m.size(1))
    return m


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_routing(topk):
    # skewed logits: plain top-k would send most tokens to expert 0
    logits = _logits(experts=4, seed=3) + torch.tensor([3.0, 0.0, 0.0, -1.0],
                                                        dtype=torch.float64)
    rows = logits.view(-1, 4)
    balanced = sinkhorn(rows)
    torch.testing.assert_close(balanced.sum(0), torch.full((4,), 0.25, dtype=torch.float64),
                               rtol=0, atol=1e-3)
    torch.testing.assert_close(balanced, _naive_balanced(rows), rtol=1e-2, atol=0)
    router = _router(num_moe_experts=4, moe_router_topk=topk,
                     moe_router_load_balancing_type="sinkhorn")
    scores = torch.sigmoid(rows) if topk == 1 else torch.softmax(rows, dim=-1)
    for train in (True, False):
        probs, routing_map = router.train(train).route(logits)
        picked = _naive_balanced(rows) if train else scores
        want_ids = torch.topk(picked, topk, dim=-1).indices
        want_map = torch.zeros_like(routing_map).scatter(1, want_ids, True)
        assert torch.equal(routing_map, want_map), train
        torch.testing.assert_close(probs, scores * want_map, **TOL)
    def spread(chosen):
        return int(chosen.sum(0).max() - chosen.sum(0).min())

    assert spread(router.train().route(logits)[1]) < spread(routing_map) / 2  # eval: skewed


# -- input jitter -----------------------------------------------------------------------------

def test_input_jitter_multiplies_the_router_input_in_training_only():
    router = _router(num_moe_experts=HIDDEN, moe_input_jitter_eps=0.1)
    with torch.no_grad():
        router.weight.copy_(torch.eye(HIDDEN, dtype=torch.float64))
        if router.bias is not None:
            router.bias.zero_()
    x = torch.rand(SEQ, BATCH, HIDDEN, dtype=torch.float64) + 0.5
    ratio = router.train().gating(x) / x
    assert ((ratio >= 0.9) & (ratio <= 1.1)).all() and (ratio - 1).abs().max() > 0.05
    torch.testing.assert_close(router.eval().gating(x), x, **TOL)


# -- capacity ---------------------------------------------------------------------------------

def test_expert_capacity_is_the_ceiling_of_tokens_times_k_over_experts_times_factor():
    assert expert_capacity(18, 5, 2, 1.0) == 8          # 7.2 -> 8
    assert expert_capacity(18, 5, 2, 0.5) == 4          # 3.6 -> 4
    assert expert_capacity(16, 4, 2, 1.5) == 12
    assert expert_capacity(10, 4, 1, 2.0) == 5


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.4, 1.0, 1.7])
def test_dropping_keeps_what_a_loop_over_tokens_keeps(policy, factor):
    logits = _logits()
    router = _router(moe_router_load_balancing_type="none").eval()
    probs, routing_map = router.route(logits)
    capacity = expert_capacity(SEQ * BATCH, 5, 2, factor)
    keep = drop_over_capacity(probs, routing_map, capacity, policy)
    assert torch.equal(keep, naive_keep(probs, routing_map, capacity, policy))
    assert (keep.sum(0) <= capacity).all()
    if factor < 1:
        assert keep.sum() < routing_map.sum()  # something was dropped
    dropped = _router(moe_router_load_balancing_type="none", moe_expert_capacity_factor=factor,
                      moe_token_drop_policy=policy).eval().route(logits)
    assert torch.equal(dropped[1], keep)
    torch.testing.assert_close(dropped[0], probs * keep, **TOL)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_padding_gives_every_expert_exactly_capacity_rows(policy):
    # skewed, so that expert 4 has fewer tokens than its capacity and gets padding rows
    logits = _logits() + torch.tensor([2.0, 1.0, 0.0, 0.0, -3.0], dtype=torch.float64)
    tokens = torch.randn(SEQ * BATCH, HIDDEN, dtype=torch.float64)
    router = _router(moe_router_load_balancing_type="none", moe_expert_capacity_factor=0.6,
                     moe_token_drop_policy=policy).eval()
    probs, keep = router.route(logits)
    capacity = expert_capacity(SEQ * BATCH, 5, 2, 0.6)
    assert keep.sum(0).min() < capacity and keep.sum(0).max() == capacity
    rows, perm = permute(tokens, probs, keep, pad_to=capacity)
    assert perm.counts == [capacity] * 5 and rows.shape == (5 * capacity, HIDDEN)
    expected_rows, expected_probs = [], []
    for e in range(5):
        kept = [t for t in range(SEQ * BATCH) if keep[t, e]]
        expected_rows += [tokens[t] for t in kept] + [torch.zeros(HIDDEN, dtype=torch.float64)
                                                      ] * (capacity - len(kept))
        expected_probs += [float(probs[t, e]) for t in kept] + [0.0] * (capacity - len(kept))
    torch.testing.assert_close(rows, torch.stack(expected_rows), **TOL)
    torch.testing.assert_close(perm.probs, torch.tensor(expected_probs, dtype=torch.float64),
                               **TOL)
    combined = unpermute(rows * 2.0, perm)
    want = torch.zeros_like(tokens)
    for t in range(SEQ * BATCH):
        for e in range(5):
            if keep[t, e]:
                want[t] += float(probs[t, e]) * 2.0 * tokens[t]
    torch.testing.assert_close(combined, want, **TOL)
    unpadded_rows, unpadded = permute(tokens, probs, keep)
    torch.testing.assert_close(unpermute(unpadded_rows * 2.0, unpadded), want, **TOL)


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(moe_router_topk=6), "--moe-router-topk \\(6\\) must be between 1 and --num-experts"),
    (dict(expert_model_parallel_size=2), "--num-experts \\(5\\) must be divisible by "
                                         "--expert-model-parallel-size \\(2\\)"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
     "sinkhorn .* --moe-aux-loss-coeff must be 0"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
    (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type must be one of "
                                             "allgather, alltoall; got 'flex'"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-gate needs"),
])
def test_impossible_settings_name_the_flags(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(num_moe_experts=5, **kwargs)


def test_negative_capacity_factor_means_no_limit():
    assert MoEConfig(num_moe_experts=4, moe_expert_capacity_factor=-1).drops_tokens is False

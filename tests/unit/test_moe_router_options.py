"""The router options that follow Megatron-Core's current ones: several balancing losses at once
(``--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss`` with one
``--moe-aux-loss-coeff`` each), the ``sqrtsoftplus`` score function and
``--moe-router-force-load-balancing``.

References: fp64 formulas written token by token here (sqrtsoftplus choices, probabilities and
balancing scores), and each balancing loss computed alone: a combination must log each loss's
own value under Megatron's name and reach the gradients as the sum of the single losses times
their coefficients. Everything is float64 (tolerance 1e-12: two orderings of the same sums).
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import MoEConfig, MoELossTracker, TopKRouter, topk_routing
from megatron.model.moe.router import random_logits, scores_for_aux_loss
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.configs import build_moe_config
from tests.unit.test_megatron_flags import MINIMAL

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN, EXPERTS = 6, 3, 8, 5
COEFFS = {"aux_loss": 0.1, "seq_aux_loss": 0.2, "global_aux_loss": 0.3}
NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
         "global_aux_loss": "global_load_balancing_loss"}


def _config():
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                             padded_vocab_size=16, max_position_embeddings=SEQ,
                             seq_length=SEQ, params_dtype=torch.float64)


def _router(tracker=None, **moe):
    moe.setdefault("num_moe_experts", EXPERTS)
    return TopKRouter(_config(), MoEConfig(**moe), layer_number=2, tracker=tracker)


def _logits(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, EXPERTS, generator=gen, dtype=torch.float64) * 2


def naive_sqrtsoftplus(v):
    return math.sqrt(math.log1p(math.exp(float(v))))


def naive_sqrtsoftplus_choice(row, topk, bias=None, scale=None):
    """One token's (expert ids best first, probabilities) under sqrtsoftplus scores."""
    scores = [naive_sqrtsoftplus(v) for v in row]
    keyed = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
    order = sorted(range(len(row)), key=lambda e: -keyed[e])[:topk]
    chosen = [scores[e] for e in order]
    probs = [c / sum(chosen) for c in chosen] if topk > 1 else chosen
    return order, [p * (scale or 1.0) for p in probs]


# -- sqrtsoftplus ------------------------------------------------------------------------------

@pytest.mark.parametrize("topk,scale,with_bias", [(1, None, False), (2, None, False),
                                                  (3, 2.5, False), (2, None, True)])
def test_sqrtsoftplus_choices_and_probabilities_match_the_formula(topk, scale, with_bias):
    logits = _logits().view(-1, EXPERTS)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4], dtype=torch.float32) if with_bias else None
    probs, indices = topk_routing(logits, topk, "sqrtsoftplus", scaling_factor=scale,
                                  expert_bias=bias)
    for t, row in enumerate(logits):
        order, want = naive_sqrtsoftplus_choice(row, topk, bias, scale)
        assert indices[t].tolist() == order
        torch.testing.assert_close(probs[t], torch.tensor(want, dtype=torch.float64), **TOL)


def test_sqrtsoftplus_balancing_scores_and_loss_match_the_formula():
    logits = _logits()
    rows = logits.view(-1, EXPERTS)
    scores = scores_for_aux_loss(rows, "sqrtsoftplus")
    counts = [0] * EXPERTS
    mean = [0.0] * EXPERTS
    for t, row in enumerate(rows):
        raw = [naive_sqrtsoftplus(v) for v in row]
        want = [r / sum(raw) for r in raw]
        torch.testing.assert_close(scores[t], torch.tensor(want, dtype=torch.float64), **TOL)
        for e in naive_sqrtsoftplus_choice(row, 2)[0]:
            counts[e] += 1
        for e in range(EXPERTS):
            mean[e] += want[e] / rows.size(0)
    loss = EXPERTS * sum(counts[e] / (2 * rows.size(0)) * mean[e] for e in range(EXPERTS))
    tracker = MoELossTracker(num_layers=3)
    _router(tracker, moe_router_score_function="sqrtsoftplus",
            moe_aux_loss_coeff=0.1).train().route(logits.clone().requires_grad_())
    assert tracker.report()["load_balancing_loss"] == pytest.approx(loss, abs=1e-12)


def test_sqrtsoftplus_takes_the_expert_bias_and_softmax_does_not():
    router = _router(moe_router_score_function="sqrtsoftplus",
                     moe_router_enable_expert_bias=True)
    assert router.expert_bias is not None
    with pytest.raises(ConfigError, match="sigmoid or sqrtsoftplus"):
        MoEConfig(num_moe_experts=4, moe_router_enable_expert_bias=True)


# -- several balancing losses ------------------------------------------------------------------

def _run(types, coeffs, weights, z=None):
    """(logged values, d objective / d logits) of one training-mode routing; the objective is
    sum(probs * weights)."""
    tracker = MoELossTracker(num_layers=3)
    router = _router(tracker, moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs,
                     moe_z_loss_coeff=z).train()
    logits = _logits().clone().requires_grad_()
    probs, _ = router.route(logits)
    (probs * weights).sum().backward()
    return tracker.report(), logits.grad


@pytest.mark.parametrize("types", [("aux_loss", "global_aux_loss"),
                                   ("seq_aux_loss", "global_aux_loss"),
                                   ("aux_loss", "seq_aux_loss", "global_aux_loss"),
                                   ("global_aux_loss", "none", "aux_loss")])
def test_combined_losses_are_the_sum_of_each_alone(types):
    weights = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    coeffs = [COEFFS.get(kind, 0.0) for kind in types]
    logged, grad = _run(list(types), coeffs, weights, z=0.01)
    _, plain = _run("none", 0.0, weights, z=0.01)
    want = plain.clone()
    losses = [kind for kind in types if kind != "none"]
    for kind in losses:
        alone, alone_grad = _run(kind, COEFFS[kind], weights, z=0.01)
        assert logged[NAMES[kind]] == pytest.approx(alone[NAMES[kind]], abs=1e-12)
        assert logged["z_loss"] == pytest.approx(alone["z_loss"], abs=1e-12)
        want += alone_grad - plain
    assert set(logged) == {NAMES[kind] for kind in losses} | {"z_loss"}
    torch.testing.assert_close(grad, want, **TOL)
    assert not torch.allclose(grad, plain)   # the losses do reach the gradient


def test_a_zero_coefficient_in_the_list_turns_that_loss_off():
    weights = torch.ones(SEQ * BATCH, EXPERTS, dtype=torch.float64)
    logged, grad = _run(["aux_loss", "seq_aux_loss"], [0.1, 0.0], weights)
    alone, alone_grad = _run("aux_loss", 0.1, weights)
    assert logged == alone
    torch.testing.assert_close(grad, alone_grad, **TOL)


def test_bad_lists_are_refused_by_the_config():
    for types, coeffs, match in (
            (("aux_loss", "seq_aux_loss"), 0.1, "needs one --moe-aux-loss-coeff per type"),
            (("aux_loss", "seq_aux_loss"), (0.1,), "needs one --moe-aux-loss-coeff per type"),
            ("aux_loss", (0.1, 0.2), "one coefficient per"),
            (("aux_loss", "aux_loss"), (0.1, 0.2), "names a type twice"),
            (("aux_loss", "sinkhorn"), (0.1, 0.0), "sinkhorn routes by itself"),
            (("aux_loss", "quantile"), (0.1, 0.1), "must be one of"),
            (("aux_loss", "seq_aux_loss"), (0.1, -1.0), "must be >= 0")):
        with pytest.raises(ConfigError, match=match):
            MoEConfig(num_moe_experts=4, moe_router_load_balancing_type=types,
                      moe_aux_loss_coeff=coeffs)


MOE_ARGS = MINIMAL + ["--num-experts", "4", "--no-bias-gelu-fusion"]


def _validated(*extra):
    return validate_args(parse_args(argv=MOE_ARGS + list(extra)))


def test_the_flags_take_megatrons_lists():
    args = _validated("--moe-router-load-balancing-type", "aux_loss", "global_aux_loss",
                      "--moe-aux-loss-coeff", "1e-3", "1e-4",
                      "--moe-router-score-function", "sqrtsoftplus")
    assert args.moe_router_load_balancing_type == ["aux_loss", "global_aux_loss"]
    assert args.moe_aux_loss_coeff == [1e-3, 1e-4]
    moe = build_moe_config(args)
    assert moe.moe_router_score_function == "sqrtsoftplus"
    assert (moe.aux_loss_coeff("aux_loss"), moe.aux_loss_coeff("global_aux_loss"),
            moe.aux_loss_coeff("seq_aux_loss")) == (1e-3, 1e-4, 0.0)
    assert not moe.moe_router_force_load_balancing
    assert build_moe_config(_validated("--moe-router-force-load-balancing")
                            ).moe_router_force_load_balancing


def test_bad_flag_lists_fail_naming_the_flags():
    for extra, match in (
            (("--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
              "--moe-aux-loss-coeff", "0.1"),
             "^--moe-router-load-balancing-type aux_loss seq_aux_loss needs one "
             "--moe-aux-loss-coeff per type, got 0.1"),
            (("--moe-aux-loss-coeff", "0.1", "0.2"),
             r"^--moe-aux-loss-coeff 0.1 0.2: one coefficient per"),
            (("--moe-router-load-balancing-type", "sinkhorn", "aux_loss",
              "--moe-aux-loss-coeff", "0", "0.1"), "sinkhorn routes by itself"),
            (("--moe-router-load-balancing-type", "aux_loss", "aux_loss",
              "--moe-aux-loss-coeff", "0.1", "0.1"), "names a type twice")):
        with pytest.raises(ArgumentsError, match=match):
            _validated(*extra)


# -- forced load balancing ---------------------------------------------------------------------

def test_forced_balancing_routes_by_standard_normal_draws():
    torch.manual_seed(11)
    router = _router(moe_router_force_load_balancing=True, moe_aux_loss_coeff=0.0).train()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 5.0        # a router that sends every token to expert 0
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64).abs()
    gen_state = torch.get_rng_state()
    probs, routing_map = router(hidden)
    torch.set_rng_state(gen_state)
    drawn = torch.randn(SEQ * BATCH, EXPERTS, dtype=torch.float64)
    want_probs, want_ids = topk_routing(drawn, 2)
    assert torch.equal(routing_map.nonzero()[:, 1].view(-1, 2).sort(dim=1).values,
                       want_ids.sort(dim=1).values)
    torch.testing.assert_close(torch.gather(probs, 1, want_ids), want_probs, **TOL)
    # without the switch every token goes to expert 0
    plain = _router(moe_aux_loss_coeff=0.0).train()
    plain.load_state_dict(router.state_dict())
    assert bool(plain(hidden)[1][:, 0].all())


def test_forced_balancing_spreads_tokens_evenly():
    torch.manual_seed(0)
    router = _router(moe_router_force_load_balancing=True, moe_aux_loss_coeff=0.0).train()
    hidden = torch.randn(400, 10, HIDDEN, dtype=torch.float64)
    counts = router(hidden)[1].sum(dim=0).double()
    share = counts / counts.sum()
    assert torch.allclose(share, torch.full_like(share, 1 / EXPERTS), atol=0.02), share


def test_forced_logits_pass_the_gradient_straight_through():
    logits = torch.randn(7, EXPERTS, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(7, EXPERTS, dtype=torch.float64)
    out = random_logits(logits)
    assert not torch.equal(out, logits)
    (out * upstream).sum().backward()
    assert torch.equal(logits.grad, upstream)


def test_the_converter_exports_the_aux_loss_coefficient_of_a_list():
    from megatron.convert.hf_mixtral import router_aux_loss_coef

    assert router_aux_loss_coef({"moe_aux_loss_coeff": 0.01}) == 0.01
    assert router_aux_loss_coef({}) == 0.0
    assert router_aux_loss_coef({"moe_router_load_balancing_type": ["global_aux_loss",
                                                                    "aux_loss"],
                                 "moe_aux_loss_coeff": [1e-4, 1e-3]}) == 1e-3
    assert router_aux_loss_coef({"moe_router_load_balancing_type": ["seq_aux_loss",
                                                                    "global_aux_loss"],
                                 "moe_aux_loss_coeff": [1e-4, 1e-3]}) == 0.0

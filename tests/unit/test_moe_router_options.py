"""The router options that follow Megatron-Core's current ones: several balancing losses at once
(``--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss`` with one
``--moe-aux-loss-coeff`` each), the ``sqrtsoftplus`` score function,
``--moe-router-force-load-balancing`` and ``--moe-router-force-biased``.

References: fp64 formulas written token by token here (sqrtsoftplus choices, probabilities and
balancing scores), and each balancing loss computed alone: a combination must log each loss's
own value under Megatron's name and reach the gradients as the sum of the single losses times
their coefficients. Everything is float64 (tolerance 1e-12: two orderings of the same sums).
The forced biased logits are checked against the same draws taken from the generators by hand,
and the load they give against the top-1 shares of a normal model integrated in fp64.
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import MoEConfig, MoELossTracker, TopKRouter, topk_routing
from megatron.core.tensor_parallel.random import checkpoint
from megatron.model.moe.forced_logits import biased_logits, random_logits
from megatron.model.moe.router import scores_for_aux_loss
from megatron.model.utils import piece_seed
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


# -- forced biased logits ----------------------------------------------------------------------
# The reference stream: the standard normal draws of the logits' shape from the default
# generator, then (STD > 0) the E draws of the bias; STD < 0 takes its bias from a CPU generator
# seeded by piece_seed(--seed, "layer.<n-1>.mlp.router.force_biased") alone.

def _biased_router(std, layer_number=2, init_seed=1234, **moe):
    moe.setdefault("num_moe_experts", EXPERTS)
    moe.setdefault("moe_aux_loss_coeff", 0.0)
    cfg = MoEConfig(moe_router_force_biased=std, **moe)
    return TopKRouter(_config(), cfg, layer_number=layer_number, init_seed=init_seed).train()


def _routed_logits(router, hidden):
    """The logits ``[T, E]`` the router routes by (after the switches), and its outputs."""
    seen = []
    route = router.route
    router.route = lambda logits: seen.append(logits) or route(logits)
    try:
        out = router(hidden)
    finally:
        del router.route
    return seen[0].reshape(-1, router.num_experts), out


def _naive_layer_bias(std, layer_number, num_experts=EXPERTS, init_seed=1234):
    gen = torch.Generator().manual_seed(
        piece_seed(init_seed, f"layer.{layer_number - 1}.mlp.router.force_biased"))
    return torch.randn(num_experts, generator=gen, dtype=torch.float64) * abs(std)


def test_force_biased_flag_reaches_the_config_and_bad_values_fail():
    assert build_moe_config(_validated()).moe_router_force_biased is None
    assert build_moe_config(_validated("--moe-router-force-biased", "-2.5")
                            ).moe_router_force_biased == -2.5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="^--moe-router-force-biased must be a finite"):
            MoEConfig(num_moe_experts=4, moe_router_force_biased=bad)


@pytest.mark.parametrize("std", [-3.0, 3.0])
def test_biased_logits_are_the_normal_draws_plus_the_bias(std):
    torch.manual_seed(5)
    router = _biased_router(std)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    for _ in range(2):      # the second call starts where the first left the generator
        state = torch.get_rng_state()
        logits, _ = _routed_logits(router, hidden)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        eps = torch.randn(SEQ * BATCH, EXPERTS, dtype=torch.float64)
        bias = (_naive_layer_bias(std, 2) if std < 0
                else torch.randn(EXPERTS, dtype=torch.float64) * std)
        assert torch.equal(logits, eps + bias)
        assert torch.equal(torch.get_rng_state(), after)    # nothing else was drawn


def test_biased_logits_pass_the_gradient_straight_through():
    upstream = torch.randn(7, EXPERTS, dtype=torch.float64)
    for kw in (dict(bias=torch.full((EXPERTS,), 4.0, dtype=torch.float64)),
               dict(redraw_std=2.0)):
        logits = torch.randn(7, EXPERTS, dtype=torch.float64, requires_grad=True)
        out = biased_logits(logits, **kw)
        (out * upstream).sum().backward()
        assert torch.equal(logits.grad, upstream)


def test_stationary_bias_is_shared_by_builds_kept_over_calls_and_differs_by_layer():
    torch.manual_seed(1)
    rank0 = _biased_router(-2.0)
    torch.manual_seed(2)        # another rank: another default generator state
    rank1 = _biased_router(-2.0)
    assert torch.equal(rank0.forced_logits.bias, rank1.forced_logits.bias)
    assert torch.equal(rank0.forced_logits.bias, _naive_layer_bias(-2.0, 2))
    other_layer = _biased_router(-2.0, layer_number=3).forced_logits.bias
    other_seed = _biased_router(-2.0, init_seed=99).forced_logits.bias
    assert not torch.allclose(other_layer, rank0.forced_logits.bias, atol=0.1)
    assert not torch.allclose(other_seed, rank0.forced_logits.bias, atol=0.1)
    # Over many tokens each expert's mean logit is its bias, call after call.
    hidden = torch.randn(2000, 10, HIDDEN, dtype=torch.float64)
    for _ in range(2):
        means = _routed_logits(rank0, hidden)[0].mean(dim=0)
        torch.testing.assert_close(means, rank0.forced_logits.bias, rtol=0, atol=0.05)


def test_stationary_bias_has_the_requested_spread():
    bias = _biased_router(-2.5, num_moe_experts=4000).forced_logits.bias
    assert abs(bias.mean().item()) < 0.15          # 4 standard errors of the mean
    assert abs(bias.std().item() - 2.5) < 0.12     # ~4 standard errors of the std


def test_redrawn_bias_changes_between_calls():
    torch.manual_seed(3)
    router = _biased_router(5.0)
    hidden = torch.randn(2000, 10, HIDDEN, dtype=torch.float64)
    first = _routed_logits(router, hidden)[0].mean(dim=0)
    second = _routed_logits(router, hidden)[0].mean(dim=0)
    assert (first - second).abs().max() > 1.0, (first, second)
    assert router.forced_logits.bias is None


def _top1_shares(bias):
    """fp64 reference: P(argmax_e (eps_e + b_e) = e) for independent standard normal eps,
    ``int phi(x - b_e) prod_{j != e} Phi(x - b_j) dx`` by the trapezoid rule."""
    b = [float(v) for v in bias]
    lo, hi, n = min(b) - 12.0, max(b) + 12.0, 20000
    step = (hi - lo) / n
    shares = []
    for e in range(len(b)):
        total = 0.0
        for i in range(n + 1):
            x = lo + i * step
            value = math.exp(-0.5 * (x - b[e]) ** 2) / math.sqrt(2 * math.pi)
            for j in range(len(b)):
                if j != e:
                    value *= 0.5 * (1.0 + math.erf((x - b[j]) / math.sqrt(2.0)))
            total += value * (0.5 if i in (0, n) else 1.0)
        shares.append(total * step)
    return shares


def test_stationary_bias_skews_the_load_as_the_normal_model_predicts():
    torch.manual_seed(4)
    router = _biased_router(-1.5, moe_router_topk=1)
    bias = router.forced_logits.bias
    hidden = torch.randn(2000, 10, HIDDEN, dtype=torch.float64)
    counts = router(hidden)[1].sum(dim=0).double()
    share = counts / counts.sum()
    want = torch.tensor(_top1_shares(bias), dtype=torch.float64)
    assert abs(want.sum().item() - 1.0) < 1e-9
    # 20000 tokens: a share's standard error is at most 0.0036
    torch.testing.assert_close(share, want, rtol=0, atol=0.015)
    assert share.argmax() == bias.argmax()
    assert share.max() > 1.5 / EXPERTS         # skewed, not balanced


def test_std_zero_is_forced_balancing_and_biased_wins_over_it():
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    outs = {}
    for name, moe in (("balanced", dict(moe_router_force_load_balancing=True)),
                      ("zero", dict(moe_router_force_biased=0.0)),
                      ("biased", dict(moe_router_force_biased=-4.0)),
                      ("both", dict(moe_router_force_biased=-4.0,
                                    moe_router_force_load_balancing=True))):
        torch.manual_seed(8)
        outs[name] = _routed_logits(_router(moe_aux_loss_coeff=0.0, **moe).train(), hidden)[0]
    assert torch.equal(outs["zero"], outs["balanced"])
    assert torch.equal(outs["both"], outs["biased"])
    assert not torch.equal(outs["biased"], outs["balanced"])


@pytest.mark.parametrize("std", [-2.0, 2.0])
def test_recomputation_replays_the_biased_draws(std):
    """A router run under activation checkpointing gets the gradients of a plain run from the
    same generator state (the recompute must draw the same logits)."""
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(SEQ * BATCH, EXPERTS, dtype=torch.float64)
    grads, probs = [], []
    for recompute in (False, True):
        torch.manual_seed(6)
        router = _biased_router(std)
        x = hidden.clone().requires_grad_()
        if recompute:
            out = checkpoint(lambda h: router(h)[0], False, x)
        else:
            out = router(x)[0]
        (out * upstream).sum().backward()
        probs.append(out.detach())
        grads.append((router.weight.grad.clone(), x.grad.clone()))
    assert torch.equal(probs[0], probs[1])
    for plain, replayed in zip(*grads):
        assert torch.equal(plain, replayed)
    assert grads[0][0].abs().sum() > 0


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

"""``--moe-router-load-balancing-type global_aux_loss``: Megatron-Core's global load balancing.

Reference: Megatron-Core's formula written out here in fp64, one token at a time, for one
process holding every data-parallel rank's tokens: in micro-batch m, rank r's term is
``E / (k N^2) * sum_e S_re * c_e`` with ``S_re`` the sum over r's T tokens of expert e's score,
``c_e`` the token choices of expert e over all ranks' tokens, averaged over micro-batches
1..m of the step, and ``N = T * ranks``. The logged ``global_load_balancing_loss`` is the sum
of the terms over the ranks.

Megatron-Core attaches each rank's term as it is and data-parallel ranks average their
gradients, so each token's logits receive the gradient they get in one process over all ranks'
tokens, but the weights' gradient is that divided by the DP size: the loss is not
layout-invariant over DP by its definition. The 2-rank test therefore checks the router against
the formula (per-token gradients included), not a DP 2 run against a DP 1 run.
"""

import pytest
import torch

from megatron.model.moe import MoELossTracker
from tests.multiprocess import run_on_ranks
from tests.unit.test_moe_router import (BATCH, SEQ, TOL, _router, naive_choice, naive_scores,
                                        naive_switch_loss)

E, K, COEFF = 5, 2, 0.3


def _micro_batches(ranks, steps=2, seed=0):
    """``[step][rank]`` logits ``[SEQ, BATCH, E]`` in fp64."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(SEQ, BATCH, E, generator=gen, dtype=torch.float64)
             for _ in range(ranks)] for _ in range(steps)]


def naive_terms(micro_batches):
    """Per micro-batch, per rank: (term value, d term / d logits ``[SEQ, BATCH, E]``)."""
    running = [0.0] * E
    out = []
    for m, per_rank in enumerate(micro_batches, start=1):
        counts = [0] * E
        for logits in per_rank:
            for row in logits.view(-1, E).tolist():
                for e in naive_choice(row, K, "softmax")[0]:
                    counts[e] += 1
        running = [running[e] + counts[e] for e in range(E)]
        # Megatron-Core keeps the running sums in float32 buffers: the mean is a float32
        # quotient of exact integers (the rest is fp64).
        mean = (torch.tensor(running, dtype=torch.float32) / m).double()
        total = sum(x.numel() // E for x in per_rank)
        terms = []
        for logits in per_rank:
            rows = logits.view(-1, E).tolist()
            sums = [sum(naive_scores(row, "softmax")[e] for row in rows) for e in range(E)]
            value = E / (K * total * total) * sum(sums[e] * mean[e].item() for e in range(E))
            leaf = logits.clone().requires_grad_()
            term = E / (K * total * total) * (
                torch.softmax(leaf.view(-1, E), dim=-1).sum(dim=0) * mean).sum()
            term.backward()
            terms.append((value, leaf.grad))
        out.append(terms)
    return out


def _route_steps(router, tracker, per_step_logits):
    """Route each micro-batch with zero main-loss weight: (logged values, logits grads)."""
    logged, grads = [], []
    for logits in per_step_logits:
        leaf = logits.clone().requires_grad_()
        probs, _ = router.route(leaf)
        (probs * 0).sum().backward()
        logged.append(float(tracker.values["global_load_balancing_loss"][1]))
        tracker.clear()
        grads.append(leaf.grad)
    return logged, grads


def test_one_rank_running_average_over_micro_batches():
    tracker = MoELossTracker(num_layers=3)
    router = _router(tracker, num_moe_experts=E, moe_router_load_balancing_type="global_aux_loss",
                     moe_aux_loss_coeff=COEFF).train()
    steps = _micro_batches(1, steps=3)
    want = naive_terms(steps)
    for attempt in range(2):   # the second step starts a new average after the reset
        logged, grads = _route_steps(router, tracker, [s[0] for s in steps])
        for (value, grad), got, got_grad in zip([w[0] for w in want], logged, grads):
            assert got == pytest.approx(value, abs=1e-12)
            torch.testing.assert_close(got_grad, COEFF * grad, **TOL)
        router.reset_global_aux_loss_tracker()
    # one micro-batch on one rank: the switch loss itself, as aux_loss logs it
    rows = steps[0][0].view(-1, E).tolist()
    assert want[0][0][0] == pytest.approx(naive_switch_loss(rows, K, "softmax"), abs=1e-12)


def test_no_buffers_and_no_loss_without_coefficient_or_in_eval():
    router = _router(None, num_moe_experts=E, moe_router_load_balancing_type="global_aux_loss")
    assert router.global_tokens_per_expert is None
    tracker = MoELossTracker(num_layers=3)
    router = _router(tracker, num_moe_experts=E, moe_router_load_balancing_type="global_aux_loss",
                     moe_aux_loss_coeff=COEFF).eval()
    router.route(_micro_batches(1)[0][0])
    assert not tracker.values and float(router.ga_steps) == 0


def _two_rank_body(steps):
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    tracker = MoELossTracker(num_layers=3)
    router = _router(tracker, num_moe_experts=E, moe_router_load_balancing_type="global_aux_loss",
                     moe_aux_loss_coeff=COEFF).train()
    router.dp_group, router.dp_size = group, 2
    return _route_steps(router, tracker, [s[rank] for s in steps])


@pytest.mark.slow
def test_two_data_parallel_ranks_equal_megatrons_formula():
    steps = _micro_batches(2)
    want = naive_terms(steps)
    results = run_on_ranks(_two_rank_body, 2, steps)
    for rank, (logged, grads) in enumerate(results):
        for m, (got, got_grad) in enumerate(zip(logged, grads)):
            value, grad = want[m][rank]
            # each rank logs its term times DP; the logging's mean over DP is the sum
            assert got == pytest.approx(2 * value, abs=1e-12)
            torch.testing.assert_close(got_grad, COEFF * grad, **TOL)
    # the first micro-batch's logged value: the switch loss of both ranks' tokens
    rows = torch.cat([x.view(-1, E) for x in steps[0]]).tolist()
    logged_mean = (results[0][0][0] + results[1][0][0]) / 2
    assert logged_mean == pytest.approx(naive_switch_loss(rows, K, "softmax"), abs=1e-12)

"""``--optimizer adaptive_muon`` on one process, against a reference written out here.

Reference: Muon's float64 step from tests/unit/test_muon.py (itself written from the equations:
EMA momentum, optional Nesterov blend, the quintic Newton-Schulz iteration, the shape scale, the
query/key/value split), followed by the published second-moment step: AdaMuon (an elementwise
EMA of the squared update, divided out as ``O / (sqrt(V) + eps)``) or NorMuon (one EMA per row,
or per column when the matrix is wide, of the mean squared update, divided out as
``O / sqrt(max(V, eps))``).

Tolerance: as test_muon's (the iteration runs in fp32, ~1e-4 relative on the orthogonalised
update). AdaMuon's first step divides the update by its own size, so it is ~sign(O) and
insensitive; later steps and NorMuon's row norms carry that 1e-4 relative error, ~1e-6 on
weights at lr 1e-2 over three steps; 2e-5 allows for it, and a missing second moment, a wrong
reduction axis or the scale applied after normalising changes weights by 1e-3 or more (checked
below).
"""

import copy
import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer import OptimizerConfig
from tests.unit.test_muon import (BETA, LR, WD, build, grad_sets, muon_fp64,
                                  orthogonalized_fp64, run, takes_muon, tiny_gpt)

BETA2, EPS = 0.95, 1e-8


def adaptive_config(**kwargs):
    base = dict(optimizer="adaptive_muon", lr=LR, weight_decay=WD, clip_grad=0.0,
                muon_momentum=BETA, muon_fp32_matmul_prec="high")
    base.update(kwargs)
    return OptimizerConfig(**base)


def adaptive_muon_fp64(params, grads, *, method="adamuon", nesterov=False, mode="spectral",
                       scale_after=False):
    """``{name: fp64 weight}`` after adaptive-Muon steps on the 2-D non-embedding weights
    (``scale_after``: the order of later Emerging-Optimizers releases, the shape scale applied
    after normalising, not Megatron-Core's; here as a variant the test must tell apart)."""
    weights = {n: p.detach().double().clone() for n, p in params if takes_muon(n, p)}
    momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    second = {}
    for step_grads in grads:
        for name, w in weights.items():
            g = step_grads[name].double()
            w -= LR * WD * w
            momentum[name] = BETA * momentum[name] + (1 - BETA) * g
            u = (1 - BETA) * g + BETA * momentum[name] if nesterov else momentum[name]
            o = orthogonalized_fp64(name, u, mode, True, 2, 8)
            rows, cols = o.shape
            if method == "adamuon":
                v = second.get(name, torch.zeros_like(o))
                v = BETA2 * v + (1 - BETA2) * o * o
                d = o / (v.sqrt() + EPS)
            else:
                row_mean = (o * o).mean(dim=1, keepdim=True) if rows >= cols else \
                    (o * o).mean(dim=0, keepdim=True)
                v = BETA2 * second.get(name, torch.zeros_like(row_mean)) + (1 - BETA2) * row_mean
                d = o / v.clamp_min(EPS).sqrt()
            second[name] = v
            if scale_after:
                d = d * math.sqrt(max(rows, cols))
            w -= LR * d
    return weights


@pytest.mark.parametrize("method,nesterov,mode", [("adamuon", False, "spectral"),
                                                  ("adamuon", True, "shape_scaling"),
                                                  ("normuon", True, "spectral"),
                                                  ("normuon", False, "unit_rms_norm")])
def test_adaptive_muon_matches_fp64_reference(method, nesterov, mode):
    model = tiny_gpt()
    start = copy.deepcopy(model)
    grads = grad_sets(model, 3)
    optimizer = build(model, adaptive_config(adaptive_muon_moment2_method=method,
                                             muon_nesterov=nesterov, muon_scale_mode=mode))
    got = run(model, optimizer, grads)
    want = adaptive_muon_fp64(list(start.named_parameters()), grads, method=method,
                              nesterov=nesterov, mode=mode)
    assert any("query_key_value" in n for n in want) and any("dense_4h_to_h" in n for n in want)
    shapes = {tuple(w.shape) for w in want.values()}
    assert any(r > c for r, c in shapes) and any(r < c for r, c in shapes)  # both reductions
    for name, weight in want.items():
        torch.testing.assert_close(got[name].double(), weight, rtol=0, atol=2e-5, msg=name)


def test_reference_tells_the_settings_apart():
    model = tiny_gpt()
    params = list(model.named_parameters())
    grads = grad_sets(model, 3)
    base = adaptive_muon_fp64(params, grads)
    for other in (adaptive_muon_fp64(params, grads, method="normuon"),
                  adaptive_muon_fp64(params, grads, scale_after=True)):
        assert max((other[n] - base[n]).abs().max().item() for n in base) > 1e-3
    muon_only = muon_fp64(params, grads)
    assert max((muon_only[n] - base[n]).abs().max().item() for n in base) > 1e-3


def test_state_dict_resumes_bit_for_bit():
    grads = grad_sets(tiny_gpt(), 4)
    config = adaptive_config(adaptive_muon_moment2_method="normuon", muon_nesterov=True)
    model = tiny_gpt()
    straight = run(model, build(model, config), grads)
    model = tiny_gpt()
    optimizer = build(model, config)
    run(model, optimizer, grads[:2])
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    fields = {k for entry in saved["state"].values() for k in entry}
    assert fields == {"momentum_buffer", "moment2_buffer", "step", "exp_avg", "exp_avg_sq"}
    resumed_model = tiny_gpt()
    resumed_model.load_state_dict(saved_model)
    resumed = build(resumed_model, config)
    resumed.load_state_dict(saved)
    after = run(resumed_model, resumed, grads[2:])
    for name in straight:
        assert torch.equal(straight[name], after[name]), name


@pytest.mark.slow
def test_training_loss_decreases_with_adaptive_muon():
    from tests.unit.test_gpt_model import make_batch

    model = tiny_gpt()
    optimizer = build(model, adaptive_config(lr=3e-3, muon_fp32_matmul_prec="medium"))
    ids, pos, labels = make_batch()
    losses = []
    for _ in range(8):
        model.zero_grad()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("change,message", [
    (dict(fp16=True), "--optimizer adaptive_muon does not run with --fp16"),
    (dict(adaptive_muon_moment2_method="namo"), "adaptive_muon_moment2_method must be one of"),
    (dict(adaptive_muon_beta2=1.0), "adaptive_muon_beta2 must be in [0, 1)"),
    (dict(adaptive_muon_eps=0.0), "adaptive_muon_eps must be > 0"),
    (dict(muon_tp_mode="blockwise"), "--muon-tp-mode blockwise"),
])
def test_settings_not_built_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError) as err:
        adaptive_config(**change)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_distributed_optimizer_is_the_layer_wise_deal_and_one_rank_changes_nothing():
    grads = grad_sets(tiny_gpt(), 2)
    model = tiny_gpt()
    want = run(model, build(model, adaptive_config()), grads)
    model = tiny_gpt()
    got = run(model, build(model, adaptive_config(use_distributed_optimizer=True)), grads)
    for name in want:
        assert torch.equal(got[name], want[name]), name

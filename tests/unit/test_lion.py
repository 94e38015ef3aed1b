"""``--optimizer lion`` on one process: the update against Lion's equations in float64, the
fp32 / bf16 wrappers, a state-dict round trip that resumes bit for bit, and bad betas.

Reference: Lion written out from its update rule in float64 (sign of the interpolated momentum,
decoupled weight decay on the decayed parameters only, then the momentum's decay). The sign
makes the update exactly +-lr per element, so fp32 differs from fp64 only by the rounding of
the parameter itself: a few ulp of O(1) values per step.
"""

import io

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer import (FP32Optimizer, Float16OptimizerWithFloat16Params,
                                OptimizerConfig, get_megatron_optimizer)
from megatron.optimizer.lion import Lion
from megatron.training.arguments import parse_args

LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.99


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.proj = torch.nn.Linear(3, 2, bias=False)


DECAYED = {"linear.weight", "proj.weight"}


def _config(**kwargs):
    base = dict(optimizer="lion", lr=LR, weight_decay=WD, clip_grad=0.0, lion_beta1=B1,
                lion_beta2=B2)
    base.update(kwargs)
    return OptimizerConfig(**base)


def _build(model, config):
    return get_megatron_optimizer(config, [model], mp_group=None, tp_group=None)


def _grad_sets(model, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) * 0.1 for p in model.parameters()]
            for _ in range(count)]


def _lion_fp64(params, grad_sets, decayed):
    """Lion from its equations in float64; returns the parameters and the momenta."""
    params = [p.double().clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    for grads in grad_sets:
        for i, g in enumerate(grads):
            g = g.double()
            c = B1 * momenta[i] + (1 - B1) * g
            if decayed[i]:
                params[i] = params[i] * (1 - LR * WD)
            params[i] = params[i] - LR * torch.sign(c)
            momenta[i] = B2 * momenta[i] + (1 - B2) * g
    return params, momenta


def _step(model, opt, grads, dtype=None):
    opt.zero_grad()
    for p, g in zip(model.parameters(), grads):
        p.grad = g.to(dtype or p.dtype).clone()
    ok, _, _ = opt.step()
    assert ok


def test_fp32_lion_matches_fp64_equations():
    torch.manual_seed(0)
    model = Tiny()
    start = [p.detach().clone() for p in model.parameters()]
    opt = _build(model, _config())
    assert isinstance(opt, FP32Optimizer) and isinstance(opt.optimizer, Lion)
    grad_sets = _grad_sets(model, 6)
    for grads in grad_sets:
        _step(model, opt, grads)
    decayed = [n in DECAYED for n, _ in model.named_parameters()]
    params, momenta = _lion_fp64(start, grad_sets, decayed)
    for p, expected, m in zip(model.parameters(), params, momenta):
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.optimizer.state[p]["exp_avg"].double(), m, rtol=0,
                                   atol=1e-7)
    # Every step moves every element by ~lr; over 6 steps some moved several lr.
    assert all((p.detach() - s).abs().max() > 2.5 * LR for p, s in zip(model.parameters(),
                                                                       start))


def test_bf16_lion_steps_on_fp32_mains_like_fp64():
    torch.manual_seed(1)
    model = Tiny().bfloat16()
    start = [p.detach().float() for p in model.parameters()]
    opt = _build(model, _config(bf16=True))
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    grad_sets = _grad_sets(model, 4)
    for grads in grad_sets:
        _step(model, opt, grads, torch.bfloat16)
    # bf16 gradients: the reference sees the same rounded values.
    rounded = [[g.bfloat16().float() for g in grads] for grads in grad_sets]
    decayed = [n in DECAYED for n, _ in model.named_parameters()]
    params, _ = _lion_fp64(start, rounded, decayed)
    mains = [p for g in opt.fp32_from_float16_groups for p in g]
    by_id = {id(p): m for p, m in zip((p for g in opt.float16_groups for p in g), mains)}
    for p, expected in zip(model.parameters(), params):
        torch.testing.assert_close(by_id[id(p)].double(), expected, rtol=0, atol=1e-6)
        assert torch.equal(p.detach(), by_id[id(p)].bfloat16())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trip_resumes_bit_for_bit(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = _config(bf16=precision == "bf16", clip_grad=1.0)
    torch.manual_seed(2)
    model = Tiny().to(dtype)
    opt = _build(model, config)
    first, second = _grad_sets(model, 3, seed=1), _grad_sets(model, 3, seed=2)
    for grads in first:
        _step(model, opt, grads, dtype)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    inner = opt.state_dict() if precision == "fp32" else opt.state_dict()["optimizer"]
    assert {k for s in inner["state"].values() for k in s} == {"exp_avg"}
    assert inner["param_groups"][0]["betas"] == (B1, B2)
    for grads in second:
        _step(model, opt, grads, dtype)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = Tiny().to(dtype)
    resumed.load_state_dict(saved["model"])
    resumed_opt = _build(resumed, config)
    resumed_opt.load_state_dict(saved["optimizer"])
    for grads in second:
        _step(resumed, resumed_opt, grads, dtype)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    # Dropping the momentum at the checkpoint changes the result: the check can fail.
    fresh = Tiny().to(dtype)
    fresh.load_state_dict(saved["model"])
    fresh_opt = _build(fresh, config)
    if precision == "bf16":
        fresh_opt.load_state_dict(dict(saved["optimizer"],
                                       optimizer=dict(saved["optimizer"]["optimizer"],
                                                      state={})))
    for grads in second:
        _step(fresh, fresh_opt, grads, dtype)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("flag, value", [("lion_beta1", 1.0), ("lion_beta2", -0.1)])
def test_bad_betas_are_rejected_naming_the_flag(flag, value):
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} must be in"):
        _config(**{flag: value})


def test_command_line_reaches_the_optimizer():
    args = parse_args(argv=["--optimizer", "lion", "--lion-beta1", "0.8", "--lion-beta2", "0.9"])
    assert (args.optimizer, args.lion_beta1, args.lion_beta2) == ("lion", 0.8, 0.9)
    defaults = parse_args(argv=[])
    assert (defaults.lion_beta1, defaults.lion_beta2) == (0.95, 0.98)

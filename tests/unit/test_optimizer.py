"""Optimizer wrappers on one process: AdamW/SGD semantics, mixed precision, skipping, state.

References: a float64 AdamW written out from its update equations; plain torch optimizers run on
fp32 copies fed the same (unscaled) gradients; hand arithmetic for SGD, clipping and decay.
"""

import copy
import io
import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer import (FP32Optimizer, Float16OptimizerWithFloat16Params,
                                OptimizerConfig, get_megatron_optimizer, get_param_groups)

LR, WD = 1e-2, 0.1


class Tiny(torch.nn.Module):
    """2-D weights (decayed), biases and norm weights (not decayed)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.proj = torch.nn.Linear(3, 2, bias=False)


DECAYED = {"linear.weight", "proj.weight"}


def _config(**kwargs):
    base = dict(lr=LR, weight_decay=WD, clip_grad=0.0)
    base.update(kwargs)
    return OptimizerConfig(**base)


def _build(model, config, **kwargs):
    return get_megatron_optimizer(config, [model], mp_group=None, tp_group=None, **kwargs)


def _grad_sets(model, count, seed=0, scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) * scale for p in model.parameters()]
            for _ in range(count)]


def _set_grads(model, grads, dtype=None, attr="grad"):
    for p, g in zip(model.parameters(), grads):
        setattr(p, attr, g.to(dtype or p.dtype).clone())


def _adamw_fp64(params, grad_sets, decay_flags, lr=LR, wd=WD, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW from its equations, in float64: decoupled decay, then the bias-corrected step."""
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grad_sets, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            if decay_flags[i]:
                p.mul_(1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + eps))
    return params


# -- config --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=None), r"--lr must be given"),
    (dict(lr=1e-3, min_lr=1e-2), r"--min-lr must be in \[0, --lr=0.001\], got 0.01"),
    (dict(lr=1e-3, optimizer="lamb"),
     r"--optimizer must be adam, sgd, lion, muon, dist_muon, soap or adaptive_muon, got 'lamb'"),
    (dict(lr=1e-3, fp16=True, bf16=True), r"--fp16 and --bf16"),
    (dict(lr=1e-3, adam_beta2=1.0), r"--adam-beta2 must be in \[0, 1\), got 1.0"),
    (dict(lr=1e-3, clip_grad=-1.0), r"--clip-grad must be >= 0"),
    (dict(lr=1e-3, loss_scale=0.0), r"--loss-scale must be > 0"),
    (dict(lr=1e-3, min_loss_scale=8.0, initial_loss_scale=4.0), r"--min-loss-scale"),
    (dict(lr=1e-3, hysteresis=0), r"--hysteresis must be >= 1, got 0"),
    (dict(lr=1e-3, loss_scale_window=0.5), r"--loss-scale-window"),
    (dict(lr=1e-3, fp16=True, params_dtype=torch.bfloat16), r"does not match --fp16"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerConfig(**kwargs)


def test_config_derives_params_dtype():
    assert OptimizerConfig(lr=1.0).params_dtype == torch.float32
    assert OptimizerConfig(lr=1.0, fp16=True).params_dtype == torch.float16
    assert OptimizerConfig(lr=1.0, bf16=True).params_dtype == torch.bfloat16
    assert OptimizerConfig(lr=1.0, loss_scale_window=1000.0).loss_scale_window == 1000


def test_distributed_optimizer_is_rejected_clearly():
    with pytest.raises(ConfigError, match="--use-distributed-optimizer"):
        _build(Tiny(), _config(use_distributed_optimizer=True))


# -- param groups and weight decay ------------------------------------------------------------


def test_no_weight_decay_on_biases_and_norms():
    model = Tiny()
    groups = get_param_groups([model], _config())
    names = {id(p): n for n, p in model.named_parameters()}
    by_wd = {g["wd_mult"]: {names[id(p)] for p in g["params"]} for g in groups}
    assert by_wd[1.0] == DECAYED
    assert by_wd[0.0] == {"linear.bias", "norm.weight", "norm.bias"}
    assert all(g["weight_decay"] == WD * g["wd_mult"] and g["lr"] == LR for g in groups)

    # Behaviour: with zero gradients Adam's update is 0, so only decoupled decay moves weights.
    before = copy.deepcopy(model.state_dict())
    opt = _build(model, _config())
    _set_grads(model, [torch.zeros_like(p) for p in model.parameters()])
    assert opt.step()[0]
    for name, p in model.named_parameters():
        factor = 1 - LR * WD if name in DECAYED else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-7, atol=0)


def test_custom_conditions_and_lr_mult():
    model = Tiny()
    groups = get_param_groups(
        [model], _config(), no_weight_decay_cond=lambda n, p: n.startswith("proj"),
        scale_lr_cond=lambda n, p: n.startswith("norm"), lr_mult=0.25)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {(g["wd_mult"], g["lr_mult"]): sorted(names[id(p)] for p in g["params"])
           for g in groups}
    assert got == {(1.0, 1.0): ["linear.bias", "linear.weight"],
                   (1.0, 0.25): ["norm.bias", "norm.weight"],
                   (0.0, 1.0): ["proj.weight"]}
    assert [g["lr"] for g in groups] == [LR, LR * 0.25, LR]


def test_frozen_parameters_are_left_out():
    model = Tiny()
    model.norm.weight.requires_grad_(False)
    opt = _build(model, _config())
    assert all(p is not model.norm.weight for p in opt.get_parameters())
    assert len(opt.get_parameters()) == 4


# -- fp32 -----------------------------------------------------------------------------------


def test_fp32_adam_matches_fp64_adamw_equations():
    model = Tiny()
    start = [p.detach().clone() for p in model.parameters()]
    opt = _build(model, _config())
    assert isinstance(opt, FP32Optimizer)
    grad_sets = _grad_sets(model, 5)
    for grads in grad_sets:
        opt.zero_grad()
        _set_grads(model, grads)
        assert opt.step() == (True, None, None)
    flags = [n in DECAYED for n, _ in model.named_parameters()]
    expected = _adamw_fp64(start, grad_sets, flags)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=0, atol=2e-6)


def test_sgd_momentum_matches_hand_computation():
    model = Tiny()
    start = [p.detach().clone().double() for p in model.parameters()]
    opt = _build(model, _config(optimizer="sgd", sgd_momentum=0.5, weight_decay=0.0))
    grad_sets = _grad_sets(model, 3)
    for grads in grad_sets:
        _set_grads(model, grads)
        opt.step()
    for i, p in enumerate(model.parameters()):
        g1, g2, g3 = (gs[i].double() for gs in grad_sets)
        b1, b2, b3 = g1, 0.5 * g1 + g2, 0.5 * (0.5 * g1 + g2) + g3  # momentum buffers
        # fp32 rounding of O(1) parameters over three updates: a few ulp (~6e-8 each).
        torch.testing.assert_close(p.detach().double(), start[i] - LR * (b1 + b2 + b3),
                                   rtol=0, atol=4e-7)


def test_clipping_uses_the_global_norm_and_returns_it():
    model = Tiny()
    start = [p.detach().clone().double() for p in model.parameters()]
    opt = _build(model, _config(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0,
                                clip_grad=0.5, log_num_zeros_in_grad=True))
    grads = _grad_sets(model, 1, scale=1.0)[0]
    grads[1][0] = 0.0  # one exact zero to count
    _set_grads(model, grads)
    ok, norm, zeros = opt.step()
    expected_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert ok and norm == pytest.approx(expected_norm, rel=1e-6)
    assert expected_norm > 0.5 and zeros == 1
    coeff = 0.5 / (expected_norm + 1e-6)
    for p, s, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach().double(), s - LR * coeff * g.double(),
                                   rtol=0, atol=1e-7)


def test_small_gradients_are_not_clipped():
    model = Tiny()
    opt = _build(model, _config(clip_grad=100.0))
    grads = _grad_sets(model, 1)[0]
    _set_grads(model, grads)
    opt.step()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_fp32_reads_main_grad_when_present():
    ref_model = Tiny()
    model = copy.deepcopy(ref_model)
    ref_opt, opt = _build(ref_model, _config()), _build(model, _config(), use_main_grad=True)
    for grads in _grad_sets(model, 3):
        _set_grads(ref_model, grads)
        _set_grads(model, grads, attr="main_grad")
        ref_opt.step()
        opt.step()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, r)
    del model.proj.weight.main_grad
    with pytest.raises(RuntimeError, match="has no main_grad"):
        opt.step()


# -- mixed precision ------------------------------------------------------------------------


def _half_model_and_reference(dtype):
    model = Tiny().to(dtype)
    ref_model = copy.deepcopy(model).float()  # the fp32 master weights start from the rounding
    return model, ref_model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_matches_fp32_adamw_on_the_same_grads(dtype):
    fp16 = dtype == torch.float16
    config = _config(fp16=fp16, bf16=not fp16, initial_loss_scale=1024.0)
    model, ref_model = _half_model_and_reference(dtype)
    opt = _build(model, config)
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    ref_opt = torch.optim.AdamW(get_param_groups([ref_model], config), lr=LR)
    scale = 1024.0 if fp16 else 1.0
    assert opt.get_loss_scale().item() == scale
    for grads in _grad_sets(model, 4):
        scaled = [(g * scale).to(dtype) for g in grads]  # what backward of a scaled loss gives
        _set_grads(model, scaled)
        for r, s in zip(ref_model.parameters(), scaled):
            r.grad = s.float() / scale  # a power-of-two scale unscales exactly
        assert opt.step()[0]
        ref_opt.step()
        assert all(p.grad is None for p in model.parameters())  # half grads freed
    main = [p for g in opt.fp32_from_float16_groups for p in g]
    ref = [p for g in ref_opt.param_groups for p in g["params"]]
    model_params = [p for g in opt.float16_groups for p in g]
    for m, r, p in zip(main, ref, model_params):
        assert m.dtype == torch.float32 and p.dtype == dtype
        torch.testing.assert_close(m, r.detach(), rtol=1.2e-7, atol=1e-10)
        assert torch.equal(p.detach(), m.to(dtype))  # model params are the main params rounded


def test_fp16_skips_a_step_with_inf_or_nan_and_backs_off():
    config = _config(fp16=True, initial_loss_scale=256.0, hysteresis=1)
    model, ref_model = _half_model_and_reference(torch.float16)
    opt = _build(model, config)
    ref_opt = torch.optim.AdamW(get_param_groups([ref_model], config), lr=LR)
    grads = _grad_sets(model, 3)
    for bad in (float("inf"), float("nan")):
        before_model = [p.detach().clone() for p in model.parameters()]
        before_main = [p.clone() for g in opt.fp32_from_float16_groups for p in g]
        scale = opt.get_loss_scale().item()
        poisoned = [(g * scale).half() for g in grads[0]]
        poisoned[2].view(-1)[1] = bad
        _set_grads(model, poisoned)
        assert opt.step() == (False, None, None)
        assert opt.get_loss_scale().item() == scale / 2
        for p, b in zip(model.parameters(), before_model):
            assert torch.equal(p.detach(), b)
        for p, b in zip((p for g in opt.fp32_from_float16_groups for p in g), before_main):
            assert torch.equal(p, b)
        assert not opt.optimizer.state  # AdamW never stepped
    # Finite gradients at the reduced scale: the step happens and matches the reference.
    scale = opt.get_loss_scale().item()
    assert scale == 64.0
    for g in grads[1:]:
        opt.zero_grad()
        _set_grads(model, [(x * scale).half() for x in g])
        for r, x in zip(ref_model.parameters(), g):
            r.grad = (x * scale).half().float() / scale
        assert opt.step()[0]
        ref_opt.step()
    for m, r in zip((p for g in opt.fp32_from_float16_groups for p in g),
                    (p for g in ref_opt.param_groups for p in g["params"])):
        torch.testing.assert_close(m, r.detach(), rtol=1.2e-7, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_main_grad_path_equals_grad_path(dtype):
    fp16 = dtype == torch.float16
    config = _config(fp16=fp16, bf16=not fp16, initial_loss_scale=512.0, clip_grad=1.0)
    model_a = Tiny().to(dtype)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = _build(model_a, config), _build(model_b, config)
    scale = opt_a.get_loss_scale().item()
    for grads in _grad_sets(model_a, 3, scale=1.0):
        _set_grads(model_a, [(g * scale).to(dtype) for g in grads])
        # The data-parallel wrapper accumulates in fp32 main_grad and leaves .grad None.
        _set_grads(model_b, [(g * scale).to(dtype).float() for g in grads], attr="main_grad")
        result_a, result_b = opt_a.step(), opt_b.step()
        assert result_a == result_b and result_a[1] is not None
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


def test_mixed_precision_keeps_fp32_params_in_place():
    model = Tiny().bfloat16()
    model.norm.float()  # e.g. norms kept in fp32
    opt = _build(model, _config(bf16=True))
    fp32 = [p for g in opt.fp32_from_fp32_groups for p in g]
    assert {id(p) for p in fp32} == {id(model.norm.weight), id(model.norm.bias)}
    grads = _grad_sets(model, 1)[0]
    _set_grads(model, grads)
    before = model.norm.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.norm.weight.detach(), before)


def test_bf16_has_no_scaler_and_check_for_nan_raises():
    model = Tiny().bfloat16()
    opt = _build(model, _config(bf16=True, check_for_nan_in_loss_and_grad=True))
    assert opt.grad_scaler is None and opt.get_loss_scale().item() == 1.0
    grads = [g.bfloat16() for g in _grad_sets(model, 1)[0]]
    grads[0][0, 0] = float("nan")
    _set_grads(model, grads)
    with pytest.raises(RuntimeError, match="--check-for-nan-in-loss-and-grad"):
        opt.step()
    model = Tiny()
    opt = _build(model, _config(check_for_nan_in_loss_and_grad=True))
    grads = _grad_sets(model, 1)[0]
    grads[3][0] = float("inf")
    _set_grads(model, grads)
    with pytest.raises(RuntimeError, match="inf or nan"):
        opt.step()


def test_scale_loss_and_zero_grad():
    model = Tiny().half()
    opt = _build(model, _config(fp16=True, initial_loss_scale=2.0 ** 20))
    loss = torch.tensor(3.0, dtype=torch.float16)
    scaled = opt.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.shape == () and scaled.item() == 3.0 * 2 ** 20
    _set_grads(model, _grad_sets(model, 1)[0])
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_reload_model_params_refreshes_main_params():
    model = Tiny().bfloat16()
    opt = _build(model, _config(bf16=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.reload_model_params()
    for p, m in zip((p for g in opt.float16_groups for p in g),
                    (p for g in opt.fp32_from_float16_groups for p in g)):
        assert torch.equal(m, p.detach().float())


# -- state dicts ----------------------------------------------------------------------------


def _run(model, opt, grad_sets, dtype):
    for grads in grad_sets:
        opt.zero_grad()
        scale = opt.get_loss_scale().item()
        _set_grads(model, [(g * scale).to(dtype) for g in grads])
        opt.step()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_state_dict_round_trip_gives_bit_identical_steps(precision):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    config = _config(fp16=precision == "fp16", bf16=precision == "bf16", clip_grad=1.0,
                     initial_loss_scale=2.0 ** 12, loss_scale_window=2)
    model = Tiny().to(dtype)
    opt = _build(model, config)
    first, second = _grad_sets(model, 3, seed=1), _grad_sets(model, 3, seed=2, scale=1.0)
    _run(model, opt, first, dtype)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    if precision == "fp32":
        assert set(opt.state_dict()) == {"state", "param_groups"}
    else:
        expected = {"optimizer", "fp32_from_fp16_params"} | (
            {"grad_scaler"} if precision == "fp16" else set())
        assert set(opt.state_dict()) == expected
        main = [p for g in opt.fp32_from_float16_groups for p in g]
        # The master weights hold more than the model's rounding, so restoring them matters.
        assert any(not torch.equal(m, m.to(dtype).float()) for m in main)
    _run(model, opt, second, dtype)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = Tiny().to(dtype)  # different initial weights
    resumed.load_state_dict(saved["model"])
    resumed_opt = _build(resumed, config)
    resumed_opt.load_state_dict(saved["optimizer"])
    _run(resumed, resumed_opt, second, dtype)

    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.get_loss_scale(), resumed_opt.get_loss_scale())
    if precision != "fp32":
        for a, b in zip((p for g in opt.fp32_from_float16_groups for p in g),
                        (p for g in resumed_opt.fp32_from_float16_groups for p in g)):
            assert torch.equal(a, b)


def test_load_rejects_mismatched_main_params():
    model = Tiny().bfloat16()
    opt = _build(model, _config(bf16=True))
    state = opt.state_dict()
    state = dict(state, fp32_from_fp16_params=[[torch.zeros(5)] + g[1:]
                                               for g in state["fp32_from_fp16_params"]])
    with pytest.raises(ValueError, match=r"param 0 has shape \(5,\)"):
        opt.load_state_dict(state)


def test_fully_sharded_fp16_unscales_skips_on_overflow_and_saves_the_scaler():
    """The FSDP2 optimizer with a loss scaler (--use-torch-fsdp2 --fp16), on one rank's fp32
    shards (plain tensors here: the unscale, the skip and the scaler are the same code): an
    inf or nan skips the step, leaves weights and moments untouched and halves the scale
    (--hysteresis 1); finite scaled gradients step as torch's AdamW on the unscaled ones."""
    from megatron.optimizer.builder import _build_torch_optimizer, build_grad_scaler
    from megatron.optimizer.optimizer import FullyShardedOptimizer

    config = _config(fp16=True, initial_loss_scale=256.0, hysteresis=1)
    model, ref_model = Tiny(), Tiny()
    ref_model.load_state_dict(model.state_dict())
    opt = FullyShardedOptimizer(
        _build_torch_optimizer(config, get_param_groups([model], config), sharded=True),
        config, half=True, grad_scaler=build_grad_scaler(config))
    ref_opt = torch.optim.AdamW(get_param_groups([ref_model], config), lr=LR)
    grads = _grad_sets(model, 3)
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = [g * 256.0 for g in grads[0]]
    poisoned[1].view(-1)[0] = float("inf")
    _set_grads(model, poisoned)
    assert opt.step() == (False, None, None)
    assert opt.get_loss_scale().item() == 128.0 and not opt.optimizer.state
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    for g in grads[1:]:
        opt.zero_grad()
        _set_grads(model, [x * 128.0 for x in g])
        for r, x in zip(ref_model.parameters(), g):
            r.grad = x.clone()
        assert opt.step()[0]
        ref_opt.step()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1.2e-7, atol=1e-10)
    state = opt.state_dict()
    assert state["grad_scaler"]["scale"].item() == 128.0
    assert set(state) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}

"""PrecisionAwareAdamW (``--use-precision-aware-optimizer``) against references written here.

The reference for the narrow-storage contract is torch's own AdamW stepping fp32 copies of the
moments, with the storage rounding applied between steps by code written in this file (bf16:
a cast; fp16: TransformerEngine's per-tensor scale, amax / (fp16 max / 2)). Both compute the
same fp32 operations in the same order, so the parameters and the stored moments must agree
bit for bit. A second reference runs Adam in fp64 with the moments rounded to bf16 each step:
its parameters agree within the fp32 arithmetic's drift (1e-6 relative), while dropping the
rounding (plain fp32 Adam) moves them by far more, so the rounding is really applied.
"""

import copy

import pytest
import torch

from megatron.optimizer.precision_aware_adam import PrecisionAwareAdamW, precision_aware_conflict
from megatron.tokenizer import build_tokenizer
from megatron.training.arguments import (ArgumentsError, build_configs, parse_args,
                                         validate_args)

STEPS = 6
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
HALF_FP16_MAX = 65504.0 / 2.0


def _ref_round(value: torch.Tensor, dtype: str) -> torch.Tensor:
    """The fp32 value a state of ``value`` reads back as after being stored in ``dtype``."""
    if dtype == "fp32":
        return value.clone()
    if dtype == "bf16":
        return value.bfloat16().float()
    amax = float(value.abs().max())
    if amax == 0.0:
        return torch.zeros_like(value)
    if dtype == "fp16":
        scale = torch.tensor([amax], dtype=torch.float32) / HALF_FP16_MAX
        return (value * (1.0 / scale)).half().float() * scale
    scale = torch.tensor([amax], dtype=torch.float32) / 448.0  # E4M3's largest value
    scaled = torch.clamp(value * (1.0 / scale), -448.0, 448.0)
    return scaled.to(torch.float8_e4m3fn).float() * (1.0 / (1.0 / scale))


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=gen), torch.randn(11, generator=gen) * 1e-3]


def _grads(step, params, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * scale for p in params]


def _reference(dtypes, grad_scale=1.0):
    """torch.optim.AdamW on fp32 copies, the moments rounded to storage between steps."""
    exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype, main_grads_dtype = dtypes
    params = [_ref_round(p, main_params_dtype) for p in _params()]
    moments = [[torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    for step in range(1, STEPS + 1):
        grads = _grads(step, params, grad_scale)
        for i, (p, g) in enumerate(zip(params, grads)):
            if main_grads_dtype == "bf16":
                g = g.bfloat16().float()
            q = p.clone().requires_grad_()
            q.grad = g
            opt = torch.optim.AdamW([q], foreach=False, fused=False, **HYPER)
            opt.state[q] = {"step": torch.tensor(float(step - 1)),
                            "exp_avg": moments[i][0].clone(),
                            "exp_avg_sq": moments[i][1].clone()}
            opt.step()
            moments[i] = [_ref_round(opt.state[q]["exp_avg"], exp_avg_dtype),
                          _ref_round(opt.state[q]["exp_avg_sq"], exp_avg_sq_dtype)]
            params[i] = _ref_round(q.detach(), main_params_dtype)
    return params, moments


def _ours(dtypes, grad_scale=1.0):
    exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype, main_grads_dtype = dtypes
    params = [p.clone() for p in _params()]
    opt = PrecisionAwareAdamW(params, exp_avg_dtype=exp_avg_dtype,
                              exp_avg_sq_dtype=exp_avg_sq_dtype,
                              main_params_dtype=main_params_dtype,
                              main_grads_dtype=main_grads_dtype, **HYPER)
    for step in range(1, STEPS + 1):
        for p, g in zip(params, _grads(step, params, grad_scale)):
            p.grad = g
        opt.step()
    return params, opt


COMBOS = [("fp32", "fp32", "fp32", "fp32"), ("bf16", "bf16", "fp32", "fp32"),
          ("fp16", "fp16", "fp32", "fp32"), ("bf16", "fp32", "fp32", "bf16"),
          ("fp32", "fp16", "fp16", "fp32"), ("bf16", "bf16", "fp16", "bf16"),
          ("fp8", "fp8", "fp32", "fp32"), ("fp8", "bf16", "fp16", "bf16")]


@pytest.mark.parametrize("dtypes", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_matches_torch_adamw_with_moments_rounded_to_storage(dtypes):
    ref_params, ref_moments = _reference(dtypes)
    params, opt = _ours(dtypes)
    for i, p in enumerate(params):
        assert torch.equal(p, ref_params[i]), i
        for name, ref in zip(("exp_avg", "exp_avg_sq"), ref_moments[i]):
            assert torch.equal(opt.unscaled_state(p, name), ref), (i, name)


def test_state_is_stored_in_the_narrow_dtypes():
    params, opt = _ours(("bf16", "fp16", "fp32", "fp32"))
    state = opt.state[params[0]]
    assert state["exp_avg"].dtype == torch.bfloat16 and "exp_avg_scale" not in state
    assert state["exp_avg_sq"].dtype == torch.float16
    assert state["exp_avg_sq_scale"].shape == (1,)
    assert float(state["exp_avg_sq"].float().abs().max()) == HALF_FP16_MAX  # amax fills range


def test_fp8_state_is_e4m3_scaled_to_its_range():
    params, opt = _ours(("fp8", "fp8", "fp32", "fp32"))
    state = opt.state[params[0]]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn
    assert float(state["exp_avg"].float().abs().max()) == 448.0
    assert (opt.unscaled_state(params[1], "exp_avg_sq") > 0).any()


def test_a_tensor_of_zeros_is_stored_as_zeros():
    params, opt = _ours(("fp8", "fp16", "fp32", "fp32"), grad_scale=0.0)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.unscaled_state(params[0], name), torch.zeros(5, 7))


def test_fp16_scaling_keeps_moments_below_fp16_range():
    """Gradients of 1e-6 give second moments ~1e-13, below fp16's smallest subnormal (6e-8):
    unscaled fp16 would store zeros; the per-tensor scale keeps them to fp16's 11 bits."""
    params, opt = _ours(("fp16", "fp16", "fp32", "fp32"), grad_scale=1e-6)
    ref_params, ref_moments = _reference(("fp32", "fp32", "fp32", "fp32"), grad_scale=1e-6)
    for i, p in enumerate(params):
        v = opt.unscaled_state(p, "exp_avg_sq")
        assert (v > 0).all()
        torch.testing.assert_close(v, ref_moments[i][1], rtol=2e-3, atol=0)


def test_all_fp32_is_torch_adamw():
    params, _ = _ours(("fp32",) * 4)
    ref = [p.clone().requires_grad_() for p in _params()]
    opt = torch.optim.AdamW(ref, foreach=False, fused=False, **HYPER)
    for step in range(1, STEPS + 1):
        for p, g in zip(ref, _grads(step, ref)):
            p.grad = g
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, ref))


def _fp64_adam(round_moments: bool):
    params = [p.double() for p in _params()]
    moments = [[torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    beta1, beta2 = HYPER["betas"]
    lr, eps, wd = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
    for step in range(1, STEPS + 1):
        for i, g in enumerate(_grads(step, params)):
            g = g.double()
            m = beta1 * moments[i][0] + (1 - beta1) * g
            v = beta2 * moments[i][1] + (1 - beta2) * g * g
            # The update reads this step's moments; only what is stored for the next is rounded.
            moments[i] = [m.bfloat16().double(), v.bfloat16().double()] if round_moments \
                else [m, v]
            update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
            params[i] = params[i] * (1 - lr * wd) - lr * update
    return params


def test_bf16_moments_follow_fp64_adam_with_rounded_moments():
    """fp32 arithmetic against fp64: parameters of size ~1 drift by a few fp32 ulps per step
    (measured 8e-7 relative at most over six steps; 2e-6 allowed). fp64 Adam whose moments are
    not rounded is off by 2.5e-5 relative in the median element, so the rounding is seen."""
    params, _ = _ours(("bf16", "bf16", "fp32", "fp32"))
    rounded, plain = _fp64_adam(True), _fp64_adam(False)
    ours = torch.cat([((p.double() - r).abs() / r.abs()).flatten()
                      for p, r in zip(params, rounded)])
    unrounded = torch.cat([((f - r).abs() / r.abs()).flatten() for f, r in zip(plain, rounded)])
    assert ours.max() < 2e-6, ours.max()
    assert unrounded.median() > 1e-5, unrounded.median()


@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "fp32", "bf16"),
                                    ("fp16", "fp8", "fp16", "fp32")], ids=["bf16", "fp16-fp8"])
def test_state_dict_round_trip_continues_bit_for_bit(dtypes):
    """The optimizer's own state_dict keeps the stored values and their scales."""
    params, opt = _ours(dtypes)
    saved = copy.deepcopy(opt.state_dict())  # as from a file: no tensor shared with ``opt``
    assert saved["state"][0]["exp_avg"].dtype == opt.state_dtypes["exp_avg"]
    twin_params = [p.clone() for p in params]
    twin = PrecisionAwareAdamW(twin_params, exp_avg_dtype=dtypes[0], exp_avg_sq_dtype=dtypes[1],
                               main_params_dtype=dtypes[2], main_grads_dtype=dtypes[3], **HYPER)
    twin.load_state_dict(saved)
    assert twin.state[twin_params[0]]["exp_avg_sq"].dtype == opt.state_dtypes["exp_avg_sq"]
    for step in (STEPS + 1, STEPS + 2):
        for group in (params, twin_params):
            for p, g in zip(group, _grads(step, group)):
                p.grad = g
        opt.step()
        twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


@pytest.mark.parametrize("flags, named", [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--main-grads-dtype", "bf16", "--main-params-dtype", "fp16"], "--main-params-dtype fp16"),
    (["--use-precision-aware-optimizer"], "needs --use-distributed-optimizer"),
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer", "--optimizer", "sgd"],
     "--optimizer adam only, got --optimizer sgd"),
    (["--exp-avg-sq-dtype", "fp8"], "--exp-avg-sq-dtype fp8 needs --use-precision-aware"),
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer",
      "--optimizer-cpu-offload"], "with --optimizer-cpu-offload is not built"),
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer", "--bf16",
      "--accumulate-allreduce-grads-in-fp32", "--main-grads-dtype", "bf16"],
     "--main-grads-dtype bf16 cannot be used with --accumulate-allreduce-grads-in-fp32"),
])
def test_bad_combinations_are_refused_in_one_line(flags, named):
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--lr", "1e-3", "--train-iters", "2"]
    args = parse_args(argv=base + flags)
    args.world_size = 1
    with pytest.raises(ArgumentsError) as err:
        validate_args(args)
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_good_combination_passes_and_reaches_the_config():
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--lr", "1e-3", "--train-iters", "2", "--bf16", "--use-distributed-optimizer",
            "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
            "--exp-avg-sq-dtype", "fp16", "--main-params-dtype", "fp16",
            "--main-grads-dtype", "bf16", "--vocab-size", "500", "--tokenizer-type",
            "NullTokenizer"]
    args = parse_args(argv=base)
    args.world_size = 1
    args = validate_args(args)
    build_tokenizer(args)
    config = build_configs(args).optimizer
    assert (config.use_precision_aware_optimizer, config.exp_avg_dtype, config.exp_avg_sq_dtype,
            config.main_params_dtype, config.main_grads_dtype) == (
        True, "bf16", "fp16", "fp16", "bf16")


def test_conflict_is_none_for_the_defaults():
    assert precision_aware_conflict(False, "adam", False, "fp32", "fp32", "fp32", "fp32") is None

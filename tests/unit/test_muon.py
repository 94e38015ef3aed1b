"""``--optimizer muon`` on one process, against references written out here.

References: Muon's step in float64 from its equations (decoupled weight decay, EMA momentum,
optional Nesterov blend, the Newton-Schulz iteration with the quintic table copied from
Megatron-Core's documentation, the shape scale), applied to a tiny GPT's parameters; torch's own
``AdamW`` for the parameters Muon leaves to Adam.

Tolerance: the optimizer runs the iteration in fp32 (``--muon-fp32-matmul-prec high``); the
quintic polynomials have slopes up to ~4 per step, so fp32 rounding (~1e-7) grows to ~1e-4
relative on the orthogonalised update, ~1e-6 on parameters after a few steps at lr 1e-2. 2e-5
leaves room for that; a wrong scale mode (a factor sqrt(32 / 8) or more), a missed Nesterov
blend or a QKV split that is not done shows up at 1e-3 or more (checked below).
"""

import copy
import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.model import GPTModel
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.optimizer.muon import Muon, check_muon_settings, ns_coefficients
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

LR, WD, BETA = 1e-2, 0.1, 0.9
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
GQA = dict(num_query_groups=2, swiglu=True, untie_embeddings_and_output_weights=True,
           normalization="RMSNorm", add_bias_linear=True)


def tiny_gpt(**overrides):
    torch.manual_seed(0)
    return GPTModel(make_config(params_dtype=torch.float32, **dict(GQA, **overrides)),
                    single_process_state())


def muon_config(**kwargs):
    base = dict(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=0.0, muon_momentum=BETA,
                muon_fp32_matmul_prec="high")
    base.update(kwargs)
    return OptimizerConfig(**base)


def build(model, config):
    return get_megatron_optimizer(config, [model], mp_group=None, tp_group=None)


def grad_sets(model, count, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in model.named_parameters()}
            for _ in range(count)]


def run(model, optimizer, grads):
    for step_grads in grads:
        for name, p in model.named_parameters():
            p.grad = step_grads[name].to(p.dtype)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def takes_muon(name, p):
    """Megatron-Core's rule: 2-D, and not the word embeddings or the output layer (a learned
    position-embedding table takes Muon)."""
    return p.dim() == 2 and "word_embeddings" not in name and "output_layer" not in name


# ---- the reference, in float64 -------------------------------------------------------------

def ns_fp64(g):
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for a, b, c in QUINTIC:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def scale(rows, cols, mode):
    return {"spectral": math.sqrt(max(rows, cols)), "unit_rms_norm": math.sqrt(rows / cols),
            "shape_scaling": math.sqrt(max(1.0, rows / cols))}[mode]


def orthogonalized_fp64(name, u, mode, split_qkv, heads_per_group, head_dim):
    if not (split_qkv and "query_key_value.weight" in name):
        return ns_fp64(u) * scale(u.shape[0], u.shape[1], mode)
    rows = (heads_per_group + 2) * head_dim
    groups = u.view(-1, rows, u.shape[1])
    q_rows = heads_per_group * head_dim
    parts = []
    for lo, hi in ((0, q_rows), (q_rows, q_rows + head_dim), (q_rows + head_dim, rows)):
        block = groups[:, lo:hi].reshape(-1, u.shape[1])
        out = ns_fp64(block) * scale(block.shape[0], block.shape[1], mode)
        parts.append(out.view(groups.shape[0], hi - lo, u.shape[1]))
    return torch.cat(parts, dim=1).view_as(u)


def muon_fp64(params, grads, *, nesterov=False, mode="spectral", extra=1.0, split_qkv=True,
              heads_per_group=2, head_dim=8):
    """``{name: fp64 weight}`` after Muon steps on the 2-D non-embedding weights."""
    weights = {n: p.detach().double().clone() for n, p in params if takes_muon(n, p)}
    momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    for step_grads in grads:
        for name, w in weights.items():
            g = step_grads[name].double()
            w -= LR * WD * w
            momentum[name] = BETA * momentum[name] + (1 - BETA) * g
            u = (1 - BETA) * g + BETA * momentum[name] if nesterov else momentum[name]
            w -= LR * extra * orthogonalized_fp64(name, u, mode, split_qkv, heads_per_group,
                                                  head_dim)
    return weights


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("nesterov,mode,extra", [(False, "spectral", 1.0),
                                                 (True, "unit_rms_norm", 0.5),
                                                 (True, "shape_scaling", 1.0)])
def test_muon_matches_fp64_reference_and_adam_matches_torch_adamw(nesterov, mode, extra):
    model = tiny_gpt()
    start = copy.deepcopy(model)
    grads = grad_sets(model, 3)
    optimizer = build(model, muon_config(muon_nesterov=nesterov, muon_scale_mode=mode,
                                         muon_extra_scale_factor=extra))
    got = run(model, optimizer, grads)
    want = muon_fp64(list(start.named_parameters()), grads, nesterov=nesterov, mode=mode,
                     extra=extra)
    assert set(want) == {n for n, p in start.named_parameters() if takes_muon(n, p)}
    assert any("query_key_value" in n for n in want) and any("dense_h_to_4h" in n for n in want)
    for name, weight in want.items():
        torch.testing.assert_close(got[name].double(), weight, rtol=0, atol=2e-5, msg=name)
    # Everything else: torch's AdamW with Megatron's groups (no decay for biases and 1-D).
    rest = [(n, p) for n, p in start.named_parameters() if not takes_muon(n, p)]
    decayed = [p for n, p in rest if p.dim() > 1 and not n.endswith(".bias")]
    plain = [p for n, p in rest if not (p.dim() > 1 and not n.endswith(".bias"))]
    assert decayed and plain
    adamw = torch.optim.AdamW([{"params": decayed, "weight_decay": WD},
                               {"params": plain, "weight_decay": 0.0}], lr=LR, foreach=False)
    for step_grads in grads:
        for name, p in rest:
            p.grad = step_grads[name].clone()
        adamw.step()
    for name, p in rest:
        assert torch.equal(got[name], p.detach()), name


def test_reference_tells_the_settings_apart():
    """The tolerance above separates each setting from its neighbours (the test can fail)."""
    model = tiny_gpt()
    params = list(model.named_parameters())
    grads = grad_sets(model, 2)
    base = muon_fp64(params, grads)
    for other in (dict(nesterov=True), dict(mode="unit_rms_norm"), dict(split_qkv=False),
                  dict(extra=0.9)):
        changed = muon_fp64(params, grads, **other)
        assert max((base[n] - changed[n]).abs().max().item() for n in base) > 1e-3, other


def test_no_split_qkv_orthogonalizes_the_fused_weight_whole():
    model = tiny_gpt()
    start = copy.deepcopy(model)
    grads = grad_sets(model, 2)
    got = run(model, build(model, muon_config(muon_split_qkv=False)), grads)
    want = muon_fp64(list(start.named_parameters()), grads, split_qkv=False)
    for name, weight in want.items():
        torch.testing.assert_close(got[name].double(), weight, rtol=0, atol=2e-5, msg=name)


def test_medium_precision_runs_the_iteration_in_bf16():
    """medium: close to the fp64 reference at bf16's resolution, and not equal to high."""
    model, twin = tiny_gpt(), tiny_gpt()
    start = copy.deepcopy(model)
    grads = grad_sets(model, 2)
    got = run(model, build(model, muon_config(muon_fp32_matmul_prec="medium")), grads)
    high = run(twin, build(twin, muon_config()), grads)
    want = muon_fp64(list(start.named_parameters()), grads)
    for name, weight in want.items():
        torch.testing.assert_close(got[name].double(), weight, rtol=0, atol=2e-3, msg=name)
    assert any(not torch.equal(got[n], high[n]) for n in want)


def test_state_dict_resumes_bit_for_bit():
    grads = grad_sets(tiny_gpt(), 4)
    model = tiny_gpt()
    optimizer = build(model, muon_config(muon_nesterov=True))
    straight = run(model, optimizer, grads)

    model = tiny_gpt()
    optimizer = build(model, muon_config(muon_nesterov=True))
    run(model, optimizer, grads[:2])
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())
    fields = {k for entry in saved["state"].values() for k in entry}
    assert fields == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    resumed_model = tiny_gpt()
    resumed_model.load_state_dict(saved_model)
    resumed = build(resumed_model, muon_config(muon_nesterov=True))
    resumed.load_state_dict(saved)
    after = run(resumed_model, resumed, grads[2:])
    for name in straight:
        assert torch.equal(straight[name], after[name]), name


def test_coefficient_tables_follow_megatron_core():
    assert ns_coefficients("quintic", 10) == QUINTIC * 2
    assert len(ns_coefficients("polar_express", 10)) == 10
    assert ns_coefficients("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    with pytest.raises(ConfigError, match="--muon-num-ns-steps must be a multiple of 5"):
        ns_coefficients("quintic", 4)
    with pytest.raises(ConfigError, match="--muon-coefficient-type"):
        ns_coefficients("cubic", 5)


@pytest.mark.parametrize("change,flag", [
    (dict(muon_tp_mode="blockwise"), "--muon-tp-mode blockwise"),
    (dict(muon_tp_mode="distributed"), "--muon-tp-mode distributed"),
    (dict(use_distributed_optimizer=True), "--optimizer muon does not run with "
                                           "--use-distributed-optimizer"),
    (dict(muon_use_syrk=True), "--muon-use-syrk"),
    (dict(muon_scalar_optimizer="lion"), "--muon-scalar-optimizer lion"),
    (dict(muon_fp32_matmul_prec="low"), "--muon-fp32-matmul-prec low"),
    (dict(muon_scale_mode="rms"), "--muon-scale-mode"),
    (dict(fp16=True), "--optimizer muon does not run with --fp16"),
])
def test_settings_not_built_are_refused_in_one_line(change, flag):
    with pytest.raises(ConfigError) as err:
        muon_config(**change)
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_muon_refuses_a_one_dimensional_weight():
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(3))], "use_muon": True}], lr=LR)


def test_dist_muon_validates_with_both_checkpoint_formats_and_not_the_distributed_optimizer():
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args

    argv = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --optimizer dist_muon "
            "--save /nonexistent").split()
    for fmt in ("torch", "torch_dist"):
        assert validate_args(parse_args(argv=argv + ["--ckpt-format", fmt])).optimizer == \
            "dist_muon"
    with pytest.raises(ArgumentsError, match="does not run with --use-distributed-optimizer"):
        validate_args(parse_args(argv=argv + ["--use-distributed-optimizer"]))


def test_dist_muon_on_one_rank_is_muon():
    grads = grad_sets(tiny_gpt(), 2)
    model = tiny_gpt()
    want = run(model, build(model, muon_config()), grads)
    model = tiny_gpt()
    got = run(model, build(model, muon_config(optimizer="dist_muon")), grads)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_muon_flags_reach_the_config():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.configs import build_configs

    argv = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --optimizer muon "
            "--muon-momentum 0.8 --muon-nesterov --muon-no-split-qkv --muon-scale-mode "
            "shape_scaling --muon-extra-scale-factor 0.2 --muon-num-ns-steps 10 "
            "--muon-fp32-matmul-prec high").split()
    args = validate_args(parse_args(argv=argv))
    args.padded_vocab_size = 128
    config = build_configs(args).optimizer
    assert (config.optimizer, config.muon_momentum, config.muon_nesterov,
            config.muon_split_qkv, config.muon_scale_mode, config.muon_extra_scale_factor,
            config.muon_num_ns_steps, config.muon_fp32_matmul_prec) == (
        "muon", 0.8, True, False, "shape_scaling", 0.2, 10, "high")


@pytest.mark.slow
def test_training_loss_decreases_with_muon():
    """A few full steps on one fixed batch: the GPT's loss falls."""
    model = tiny_gpt()
    optimizer = build(model, muon_config(muon_fp32_matmul_prec="medium"))
    ids, pos, labels = make_batch()
    losses = []
    for _ in range(8):
        model.zero_grad()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_bf16_steps_on_fp32_main_weights_like_fp32():
    """--bf16: Muon steps on the fp32 main copies (which keep the QKV split) and the bf16
    model follows the fp32 run within two bf16 steps (half a step rounding the start, half
    rounding the end, the rest for the update taken from the rounded start)."""
    grads = grad_sets(tiny_gpt(), 2)
    fp32 = tiny_gpt()
    want = run(fp32, build(fp32, muon_config()), grads)
    half = tiny_gpt().to(torch.bfloat16)
    optimizer = build(half, muon_config(bf16=True))
    mains = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in mains)
    assert sum(1 for p in mains if getattr(p, "muon_qkv_split", None) == (16, 8, 8)) == 2
    got = run(half, optimizer, grads)
    for name in want:
        ulp = 2.0 ** -8 * want[name].abs().max().item()  # one bf16 step at the largest weight
        torch.testing.assert_close(got[name].float(), want[name], rtol=0, atol=2 * ulp, msg=name)


def test_conversion_does_not_read_muon_state_as_adam():
    from megatron.checkpoint.optimizer_state import SourceOptimizer

    model = tiny_gpt()
    optimizer = build(model, muon_config())
    run(model, optimizer, grad_sets(model, 1))
    found, why = SourceOptimizer.read({"optimizer": optimizer.state_dict()},
                                      [model.state_dict_for_save_checkpoint()])
    assert found is None and "Muon" in why

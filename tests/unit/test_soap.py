"""``--optimizer soap`` on one process, against a reference written out here.

Reference: the published SOAP step (Vyas et al. 2024, as NVIDIA Emerging-Optimizers runs it for
Megatron-Core: bias-corrected EMAs of Shampoo's factors, optionally with the KL-Shampoo
correction; the first basis from a full eigendecomposition, later ones from one power
iteration + QR after sorting by the estimated eigenvalues, every N steps; Adam with bias
correction in that basis), in float64 with numpy's eigh / QR and explicit matrix products.

Matrices are square here: a rectangular gradient's Gram matrix has a null space, whose basis
any eigensolver picks arbitrarily, and SOAP's elementwise Adam is not invariant to that choice;
with square random gradients every eigenvalue is simple and the bases agree up to signs, which
SOAP's update does not see. Tolerance: float64 weights are stepped in float64, rounding ~1e-15
grows through a few eigendecompositions (condition ~1e3 here) to ~1e-11 on weights; 1e-9 is
far below what a missed bias correction, a stale or missing basis refresh, a wrong KL scale or
an unsorted QR gives (1e-4 or more, checked below).
"""

import copy

import numpy as np
import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer import OptimizerConfig
from megatron.optimizer.soap import SOAP, SoapSettings
from tests.unit.test_muon import build, grad_sets, run, tiny_gpt

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


# ---- the reference, in float64 -------------------------------------------------------------

def _eig_desc(x):
    _, vectors = np.linalg.eigh(x)
    return vectors[:, ::-1]


def _inverse_seen_in(factor, basis, eps):
    estimates = np.array([basis[:, k] @ factor @ basis[:, k] for k in range(basis.shape[1])])
    return basis @ np.diag(1.0 / np.maximum(estimates, eps)) @ basis.T


def soap_fp64(w, grads, *, shampoo_beta=0.95, frequency=1, kl=True, eps=EPS):
    """The weight after SOAP steps on ``w`` with ``grads`` (numpy float64)."""
    w = w.copy()
    m, n = w.shape
    left, right = np.zeros((m, m)), np.zeros((n, n))
    q_l, q_r = np.eye(m), np.eye(n)
    avg, avg_sq = np.zeros((m, n)), np.zeros((m, n))
    for k, g in enumerate(grads):
        t = k + 1
        b = 1 - (1 - shampoo_beta) / (1 - shampoo_beta ** t)
        if kl:
            new_left = g @ _inverse_seen_in(right, q_r, eps) @ g.T / n
            new_right = g.T @ _inverse_seen_in(left, q_l, eps) @ g / m
        else:
            new_left, new_right = g @ g.T, g.T @ g
        left, right = b * left + (1 - b) * new_left, b * right + (1 - b) * new_right
        if k % frequency == 0:
            plain = q_l @ avg @ q_r.T
            if k == 0:
                q_l, q_r = _eig_desc(left), _eig_desc(right)
            else:
                new_bases = []
                for axis, (factor, q) in enumerate(((left, q_l), (right, q_r))):
                    est = np.diag(q.T @ factor @ q)
                    order = np.argsort(-est, kind="stable")
                    avg_sq = np.take(avg_sq, order, axis=axis)
                    new_bases.append(np.linalg.qr(factor @ q[:, order])[0])
                q_l, q_r = new_bases
            avg = q_l.T @ plain @ q_r
        w = w - LR * WD * w
        rotated = q_l.T @ g @ q_r
        avg = BETAS[0] * avg + (1 - BETAS[0]) * rotated
        avg_sq = BETAS[1] * avg_sq + (1 - BETAS[1]) * rotated ** 2
        step = (avg / (1 - BETAS[0] ** t)) / (np.sqrt(avg_sq / (1 - BETAS[1] ** t)) + eps)
        w = w - LR * (q_l @ step @ q_r.T)
    return w


# ---- helpers -------------------------------------------------------------------------------

def _square_problem(dtype, steps=6, seed=1):
    """Two square weights and gradients that share a direction from step to step (as training
    gradients do), so the eigenbases drift rather than jump."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(5, 5, generator=gen, dtype=torch.float64),
               torch.randn(4, 4, generator=gen, dtype=torch.float64)]
    common = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in weights]
    grads = [[0.1 * (c + 0.5 * torch.randn(c.shape, generator=gen, dtype=torch.float64))
              for c in common] for _ in range(steps)]
    params = [torch.nn.Parameter(w.to(dtype)) for w in weights]
    return params, grads


def _run_soap(params, grads, settings):
    optimizer = SOAP([{"params": params, "use_muon": True}], lr=LR, weight_decay=WD,
                     betas=BETAS, settings=settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        optimizer.step()
    return [p.detach().double() for p in params]


def _reference(params0, grads, **kw):
    return [torch.from_numpy(soap_fp64(w.numpy(), [g[i].numpy() for g in grads], **kw))
            for i, w in enumerate(params0)]


def soap_config(**kwargs):
    base = dict(optimizer="soap", lr=LR, weight_decay=WD, clip_grad=0.0, adam_beta1=BETAS[0],
                adam_beta2=BETAS[1])
    base.update(kwargs)
    return OptimizerConfig(**base)


# ---- tests ---------------------------------------------------------------------------------

# Megatron-Core's defaults first. With KL-Shampoo the first step's factors are divided by eps
# (the factors start at zero), so at eps 1e-8 they outweigh later steps' for hundreds of steps
# and the basis hardly moves; eps 0.05 (of the order of these gradients' eigenvalues) lets the
# refreshes matter, so the KL variants below are told apart (test_reference_tells_...).
@pytest.mark.parametrize("kl,frequency,beta,eps", [(True, 1, 0.95, EPS), (True, 2, 0.9, 0.05),
                                                   (True, 1, 0.95, 0.05), (False, 1, 0.9, EPS),
                                                   (False, 3, 0.95, EPS)])
def test_soap_matches_fp64_reference(kl, frequency, beta, eps):
    params, grads = _square_problem(torch.float64)
    start = [p.detach().clone() for p in params]
    got = _run_soap(params, grads, SoapSettings(shampoo_beta=beta,
                                                precondition_frequency=frequency,
                                                use_kl_shampoo=kl, eps=eps))
    want = _reference(start, grads, shampoo_beta=beta, frequency=frequency, kl=kl, eps=eps)
    for g, w, s in zip(got, want, start):
        assert (w - s).abs().max() > 1e-3  # the weights moved
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)


def test_soap_in_fp32_stays_near_the_fp64_reference():
    """Megatron-Core's precision (fp32 weights, factors and moments). The first step's basis
    is the gradient's own singular vectors, so its projection is diagonal: the off-diagonal
    entries are rounding (~1e-9 in fp32, ~1e-18 in fp64), and Adam divides them by their own
    size plus eps. With eps 1e-8 that makes them O(0.1) in fp32 (a property of SOAP in fp32,
    not of this code); with eps 1e-3 on both sides the fp32 run stays within ~1e-6 of the
    reference on weights (7e-6 the worst of a few seeds), under the 2e-5 allowed here."""
    params, grads = _square_problem(torch.float32)
    start = [p.detach().double().clone() for p in params]
    got = _run_soap(params, grads, SoapSettings(eps=1e-3))
    for g, w in zip(got, _reference(start, grads, eps=1e-3)):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)


def test_reference_tells_the_settings_apart():
    params, grads = _square_problem(torch.float64)
    start = [p.detach().clone() for p in params]
    base = _reference(start, grads, eps=0.05)[0]
    for other in (_reference(start, grads, kl=False, eps=0.05)[0],
                  _reference(start, grads, frequency=2, eps=0.05)[0],
                  _reference(start, grads, shampoo_beta=0.5, eps=0.05)[0]):
        assert (other - base).abs().max() > 1e-4
    plain = _reference(start, grads, kl=False)[0]
    assert (_reference(start, grads, kl=False, frequency=2)[0] - plain).abs().max() > 1e-4


def test_gpt_split_soap_for_matrices_adamw_for_the_rest():
    """The tiny GPT: 2-D non-embedding weights carry SOAP's state, the rest torch AdamW's
    (compared bit for bit against torch's AdamW with Megatron's groups)."""
    model = tiny_gpt()
    start = copy.deepcopy(model)
    grads = grad_sets(model, 3)
    optimizer = build(model, soap_config())
    got = run(model, optimizer, grads)
    inner = optimizer.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    for group in inner.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            matrix = p.dim() == 2 and "word_embeddings" not in name and "output_layer" not in name
            assert group["use_muon"] == matrix, name
            assert ("Q_L" in inner.state[p]) == matrix, name
    rest = [(n, p) for n, p in start.named_parameters() if not ("Q_L" in inner.state[
        dict(model.named_parameters())[n]])]
    decayed = [p for n, p in rest if p.dim() > 1 and not n.endswith(".bias")]
    plain = [p for n, p in rest if not (p.dim() > 1 and not n.endswith(".bias"))]
    adamw = torch.optim.AdamW([{"params": decayed, "weight_decay": WD},
                               {"params": plain, "weight_decay": 0.0}], lr=LR, betas=BETAS,
                              foreach=False)
    for step_grads in grads:
        for name, p in rest:
            p.grad = step_grads[name].clone()
        adamw.step()
    for name, p in rest:
        assert torch.equal(got[name], p.detach()), name


def test_state_dict_resumes_bit_for_bit():
    grads = grad_sets(tiny_gpt(), 4)
    config = soap_config(soap_precondition_frequency=2)
    model = tiny_gpt()
    straight = run(model, build(model, config), grads)
    model = tiny_gpt()
    optimizer = build(model, config)
    run(model, optimizer, grads[:3])
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    resumed_model = tiny_gpt()
    resumed_model.load_state_dict(saved_model)
    resumed = build(resumed_model, config)
    resumed.load_state_dict(saved)
    after = run(resumed_model, resumed, grads[3:])
    for name in straight:
        assert torch.equal(straight[name], after[name]), name
    # Without the eigenbases and factors the continuation differs.
    fresh_model = tiny_gpt()
    fresh_model.load_state_dict(saved_model)
    fresh = run(fresh_model, build(fresh_model, config), grads[3:])
    assert any(not torch.equal(fresh[n], straight[n]) for n in straight)


@pytest.mark.slow
def test_training_loss_decreases_with_soap():
    from tests.unit.test_gpt_model import make_batch

    model = tiny_gpt()
    optimizer = build(model, soap_config(lr=3e-3))
    ids, pos, labels = make_batch()
    losses = []
    for _ in range(6):
        model.zero_grad()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("change,message", [
    (dict(fp16=True), "--optimizer soap does not run with --fp16"),
    (dict(soap_shampoo_beta=1.0), "soap_shampoo_beta must be in [0, 1)"),
    (dict(soap_precondition_frequency=0), "soap_precondition_frequency must be a whole"),
    (dict(optimizer_cpu_offload=True), "--optimizer-cpu-offload steps adam"),
])
def test_settings_out_of_range_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError) as err:
        soap_config(**change)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_soap_refuses_a_one_dimensional_weight():
    with pytest.raises(ValueError, match="2-D"):
        SOAP([{"params": [torch.nn.Parameter(torch.ones(3))], "use_muon": True}], lr=LR)


ARGV = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3").split()


@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_flags_validate_and_the_distributed_optimizer_keeps_whole_gradients(optimizer):
    """--use-distributed-optimizer with these is Megatron-Core's layer-wise deal: the optimizer
    config keeps the flag, the gradient buffers all-reduce (no element sharding)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.configs import build_configs

    args = validate_args(parse_args(argv=ARGV + ["--optimizer", optimizer,
                                                 "--use-distributed-optimizer"]))
    args.padded_vocab_size = 128
    configs = build_configs(args)
    assert configs.optimizer.optimizer == optimizer
    assert configs.optimizer.use_distributed_optimizer
    assert not configs.ddp.use_distributed_optimizer
    adam = validate_args(parse_args(argv=ARGV + ["--use-distributed-optimizer"]))
    adam.padded_vocab_size = 128
    assert build_configs(adam).ddp.use_distributed_optimizer


@pytest.mark.parametrize("extra,message", [
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor with --optimizer soap is "
                                        "not built"),
    (["--use-torch-fsdp2"], "--optimizer soap does not run with --use-torch-fsdp2"),
    (["--use-distributed-optimizer", "--overlap-param-gather"],
     "--overlap-param-gather with --optimizer soap"),
    (["--fp16"], "--optimizer soap does not run with --fp16"),
])
def test_combinations_not_built_are_refused_in_one_line(extra, message):
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args

    with pytest.raises(ArgumentsError) as err:
        validate_args(parse_args(argv=ARGV + ["--optimizer", "soap", *extra]))
    assert message in str(err.value) and "\n" not in str(err.value).strip()


def test_loading_another_optimizers_state_is_refused_naming_the_fields():
    model = tiny_gpt()
    grads = grad_sets(model, 1)
    muon = build(model, OptimizerConfig(optimizer="muon", lr=LR, clip_grad=0.0))
    run(model, muon, grads)
    for config, kept in ((soap_config(), "Q_L"), (OptimizerConfig(
            optimizer="adaptive_muon", lr=LR, clip_grad=0.0), "moment2_buffer")):
        with pytest.raises(ValueError, match=rf"fields \['momentum_buffer'\].*{kept}.*"
                                             r"--no-load-optim"):
            build(tiny_gpt(), config).load_state_dict(copy.deepcopy(muon.state_dict()))

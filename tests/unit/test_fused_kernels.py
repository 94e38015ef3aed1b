"""The compiled fused ops (CPU bodies) against float64 references, their autograd, RNG,
determinism, fallback and loader.

Tolerances: inputs are generated in the tested dtype, so the float64 reference sees exactly the
kernel's inputs. A kernel computes in float32 and rounds its result once to the output dtype, so
it must agree with float64 to about one rounding of that dtype: relative 1e-5 for float32
(float32 math over rows of up to ~1000 terms), 1e-3 for float16 (unit roundoff 4.9e-4),
8e-3 for bfloat16 (3.9e-3), with an absolute floor of the same size times the largest value
compared (entries near zero carry the error of their larger neighbours). Gradients take a factor
4: they combine several rounded half-precision inputs (saved outputs, incoming gradients).
Any wrong formula, constant, mask or reduction is off by far more.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.fused_kernels import loader, ops, selfcheck
from megatron.fused_kernels.bias_dropout_add import bias_dropout_add
from megatron.fused_kernels.bias_gelu import bias_gelu_reference, gelu_tanh, gelu_tanh_grad
from megatron.fused_kernels.layer_norm import layer_norm_reference, rms_norm_reference
from megatron.fused_kernels.softmax import (
    scaled_masked_softmax_reference,
    scaled_upper_triang_masked_softmax_reference,
)
from megatron.optimizer.fused_adam import FusedAdamW
from tests.multiprocess import run_on_ranks

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The same checks run on the CUDA bodies where a GPU is present (marker `gpu`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The run-time self-check (megatron/fused_kernels/selfcheck.py) holds bodies to these same
# numbers (gradients: factor 4 as here).
TOL = selfcheck.TOLERANCE


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """The extension must load (setup.py builds it); MEGATRON_FUSED_KERNELS=0 skips."""
    if os.environ.get("MEGATRON_FUSED_KERNELS") == "0":
        pytest.skip("compiled kernels disabled by MEGATRON_FUSED_KERNELS=0")
    assert loader.load() is not None, f"fused kernels did not load: {loader.load_error()}"
    assert ops.kernels_available("cpu")
    if torch.cuda.is_available():
        assert ops.kernels_available("cuda"), "CUDA present but the CUDA bodies are not built"


def close(actual, expected, dtype, factor=1.0, scale=None):
    """``actual`` (any dtype) within the module's tolerance of the float64 ``expected``;
    ``scale`` (default: the largest expected value) sets the absolute floor."""
    tol = TOL[dtype] * factor
    expected = expected.double()
    if scale is None:
        scale = max(expected.abs().max().item(), 1e-30) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().cpu().double(), expected.detach().cpu(), rtol=tol,
                               atol=tol * scale)


def leaf(t):
    """A float64 CPU leaf with t's values (the reference side)."""
    return t.detach().cpu().double().requires_grad_(True)


def on(device, *tensors):
    """Leaves on ``device`` that require grad (None stays None)."""
    return [None if t is None else t.detach().to(device).requires_grad_(True) for t in tensors]


# ---- softmax --------------------------------------------------------------------------------

MASKED_SHAPES = [((2, 3, 5, 7), (2, 1, 5, 7)), ((1, 2, 4, 33), (1, 1, 4, 33)),
                 ((3, 1, 1, 1), (3, 1, 1, 1)), ((2, 2, 3, 69), (2, 2, 3, 69)),
                 ((1, 1, 2, 5), None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mask_shape", MASKED_SHAPES)
def test_scaled_masked_softmax_matches_float64(dtype, shape, mask_shape, device):
    x = (torch.randn(shape) * 3).to(dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape) < 0.3
        mask.view(-1, mask_shape[-1])[0] = True  # one fully masked row: uniform, zero grad
    scale = 0.7
    (xk,) = on(device, x)
    y = ops.scaled_masked_softmax(xk, None if mask is None else mask.to(device), scale)
    x64 = leaf(x)
    y64 = scaled_masked_softmax_reference(x64, mask, scale)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, y64, dtype)
    g = torch.randn(shape).to(dtype)
    y.backward(g.to(device))
    y64.backward(g.double())
    close(xk.grad, x64.grad, dtype, factor=4)
    if mask is not None:
        full = mask.expand(shape).all(dim=-1)
        uniform = torch.full_like(y64[full], 1.0 / shape[-1])
        close(y.cpu()[full], uniform, dtype)
        assert torch.all(xk.grad.cpu()[full] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_value_is_minus_10000(device):
    """Scores below -10000: the masked positions (set to -10000) then dominate the row, which
    pins the mask constant itself (a -inf or -1e9 mask would give them no weight)."""
    x = torch.full((1, 1, 2, 6), -20020.0)
    x[..., 0] = -20010.0
    mask = torch.zeros(1, 1, 2, 6, dtype=torch.bool)
    mask[..., 3:] = True
    y = ops.scaled_masked_softmax(x.to(device), mask.to(device), 0.5)
    expected = scaled_masked_softmax_reference(x.double(), mask, 0.5)
    assert expected[..., 3:].min() > 0.3  # the masked three share almost all the mass
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-7)


CAUSAL_SHAPES = [(3, 5, 5), (2, 7, 9), (2, 9, 7), (1, 1, 1), (4, 16, 130)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CAUSAL_SHAPES)
def test_scaled_upper_triang_softmax_matches_float64(dtype, shape, device):
    x = (torch.randn(shape) * 3).to(dtype)
    (xk,) = on(device, x)
    y = ops.scaled_upper_triang_masked_softmax(xk, 0.5)
    x64 = leaf(x)
    y64 = scaled_upper_triang_masked_softmax_reference(x64, 0.5)
    close(y, y64, dtype)
    g = torch.randn(shape).to(dtype)
    y.backward(g.to(device))
    y64.backward(g.double())
    close(xk.grad, x64.grad, dtype, factor=4)
    # Above the diagonal: probability 0 (or uniform on fully masked rows), gradient 0.
    sq, sk = shape[-2:]
    hidden = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)
    assert torch.all(xk.grad.cpu()[:, hidden] == 0)


# ---- layer norm / RMS norm ------------------------------------------------------------------

NORM_TYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16),
              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
              (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("x_dtype,w_dtype", NORM_TYPES)
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 64), (1, 1), (3, 1025)])
@pytest.mark.parametrize("rms,with_bias", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_matches_float64(x_dtype, w_dtype, shape, rms, with_bias, device):
    h = shape[-1]
    # Rows alternate between O(1) spread and a spread of ~eps^0.5 (where eps changes the
    # result by ~30%, so its value and place inside the square root are checked).
    x = torch.randn(shape) * 2 + 0.5
    x.view(-1, h)[::2] *= 2e-3
    x = x.to(x_dtype)
    w = (torch.randn(h) * 0.5 + 1).to(w_dtype)
    b = (torch.randn(h) * 0.1).to(w_dtype) if with_bias else None
    xk, wk, bk = on(device, x, w, b)
    x64, w64 = leaf(x), leaf(w)
    b64 = leaf(b) if with_bias else None
    if rms:
        y, y64 = ops.rms_norm(xk, wk, 1e-5), rms_norm_reference(x64, w64, 1e-5)
    else:
        y, y64 = ops.layer_norm(xk, wk, bk, 1e-5), layer_norm_reference(x64, w64, b64, 1e-5)
    half_w = w_dtype in (torch.float16, torch.bfloat16)
    out_dtype = w_dtype if (x_dtype == torch.float32 and half_w) else x_dtype
    assert y.dtype == out_dtype
    low = x_dtype if TOL[x_dtype] > TOL[w_dtype] else w_dtype  # coarsest dtype involved
    close(y, y64, low)
    g = torch.randn(shape).to(out_dtype)
    y.backward(g.to(device))
    y64.backward(g.double())
    assert xk.grad.dtype == x_dtype and wk.grad.dtype == w_dtype
    # dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat)) cancels (exactly for h = 1, 2), so
    # its error is relative to the size of the terms, rstd |dy w|, not to the result.
    x64d = x64.detach()
    centred = x64d if rms else x64d - x64d.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
    terms = (rstd * (g.double() * w64.detach()).abs()).max().item()
    close(xk.grad, x64.grad, low, factor=4, scale=terms)
    close(wk.grad, w64.grad, low, factor=4)
    if with_bias:
        close(bk.grad, b64.grad, low, factor=4)


# ---- bias + GeLU ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 17), (2, 5, 64), (1, 1), (4, 1000)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_matches_float64(dtype, shape, with_bias, device):
    x = (torch.randn(shape) * 3).to(dtype)
    b = torch.randn(shape[-1]).to(dtype) if with_bias else None
    xk, bk = on(device, x, b)
    x64 = leaf(x)
    b64 = leaf(b) if with_bias else None
    y, y64 = ops.bias_gelu(xk, bk), bias_gelu_reference(x64, b64)
    close(y, y64, dtype)
    g = torch.randn(shape).to(dtype)
    y.backward(g.to(device))
    y64.backward(g.double())
    close(xk.grad, x64.grad, dtype, factor=4)
    if with_bias:
        close(bk.grad, b64.grad, dtype, factor=4)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gelu_constants_in_float32(device):
    """Dense float32 sweep of x in [-6, 6] against the float64 formula, tightly: a kernel value
    is within ~1 ulp of the output (4e-7 absolute here), while an error in the 4th significant
    digit of either constant moves the output by ~1e-5 and its derivative by ~1.5e-5."""
    x = torch.linspace(-6, 6, 20001)
    (xk,) = on(device, x)
    y = ops.bias_gelu(xk, None)
    y.backward(torch.ones_like(y))
    x64 = x.double()
    torch.testing.assert_close(y.cpu().double(), gelu_tanh(x64), rtol=1e-6, atol=5e-7)
    grad64 = gelu_tanh_grad(torch.ones_like(x64), x64)
    torch.testing.assert_close(xk.grad.cpu().double(), grad64, rtol=1e-6, atol=3e-6)


# ---- bias + dropout + add -------------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)


def philox_words(counters: np.ndarray, key: int) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011) in numpy: [len(counters), 4] uint32 words."""
    c0, c1 = counters & _M32, counters >> np.uint64(32)
    c2, c3 = np.zeros_like(counters), np.zeros_like(counters)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    return np.stack([c0, c1, c2, c3], axis=1)


def test_philox_reference_known_answer():
    # Random123's published known-answer vector for philox4x32-10 at counter 0, key 0.
    words = philox_words(np.zeros(1, dtype=np.uint64), 0)[0]
    assert [hex(int(w)) for w in words] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c",
                                            "0x9b00dbd8"]


def expected_keep(numel: int, seed: int, offset: int, p: float) -> torch.Tensor:
    """The documented mask: element e kept iff word e % 4 of philox(offset + e // 4) >= p 2^32."""
    groups = (numel + 3) // 4
    words = philox_words(np.arange(groups, dtype=np.uint64) + np.uint64(offset), seed)
    threshold = min(int(round(p * 2.0 ** 32)), 2 ** 32 - 1)
    return torch.from_numpy(words.reshape(-1)[:numel] >= threshold)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 24), (5, 7), (1, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_bias_dropout_add_train_matches_documented_mask(dtype, shape, with_bias, device):
    """The mask is the documented Philox stream (so CPU and CUDA agree for a (seed, offset))."""
    p = 0.3
    x, res = torch.randn(shape).to(dtype).to(device), torch.randn(shape).to(dtype).to(device)
    b = torch.randn(shape[-1]).to(dtype).to(device) if with_bias else None
    out, rng = torch.ops.megatron_fused.bias_dropout_add_fwd(x, b, res, p, True)
    seed, offset = (int(v) % 2 ** 64 for v in rng.tolist())
    keep = expected_keep(x.numel(), seed, offset, p).view(shape)
    v = x.cpu().double() + (b.cpu().double() if with_bias else 0.0)
    close(out, res.cpu().double() + torch.where(keep, v / (1 - p), torch.zeros_like(v)), dtype)

    # Through autograd: same mask regenerated in backward.
    torch.manual_seed(7)
    xk, rk, bk = on(device, x, res, b)
    out = ops.bias_dropout_add_train(xk, bk, rk, p)
    torch.manual_seed(7)
    _, rng = torch.ops.megatron_fused.bias_dropout_add_fwd(x, b, res, p, True)
    keep = expected_keep(x.numel(), *(int(v) % 2 ** 64 for v in rng.tolist()), p).view(shape)
    g = torch.randn(shape).to(dtype)
    out.backward(g.to(device))
    grad_x = torch.where(keep, g.double() / (1 - p), torch.zeros(shape, dtype=torch.float64))
    close(xk.grad, grad_x, dtype, factor=4)
    assert torch.equal(rk.grad.cpu(), g)
    if with_bias:
        close(bk.grad, grad_x.reshape(-1, shape[-1]).sum(0), dtype, factor=4)


def test_bias_dropout_add_statistics_and_seeding():
    x, res = torch.ones(200, 500), torch.zeros(200, 500)
    torch.manual_seed(3)
    a = ops.bias_dropout_add_train(x, None, res, 0.25)
    torch.manual_seed(3)
    b = ops.bias_dropout_add_train(x, None, res, 0.25)
    c = ops.bias_dropout_add_train(x, None, res, 0.25)  # generator advanced: new mask
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = (a != 0).double().mean().item()
    sigma = (0.25 * 0.75 / a.numel()) ** 0.5
    assert abs(kept - 0.75) < 5 * sigma
    assert torch.allclose(a[a != 0], torch.tensor(1 / 0.75))
    # p = 0 and inference are the identity on x + bias; p = 1 drops everything.
    assert torch.equal(ops.bias_dropout_add_train(x, None, res, 0.0), x)
    assert torch.equal(ops.bias_dropout_add_train(x, None, res, 1.0), res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_inference_matches_float64(dtype):
    x, res, b = (torch.randn(3, 5, 40).to(dtype), torch.randn(3, 5, 40).to(dtype),
                 torch.randn(40).to(dtype))
    xk, rk, bk = (t.clone().requires_grad_(True) for t in (x, res, b))
    out = ops.bias_dropout_add_inference(xk, bk, rk, 0.5)
    x64, r64, b64 = leaf(x), leaf(res), leaf(b)
    out64 = bias_dropout_add(x64, b64, r64, 0.5, training=False)
    close(out, out64, dtype)
    g = torch.randn(3, 5, 40).to(dtype)
    out.backward(g)
    out64.backward(g.double())
    for got, want in ((xk.grad, x64.grad), (rk.grad, r64.grad), (bk.grad, b64.grad)):
        close(got, want, dtype, factor=4)


# ---- cross entropy --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 7, 33), (5, 2), (2, 1000)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_matches_float64(dtype, shape, smoothing, device):
    logits = (torch.randn(shape) * 4).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1])
    (lk,) = on(device, logits)
    loss = ops.vocab_parallel_cross_entropy(lk, target.to(device), None, smoothing)
    l64 = leaf(logits)
    loss64 = vocab_parallel_cross_entropy(l64, target, None, smoothing)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    close(loss, loss64, dtype)
    g = torch.rand(target.shape)
    loss.backward(g.to(device))
    loss64.backward(g.double())
    assert lk.grad.dtype == dtype
    close(lk.grad, l64.grad, dtype, factor=4)


def test_cross_entropy_inplace_backward_and_saved_memory():
    logits = torch.randn(6, 50, requires_grad=True)
    target = torch.randint(0, 50, (6,))
    expected = logits.detach().clone().requires_grad_(True)
    vocab_parallel_cross_entropy(expected, target, None, 0.0).sum().backward()
    work = logits.detach().clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ops.vocab_parallel_cross_entropy(work, target, inplace_backward=True)
    # Forward keeps the logits themselves plus O(tokens) numbers, no [tokens, vocab] buffer.
    for t in saved:
        assert t.untyped_storage().data_ptr() == work.untyped_storage().data_ptr() \
            or t.numel() <= 6, f"forward saved a {tuple(t.shape)} tensor"
    storage = work.untyped_storage().data_ptr()
    loss.sum().backward()
    assert work.grad.untyped_storage().data_ptr() == storage  # written into the logits
    torch.testing.assert_close(work.grad, expected.grad, rtol=1e-5, atol=1e-7)


def _vocab_parallel_loss(rank_logits, target, smoothing):
    import torch.distributed as dist

    rank = dist.get_rank()
    local = rank_logits[rank].clone().requires_grad_(True)
    loss = ops.vocab_parallel_cross_entropy(local, target, dist.group.WORLD, smoothing)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), local.grad


def test_cross_entropy_vocab_parallel_two_ranks():
    logits = torch.randn(5, 3, 40)
    target = torch.randint(0, 40, (5, 3))
    full = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(full, target, None, 0.1)
    loss.backward(torch.ones_like(loss))
    results = run_on_ranks(_vocab_parallel_loss, 2, list(logits.chunk(2, dim=-1)), target, 0.1)
    for rank, (rank_loss, rank_grad) in enumerate(results):
        torch.testing.assert_close(rank_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank_grad, full.grad.chunk(2, dim=-1)[rank], rtol=1e-5,
                                   atol=1e-7)


# ---- AdamW ----------------------------------------------------------------------------------

SHAPES = [(33, 7), (5,), (70001,), ()]


def _run_optimizers(steps, make_fused, make_torch, device="cpu"):
    """FusedAdamW on ``device`` and torch's AdamW on the CPU, fed the same gradients."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    fused_params = [p.clone().to(device).requires_grad_(True) for p in init]
    torch_params = [p.clone().requires_grad_(True) for p in init]
    fused, ref = make_fused(fused_params), make_torch(torch_params)
    for _ in range(steps):
        for a, b in zip(fused_params, torch_params):
            g = torch.randn(a.shape)
            a.grad, b.grad = g.to(device), g.clone()
        fused.step()
        ref.step()
    return fused, ref, fused_params, torch_params


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_matches_torch_adamw_over_many_steps(amsgrad, maximize, device):
    """Moments match torch to float32 rounding; params differ only because torch's CPU sqrt
    (MKL) is not correctly rounded and ours is: <= 1 ulp per step in the denominator, which
    after 60 steps leaves params within 1e-6 absolute (lr 1e-3) and 1e-5 relative."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad,
              maximize=maximize)
    fused, ref, fp, tp = _run_optimizers(
        60, lambda p: FusedAdamW(p, **kw), lambda p: torch.optim.AdamW(p, foreach=False, **kw),
        device)
    for a, b in zip(fp, tp):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)
        sa, sb = fused.state[a], ref.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 60
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            torch.testing.assert_close(sa[key].cpu(), sb[key], rtol=1e-6, atol=0)


def test_fused_adamw_matches_float64_formula():
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.05
    p = torch.randn(1001)
    fused_p = p.clone().requires_grad_(True)
    opt = FusedAdamW([fused_p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    p64, m, v = p.double(), torch.zeros(1001, dtype=torch.float64), torch.zeros(1001,
                                                                             dtype=torch.float64)
    for step in range(1, 11):
        g = torch.randn(1001)
        fused_p.grad = g.clone()
        opt.step()
        p64 = p64 * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g.double()
        v = b2 * v + (1 - b2) * g.double() ** 2
        denom = (v / (1 - b2 ** step)).sqrt() + eps
        p64 = p64 - lr / (1 - b1 ** step) * m / denom
    torch.testing.assert_close(fused_p.double(), p64, rtol=1e-5, atol=1e-6)


def test_multi_tensor_adamw_bf16_grads_match_torch():
    torch.manual_seed(2)
    main = [torch.randn(300, 7), torch.randn(11)]
    ref_params = [t.clone().requires_grad_(True) for t in main]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    moments = [[torch.zeros_like(t) for t in main] for _ in range(2)]
    for step in range(1, 6):
        grads = [torch.randn(t.shape).to(torch.bfloat16) for t in main]
        ops.multi_tensor_adamw(main, grads, *moments, lr=1e-2, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=1e-2, step=step)
        for p, g in zip(ref_params, grads):
            p.grad = g.float()  # the exact values of the bf16 grads
        ref.step()
    for a, b in zip(main, ref_params):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_fused_adamw_model_param_copy_and_state_dict():
    main = [torch.randn(300, 7), torch.randn(11)]
    model = [torch.zeros(300, 7, dtype=torch.bfloat16), torch.zeros(11, dtype=torch.float16)]
    opt = FusedAdamW([{"params": main, "model_params": model}], lr=1e-2)
    for _ in range(3):
        for t in main:
            t.grad = torch.randn(t.shape)
        opt.step()
        for a, copy in zip(main, model):
            assert torch.equal(copy, a.to(copy.dtype))  # round-to-nearest of the main param
    state = opt.state_dict()
    assert "model_params" not in state["param_groups"][0]
    torch_opt = torch.optim.AdamW([t.clone() for t in main], lr=1e-2)
    torch_opt.load_state_dict(state)  # the layouts agree
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["model_params"] is model


# ---- determinism ----------------------------------------------------------------------------


def _all_ops_once(device="cpu"):
    torch.manual_seed(11)
    x, w, b, logits = on(device, torch.randn(3, 4, 37, 37), torch.randn(37), torch.randn(37),
                         torch.randn(64, 301))
    target = torch.randint(0, 301, (64,)).to(device)
    mask = (torch.rand(3, 1, 37, 37) < 0.2).to(device)
    outs = [ops.scaled_masked_softmax(x, mask, 0.3),
            ops.scaled_upper_triang_masked_softmax(x.view(12, 37, 37), 0.3),
            ops.layer_norm(x, w, b, 1e-5), ops.rms_norm(x, w, 1e-5), ops.bias_gelu(x, b),
            ops.bias_dropout_add_train(x, b, x.detach(), 0.1),
            ops.vocab_parallel_cross_entropy(logits, target)]
    sum(o.float().sum() * (i + 1) for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs] + [x.grad, w.grad, b.grad, logits.grad]


@pytest.mark.gpu
def test_cuda_outputs_and_grads_bitwise_deterministic():
    first, again = _all_ops_once("cuda"), _all_ops_once("cuda")
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_outputs_and_grads_bitwise_deterministic_across_runs_and_threads():
    threads = torch.get_num_threads()
    try:
        first = _all_ops_once()
        again = _all_ops_once()
        torch.set_num_threads(1)
        single = _all_ops_once()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, again, single):
        assert torch.equal(a, b) and torch.equal(a, c)


def _clone_outputs():
    """Every CPU body's outputs and gradients in float32 and bfloat16, plus fused AdamW steps,
    on rows long enough to fill the 16 lanes many times and with ragged tails."""
    results = _all_ops_once()
    torch.manual_seed(5)
    x = torch.randn(6, 3, 203, 203).bfloat16().requires_grad_(True)
    w, b = torch.randn(203).bfloat16(), torch.randn(203).bfloat16()
    logits = torch.randn(40, 1001).bfloat16().requires_grad_(True)
    target = torch.randint(0, 1001, (40,))
    outs = [ops.scaled_upper_triang_masked_softmax(x.view(18, 203, 203), 0.7),
            ops.layer_norm(x, w, b, 1e-5), ops.rms_norm(x, w, 1e-5), ops.bias_gelu(x, b),
            ops.vocab_parallel_cross_entropy(logits, target, None, 0.1)]
    sum(o.float().sum() * (i + 1) for i, o in enumerate(outs)).backward()
    results += [o.detach() for o in outs] + [x.grad, logits.grad]
    params = [torch.randn(1037, requires_grad=True), torch.randn(17, 33, requires_grad=True)]
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return results + [p.detach() for p in params]


def _outputs_under_cpu_isa(level, tmp_path):
    """(the clone the library reports, the outputs) of a fresh process capped at ``level``."""
    out = tmp_path / f"{level or 'native'}.pt"
    script = textwrap.dedent(f"""
        import torch
        from megatron.fused_kernels import loader
        from tests.unit.test_fused_kernels import _clone_outputs
        torch.save({{"isa": loader.cpu_isa(), "outs": _clone_outputs()}}, {str(out)!r})
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("MEGATRON_FUSED_CPU_ISA", None)
    if level is not None:
        env["MEGATRON_FUSED_CPU_ISA"] = level
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=root)
    saved = torch.load(out)
    return saved["isa"], saved["outs"]


def test_every_simd_clone_the_cpu_runs_gives_bitwise_equal_results(tmp_path):
    """The x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and baseline clones of every CPU body agree
    bit for bit. This process runs the widest clone allowed here; each narrower one runs in its
    own process (the choice is made once per process) and must report the clone asked for, so a
    silent fallback cannot pass."""
    native = loader.cpu_isa()
    assert native in loader.CPU_ISA_LEVELS
    reference = _clone_outputs()
    for level in loader.CPU_ISA_LEVELS[:loader.CPU_ISA_LEVELS.index(native)]:
        isa, outs = _outputs_under_cpu_isa(level, tmp_path)
        assert isa == level
        assert len(outs) == len(reference)
        for i, (a, b) in enumerate(zip(outs, reference)):
            assert torch.equal(a, b), f"{level}: output {i} differs from the {native} clone"


def test_unknown_cpu_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MEGATRON_FUSED_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="MEGATRON_FUSED_CPU_ISA='avx512'"):
        loader.requested_cpu_isa()


# ---- fallback, install, loader --------------------------------------------------------------


def test_fallback_without_extension_gives_reference_results(monkeypatch):
    monkeypatch.setattr(loader, "load", lambda: None)
    assert not ops.kernels_available("cpu")
    x, w, b = torch.randn(2, 3, 5, 8), torch.randn(8), torch.randn(8)
    mask = torch.rand(2, 1, 5, 8) < 0.3
    assert torch.equal(ops.scaled_masked_softmax(x, mask, 0.5),
                       scaled_masked_softmax_reference(x, mask, 0.5))
    assert torch.equal(ops.scaled_upper_triang_masked_softmax(x[0], 0.5),
                       scaled_upper_triang_masked_softmax_reference(x[0], 0.5))
    assert torch.equal(ops.layer_norm(x, w, b, 1e-5), layer_norm_reference(x, w, b, 1e-5))
    assert torch.equal(ops.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    assert torch.equal(ops.bias_gelu(x, b), bias_gelu_reference(x, b))
    torch.manual_seed(5)
    got = ops.bias_dropout_add_train(x, b, x, 0.2)
    torch.manual_seed(5)
    assert torch.equal(got, bias_dropout_add(x, b, x, 0.2, True))
    target = torch.randint(0, 8, (2, 3, 5))
    assert torch.equal(ops.vocab_parallel_cross_entropy(x, target, None, 0.1),
                       vocab_parallel_cross_entropy(x, target, None, 0.1))
    # The optimizer falls back to torch's own AdamW: bit-identical.
    _, _, fp, tp = _run_optimizers(3, lambda p: FusedAdamW(p, lr=1e-2),
                                   lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False))
    for a, b_ in zip(fp, tp):
        assert torch.equal(a, b_)


def test_fake_impls_give_real_shapes_and_dtypes():
    """torch.compile traces the ops with fake tensors: their fakes must match real results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def outputs():
        torch.manual_seed(0)
        x = torch.randn(4, 2, 6, 6, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(6, requires_grad=True)
        logits = torch.randn(5, 11, requires_grad=True)
        outs = [ops.scaled_masked_softmax(x, None, 1.0),
                ops.scaled_upper_triang_masked_softmax(x.view(8, 6, 6), 1.0),
                ops.layer_norm(x.float(), w.bfloat16(), None, 1e-5),
                ops.rms_norm(x, w, 1e-5), ops.bias_gelu(x, x[0, 0, 0].detach()),
                ops.bias_dropout_add_train(x, None, x, 0.1),
                ops.vocab_parallel_cross_entropy(logits, torch.randint(0, 11, (5,)))]
        sum(o.float().sum() for o in outs).backward()
        return [(tuple(t.shape), t.dtype) for t in outs + [x.grad, w.grad, logits.grad]]

    real = outputs()
    with FakeTensorMode():
        assert outputs() == real


def test_install_routes_model_ops_to_kernels():
    from megatron import fused_kernels
    from megatron.fused_kernels.layer_norm import FusedLayerNorm, layer_norm_reference as ref

    try:
        assert ops.install()
        assert fused_kernels.get_kernel("layer_norm", ref) is ops.layer_norm
        norm = FusedLayerNorm(16)
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        norm.weight.data = norm.weight.data.to(torch.bfloat16)
        norm.bias.data = norm.bias.data.to(torch.bfloat16)
        assert torch.equal(norm(x), ops.layer_norm(x, norm.weight, norm.bias, 1e-5))
    finally:
        ops.uninstall()
    assert fused_kernels.get_kernel("layer_norm", ref) is ref


def test_loader_warns_once_with_reason_and_falls_back(monkeypatch):
    monkeypatch.setattr(loader, "_STATE", {"tried": False, "ops": None, "error": None,
                                           "warned": False})
    monkeypatch.setattr(loader, "_try_load", lambda: "JIT build failed: no compiler")
    with pytest.warns(UserWarning, match="no compiler"):
        assert loader.load() is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.load() is None
    assert loader.load_error() == "JIT build failed: no compiler"


def test_loader_disabled_by_environment_is_silent(monkeypatch):
    import warnings

    monkeypatch.setattr(loader, "_STATE", {"tried": False, "ops": None, "error": None,
                                           "warned": False})
    monkeypatch.setenv("MEGATRON_FUSED_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.load() is None
    assert "MEGATRON_FUSED_KERNELS=0" in loader.load_error()
    assert not ops.kernels_available("cpu")


def test_build_lock_released_when_holder_dies(tmp_path):
    import fcntl

    lock = str(tmp_path / "build.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from megatron.fused_kernels.loader import build_lock
            with build_lock({lock!r}):
                print("locked", flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        fd = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.kill()  # a crashed build: no cleanup code runs
        holder.wait()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel
        os.close(fd)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdin.close()
        holder.stdout.close()


@pytest.mark.slow
def test_jit_build_into_versioned_cache_despite_stale_lock(tmp_path):
    """A fresh JIT build (no prebuilt module) in a subprocess, with a stale torch lock file
    left in the build folder by a 'crashed' earlier build."""
    env = dict(os.environ, MEGATRON_FUSED_CACHE=str(tmp_path), MEGATRON_FUSED_PREBUILT="0")
    code = textwrap.dedent("""
        import os, torch
        from megatron.fused_kernels import loader
        build = loader.cache_dir(loader.cuda_build_available())
        os.makedirs(build, exist_ok=True)
        open(os.path.join(build, "lock"), "w").close()
        assert loader.load() is not None, loader.load_error()
        x = torch.randn(4, 9)
        y = torch.ops.megatron_fused.bias_gelu_fwd(x, None)
        print(os.path.basename(build), float(y.sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = out.stdout.split()[0]
    assert folder.startswith(torch.__version__ + "-")
    assert (tmp_path / folder).is_dir()

"""The pure-torch references of the fusable ops against float64 formulas written out here.

Tolerances: a float32 op compared with the float64 formula differs by rounding only
(~1e-7 relative), so 1e-6 catches any wrong formula or constant; float64 vs float64 differs by
~1e-15, checked at 1e-12. Half-precision inputs are checked against the formula evaluated on the
same (rounded) inputs, at the output dtype's resolution.
"""

import math

import pytest
import torch

from megatron import fused_kernels
from megatron.fused_kernels.bias_dropout_add import (
    bias_dropout_add,
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    get_bias_dropout_add_func,
)
from megatron.fused_kernels.bias_gelu import (
    GeLUFunction,
    bias_gelu_impl,
    bias_gelu_unfused,
)
from megatron.fused_kernels.layer_norm import (
    FusedLayerNorm,
    MixedFusedRMSNorm,
    layer_norm_reference,
    rms_norm_reference,
)
from megatron.fused_kernels.softmax import (
    FusedScaleMaskSoftmax,
    attention_mask_func,
    scaled_masked_softmax_reference,
    scaled_upper_triang_masked_softmax_reference,
)
from megatron.fused_kernels.swiglu import SwiGLUFunction, bias_swiglu_impl, bias_swiglu_unfused
from megatron.model.enums import AttnMaskType

# ---- softmax ---------------------------------------------------------------------------------


def naive_masked_softmax(x, mask, scale):
    """Row by row in float64: exp(z - max z) / sum, with z = -10000 where masked."""
    x = x.double()
    out = torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])
    m = mask.expand_as(x).reshape(-1, x.shape[-1]) if mask is not None else None
    flat = out.view(-1, x.shape[-1])
    for i in range(rows.shape[0]):
        z = [(-10000.0 if (m is not None and m[i, j]) else float(rows[i, j]) * scale)
             for j in range(rows.shape[1])]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        flat[i] = torch.tensor([v / total for v in e], dtype=torch.float64)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                       (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_scaled_masked_softmax_matches_formula(dtype, tol):
    x = (torch.randn(2, 3, 5, 7) * 3).to(dtype)
    mask = torch.rand(2, 1, 5, 7) < 0.3
    mask[0, 0, 2, :] = True                      # a fully masked row: uniform, not NaN
    got = scaled_masked_softmax_reference(x, mask, 0.7)
    assert got.dtype == dtype
    want = naive_masked_softmax(x, mask, 0.7)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(got[0, :, 2].double(), torch.full((3, 7), 1 / 7,
                                                                 dtype=torch.float64),
                               rtol=0, atol=tol)


@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 8)])
def test_upper_triang_softmax_is_causal(sq, sk):
    x = torch.randn(4, sq, sk, dtype=torch.float64)
    mask = torch.tensor([[j > i + (sk - sq) for j in range(sk)] for i in range(sq)])
    got = scaled_upper_triang_masked_softmax_reference(x, 1.3)
    torch.testing.assert_close(got, naive_masked_softmax(x, mask, 1.3), rtol=0, atol=1e-12)
    assert torch.all(got[:, 0, sk - sq + 1:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind", ["causal_none", "explicit"])
def test_fused_and_torch_softmax_paths_agree(dtype, mask_kind):
    x = torch.randn(2, 3, 6, 6, dtype=dtype)
    mask = None if mask_kind == "causal_none" else torch.rand(2, 1, 6, 6) < 0.4

    def run(fusion):
        module = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, fusion,
                                       attention_mask_func, True, 0.5)
        return module(x, mask)

    fused, plain = run(True), run(False)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6 if dtype == torch.float32
                               else 1e-13)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    want = naive_masked_softmax(x, causal if mask is None else mask, 0.5)
    torch.testing.assert_close(fused.double(), want, rtol=0, atol=1e-6)


def test_softmax_in_fp32_for_half_inputs():
    x = torch.randn(1, 2, 4, 4).bfloat16()
    module = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, False, attention_mask_func,
                                   True, None)
    out = module(x, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_masked_softmax(x, None, 1.0), rtol=0,
                               atol=8e-3)
    with pytest.raises(ValueError, match="attention-softmax-in-fp32"):
        FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, True, attention_mask_func,
                              False, 2.0)


def test_registered_kernel_replaces_reference():
    calls = []

    def fake(x, scale):
        calls.append(scale)
        return scaled_upper_triang_masked_softmax_reference(x, scale)

    module = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func,
                                   True, 2.0)
    fused_kernels.register_kernel("scaled_upper_triang_masked_softmax", fake)
    try:
        module(torch.randn(1, 2, 3, 3), None)
    finally:
        fused_kernels.unregister_kernel("scaled_upper_triang_masked_softmax")
    assert calls == [2.0]
    module(torch.randn(1, 2, 3, 3), None)
    assert calls == [2.0]


# ---- layer norm / RMS norm -------------------------------------------------------------------


def naive_layer_norm(x, w, b, eps):
    x = x.double()
    n = x.shape[-1]
    mean = x.sum(-1, keepdim=True) / n
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / n
    y = (x - mean) / torch.sqrt(var + eps) * w.double()
    return y if b is None else y + b.double()


def naive_rms_norm(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x ** 2).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.double()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                       (torch.bfloat16, 3e-2)])
def test_layer_norm_and_rms_norm_match_formula(dtype, tol):
    x = (torch.randn(3, 2, 40) * 2 + 0.5).to(dtype)
    w = (torch.randn(40) + 1).to(dtype)
    b = torch.randn(40).to(dtype)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5).double(),
                               naive_layer_norm(x, w, b, 1e-5), rtol=tol, atol=tol)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6).double(),
                               naive_rms_norm(x, w, 1e-6), rtol=tol, atol=tol)


def test_norm_modules_mixed_dtype_and_sequence_parallel_flag():
    ln = FusedLayerNorm(16, eps=1e-5, sequence_parallel=True, params_dtype=torch.bfloat16)
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    x = torch.randn(4, 16)                        # fp32 residual stream, bf16 weights
    assert ln(x).dtype == torch.bfloat16
    rms = MixedFusedRMSNorm(16, eps=1e-6, params_dtype=torch.float64)
    assert rms.weight.sequence_parallel is False
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(rms(x), naive_rms_norm(x, rms.weight, 1e-6), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: rms(t), (x,))


# ---- bias + GeLU -----------------------------------------------------------------------------


def naive_gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


def test_bias_gelu_forward_matches_formula():
    y = torch.randn(5, 3, 8, dtype=torch.float64) * 3
    b = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(bias_gelu_impl(y, b), naive_gelu_tanh(y + b), rtol=0, atol=1e-13)
    torch.testing.assert_close(bias_gelu_unfused(y, b), naive_gelu_tanh(y + b), rtol=0,
                               atol=1e-13)
    # Megatron's constant 0.79788456 is sqrt(2/pi) to 8 digits: torch's tanh GeLU agrees to 1e-8.
    torch.testing.assert_close(bias_gelu_impl(y, None),
                               torch.nn.functional.gelu(y, approximate="tanh"), rtol=0, atol=1e-8)
    f32 = bias_gelu_impl(y.float(), b.float())
    torch.testing.assert_close(f32.double(), naive_gelu_tanh(y + b), rtol=1e-6, atol=1e-6)


def test_bias_gelu_handwritten_backward():
    y = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(GeLUFunction.apply, (y, b))
    assert torch.autograd.gradcheck(lambda t: GeLUFunction.apply(t, None), (y,))
    g = torch.randn(4, 2, 6, dtype=torch.float64)
    fused = torch.autograd.grad(bias_gelu_impl(y, b), (y, b), g)
    plain = torch.autograd.grad(bias_gelu_unfused(y, b), (y, b), g)
    for a, c in zip(fused, plain):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-12)


# ---- bias + dropout + add --------------------------------------------------------------------


def test_bias_dropout_add_inference_is_exact_sum():
    x, r = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    b = torch.randn(8)
    want = (x.double() + b.double()) + r.double()
    for fn in (bias_dropout_add_fused_inference, get_bias_dropout_add_func(False, False)):
        torch.testing.assert_close(fn(x, b, r, 0.5).double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(bias_dropout_add(x, None, r, 0.5, False), x + r)


def test_bias_dropout_add_train_drops_and_rescales_identically():
    x, r = torch.randn(64, 4, 32, dtype=torch.float64), torch.randn(64, 4, 32,
                                                                    dtype=torch.float64)
    b = torch.randn(32, dtype=torch.float64)
    torch.manual_seed(7)
    fused = bias_dropout_add_fused_train(x, b, r, 0.25)
    torch.manual_seed(7)
    plain = get_bias_dropout_add_func(False, True)(x, b, r, 0.25)
    assert torch.equal(fused, plain)              # same RNG draw, same numbers
    kept = (fused - r).abs() > 1e-12
    torch.testing.assert_close((fused - r)[kept], ((x + b) / 0.75)[kept], rtol=0, atol=1e-12)
    dropped = 1 - kept.double().mean().item()
    assert abs(dropped - 0.25) < 0.02             # 8192 draws: std of the fraction ~0.005


# ---- SwiGLU ----------------------------------------------------------------------------------


def test_bias_swiglu_forward_and_backward():
    y = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    a, v = (y + b)[..., :5], (y + b)[..., 5:]
    want = a / (1 + torch.exp(-a)) * v
    torch.testing.assert_close(bias_swiglu_impl(y, b), want, rtol=0, atol=1e-13)
    torch.testing.assert_close(bias_swiglu_unfused(y, b), want, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (y, b))
    assert torch.autograd.gradcheck(lambda t: SwiGLUFunction.apply(t, None), (y,))

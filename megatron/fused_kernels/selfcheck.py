"""Nothing unverified computes: each compiled op proves itself against its reference first.

The first time :mod:`.ops` would run a compiled body for an op on a device type ("cpu",
"cuda") with a given dtype, :func:`passes` runs that body on small inputs of that dtype, forward
and backward, and compares it with the op's pure-torch reference evaluated in float64 on the
same inputs, with the tolerances of ``tests/unit/test_fused_kernels.py`` (:data:`TOLERANCE`,
gradients ``GRAD_FACTOR`` times looser). The verdict is cached per process and per
(op, device type, dtype):

- agreement: the compiled body is used from then on;
- disagreement, or the body raises: the op runs its reference for the rest of the run on that
  device type and dtype, and one warning names the op, device, dtype and the error (largest
  absolute difference and the tolerance, or the exception).

A check takes about a millisecond on a CPU (``benchmarks/bench_kernel_selfcheck.py``). It
leaves the caller's state alone: RNG states are restored, autocast, inference mode and
saved-tensor hooks of the caller do not apply inside it, and a fake-tensor mode is lifted.
``MEGATRON_KERNEL_SELFCHECK=0`` (read at each op's first use) skips the check: the compiled
bodies are trusted, e.g. for benchmarks.

The checks receive the compiled callable and the reference from :mod:`.ops` with the
reference's signature, so this module needs nothing from it (no import cycle).
"""

import os
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

# Per dtype: relative tolerance, and absolute floor of the same size times the largest expected
# value; the reasoning is in tests/unit/test_fused_kernels.py, which uses these numbers.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
GRAD_FACTOR = 4.0
_WIDTH = 37  # the last dim of the checks: an AVX2 main loop plus a scalar tail

_RESULTS: Dict[Tuple[str, str, torch.dtype], bool] = {}


class Comparison(NamedTuple):
    """One tensor a compiled body produced and the float64 reference value it must match."""

    what: str
    actual: Optional[torch.Tensor]
    expected: torch.Tensor
    factor: float = 1.0
    scale: Optional[float] = None  # absolute floor = tol * scale; None: max |expected|


def enabled() -> bool:
    """False when ``MEGATRON_KERNEL_SELFCHECK=0``."""
    return os.environ.get("MEGATRON_KERNEL_SELFCHECK", "1") != "0"


def results() -> Dict[Tuple[str, str, torch.dtype], bool]:
    """The verdicts so far: (op, device type, dtype) -> compiled body in use."""
    return dict(_RESULTS)


def reset() -> None:
    """Forget every verdict (tests), so the next use of each op checks again."""
    _RESULTS.clear()


def passes(op: str, device_type: str, dtype: torch.dtype, compiled: Callable,
           reference: Callable) -> bool:
    """Whether ``op``'s compiled body may run on ``device_type`` with ``dtype``; checks once.

    Args:
        op: a key of :data:`CHECKS`.
        compiled: the compiled path, with ``reference``'s signature.
        reference: the pure-torch reference.
    """
    key = (op, device_type, dtype)
    verdict = _RESULTS.get(key)
    if verdict is None:
        # Traced by torch.compile: run the check eagerly, outside the graph.
        check = torch.compiler.disable(_check) if torch.compiler.is_compiling() else _check
        verdict = _RESULTS[key] = check(op, device_type, dtype, compiled, reference)
    return verdict


def _check(op, device_type, dtype, compiled, reference) -> bool:
    if not enabled():
        return True
    try:
        error = _run_isolated(CHECKS[op], compiled, reference, device_type, dtype)
    except Exception as exc:  # a body that raises is as wrong as one that miscomputes
        error = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    if error is None:
        return True
    name = str(dtype).replace("torch.", "")
    warnings.warn(f"fused kernel self-check failed: {op} on {device_type} with {name}: {error}. "
                  f"{op} runs its pure-torch reference on {device_type} with {name} for the "
                  f"rest of this run.", stacklevel=3)
    return False


def _run_isolated(case, compiled, reference, device_type, dtype) -> Optional[str]:
    """``case``'s comparisons, outside the caller's autocast, grad mode, saved-tensor hooks,
    fake mode and RNG stream; the first failure as text, or None."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    devices = [torch.cuda.current_device()] if device_type == "cuda" else []
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices), \
            torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast(device_type, enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        generator = torch.Generator().manual_seed(1234)
        comparisons = case(compiled, reference, _Inputs(device_type, dtype, generator))
        for c in comparisons:
            error = _compare(c, dtype)
            if error is not None:
                return error
    return None


def _compare(c: Comparison, dtype: torch.dtype) -> Optional[str]:
    if c.actual is None:
        return f"{c.what}: missing (None)"
    if tuple(c.actual.shape) != tuple(c.expected.shape):
        return f"{c.what}: shape {tuple(c.actual.shape)}, expected {tuple(c.expected.shape)}"
    actual, expected = c.actual.detach().double(), c.expected.detach().double()
    tol = TOLERANCE[dtype] * c.factor
    scale = c.scale
    if scale is None:
        scale = float(expected.abs().max()) if expected.numel() else 1.0
    atol = tol * max(scale, 1e-30)
    diff = (actual - expected).abs()
    bad = ~(diff <= atol + tol * expected.abs())  # NaN counts as bad
    if bool(bad.any()):
        worst = float(diff.nan_to_num(float("inf")).max())
        return (f"{c.what}: max abs difference {worst:.3g} from the reference exceeds "
                f"the tolerance {atol:.3g} absolute + {tol:.3g} relative")
    return None


class _Inputs:
    """Seeded random inputs on the checked device, from a private generator."""

    def __init__(self, device_type: str, dtype: torch.dtype, generator: torch.Generator):
        self.device, self.dtype, self.generator = device_type, dtype, generator

    def randn(self, *shape, scale=1.0, shift=0.0, dtype=None) -> torch.Tensor:
        x = torch.randn(shape, generator=self.generator) * scale + shift
        return x.to(dtype or self.dtype).to(self.device)

    def rand(self, *shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator).to(self.device)


def _forward_backward(compiled, reference, args, inputs: _Inputs,
                      grad: Optional[torch.Tensor] = None) -> List[Comparison]:
    """Both paths on copies of ``args`` (float tensors become leaves, float64 for the
    reference), backward from ``grad`` (default: random); compares the output, then every
    float argument's gradient."""
    def is_float(a):
        return isinstance(a, torch.Tensor) and a.is_floating_point()

    ours = [a.detach().clone().requires_grad_(True) if is_float(a) else a for a in args]
    theirs = [a.detach().double().requires_grad_(True) if is_float(a) else a for a in args]
    out, out64 = compiled(*ours), reference(*theirs)
    if grad is None:
        grad = inputs.randn(*out.shape, dtype=out.dtype)
    # Scalar backward: the same gradient reaches the bodies, without the ~0.4 s one-off import
    # (sympy) torch's shape check of an explicit non-scalar gradient costs.
    (out * grad).sum().backward()
    (out64 * grad.double()).sum().backward()
    checks = [Comparison("output", out, out64)]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if is_float(a):
            checks.append(Comparison(f"gradient of argument {i}", a.grad, b.grad, GRAD_FACTOR))
    return checks


# ---- one case per op ------------------------------------------------------------------------


def _scaled_masked_softmax(compiled, reference, inputs):
    mask = inputs.rand(2, 1, 3, _WIDTH) < 0.3
    mask[0, 0, 0] = True  # a fully masked row
    return _forward_backward(compiled, reference,
                             [inputs.randn(2, 2, 3, _WIDTH, scale=3.0), mask, 0.7], inputs)


def _scaled_upper_triang_masked_softmax(compiled, reference, inputs):
    return _forward_backward(compiled, reference, [inputs.randn(2, 5, _WIDTH, scale=3.0), 0.5],
                             inputs)


def _norm_checks(compiled, reference, inputs, rms):
    x = inputs.randn(4, _WIDTH, scale=2.0, shift=0.5)
    w = inputs.randn(_WIDTH, scale=0.5, shift=1.0)
    args = [x, w, 1e-5] if rms else [x, w, inputs.randn(_WIDTH, scale=0.1), 1e-5]
    grad = inputs.randn(4, _WIDTH)
    checks = _forward_backward(compiled, reference, args, inputs, grad)
    # dx cancels: its error is relative to rstd |dy w| (as in the kernel tests), not to dx.
    x64 = x.double()
    centred = x64 if rms else x64 - x64.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
    checks[1] = checks[1]._replace(scale=float((rstd * (grad.double() * w.double()).abs()).max()))
    return checks


def _layer_norm(compiled, reference, inputs):
    return _norm_checks(compiled, reference, inputs, rms=False)


def _rms_norm(compiled, reference, inputs):
    return _norm_checks(compiled, reference, inputs, rms=True)


def _bias_gelu(compiled, reference, inputs):
    return _forward_backward(compiled, reference,
                             [inputs.randn(4, _WIDTH, scale=3.0), inputs.randn(_WIDTH)], inputs)


def _bias_dropout_add(compiled, reference, inputs):
    """Inference against the reference; training (p = 0.5) against the mask its own backward
    reveals, so forward and backward must draw the same mask, keeping about half."""
    x, bias, residual = inputs.randn(4, _WIDTH), inputs.randn(_WIDTH), inputs.randn(4, _WIDTH)
    checks = _forward_backward(lambda *a: compiled(*a, False), reference,
                               [x, bias, residual, 0.5], inputs)
    leaves = [t.clone().requires_grad_(True) for t in (x, bias, residual)]
    out = compiled(leaves[0], leaves[1], leaves[2], 0.5, True)
    grad = inputs.rand(4, _WIDTH).to(out.dtype) + 1  # no zeros: a zero gradient means dropped
    (out * grad).sum().backward()
    keep = leaves[0].grad != 0
    kept = float(keep.double().mean())
    if not 0.3 <= kept <= 0.7:
        raise RuntimeError(f"training dropout kept {kept:.2f} of the elements at p = 0.5")
    value = (x.double() + bias.double()) * 2.0
    g64 = grad.double()
    return checks + [
        Comparison("training output", out, residual.double() + torch.where(keep, value, 0.0)),
        Comparison("training gradient of x", leaves[0].grad, torch.where(keep, g64 * 2, 0.0),
                   GRAD_FACTOR),
        Comparison("training gradient of bias", leaves[1].grad,
                   torch.where(keep, g64 * 2, 0.0).sum(0), GRAD_FACTOR),
        Comparison("training gradient of residual", leaves[2].grad, g64, GRAD_FACTOR)]


def _cross_entropy(compiled, reference, inputs):
    logits = inputs.randn(6, _WIDTH, scale=4.0)
    target = (inputs.rand(6) * _WIDTH).long().clamp_(max=_WIDTH - 1)
    return _forward_backward(compiled, reference, [logits, target, None, 0.1], inputs)


def _adamw(compiled, reference, inputs):
    """One step (the third) on float32 params near 0.01 so the update is not lost in their
    rounding; grads and the model-param copy in the checked dtype."""
    shapes = [(3, _WIDTH), (_WIDTH,)]
    results = []
    for fn in (compiled, reference):
        g = torch.Generator().manual_seed(99)  # both paths see the same state

        def f32(shape, scale, g=g):
            return (torch.randn(shape, generator=g) * scale).abs().to(inputs.device)
        params = [f32(s, 0.01) for s in shapes]
        grads = [f32(s, 1.0).to(inputs.dtype) for s in shapes]
        exp_avgs, exp_avg_sqs = [f32(s, 0.1) for s in shapes], [f32(s, 0.01) for s in shapes]
        model = ([torch.zeros(s, dtype=inputs.dtype, device=inputs.device) for s in shapes]
                 if inputs.dtype != torch.float32 else [])
        fn(params, grads, exp_avgs, exp_avg_sqs, [], model, lr=1e-2, beta1=0.9, beta2=0.95,
           eps=1e-8, weight_decay=0.1, step=3.0, amsgrad=False, maximize=False)
        results.append((params, exp_avgs, exp_avg_sqs, model))
    checks = []
    f32_factor = TOLERANCE[torch.float32] / TOLERANCE[inputs.dtype]  # float32 state: its tol
    for what, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq", "model param"), *results):
        factor = 1.0 if what == "model param" else f32_factor
        for i, (a, b) in enumerate(zip(ours, theirs)):
            checks.append(Comparison(f"{what} {i}", a, b, factor))
    return checks


CHECKS: Dict[str, Callable[..., List[Comparison]]] = {
    "scaled_masked_softmax": _scaled_masked_softmax,
    "scaled_upper_triang_masked_softmax": _scaled_upper_triang_masked_softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "bias_gelu": _bias_gelu,
    "bias_dropout_add": _bias_dropout_add,
    "vocab_parallel_cross_entropy": _cross_entropy,
    "multi_tensor_adamw": _adamw,
}

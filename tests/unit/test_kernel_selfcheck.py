"""The fused-kernel self-check: a compiled body that disagrees with its reference never computes.

A body is broken on purpose through ``ops.COMPILED_CALL_HOOKS`` (which also counts the calls
of a healthy one, so a test cannot pass by silently running the reference).
"""

import os
import warnings

import pytest
import torch

from megatron.fused_kernels import loader, ops, selfcheck
from megatron.fused_kernels.bias_gelu import bias_gelu_reference
from megatron.fused_kernels.layer_norm import layer_norm_reference


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Compiled kernels loaded, no verdicts, no hooks, self-check on; all restored after."""
    if os.environ.get("MEGATRON_FUSED_KERNELS") == "0":
        pytest.skip("compiled kernels disabled by MEGATRON_FUSED_KERNELS=0")
    assert loader.load() is not None, f"fused kernels did not load: {loader.load_error()}"
    monkeypatch.delenv("MEGATRON_KERNEL_SELFCHECK", raising=False)
    selfcheck.reset()
    yield
    ops.COMPILED_CALL_HOOKS.clear()
    selfcheck.reset()  # later users check again (milliseconds)


def counting(counts, name, perturb=None):
    """A hook for kernel ``name``: counts its calls, optionally changes its result."""
    def hook(result):
        counts[name] = counts.get(name, 0) + 1
        return result if perturb is None else perturb(result)
    return hook


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broken_body_falls_back_with_one_warning(dtype):
    ops.COMPILED_CALL_HOOKS["bias_gelu_fwd"] = lambda out: out * 1.05
    x, b = _inputs(dtype)
    with pytest.warns(UserWarning) as record:
        y = ops.bias_gelu(x, b)
    messages = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert len(messages) == 1
    name = str(dtype).replace("torch.", "")
    for word in ("bias_gelu", " cpu ", name, "max abs difference", "tolerance"):
        assert word in messages[0], (word, messages[0])
    assert torch.equal(y, bias_gelu_reference(x, b))
    assert selfcheck.results()[("bias_gelu", "cpu", dtype)] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert torch.equal(ops.bias_gelu(x, b), bias_gelu_reference(x, b))


def test_broken_backward_alone_falls_back():
    ops.COMPILED_CALL_HOOKS["bias_gelu_bwd"] = lambda grads: (grads[0] * 1.1, grads[1])
    x, b = _inputs()
    with pytest.warns(UserWarning, match="bias_gelu on cpu with float32: gradient"):
        y = ops.bias_gelu(x, b)
    assert torch.equal(y, bias_gelu_reference(x, b))


def test_raising_body_falls_back_and_names_the_exception():
    def boom(result):
        raise RuntimeError("illegal memory access (simulated)")

    ops.COMPILED_CALL_HOOKS["layer_norm_fwd"] = boom
    x, w = _inputs()
    with pytest.warns(UserWarning, match=r"layer_norm on cpu with float32: raised RuntimeError: "
                                         r"illegal memory access"):
        y = ops.layer_norm(x, w, w, 1e-5)
    assert torch.equal(y, layer_norm_reference(x, w, w, 1e-5))
    # Only that op: rms_norm shares the kernel name but is its own op, checked on its own.
    ops.COMPILED_CALL_HOOKS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.rms_norm(x, w, 1e-5)
    assert selfcheck.results()[("rms_norm", "cpu", torch.float32)] is True


def _every_op_once(dtype, device="cpu"):
    """One call of every public op on ``device`` tensors of ``dtype``, with its forward kernel
    name."""
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    def one(n):
        return torch.ones(n, device=device)

    def zero(n):
        return torch.zeros(n, device=device)

    x4, x3, x2, w = randn(2, 2, 3, 16), randn(2, 4, 16), randn(3, 16), randn(16)
    return [
        ("scaled_masked_softmax_fwd", lambda: ops.scaled_masked_softmax(x4, None, 0.5)),
        ("scaled_upper_triang_masked_softmax_fwd",
         lambda: ops.scaled_upper_triang_masked_softmax(x3, 0.5)),
        ("layer_norm_fwd", lambda: ops.layer_norm(x2, w, w, 1e-5)),
        ("layer_norm_fwd", lambda: ops.rms_norm(x2, w, 1e-5)),
        ("bias_gelu_fwd", lambda: ops.bias_gelu(x2, w)),
        ("bias_dropout_add_fwd", lambda: ops.bias_dropout_add_train(x2, w, x2, 0.1)),
        ("bias_dropout_add_fwd", lambda: ops.bias_dropout_add_inference(x2, w, x2, 0.1)),
        ("cross_entropy_fwd",
         lambda: ops.vocab_parallel_cross_entropy(x2, torch.tensor([1, 2, 3], device=device))),
        ("fused_adamw_", lambda: ops.multi_tensor_adamw(
            [one(5)], [one(5).to(dtype)], [zero(5)], [zero(5)],
            lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)),
    ]


# On a GPU (marker `gpu`) this is the proof that the CUDA bodies themselves ran and agreed.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_healthy_bodies_pass_once_and_then_run_compiled(dtype, device):
    """(b) every op's check passes and the compiled body then runs; (c) the second call of an
    op on the same device and dtype does not check again: exactly one more kernel call."""
    if device == "cuda" and not ops.kernels_available("cuda"):
        pytest.fail("CUDA bodies are not built (setup.py build_ext on a machine with nvcc)")
    counts = {}
    for name in {name for name, _ in _every_op_once(dtype, device)}:
        ops.COMPILED_CALL_HOOKS[name] = counting(counts, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may fail its check
        for name, call in _every_op_once(dtype, device):
            call()                          # first use: the check, then the compiled call
            before = counts.get(name, 0)
            assert before >= 2, f"{name}: check and compiled call expected, saw {before} calls"
            call()
            assert counts[name] == before + 1, f"{name} checked again or fell back"
    assert set(selfcheck.results()) == {(op, device, dtype) for op in selfcheck.CHECKS}
    assert all(selfcheck.results().values())


def test_each_dtype_is_checked_on_its_own():
    ops.COMPILED_CALL_HOOKS["bias_gelu_fwd"] = lambda out: out * 1.05 \
        if out.dtype == torch.float16 else out
    x, b = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.bias_gelu(x, b)
    with pytest.warns(UserWarning, match="float16"):
        ops.bias_gelu(x.half(), b.half())
    assert selfcheck.results() == {("bias_gelu", "cpu", torch.float32): True,
                                   ("bias_gelu", "cpu", torch.float16): False}


def test_disabled_by_environment_trusts_the_body(monkeypatch):
    """(d) MEGATRON_KERNEL_SELFCHECK=0: no check, so even a broken body runs, unwarned."""
    monkeypatch.setenv("MEGATRON_KERNEL_SELFCHECK", "0")
    counts = {}
    ops.COMPILED_CALL_HOOKS["bias_gelu_fwd"] = counting(counts, "bias_gelu_fwd",
                                                        lambda out: out * 1.05)
    x, b = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ops.bias_gelu(x, b)
    assert counts == {"bias_gelu_fwd": 1}  # the call itself, no check before it
    torch.testing.assert_close(y, bias_gelu_reference(x, b) * 1.05)


def test_check_leaves_rng_grad_mode_and_saved_tensor_hooks_alone():
    """The check runs inside the caller's forward: it must not move the RNG (dropout masks
    would change), nor need grad mode, nor feed its tensors to the caller's hooks."""
    x, b = _inputs()
    packed = []
    torch.manual_seed(11)
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: packed.append(t) or t, lambda t: t):
        checked = ops.bias_dropout_add_train(x, b, x, 0.5)  # the check, then one mask
    after_checked = torch.rand(3)
    assert selfcheck.results()[("bias_dropout_add", "cpu", torch.float32)] is True
    assert packed == []
    torch.manual_seed(11)
    plain = ops.bias_dropout_add_train(x, b, x, 0.5)  # verified already: no check
    assert torch.equal(checked, plain) and torch.equal(torch.rand(3), after_checked)


def test_first_use_under_fake_tensors_or_inference_mode_checks_on_real_tensors():
    """torch.compile traces with fake tensors, generation runs in inference mode: a first use
    there still runs a real check (and passes) instead of failing on fake or grad-less values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            x, b = torch.randn(3, 16, requires_grad=True), torch.randn(16)
            ops.bias_gelu(x, b).sum().backward()
        with torch.inference_mode():
            ops.layer_norm(torch.randn(2, 8), torch.ones(8), None, 1e-5)
    assert selfcheck.results() == {("bias_gelu", "cpu", torch.float32): True,
                                   ("layer_norm", "cpu", torch.float32): True}

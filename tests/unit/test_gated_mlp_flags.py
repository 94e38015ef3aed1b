"""gpt-oss's gated MLP flags: ``--quick-geglu`` (``x * sigmoid(1.702 x)`` on the gate half),
``--glu-linear-offset`` (added to the linear half) and ``--activation-func-clamp-value`` (gate
clamped to <= v, linear half to [-v, v], before the activation), as Megatron-Core's gated
unit computes them.

The dense MLP of a float64 model against the formula written out here (value and the
gradients of the input and of both weights and biases, 1e-12: the same float64 operations in
another order); the flags parsed into the model config; what cannot be combined refused in
one line naming the flags. The MoE experts are checked against the naive layer in
test_moe_layer.py, the tensor-parallel split in tests/distributed/test_numerics_flags_tp.py.
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.model import GPTModel
from megatron.model.utils import quick_gelu
from megatron.training.arguments import ArgumentsError
from tests.unit.test_gpt_model import make_config, single_process_state
from tests.unit.test_numerics_flags import _model_config, _validated

ATOL = 1e-12


def _reference(x, w1, b1, w2, b2, quick, offset, clamp):
    """The gated MLP on ``x [n, h]`` in plain operations."""
    h = x @ w1.T + b1
    half = h.shape[-1] // 2
    gate, linear = h[..., :half], h[..., half:]
    if clamp is not None:
        gate = torch.minimum(gate, torch.full_like(gate, clamp))
        linear = torch.maximum(torch.minimum(linear, torch.full_like(linear, clamp)),
                               torch.full_like(linear, -clamp))
    slope = 1.702 if quick else 1.0
    act = gate * (1.0 / (1.0 + torch.exp(-slope * gate)))
    return (act * (linear + offset)) @ w2.T + b2


def test_quick_gelu_formula():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    want = torch.tensor([v / (1 + math.exp(-1.702 * v)) for v in x.tolist()],
                        dtype=torch.float64)
    torch.testing.assert_close(quick_gelu(x), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("quick, offset, clamp", [(True, 1.0, 0.3), (True, 0.0, None),
                                                   (False, 1.0, 0.3), (False, 0.5, None)],
                         ids=["gpt_oss", "quick_geglu", "swiglu_offset_clamp",
                              "swiglu_offset"])
@pytest.mark.parametrize("fusion", [True, False])
def test_gated_mlp_against_formula(quick, offset, clamp, fusion):
    config = make_config(quick_geglu=quick, swiglu=not quick, glu_linear_offset=offset,
                         activation_func_clamp_value=clamp, bias_swiglu_fusion=fusion)
    assert config.gated_linear_unit
    mlp = GPTModel(config, single_process_state()).language_model.encoder.layers[0].mlp
    fc1, fc2 = mlp.dense_h_to_4h, mlp.dense_4h_to_h
    assert fc1.weight.shape == (2 * config.ffn_hidden_size, 32)
    with torch.no_grad():
        fc1.bias.normal_()      # order-one pre-activations, so the clamp bites
        fc2.bias.normal_()
    x = torch.randn(6, 2, 32, dtype=torch.float64, requires_grad=True)
    out, bias = mlp(x)
    out = out + bias
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    params = [p.detach().clone().requires_grad_()
              for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
    ref_x = x.detach().clone().requires_grad_()
    want = _reference(ref_x, *params, quick, offset, clamp)
    (want * grad).sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=ATOL)
    for mine, ref in zip((fc1.weight, fc1.bias, fc2.weight, fc2.bias), params):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=ATOL)
    if clamp is not None:   # the clamp bites on both halves
        h = (x @ fc1.weight.T + fc1.bias).detach()
        gate, linear = h.chunk(2, dim=-1)
        assert (gate > clamp).any() and (linear < -clamp).any() and (linear > clamp).any()


def test_flags_reach_the_model_config():
    config = _model_config("--quick-geglu", "--glu-linear-offset", "1",
                           "--activation-func-clamp-value", "7", "--ffn-hidden-size", "48")
    assert (config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value,
            config.swiglu, config.gated_linear_unit) == (True, 1.0, 7.0, False, True)
    plain = _model_config()
    assert (plain.quick_geglu, plain.glu_linear_offset, plain.activation_func_clamp_value,
            plain.gated_linear_unit) == (False, 0.0, None, False)


@pytest.mark.parametrize("flags, pattern", [
    (["--quick-geglu", "--swiglu"], "--quick-geglu cannot be combined with --swiglu"),
    (["--quick-geglu", "--squared-relu"], "--quick-geglu cannot be combined with --squared-relu"),
    (["--glu-linear-offset", "1"], "--glu-linear-offset applies to a gated MLP only"),
    (["--activation-func-clamp-value", "7"], "--activation-func-clamp-value applies to a gated"),
    (["--swiglu", "--activation-func-clamp-value", "0"], "must be > 0, got 0.0"),
])
def test_conflicting_flags_are_refused(flags, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validated(*flags)
    with pytest.raises(ConfigError, match=pattern):
        overrides = {"--quick-geglu": dict(quick_geglu=True), "--swiglu": dict(swiglu=True),
                     "--squared-relu": dict(squared_relu=True)}
        kw = {}
        for i, flag in enumerate(flags):
            kw.update(overrides.get(flag, {}))
            if flag == "--glu-linear-offset":
                kw["glu_linear_offset"] = float(flags[i + 1])
            if flag == "--activation-func-clamp-value":
                kw["activation_func_clamp_value"] = float(flags[i + 1])
        make_config(**kw)

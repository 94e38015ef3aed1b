"""--moe-apply-probs-on-input: the top-1 expert sees its token scaled by the routing
probability and its output is not scaled again; against a naive fp64 loop over tokens
(test_moe_layer's expert and router choice), outputs and every gradient."""

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.model.moe import MoEConfig, MoELayer, MoELossTracker
from megatron.training.arguments import build_parser
from tests.unit.test_moe_layer import (BATCH, HIDDEN, SEQ, TOL, _choose, _config, _expert,
                                       _perturb_biases)


def _naive(x, p, moe, config):
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ p["router.weight"].t()
    if "router.bias" in p:
        logits = logits + p["router.bias"]
    rows = []
    for t in range(tokens.size(0)):
        (e,), (prob,) = (v for v in _choose(logits[t], moe))
        rows.append(_expert(prob * tokens[t], p, f"experts.local_experts.{e}", config))
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("dispatcher,swiglu,router", [
    ("allgather", False, dict(moe_router_pre_softmax=True)),
    ("alltoall", True, dict(moe_router_score_function="sigmoid"))])
def test_probs_scale_the_expert_input(dispatcher, swiglu, router):
    """(A top-1 softmax after the top-k is always 1: the routers here give probabilities < 1.)"""
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=1, moe_apply_probs_on_input=True,
                    moe_router_load_balancing_type="none", moe_token_dispatcher_type=dispatcher,
                    **router)
    config = _config(swiglu=swiglu, add_bias_linear=True, bias_gelu_fusion=False)
    layer = MoELayer(config, moe, layer_number=1, tracker=MoELossTracker(num_layers=2)).train()
    _perturb_biases(layer)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    mine = x.clone().requires_grad_()
    out, _ = layer(mine)
    (out * grad).sum().backward()
    params = {n: q.detach().clone().requires_grad_() for n, q in layer.named_parameters()}
    ref_x = x.clone().requires_grad_()
    ref = _naive(ref_x, params, moe, config)
    (ref * grad).sum().backward()
    torch.testing.assert_close(out.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(mine.grad, ref_x.grad, **TOL)
    for name, param in layer.named_parameters():
        ref_grad = params[name].grad   # None for an expert no token chose: zero in the layer
        ref_grad = torch.zeros_like(param) if ref_grad is None else ref_grad
        torch.testing.assert_close(param.grad, ref_grad, **TOL, msg=name)
    assert params["router.weight"].grad.abs().sum() > 0
    plain = MoELayer(config, MoEConfig(**{**moe.__dict__, "moe_apply_probs_on_input": False}),
                     layer_number=1, tracker=MoELossTracker(num_layers=2))
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x)[0], out)   # with biases, input and output scaling differ


def test_flag_parses_and_needs_top1():
    assert build_parser().parse_args(["--moe-apply-probs-on-input"]).moe_apply_probs_on_input
    with pytest.raises(ConfigError, match="--moe-apply-probs-on-input needs --moe-router-topk 1"):
        MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_apply_probs_on_input=True)

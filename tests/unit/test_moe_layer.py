"""The MoE layer in one process against a naive dense reference written here in fp64: a loop
over tokens and their chosen experts, each expert an explicit ``fc2(act(fc1 x + b1)) + b2``,
and the load-balancing and z losses added to the objective by hand. Outputs and the gradients
of the input and of every weight must agree; so must the grouped-GEMM experts with the loop
over experts, and the padded with the unpadded expert input.

All float64: the same sums in another order agree to ~1e-15, the tolerance is 1e-12.
"""

import math

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model.moe import (GroupedMLP, MoEConfig, MoELayer, MoELossTracker,
                                SequentialMLP)

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN, FFN = 5, 3, 8, 12


def _config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=16,
              max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=FFN,
              params_dtype=torch.float64, add_bias_linear=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _perturb_biases(module, seed=7):
    """Biases start at zero; make them count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))


# -- the reference -----------------------------------------------------------------------------

def _gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _activate(h, config):
    """The expert activation of ``config`` on one token's fc1 output, written out."""
    if not (config.swiglu or config.quick_geglu):
        return _gelu(h)
    gate, value = h[: h.numel() // 2], h[h.numel() // 2:]
    limit = config.activation_func_clamp_value
    if limit is not None:
        gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
        value = torch.where(value > limit, torch.full_like(value, limit), value)
        value = torch.where(value < -limit, torch.full_like(value, -limit), value)
    slope = 1.702 if config.quick_geglu else 1.0
    return gate / (1.0 + torch.exp(-slope * gate)) * (value + config.glu_linear_offset)


def _expert(x, p, prefix, config):
    """One expert on one token, from the parameter dict ``p``."""
    h = p[f"{prefix}.linear_fc1.weight"] @ x
    if f"{prefix}.linear_fc1.bias" in p:
        h = h + p[f"{prefix}.linear_fc1.bias"]
    h = _activate(h, config)
    y = p[f"{prefix}.linear_fc2.weight"] @ h
    if f"{prefix}.linear_fc2.bias" in p:
        y = y + p[f"{prefix}.linear_fc2.bias"]
    return y


def _choose(logits_row, moe):
    """(expert ids, differentiable probabilities) of one token."""
    k = moe.moe_router_topk
    order = sorted(range(logits_row.numel()), key=lambda e: -float(logits_row[e].detach()))[:k]
    if moe.moe_router_score_function == "sigmoid":
        sig = torch.sigmoid(logits_row[order])
        probs = sig / sig.sum() if k > 1 else sig
    elif moe.moe_router_pre_softmax:
        probs = torch.softmax(logits_row, dim=0)[order]
    else:
        probs = torch.softmax(logits_row[order], dim=0)
    return order, probs * (moe.moe_router_topk_scaling_factor or 1.0)


def naive_moe(x, p, moe, config, shared_gate=False):
    """Output ``[s, b, h]`` and the auxiliary part of the objective (coefficients applied)."""
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    experts, k = moe.num_moe_experts, moe.moe_router_topk
    logits = tokens @ p["router.weight"].t()                                     # [T, E]
    if "router.bias" in p:
        logits = logits + p["router.bias"]
    choices = [_choose(logits[t], moe) for t in range(tokens.size(0))]
    kept = [[True] * k for _ in choices]
    if moe.moe_expert_capacity_factor is not None:
        capacity = math.ceil(tokens.size(0) * k / experts * moe.moe_expert_capacity_factor)
        for e in range(experts):
            pairs = [(t, j) for t, (order, _) in enumerate(choices) for j in range(k)
                     if order[j] == e]
            if moe.moe_token_drop_policy == "probs":
                pairs.sort(key=lambda tj: -float(choices[tj[0]][1][tj[1]].detach()))
            for t, j in pairs[capacity:]:
                kept[t][j] = False
    rows = []
    for t, (order, probs) in enumerate(choices):
        out = tokens.new_zeros(h)
        for j, e in enumerate(order):
            if kept[t][j]:
                out = out + probs[j] * _expert(tokens[t], p, f"experts.local_experts.{e}",
                                               config)
        if "shared_experts.linear_fc1.weight" in p:
            shared = _expert(tokens[t], p, "shared_experts", config)
            if shared_gate:
                shared = shared * torch.sigmoid(p["shared_experts.gate_weight"][0] @ tokens[t])
            out = out + shared
        rows.append(out)
    aux = x.new_zeros(())
    if moe.moe_aux_loss_coeff and moe.moe_router_load_balancing_type in ("aux_loss",
                                                                          "seq_aux_loss"):
        if moe.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
        groups = ([list(range(tokens.size(0)))]
                  if moe.moe_router_load_balancing_type == "aux_loss"
                  else [[i * b + j for i in range(s)] for j in range(b)])
        for group in groups:
            counts = torch.zeros(experts, dtype=x.dtype)
            for t in group:
                for e in choices[t][0]:
                    counts[e] += 1
            f = counts / (k * len(group))
            aux = aux + experts * (f * scores[group].mean(0)).sum() / len(groups)
        aux = aux * moe.moe_aux_loss_coeff
    if moe.moe_z_loss_coeff:
        aux = aux + moe.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return torch.stack(rows).view(s, b, h), aux


# -- grouped GEMM -----------------------------------------------------------------------------

@pytest.mark.parametrize("swiglu,bias", [(False, False), (True, True)])
def test_grouped_gemm_equals_the_loop_over_experts(swiglu, bias):
    config = _config(swiglu=swiglu, add_bias_linear=bias)
    moe = MoEConfig(num_moe_experts=4)
    loop, grouped = SequentialMLP(config, moe, 1), GroupedMLP(config, moe, 1)
    _perturb_biases(loop)
    grouped.load_state_dict(loop.state_dict())
    counts = [3, 0, 5, 2]  # an expert without rows
    rows = torch.randn(sum(counts), HIDDEN, dtype=torch.float64)
    grad = torch.randn(sum(counts), HIDDEN, dtype=torch.float64)
    results = []
    for module in (loop, grouped):
        x = rows.clone().requires_grad_()
        out = module(x, counts)
        (out * grad).sum().backward()
        results.append((out.detach(), x.grad, {n: q.grad for n, q in module.named_parameters()}))
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = results
    torch.testing.assert_close(out_a, out_b, **TOL)
    torch.testing.assert_close(dx_a, dx_b, **TOL)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        torch.testing.assert_close(g_a[name], g_b[name], **TOL, msg=name)
    assert not g_a["local_experts.1.linear_fc1.weight"].any()  # no rows, no gradient


# -- the whole layer ----------------------------------------------------------------------------

CASES = {
    "softmax_aux_z": (dict(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01), {}),
    "sigmoid_scaled_seq_aux_swiglu_bias_grouped_alltoall": (
        dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
             moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1,
             moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall"),
        dict(swiglu=True, add_bias_linear=True)),
    # gpt-oss's experts: quick GeGLU, linear half + 1, clamped (the clamp must bite: the
    # fc1 outputs here are of order one), biases in the router and the experts.
    "quick_geglu_offset_clamp_bias": (
        dict(moe_aux_loss_coeff=0.05),
        dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.7,
             add_bias_linear=True)),
    "quick_geglu_offset_clamp_bias_grouped": (
        dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall"),
        dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.7,
             add_bias_linear=True)),
    "swiglu_clamp_bias": (dict(), dict(swiglu=True, activation_func_clamp_value=0.5,
                                       add_bias_linear=True)),
    "pre_softmax_top3_capacity_probs_padded": (
        dict(num_moe_experts=6, moe_router_topk=3, moe_router_pre_softmax=True,
             moe_aux_loss_coeff=0.02, moe_expert_capacity_factor=0.8,
             moe_pad_expert_input_to_capacity=True), {}),
    "top1_capacity_position_shared_gate_ffn": (
        dict(moe_router_topk=1, moe_expert_capacity_factor=0.7,
             moe_token_drop_policy="position", moe_router_load_balancing_type="none",
             moe_shared_expert_intermediate_size=6, moe_shared_expert_gate=True,
             moe_ffn_hidden_size=10, moe_token_dispatcher_type="alltoall"), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equals_the_naive_reference(case):
    moe_kwargs, config_kwargs = CASES[case]
    moe = MoEConfig(**{"num_moe_experts": 4, **moe_kwargs})
    config = _config(**config_kwargs)
    tracker = MoELossTracker(num_layers=2)
    tracker.backward_scale = 0.5
    layer = MoELayer(config, moe, layer_number=2, tracker=tracker).train()
    _perturb_biases(layer)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)

    mine = x.clone().requires_grad_()
    out, bias = layer(mine)
    assert bias is None and out.shape == x.shape
    (out * grad).sum().backward()

    params = {n: q.detach().clone().requires_grad_() for n, q in layer.named_parameters()}
    ref_x = x.clone().requires_grad_()
    ref_out, aux = naive_moe(ref_x, params, moe, config, moe.moe_shared_expert_gate)
    ((ref_out * grad).sum() + tracker.backward_scale * aux).backward()

    torch.testing.assert_close(out.detach(), ref_out.detach(), **TOL)
    torch.testing.assert_close(mine.grad, ref_x.grad, **TOL)
    for name, param in layer.named_parameters():
        want = params[name].grad   # None: an expert no token chose
        want = torch.zeros_like(param) if want is None else want
        torch.testing.assert_close(param.grad, want, **TOL, msg=name)
    limit = config.activation_func_clamp_value
    if limit is not None:   # the clamp must bite on both halves
        fc1 = layer.experts.local_experts[0].linear_fc1
        h = fc1(x.view(-1, HIDDEN))[0].detach()
        gate, value = h.chunk(2, dim=-1)
        assert (gate > limit).any() and (value.abs() > limit).any(), case
    if moe.moe_expert_capacity_factor is not None:  # the case must actually drop something
        probs, routing_map = layer.router.eval()(x)
        assert routing_map.sum() < moe.moe_router_topk * SEQ * BATCH, case


def test_padding_to_capacity_changes_nothing_but_the_row_count():
    config = _config()
    outputs = []
    for pad in (False, True):
        for dispatcher in ("allgather", "alltoall"):
            moe = MoEConfig(num_moe_experts=4, moe_expert_capacity_factor=0.9,
                            moe_pad_expert_input_to_capacity=pad,
                            moe_token_dispatcher_type=dispatcher)
            layer = MoELayer(config, moe)
            seen = []
            layer.experts.register_forward_pre_hook(lambda m, args: seen.append(list(args[1])))
            outputs.append(layer(torch.ones(SEQ, BATCH, HIDDEN, dtype=torch.float64)
                                 .cumsum(0))[0])
            capacity = math.ceil(SEQ * BATCH * 2 / 4 * 0.9)
            if pad:
                assert seen == [[capacity] * 4]
            else:
                assert sum(seen[0]) <= 2 * SEQ * BATCH and seen[0] != [capacity] * 4
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], **TOL)


def test_parameter_names_are_megatron_cores():
    moe = MoEConfig(num_moe_experts=2, moe_shared_expert_intermediate_size=4,
                    moe_shared_expert_gate=True)
    names = [n for n, _ in MoELayer(_config(), moe).named_parameters()]
    assert names == ["router.weight",
                     "experts.local_experts.0.linear_fc1.weight",
                     "experts.local_experts.0.linear_fc2.weight",
                     "experts.local_experts.1.linear_fc1.weight",
                     "experts.local_experts.1.linear_fc2.weight",
                     "shared_experts.gate_weight",
                     "shared_experts.linear_fc1.weight",
                     "shared_experts.linear_fc2.weight"]
    layer = MoELayer(_config(swiglu=True, add_bias_linear=True), MoEConfig(num_moe_experts=2))
    shapes = {n: tuple(q.shape) for n, q in layer.named_parameters()}
    assert shapes["router.weight"] == (2, HIDDEN) and shapes["router.bias"] == (2,)
    assert shapes["experts.local_experts.1.linear_fc1.weight"] == (2 * FFN, HIDDEN)
    assert shapes["experts.local_experts.1.linear_fc2.weight"] == (HIDDEN, FFN)
    assert shapes["experts.local_experts.1.linear_fc2.bias"] == (HIDDEN,)
    assert all(getattr(q, "allreduce", True) is False
               for n, q in layer.named_parameters() if n.startswith("experts."))


def test_group_sizes_must_match_the_config_and_shared_experts_refuse_bias():
    with pytest.raises(ValueError, match="--expert-model-parallel-size is 2 but the ep_group "
                                         "passed has 1 ranks"):
        MoELayer(_config(), MoEConfig(num_moe_experts=4, expert_model_parallel_size=2))
    with pytest.raises(ValueError, match="shared experts have no bias"):
        MoELayer(_config(add_bias_linear=True),
                 MoEConfig(num_moe_experts=4, moe_shared_expert_intermediate_size=4))


# -- the fused bias-GeLU of Megatron-Core's SequentialMLP ---------------------------------------


def _gelu_tanh(x):
    """GeLU's tanh approximation with Megatron's constants, written out."""
    return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


def test_sequential_experts_with_bias_run_the_fused_tanh_bias_gelu():
    """With biases and bias_gelu_fusion (Megatron's default) each expert computes
    fc2(gelu_tanh(fc1 x + b1)) + b2, as Megatron-Core's SequentialMLP does; without biases
    Megatron turns the fusion off and the experts keep exact GeLU; grouped experts refuse it."""
    moe = MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=FFN)
    gen = torch.Generator().manual_seed(3)
    rows = 3 * torch.randn(10, HIDDEN, generator=gen, dtype=torch.float64)
    counts = [3, 0, 4, 3]
    for bias, fusion, act in ((True, True, _gelu_tanh), (True, False, _gelu),
                              (False, True, _gelu)):
        experts = SequentialMLP(_config(add_bias_linear=bias, bias_gelu_fusion=fusion), moe, 1)
        _perturb_biases(experts)
        mine = rows.clone().requires_grad_()
        out = experts(mine, counts)
        grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * grad).sum().backward()
        params = {n: q.detach().clone().requires_grad_() for n, q in experts.named_parameters()}
        ref_rows = rows.clone().requires_grad_()
        pieces, start = [], 0
        for e, n in enumerate(counts):
            p = lambda name: params.get(f"local_experts.{e}.{name}")   # noqa: E731
            h = ref_rows[start:start + n] @ p("linear_fc1.weight").t()
            h = act(h if p("linear_fc1.bias") is None else h + p("linear_fc1.bias"))
            y = h @ p("linear_fc2.weight").t()
            pieces.append(y if p("linear_fc2.bias") is None else y + p("linear_fc2.bias"))
            start += n
        want = torch.cat(pieces)
        (want * grad).sum().backward()
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(mine.grad, ref_rows.grad, **TOL)
        for name, param in experts.named_parameters():
            ref = params[name].grad
            ref = torch.zeros_like(param) if ref is None else ref
            torch.testing.assert_close(param.grad, ref, **TOL, msg=name)
        # the two GeLUs differ by far more than the tolerance on these rows
        assert (_gelu_tanh(rows) - _gelu(rows)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="grouped experts have no fused bias-GeLU"):
        GroupedMLP(_config(add_bias_linear=True), moe, 1)
    GroupedMLP(_config(add_bias_linear=True, bias_gelu_fusion=False), moe, 1)

"""MoE variants against naive fp64 references written here: ``--moe-latent-size`` (the experts
between ``fc1_latent_proj`` and ``fc2_latent_proj``; router and shared expert on the hidden
state), the interleaved GLU layout of the experts' and the shared expert's fc1
(``--moe-mlp-glu-interleave-size``, ``--moe-shared-expert-glu-interleave-size``), and routing
replay (``--moe-enable-routing-replay``).

All float64: the same sums in another order agree to ~1e-15, the tolerance is 1e-12.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe.experts import remove_glu_interleaving

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN, FFN, LATENT, SHARED = 5, 3, 8, 12, 6, 8


def _config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=16,
              max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=FFN,
              params_dtype=torch.float64, add_bias_linear=False, swiglu=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _moe(**overrides):
    kw = dict(num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="none")
    kw.update(overrides)
    return MoEConfig(**kw)


def _swiglu_halves(h):
    gate, value = h.chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * value


def _swiglu_blocks(h, n):
    """The interleaved layout read block by block: [gate n | value n] repeated."""
    blocks = h.reshape(*h.shape[:-1], -1, 2 * n)
    gate, value = blocks[..., :n].flatten(-2), blocks[..., n:].flatten(-2)
    return gate / (1.0 + torch.exp(-gate)) * value


def _naive(layer, x, glu=_swiglu_halves, shared_glu=_swiglu_halves):
    """Token by token: softmax top-k over the router logits, each chosen expert on the latent
    projection of the token, weighted sum, projected back, plus the shared expert."""
    p = dict(layer.named_parameters())
    tokens = x.reshape(-1, HIDDEN)
    out = torch.zeros_like(tokens)
    for t, token in enumerate(tokens):
        logits = p["router.weight"] @ token
        top, idx = torch.topk(logits, layer.moe_config.moe_router_topk)
        probs = torch.softmax(top, dim=-1)
        z = p["fc1_latent_proj.weight"] @ token if layer.fc1_latent_proj is not None else token
        acc = torch.zeros_like(z)
        for prob, e in zip(probs, idx.tolist()):
            w1 = p[f"experts.local_experts.{e}.linear_fc1.weight"]
            w2 = p[f"experts.local_experts.{e}.linear_fc2.weight"]
            acc = acc + prob * (w2 @ glu(w1 @ z))
        if layer.fc2_latent_proj is not None:
            acc = p["fc2_latent_proj.weight"] @ acc
        if layer.shared_experts is not None:
            s1 = p["shared_experts.linear_fc1.weight"]
            acc = acc + p["shared_experts.linear_fc2.weight"] @ shared_glu(s1 @ token)
        out[t] = acc
    return out.view_as(x)


def _input(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)


# -- latent MoE --------------------------------------------------------------------------------

def test_latent_moe_shapes_and_keys():
    layer = MoELayer(_config(), _moe(moe_latent_size=LATENT,
                                     moe_shared_expert_intermediate_size=SHARED))
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes["fc1_latent_proj.weight"] == (LATENT, HIDDEN)
    assert shapes["fc2_latent_proj.weight"] == (HIDDEN, LATENT)
    assert shapes["experts.local_experts.0.linear_fc1.weight"] == (2 * FFN, LATENT)
    assert shapes["experts.local_experts.0.linear_fc2.weight"] == (LATENT, FFN)
    assert shapes["router.weight"] == (4, HIDDEN)                # routes the hidden state
    assert shapes["shared_experts.linear_fc1.weight"] == (2 * SHARED, HIDDEN)


@pytest.mark.parametrize("grouped", [False, True])
def test_latent_moe_matches_naive_fp64(grouped):
    layer = MoELayer(_config(), _moe(moe_latent_size=LATENT, moe_grouped_gemm=grouped,
                                     moe_shared_expert_intermediate_size=SHARED))
    x = _input().requires_grad_()
    out, _ = layer(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = _naive(layer, ref_x)
    torch.testing.assert_close(out, ref, **TOL)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), [x] + list(layer.parameters()))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), [ref_x] + list(layer.parameters()))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_latent_projection_bias_and_bad_size():
    layer = MoELayer(_config(add_bias_linear=False), _moe(moe_latent_size=LATENT))
    assert layer.fc1_latent_proj.bias is None
    with pytest.raises(ConfigError, match="--moe-latent-size"):
        _moe(moe_latent_size=0)


# -- GLU interleave ----------------------------------------------------------------------------

def test_remove_glu_interleaving_against_blocks():
    n, f = 2, 6
    x = torch.arange(2 * f, dtype=torch.float64).repeat(3, 1)        # [3, 2f]
    got = remove_glu_interleaving(x, n)
    gate = torch.cat([x[:, 4 * b: 4 * b + n] for b in range(f // n)], dim=-1)
    value = torch.cat([x[:, 4 * b + n: 4 * b + 2 * n] for b in range(f // n)], dim=-1)
    torch.testing.assert_close(got, torch.cat([gate, value], dim=-1), **TOL)
    with pytest.raises(ValueError, match="interleave size 4"):
        remove_glu_interleaving(x, 4)


@pytest.mark.parametrize("grouped", [False, True])
def test_glu_interleave_matches_naive_fp64(grouped):
    layer = MoELayer(_config(), _moe(moe_mlp_glu_interleave_size=3, moe_grouped_gemm=grouped,
                                     moe_shared_expert_intermediate_size=SHARED,
                                     moe_shared_expert_glu_interleave_size=2))
    x = _input(1)
    out, _ = layer(x)
    ref = _naive(layer, x, glu=lambda h: _swiglu_blocks(h, 3),
                 shared_glu=lambda h: _swiglu_blocks(h, 2))
    torch.testing.assert_close(out, ref, **TOL)
    # the same weights read as two halves give another function: the layout matters
    other = _naive(layer, x)
    assert (out - other).abs().max() > 0.1 * out.abs().max()


def test_glu_interleave_equals_reordered_halves_layout():
    """An interleaved model equals the two-halves model whose fc1 rows are de-interleaved."""
    inter = MoELayer(_config(), _moe(moe_mlp_glu_interleave_size=2))
    plain = MoELayer(_config(), _moe())
    state = inter.state_dict()
    for key, value in state.items():
        if key.endswith("linear_fc1.weight"):
            state[key] = remove_glu_interleaving(value.t(), 2).t()
    plain.load_state_dict(state)
    x = _input(2)
    torch.testing.assert_close(inter(x)[0], plain(x)[0], **TOL)


def test_glu_interleave_must_divide_the_ffn():
    with pytest.raises(ValueError, match="--moe-mlp-glu-interleave-size 5"):
        MoELayer(_config(), _moe(moe_mlp_glu_interleave_size=5))
    with pytest.raises(ConfigError, match="--moe-shared-expert-glu-interleave-size needs"):
        _moe(moe_shared_expert_glu_interleave_size=2)


# -- routing replay ----------------------------------------------------------------------------

from megatron.model.moe.router_replay import (RouterReplayAction, clear_replay_data,  # noqa: E402
                                              get_recorded_data, router_replays,
                                              set_replay_data, set_router_replay_action)


def _two_layers(**moe):
    return torch.nn.ModuleList([MoELayer(_config(), _moe(moe_enable_routing_replay=True, **moe),
                                         layer_number=i + 1) for i in range(2)])


def _chosen(routing_map):
    return routing_map.nonzero()[:, 1].view(routing_map.size(0), -1)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_replay_reproduces_recorded_routing(score):
    layers = _two_layers(moe_router_score_function=score, moe_router_topk_scaling_factor=1.5)
    x = _input(3)
    assert len(router_replays([layers])) == 2
    set_router_replay_action([layers], RouterReplayAction.RECORD)
    maps = [layer.router(x)[1] for layer in layers]
    recorded = get_recorded_data([layers])
    for routing_map, ids in zip(maps, recorded):
        assert torch.equal(_chosen(routing_map), ids.sort(dim=-1).values)
    with torch.no_grad():                       # the routers now prefer other experts
        for layer in layers:
            layer.router.weight.copy_(torch.randn_like(layer.router.weight))
    set_router_replay_action([layers], None)
    assert any(not torch.equal(layer.router(x)[1], m) for layer, m in zip(layers, maps))
    set_replay_data([layers], recorded)
    set_router_replay_action([layers], RouterReplayAction.REPLAY_FORWARD)
    for layer, routing_map, ids in zip(layers, maps, recorded):
        x_req = x.detach().clone().requires_grad_()
        probs, replayed_map = layer.router(x_req)
        assert torch.equal(replayed_map, routing_map)
        # the replayed experts' weights under the new logits, written out
        logits = x_req.reshape(-1, HIDDEN) @ layer.router.weight.t()
        chosen = torch.gather(logits, 1, ids)
        if score == "softmax":
            want = torch.softmax(chosen, dim=-1)
        else:
            s = torch.sigmoid(chosen)
            want = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
        want = torch.zeros_like(logits).scatter(1, ids, 1.5 * want)
        torch.testing.assert_close(probs, want, **TOL)
        assert torch.autograd.grad(probs.sum() * 0 + (probs ** 2).sum(),
                                   layer.router.weight)[0].abs().sum() > 0


def test_replay_backward_pops_in_order_and_errors_are_clear():
    layers = _two_layers()
    layer = layers[0]
    tokens = SEQ * BATCH
    first = torch.tensor([[0, 1]] * tokens)
    second = torch.tensor([[2, 3]] * tokens)
    set_replay_data([layers], [first, first])
    set_replay_data([layers], [second, second])
    set_router_replay_action([layers], RouterReplayAction.REPLAY_BACKWARD)
    x = _input(4)
    assert torch.equal(_chosen(layer.router(x)[1]), first)
    assert torch.equal(_chosen(layer.router(x)[1]), second)
    with pytest.raises(RuntimeError, match="replay_backward with no replayed forward"):
        layer.router(x)
    clear_replay_data([layers])
    set_router_replay_action([layers], RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(RuntimeError, match="no expert ids set"):
        layer.router(x)
    with pytest.raises(ValueError, match=r"2 routers"):
        set_replay_data([layers], [first])
    set_replay_data([layers], [first[:3], first])
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        layer.router(x)
    with pytest.raises(ConfigError, match="--moe-enable-routing-replay"):
        _moe(moe_enable_routing_replay=True, moe_router_load_balancing_type="sinkhorn")


def test_replay_flag_alone_changes_nothing():
    plain = MoELayer(_config(), _moe())
    replaying = MoELayer(_config(), _moe(moe_enable_routing_replay=True))
    x = _input(5)
    assert torch.equal(plain(x)[0], replaying(x)[0])
    assert plain.router.router_replay is None


@pytest.mark.parametrize("bias", [False, True])
def test_memory_accounting_counts_the_latent_layer(bias):
    from megatron.training.memory_accounting import _moe_mlp_parameters

    config = _config(add_bias_linear=bias, swiglu=not bias)
    moe = _moe(moe_latent_size=LATENT)
    layer = MoELayer(config, moe)
    assert _moe_mlp_parameters(config, moe, 1) == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("flag", ["moe_latent_size", "moe_mlp_glu_interleave_size",
                                  "moe_shared_expert_glu_interleave_size"])
def test_the_converter_refuses_the_variants_in_one_line(flag):
    from types import SimpleNamespace

    from megatron.convert.megatron_io import _moe_fields
    from megatron.convert.schema import ConversionError

    args = SimpleNamespace(num_experts=4, **{flag: 4})
    with pytest.raises(ConversionError, match="--" + flag.replace("_", "-")):
        _moe_fields(args, "ckpt/iter_0000001")


def test_flags_reach_the_configs():
    from megatron.training.arguments import build_configs, validate_args
    from megatron.tokenizer import build_tokenizer
    from tests.unit.test_arguments import BASE, _args

    args = validate_args(_args(BASE + [
        "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--num-experts", "4",
        "--swiglu", "--disable-bias-linear", "--moe-latent-size", "8",
        "--moe-mlp-glu-interleave-size", "4", "--moe-shared-expert-intermediate-size", "8",
        "--moe-shared-expert-glu-interleave-size", "2", "--moe-enable-routing-replay",
        "--mlp-chunks-for-training", "3"]))
    build_tokenizer(args)
    configs = build_configs(args)
    moe = configs.moe
    assert (moe.moe_latent_size, moe.moe_mlp_glu_interleave_size,
            moe.moe_shared_expert_glu_interleave_size, moe.moe_enable_routing_replay) == \
        (8, 4, 2, True)
    assert configs.model.mlp_chunks_for_training == 3

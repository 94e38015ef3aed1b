"""``--moe-router-load-balancing-type quantile_balancing`` against fp64 loops written from its
definition (Megatron-Core's): the top k of ``logits - qb_beta`` choose the experts; each
micro-batch's batch bias is the (T k // E + 1)-th largest ``logits[:, e] - a_t`` over tokens
(``a_t``: the token's (k+1)-th largest biased logit); after the step ``qb_beta`` becomes
``ema * qb_beta + (1 - ema) * mean batch bias``, shifted to mean zero."""

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import MoEConfig, TopKRouter, topk_routing
from megatron.model.moe.router import (probs_of_chosen, quantile_choice,
                                       update_quantile_biases, updated_quantile_bias)


def _naive_choice(logits, topk, beta):
    tokens, experts = len(logits), len(logits[0])
    chosen, thresholds = [], []
    for t in range(tokens):
        biased = sorted(((logits[t][e] - beta[e], e) for e in range(experts)), reverse=True)
        chosen.append({e for _, e in biased[:topk]})
        thresholds.append(biased[topk][0])
    target = tokens * topk // experts
    batch = []
    for e in range(experts):
        column = sorted((logits[t][e] - thresholds[t] for t in range(tokens)), reverse=True)
        batch.append(column[target])
    return chosen, batch


@pytest.mark.parametrize("tokens,experts,topk", [(12, 4, 1), (20, 6, 2), (9, 8, 3)])
def test_choice_and_batch_bias_are_the_naive_loops(tokens, experts, topk):
    gen = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, dtype=torch.float64, generator=gen)
    beta = torch.randn(experts, dtype=torch.float64, generator=gen) * 0.5
    indices, batch = quantile_choice(logits, topk, beta)
    want_chosen, want_batch = _naive_choice(logits.tolist(), topk, beta.tolist())
    assert [set(row) for row in indices.tolist()] == want_chosen
    assert batch.tolist() == want_batch


def test_bias_update_is_the_formula():
    beta = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    mean = torch.tensor([0.25, 0.5, -1.0], dtype=torch.float64)
    new = updated_quantile_bias(beta, mean, 0.25)
    raw = [0.25 * b + 0.75 * m for b, m in zip(beta.tolist(), mean.tolist())]
    centre = sum(raw) / 3
    assert new.tolist() == pytest.approx([r - centre for r in raw], abs=1e-15)


@pytest.mark.parametrize("score,pre", [("softmax", False), ("softmax", True),
                                       ("sigmoid", False), ("sqrtsoftplus", False)])
def test_probs_of_chosen_weigh_like_the_topk_router(score, pre):
    logits = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, indices = topk_routing(logits, 2, score, pre, 1.5)
    assert torch.equal(probs_of_chosen(logits, indices, score, pre, 1.5), want)


def test_sigmoid_probs_of_other_choices_are_normalised_scores():
    logits = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    indices = torch.tensor([[3, 0]] * 5)
    got = probs_of_chosen(logits, indices, "sigmoid")
    for t in range(5):
        s = [1 / (1 + pow(2.718281828459045, -logits[t, e].item())) for e in (3, 0)]
        assert got[t].tolist() == pytest.approx([v / sum(s) for v in s], rel=1e-12)


def _router(ema=0.0, score="softmax", topk=2, **kw):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=32, max_position_embeddings=8, seq_length=8,
                               add_bias_linear=False, params_dtype=kw.pop("dtype", torch.float32))
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=topk, moe_router_score_function=score,
                    moe_router_load_balancing_type="quantile_balancing",
                    moe_router_quantile_balancing_ema=ema, **kw)
    return TopKRouter(config, moe, layer_number=1)


def test_router_chooses_by_the_biased_logits_and_weighs_by_the_plain_ones():
    router = _router(score="sigmoid").eval()
    router.qb_beta.copy_(torch.tensor([3.0, 0.0, 0.0, -3.0]))
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(5))
    probs, routing_map = router(x)
    logits = router.gating(x).reshape(-1, 4).double()
    chosen = torch.topk(logits - router.qb_beta.double(), 2, dim=1).indices
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, chosen, True))
    assert routing_map[:, 3].all() and not routing_map[:, 0].any()
    scores = torch.sigmoid(logits).gather(1, chosen)
    want = torch.zeros_like(logits).scatter(1, chosen, scores / scores.sum(1, keepdim=True))
    assert torch.allclose(probs.double(), want, atol=1e-6)
    assert router.qb_beta_count.item() == 0          # eval: nothing accumulated


def test_training_accumulates_then_the_step_updates_and_resets():
    router = _router(ema=0.5)
    assert "qb_beta" in router.state_dict()
    assert "qb_beta_accum" not in router.state_dict()   # not saved, as Megatron
    assert "qb_beta_count" not in router.state_dict()
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(5, 2, 16, generator=gen) for _ in range(2)]
    with torch.no_grad():
        router(xs[0])                                     # no gradients: not counted
    assert router.qb_beta_count.item() == 0
    batches = []
    for x in xs:
        router(x)
        logits = router.gating(x).detach().reshape(-1, 4).double()
        batches.append(_naive_choice(logits.tolist(), 2, [0.0] * 4)[1])
    assert router.qb_beta_count.item() == 2
    assert update_quantile_biases([torch.nn.ModuleList([router])]) == 1
    mean = [(a + b) / 2 for a, b in zip(*batches)]
    raw = [0.5 * m for m in mean]
    want = [r - sum(raw) / 4 for r in raw]
    assert router.qb_beta.tolist() == pytest.approx(want, abs=1e-6)
    assert router.qb_beta_count.item() == 0 and router.qb_beta_accum.abs().sum() == 0


def test_updates_balance_a_skewed_router():
    router = _router(topk=1)
    with torch.no_grad():
        router.weight[0] += 0.5                     # expert 0 takes most tokens
    x = torch.randn(64, 4, 16, generator=torch.Generator().manual_seed(7))
    x[..., :] += 1.0
    loads = []
    for _ in range(6):
        _, routing_map = router(x)
        loads.append(routing_map.sum(0).max().item())
        update_quantile_biases([router])
    assert loads[0] > 128                            # 256 tokens, 64 each when balanced
    assert loads[-1] <= 80, loads


def test_bias_stays_float32_in_a_bf16_model():
    router = _router().to(torch.bfloat16)
    assert router.qb_beta.dtype == torch.float32 and router.qb_beta_accum.dtype == torch.float32
    router(torch.randn(4, 2, 16, dtype=torch.bfloat16))
    update_quantile_biases([router])
    assert router.qb_beta.dtype == torch.float32


@pytest.mark.parametrize("kw,flag", [
    ({"moe_router_load_balancing_type": ("quantile_balancing", "aux_loss"),
      "moe_aux_loss_coeff": (0.0, 0.01)}, "aux_loss has a non-zero --moe-aux-loss-coeff"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "--moe-router-num-groups"),
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"},
     "--moe-router-enable-expert-bias"),
    ({"moe_router_topk": 4}, "--moe-router-topk"),
    ({"moe_router_quantile_balancing_ema": 1.5}, "--moe-router-quantile-balancing-ema"),
])
def test_bad_settings_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        MoEConfig(**{"num_moe_experts": 4, "moe_router_topk": 2,
                     "moe_router_load_balancing_type": "quantile_balancing", **kw})


def test_flags_reach_the_config():
    from megatron.training.arguments import parse_args
    from megatron.training.configs import build_moe_config

    args = parse_args(argv=[
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--num-experts", "8", "--moe-router-load-balancing-type", "quantile_balancing",
        "--moe-router-quantile-balancing-ema", "0.9"])
    cfg = build_moe_config(args)
    assert cfg.uses_quantile_balancing and cfg.moe_router_quantile_balancing_ema == 0.9


def test_the_converter_refuses_a_quantile_balancing_checkpoint_in_one_line():
    from types import SimpleNamespace

    from megatron.convert.megatron_io import _moe_fields
    from megatron.convert.schema import ConversionError

    args = SimpleNamespace(num_experts=4, moe_router_load_balancing_type=["quantile_balancing"])
    with pytest.raises(ConversionError, match="qb_beta"):
        _moe_fields(args, "ckpt/iter_0000001")
    args.moe_router_load_balancing_type = ["aux_loss"]
    assert _moe_fields(args, "ckpt/iter_0000001")["num_experts"] == 4

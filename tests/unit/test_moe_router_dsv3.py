"""DeepSeek-V3's routing pieces against naive fp64 loops written here: group-limited top-k,
expert-bias selection, the bias update, and how a router counts and updates; plus the flag
checks of the new router settings."""

import itertools

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.moe import (MoEConfig, TopKRouter, group_limited_topk, topk_routing,
                                update_expert_biases, updated_expert_bias)


def _naive_group_topk(row, topk, num_groups, group_topk):
    """One token: the k best experts among its best groups, by plain Python loops."""
    size = len(row) // num_groups
    group_scores = []
    for g in range(num_groups):
        members = sorted(row[g * size:(g + 1) * size], reverse=True)
        group_scores.append((sum(members[:topk // group_topk]), g))
    best = sorted(group_scores, key=lambda t: (-t[0], t[1]))[:group_topk]
    allowed = [e for _, g in best for e in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda e: -row[e])[:topk]


@pytest.mark.parametrize("experts,groups,group_topk,topk",
                         [(8, 4, 2, 2), (16, 4, 2, 4), (12, 3, 1, 3), (8, 2, 2, 4)])
def test_group_limited_topk_is_the_naive_loop(experts, groups, group_topk, topk):
    gen = torch.Generator().manual_seed(experts * 100 + topk)
    scores = torch.rand(40, experts, generator=gen, dtype=torch.float64)
    values, indices = group_limited_topk(scores, topk, groups, group_topk)
    for t in range(scores.size(0)):
        want = _naive_group_topk(scores[t].tolist(), topk, groups, group_topk)
        assert indices[t].tolist() == want, t
        assert values[t].tolist() == [scores[t, e].item() for e in want]


def test_groups_change_the_choice_where_plain_topk_crosses_groups():
    # Expert 2 is the best one, but its group scores 0.81 + 0.10 against group 0's
    # 0.80 + 0.79 (a group scores its best k / group_topk = 2): with one group allowed the
    # token keeps to group 0.
    scores = torch.tensor([[0.80, 0.79, 0.81, 0.10]], dtype=torch.float64)
    assert torch.topk(scores, 2).indices.tolist() == [[2, 0]]
    _, indices = group_limited_topk(scores, 2, 2, 1)
    assert indices.tolist() == [[0, 1]]


def test_expert_bias_chooses_but_does_not_weigh():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(8, generator=gen, dtype=torch.float64) * 0.3
    probs, indices = topk_routing(logits, 2, "sigmoid", scaling_factor=2.5, num_groups=4,
                                  group_topk=2, expert_bias=bias)
    for t in range(30):
        sig = [1 / (1 + torch.exp(-x).item()) for x in logits[t]]
        biased = [s + b for s, b in zip(sig, bias.tolist())]
        want = _naive_group_topk(biased, 2, 4, 2)
        assert indices[t].tolist() == want
        total = sum(sig[e] for e in want)
        assert probs[t].tolist() == pytest.approx([2.5 * sig[e] / total for e in want],
                                                  abs=1e-12)
    unbiased = topk_routing(logits, 2, "sigmoid", num_groups=4, group_topk=2)[1]
    assert not torch.equal(unbiased, indices)   # the bias did move some choices


def test_bias_update_is_the_naive_loop():
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    counts = torch.randint(0, 20, (3, 8), generator=gen).double()
    counts[1] = 7.0   # all equal: nothing moves
    got = updated_expert_bias(bias, counts, 1e-3)
    for r, e in itertools.product(range(3), range(8)):
        mean = sum(counts[r].tolist()) / 8
        step = 1e-3 if counts[r, e] < mean else (-1e-3 if counts[r, e] > mean else 0.0)
        assert got[r, e].item() == bias[r, e].item() + step


def _router(rate=0.5, **kw):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=32, max_position_embeddings=8, seq_length=8)
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=1, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate, **kw)
    return TopKRouter(config, moe, layer_number=1)


def test_router_counts_in_training_updates_and_resets():
    router = _router()
    assert "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()   # not saved, as Megatron
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router(x)                                                  # no gradients: not counted
    assert router.local_tokens_per_expert.sum() == 0
    _, routing_map = router(x)
    router(x)
    counts = 2 * routing_map.sum(0).double()
    assert router.local_tokens_per_expert.double().tolist() == counts.tolist()
    holder = torch.nn.ModuleList([router])
    assert update_expert_biases([holder]) == 1
    want = updated_expert_bias(torch.zeros(4, dtype=torch.float64), counts, 0.5)
    assert router.expert_bias.double().tolist() == want.tolist()
    assert router.local_tokens_per_expert.sum() == 0


def test_expert_bias_stays_float32_in_a_bf16_model():
    router = _router().to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32
    assert router.local_tokens_per_expert.dtype == torch.float32
    router(torch.randn(4, 2, 16, dtype=torch.bfloat16))
    update_expert_biases([router])
    assert router.expert_bias.dtype == torch.float32
    assert sorted(set(router.expert_bias.abs().tolist())) <= [0.0, 0.5]


def test_router_dtype_computes_the_logits_in_fp64():
    router = _router(moe_router_dtype="fp64")
    x = torch.randn(4, 2, 16)
    assert router.gating(x).dtype == torch.float64
    assert _router().gating(x).dtype == torch.float32


@pytest.mark.parametrize("kw,flag", [
    ({"moe_router_num_groups": 4}, "--moe-router-group-topk"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "--moe-router-num-groups"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "--moe-router-group-topk"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_topk": 3},
     "--moe-router-topk"),
    ({"moe_router_enable_expert_bias": True}, "--moe-router-score-function sigmoid"),
    ({"moe_router_dtype": "fp16"}, "--moe-router-dtype"),
])
def test_bad_router_settings_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        MoEConfig(num_moe_experts=8, **{"moe_router_topk": 2, **kw})


def test_flags_reach_the_config():
    from megatron.training.arguments import parse_args
    from megatron.training.configs import build_moe_config

    args = parse_args(argv=[
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--num-experts", "8", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
        "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
        "--moe-router-dtype", "fp32", "--mtp-num-layers", "1"])
    cfg = build_moe_config(args)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.01
    assert cfg.moe_router_dtype == "fp32"
    assert args.mtp_num_layers == 1 and args.mtp_loss_scaling_factor == 0.1


@pytest.mark.parametrize("extra,world,pattern", [
    (["--pipeline-model-parallel-size", "2"], 2,
     r"--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --position-embedding"),
    (["--mtp-loss-scaling-factor", "-1"], 1, r"--mtp-loss-scaling-factor must be >= 0"),
])
def test_mtp_layouts_not_built_are_refused_in_one_line(extra, world, pattern):
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args

    args = parse_args(argv=["--num-layers", "4", "--hidden-size", "64",
                            "--num-attention-heads", "8", "--seq-length", "32",
                            "--max-position-embeddings", "32", "--micro-batch-size", "2",
                            "--train-iters", "10", "--mtp-num-layers", "1", *extra])
    args.world_size = world
    with pytest.raises(ArgumentsError, match=pattern):
        validate_args(args)


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--context-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]],
    ids=["tp2-sp", "cp2", "tp2-sp-cp2"])
def test_mtp_with_sequence_or_context_parallelism_is_accepted(extra):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=["--num-layers", "4", "--hidden-size", "64",
                            "--num-attention-heads", "8", "--seq-length", "32",
                            "--max-position-embeddings", "32", "--micro-batch-size", "2",
                            "--train-iters", "10", "--mtp-num-layers", "1", *extra])
    args.world_size = 4
    args = validate_args(args)
    assert args.mtp_num_layers == 1
    assert args.sequence_parallel == ("--sequence-parallel" in extra)

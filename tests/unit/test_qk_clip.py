"""QK-clip (--qk-clip) and the largest attention logit (--log-max-attention-logit) in one
process, against references written out here in float64.

- the per-head maximum a training forward records equals the largest unmasked entry of
  ``q k^T * scale`` computed from the weights (both attention bodies, grouped queries, query-key
  layer scaling, a padding mask), taken over micro-batches, and nothing is recorded in
  evaluation;
- the rescale scales each query group's query rows by ``eta^alpha`` and key rows by
  ``eta^(1 - alpha)`` (``eta = threshold / group max``), leaves gates, values and biases alone,
  and so brings a clipped group's largest logit to exactly the threshold; multi-latent attention
  scales the rotary query rows by ``eta`` and leaves the shared rotary key alone;
- one optimizer step of a tiny GPT with the clip equals the plain step followed by the clip
  computed by hand from the layer inputs;
- the mixed-precision optimizer scales its fp32 main weights, the model weights follow;
- the flags parse with Megatron's defaults, bad combinations are refused in one line, and the
  value reaches the log line and TensorBoard.

Everything runs in float64 unless noted; two computations of the same number in another order
agree to ~1e-15 relative, so 1e-12 catches any wrong formula.
"""

import argparse
import copy
import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.core.utils import init_method_normal
from megatron.model.attention import ParallelAttention
from megatron.model.enums import AttnMaskType
from megatron.model.gpt_model import GPTModel
from megatron.model.multi_latent_attention import MultiLatentAttention
from megatron.model.rotary_pos_embedding import build_rotary_embedding
from megatron.optimizer import (FP32Optimizer, Float16OptimizerWithFloat16Params,
                                OptimizerConfig, qk_clip)
from megatron.training import log as training_log
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.train_state import TrainState
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

HEADS, HN, HIDDEN, SEQ, BATCH = 4, 8, 32, 6, 2


def _attention(groups=HEADS, layer_number=1, attn_mask_type=AttnMaskType.causal, **kw):
    config = make_config(num_attention_heads=HEADS, num_query_groups=groups,
                         log_max_attention_logit=True, **kw)
    torch.manual_seed(0)
    init = init_method_normal(0.3)
    return ParallelAttention(config, layer_number, None, 1, False, init, init,
                             attn_mask_type=attn_mask_type)


def _qk_fp64(attn, x):
    """Query ``[s, b, heads, hn]`` and key ``[s, b, groups, hn]`` in fp64 from the weights and
    bias of ``attn`` (rows per group: queries, key, value)."""
    w = attn.query_key_value.weight.detach().double()
    bias = attn.query_key_value.bias.detach().double()
    groups = attn.num_groups
    per = HEADS // groups
    rows = (per + 2) * HN
    q_rows = [r for g in range(groups) for r in range(g * rows, g * rows + per * HN)]
    k_rows = [r for g in range(groups)
              for r in range(g * rows + per * HN, g * rows + (per + 1) * HN)]
    s, b, _ = x.shape
    q = (x.double() @ w[q_rows].T + bias[q_rows]).view(s, b, HEADS, HN)
    k = (x.double() @ w[k_rows].T + bias[k_rows]).view(s, b, groups, HN)
    return q, k


def _max_logits_fp64(attn, x, mask=None):
    """Per head: the largest ``q . k / sqrt(hn)`` over the batch and unmasked (query, key)
    pairs, written as loops over heads."""
    q, k = _qk_fp64(attn, x)
    per = HEADS // attn.num_groups
    s = x.size(0)
    if mask is None:
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    out = []
    for h in range(HEADS):
        scores = torch.einsum("sbd,tbd->bst", q[:, :, h], k[:, :, h // per]) / math.sqrt(HN)
        hidden = mask[:, 0] if mask.size(1) == 1 else mask[:, h]
        out.append(scores.masked_fill(hidden.expand_as(scores), float("-inf")).max())
    return torch.stack(out)


def _inputs(seed):
    return torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("flash", [False, True], ids=["explicit", "sdpa"])
@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layer_scaling", [False, True])
def test_max_logit_matches_fp64_reference_over_micro_batches(flash, groups, layer_scaling):
    attn = _attention(groups, layer_number=3, use_flash_attn=flash,
                      apply_query_key_layer_scaling=layer_scaling).train()
    xs = [_inputs(1), _inputs(2)]
    for x in xs:
        attn(x, None)
    want = torch.maximum(_max_logits_fp64(attn, xs[0]), _max_logits_fp64(attn, xs[1]))
    got = attn.core_attention.current_max_attn_logits
    assert got.dtype == torch.float32 and got.shape == (HEADS,)
    # fp32 storage of an fp64 computation: 1e-6 relative.
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(_max_logits_fp64(attn, xs[0]), _max_logits_fp64(attn, xs[1]))


@pytest.mark.parametrize("flash", [False, True], ids=["explicit", "sdpa"])
def test_max_logit_skips_padding_the_mask_hides(flash):
    attn = _attention(use_flash_attn=flash, attn_mask_type=AttnMaskType.padding).train()
    x = _inputs(3)
    mask = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    mask[0, :, :, 2:] = True                     # sequence 0: keys 2.. are padding
    mask[1, :, :, 3:] = True
    attn(x, mask)
    want = _max_logits_fp64(attn, x, mask)
    torch.testing.assert_close(attn.core_attention.current_max_attn_logits.double(), want,
                               rtol=1e-6, atol=1e-6)
    unmasked = _max_logits_fp64(attn, x, torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool))
    assert not torch.allclose(unmasked, want)


def test_sdpa_max_logit_is_computed_in_blocks_of_query_rows(monkeypatch):
    import megatron.model.attention as attention_module
    attn = _attention(use_flash_attn=True).train()
    x = _inputs(4)
    monkeypatch.setattr(attention_module, "MAX_LOGIT_BLOCK_ELEMENTS", BATCH * HEADS * SEQ * 2)
    attn(x, None)                                # blocks of two query rows
    torch.testing.assert_close(attn.core_attention.current_max_attn_logits.double(),
                               _max_logits_fp64(attn, x), rtol=1e-6, atol=1e-6)


def test_nothing_is_recorded_in_evaluation_or_without_the_flags():
    attn = _attention().eval()
    attn(_inputs(1), None)
    assert attn.core_attention.current_max_attn_logits is None
    config = make_config(num_attention_heads=HEADS)
    init = init_method_normal(0.3)
    plain = ParallelAttention(config, 1, None, 1, False, init, init).train()
    plain(_inputs(1), None)
    assert plain.core_attention.current_max_attn_logits is None


def _clip_reference(weight, group_max, threshold, alpha, groups, gate=False):
    """The QKV weight after QK-clip, row by row in fp64."""
    out = weight.detach().double().clone()
    per = HEADS // groups
    rows = ((2 * per if gate else per) + 2) * HN
    for g in range(groups):
        m = float(group_max[g])
        eta = threshold / m if m > threshold else 1.0
        base = g * rows
        out[base:base + per * HN] *= eta ** alpha
        key = base + (2 * per if gate else per) * HN
        out[key:key + HN] *= eta ** (1 - alpha)
    return out


def _sgd_optimizer(modules, lr=0.0):
    params = [p for m in modules for p in m.parameters()]
    return FP32Optimizer(torch.optim.SGD(params, lr=lr), OptimizerConfig(lr=lr, clip_grad=0.0))


@pytest.mark.parametrize("groups,gate", [(HEADS, False), (2, False), (2, True)],
                         ids=["mha", "gqa", "gqa-gate"])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_clip_scales_query_and_key_rows_by_group_like_the_reference(groups, gate, alpha):
    attn = _attention(groups, attention_output_gate=gate, add_bias_linear=False).train()
    x = _inputs(5)
    attn(x, None)
    maxima = attn.core_attention.current_max_attn_logits.clone()
    group_max = maxima.view(groups, -1).amax(1)
    threshold = float(group_max.sort().values[groups // 2 - 1]) if groups > 1 else 0.5
    threshold = min(threshold, float(group_max.max()) * 0.7)   # at least one group clipped
    want = _clip_reference(attn.query_key_value.weight, group_max, threshold, alpha, groups,
                           gate)
    qk_clip.clip([attn], _sgd_optimizer([attn]), threshold, alpha)
    torch.testing.assert_close(attn.query_key_value.weight.detach(), want, rtol=1e-14,
                               atol=0)
    # Logits are bilinear in the query and key weights: a clipped group's largest logit is now
    # the threshold, the others are as they were.
    attn.core_attention.current_max_attn_logits = None
    attn(x, None)
    after = attn.core_attention.current_max_attn_logits.view(groups, -1).amax(1)
    expect = torch.minimum(group_max, torch.full_like(group_max, threshold))
    torch.testing.assert_close(after, expect, rtol=1e-6, atol=1e-6)


def test_nothing_is_scaled_when_no_head_exceeds_the_threshold():
    attn = _attention().train()
    attn(_inputs(1), None)
    before = attn.query_key_value.weight.detach().clone()
    top = float(attn.core_attention.current_max_attn_logits.max())
    assert attn.qk_clip_row_factors(top, 0.5) == []
    qk_clip.clip([attn], _sgd_optimizer([attn]), top + 1.0, 0.5)
    assert torch.equal(attn.query_key_value.weight, before)


MLA_D, MLA_R, MLA_DV, MLA_C = 8, 4, 6, 16


def _mla(q_lora_rank):
    config = make_config(num_attention_heads=HEADS, position_embedding_type="rope",
                         multi_latent_attention=True, q_lora_rank=q_lora_rank,
                         kv_lora_rank=MLA_C, qk_head_dim=MLA_D, qk_pos_emb_head_dim=MLA_R,
                         v_head_dim=MLA_DV, qk_clip=True, add_bias_linear=False)
    torch.manual_seed(3)
    init = init_method_normal(0.3)
    return MultiLatentAttention(config, 1, None, 1, False, init, init).train(), config


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_clip_splits_the_query_scale_between_no_position_and_rotary_rows(q_lora_rank):
    mla, config = _mla(q_lora_rank)
    rotary = build_rotary_embedding(config)(SEQ)
    x = _inputs(6)
    mla(x, None, rotary)
    maxima = mla.core_attention.current_max_attn_logits.clone()
    threshold, alpha = float(maxima.median()), 0.3
    query = mla.linear_q_proj if q_lora_rank is None else mla.linear_q_up_proj
    q_want = query.weight.detach().clone()
    kv_want = mla.linear_kv_up_proj.weight.detach().clone()
    down_before = mla.linear_kv_down_proj.weight.detach().clone()
    for h in range(HEADS):
        m = float(maxima[h])
        eta = threshold / m if m > threshold else 1.0
        q0, k0 = h * (MLA_D + MLA_R), h * (MLA_D + MLA_DV)
        q_want[q0:q0 + MLA_D] *= eta ** alpha
        q_want[q0 + MLA_D:q0 + MLA_D + MLA_R] *= eta
        kv_want[k0:k0 + MLA_D] *= eta ** (1 - alpha)
    qk_clip.clip([mla], _sgd_optimizer([mla]), threshold, alpha)
    torch.testing.assert_close(query.weight.detach(), q_want, rtol=1e-14, atol=0)
    torch.testing.assert_close(mla.linear_kv_up_proj.weight.detach(), kv_want, rtol=1e-14,
                               atol=0)
    assert torch.equal(mla.linear_kv_down_proj.weight, down_before)   # shared rotary key
    mla.core_attention.current_max_attn_logits = None
    mla(x, None, rotary)
    torch.testing.assert_close(mla.core_attention.current_max_attn_logits,
                               torch.clamp(maxima, max=threshold), rtol=1e-6, atol=1e-6)


def _gpt():
    config = make_config(qk_clip=True, num_layers=2)
    torch.manual_seed(7)
    return GPTModel(config, single_process_state(), init_seed=7)


class _Stub:
    dp_cp_group = None
    model_parallel_group = None


def test_one_step_with_qk_clip_equals_the_plain_step_and_a_hand_computed_clip():
    model = _gpt().train()
    plain = copy.deepcopy(model)
    layers = [layer.self_attention for layer in model.language_model.encoder.layers]
    inputs = {}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
    before = [copy.deepcopy(layer) for layer in layers]   # the weights the forward used
    ids, pos, labels = make_batch()
    lr, threshold, alpha = 0.5, None, 0.5
    for net in (model, plain):
        net(ids, pos, None, labels=labels).mean().backward()
    # The maxima are kept in fp32 (as Megatron-Core keeps them); eta is formed from those.
    maxima = [_max_logits_fp64(before[i], inputs[i]).float().double()
              for i in range(len(layers))]
    threshold = float(torch.cat(maxima).median())
    opt, plain_opt = _sgd_optimizer([model], lr), _sgd_optimizer([plain], lr)
    opt.step()
    plain_opt.step()
    largest = qk_clip.finish_step([model], opt, _Stub(), clip_weights=True,
                                  threshold=threshold, alpha=alpha)
    assert largest == pytest.approx(float(torch.cat(maxima).max()), rel=1e-6)
    plain_layers = plain.language_model.encoder.layers
    for i, layer in enumerate(layers):
        assert layer.core_attention.current_max_attn_logits is None      # reset
        want = _clip_reference(plain_layers[i].self_attention.query_key_value.weight,
                               maxima[i], threshold, alpha, HEADS)
        torch.testing.assert_close(layer.query_key_value.weight.detach(), want, rtol=1e-12,
                                   atol=0)
    clipped = {n for n, p in model.named_parameters()
               if not torch.equal(p, dict(plain.named_parameters())[n])}
    assert clipped and all(n.endswith("query_key_value.weight") for n in clipped)


def test_skipped_step_resets_without_clipping():
    model = _gpt().train()
    ids, pos, labels = make_batch()
    model(ids, pos, None, labels=labels)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    largest = qk_clip.finish_step([model], _sgd_optimizer([model]), _Stub(), clip_weights=False,
                                  threshold=1e-6, alpha=0.5)
    assert largest > 1e-6
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(m.current_max_attn_logits is None for m in model.modules()
               if hasattr(m, "current_max_attn_logits"))


def test_mixed_precision_optimizer_scales_the_fp32_main_weight_and_the_model_follows():
    weight = torch.nn.Parameter(torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
                                .to(torch.bfloat16))
    opt = Float16OptimizerWithFloat16Params(
        torch.optim.SGD([weight], lr=0.0), OptimizerConfig(lr=0.0, bf16=True, clip_grad=0.0),
        grad_scaler=None)
    main = opt.fp32_from_float16_groups[0][0]
    main.data.add_(1e-3)                           # a main weight finer than bf16 can hold
    start = main.detach().clone()
    factor = torch.tensor([1.0, 0.5, 0.3, 1.0, 0.7, 1.0])
    opt.scale_param_rows([(weight, factor)])
    torch.testing.assert_close(main, start * factor[:, None], rtol=0, atol=0)
    assert torch.equal(weight.detach(), main.detach().to(torch.bfloat16))


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 3 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


def _validated(*flags, world_size=1):
    args = parse_args(argv=BASE + list(flags))
    args.world_size, args.rank = world_size, 0
    return validate_args(args)


def test_flags_parse_with_megatron_defaults_and_reach_the_model_config():
    from megatron.training.configs import build_configs
    args = _validated()
    assert (args.qk_clip, args.qk_clip_alpha, args.qk_clip_threshold,
            args.log_max_attention_logit) == (False, 0.5, 100, False)
    args = _validated("--qk-clip", "--qk-clip-alpha", "0.25", "--qk-clip-threshold", "30",
                      "--log-max-attention-logit")
    args.padded_vocab_size = 128
    model = build_configs(args).model
    assert (model.qk_clip, model.qk_clip_alpha, model.qk_clip_threshold,
            model.log_max_attention_logit) == (True, 0.25, 30.0, True)


@pytest.mark.parametrize("flags,words", [
    (("--qk-clip", "--context-parallel-size", "2"), "--context-parallel-size"),
    (("--log-max-attention-logit", "--context-parallel-size", "2"), "--context-parallel-size"),
    (("--qk-clip", "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"),
     "--use-torch-fsdp2"),
    (("--qk-clip", "--optimizer-cpu-offload", "--use-distributed-optimizer"),
     "--optimizer-cpu-offload"),
    (("--qk-clip", "--qk-clip-alpha", "1.5"), "--qk-clip-alpha"),
    (("--qk-clip", "--qk-clip-threshold", "0"), "--qk-clip-threshold"),
])
def test_combinations_that_cannot_run_are_refused_in_one_line(flags, words):
    with pytest.raises((ArgumentsError, SystemExit, ConfigError)) as info:
        _validated(*flags, world_size=2)
    message = str(info.value)
    assert words in message
    assert "--qk-clip" in message or "--log-max-attention-logit" in message
    assert "\n" not in message.strip()


def test_log_line_and_tensorboard_carry_the_value():
    args = _validated("--log-max-attention-logit")
    state = TrainState(iteration=3, consumed_train_samples=12, max_attention_logit=12.34567)
    stats = training_log.IntervalStats()
    stats.add({"lm loss": 2.0}, False)
    line = training_log.format_log_line(args, state, stats, 1e-3, 4, 1.0, 0.5)
    assert "| max attention logit: 12.346 |" in line
    assert "max attention logit" not in training_log.format_log_line(
        args, TrainState(iteration=3), stats, 1e-3, 4, 1.0, 0.5)

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, name, value, step):
            self.scalars[name] = (value, step)

    args.tensorboard_log_interval = 1
    writer = Writer()
    training_log.write_train_scalars(writer, args, state, {"lm loss": 2.0}, 1e-3, 4, 1.0, 0.5)
    assert writer.scalars["max_attention_logit"] == (12.34567, 3)
    args.log_max_attention_logit = False
    writer = Writer()
    training_log.write_train_scalars(writer, args, state, {"lm loss": 2.0}, 1e-3, 4, 1.0, 0.5)
    assert "max_attention_logit" not in writer.scalars

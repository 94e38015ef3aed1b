"""Megatron flags that change numerics, each against an independent reference.

References are fp64 formulas written out here, naive loops, or the same model with the
equivalent explicit setting (e.g. ``--apply-layernorm-1p`` with weight ``w`` against the plain
LayerNorm with weight ``1 + w``). Everything runs in float64: two computations of one function
that differ only in operation order agree to ~1e-15 relative, so 1e-12 absolute leaves a wide
margin and any wrong formula still shows up at 1e-3 or more.
"""

import math

import pytest
import torch

from megatron.training.arguments import ArgumentsError, build_configs, parse_args, validate_args
from megatron.convert.hf import family_for_meta
from megatron.convert.megatron_layout import layer_tensor_names, layer_tensor_shapes, tp_split_rule
from megatron.convert.schema import ConversionError, ModelMeta
from megatron.core.config import ConfigError
from megatron.fused_kernels.layer_norm import FusedLayerNorm
from megatron.fused_kernels.softmax import FusedScaleMaskSoftmax, attention_mask_func
from megatron.model import GPTModel
from megatron.model.attention import CoreAttention
from megatron.model.enums import AttnMaskType
from megatron.model.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.optimizer import OptimizerConfig, OptimizerParamScheduler, get_param_groups
from tests.unit.test_gpt_model import (
    loss_and_grads,
    make_batch,
    make_config,
    single_process_state,
)

ATOL = 1e-12
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 10 --vocab-size 100 "
        "--tokenizer-type NullTokenizer").split()


def _validated(*extra):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = 1
    return validate_args(args)


def _model_config(*extra):
    args = _validated(*extra)
    args.padded_vocab_size = 128
    return build_configs(args).model


def _gpt(seed=1234, **overrides):
    return GPTModel(make_config(**overrides), single_process_state(), init_seed=seed)


def _randomise_norms(model, gen_seed=0):
    """Norm weights away from their initial ones/zeros, so a wrong formula shows."""
    g = torch.Generator().manual_seed(gen_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _copy_weights(src, dst, transform=lambda name, t: t):
    with torch.no_grad():
        for (name, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
            q.copy_(transform(name, p.detach()))


# ---- --apply-layernorm-1p ------------------------------------------------------------------------


def test_layernorm_1p_formula_and_zero_init():
    norm = FusedLayerNorm(8, eps=1e-5, params_dtype=torch.float64, apply_layernorm_1p=True)
    assert torch.equal(norm.weight, torch.zeros(8, dtype=torch.float64))
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-5) * (1 + norm.weight) + norm.bias
    torch.testing.assert_close(norm(x), want, rtol=0, atol=ATOL)


def test_layernorm_1p_model_equals_plain_model_with_weight_plus_one():
    one_p = _gpt(apply_layernorm_1p=True)
    for name, p in one_p.named_parameters():
        if "layernorm.weight" in name:
            assert torch.equal(p, torch.zeros_like(p)), name
    _randomise_norms(one_p)
    plain = _gpt()
    _copy_weights(one_p, plain, lambda n, t: t + 1 if "layernorm.weight" in n else t)
    batch = make_batch()
    la, _ = loss_and_grads(one_p, batch)
    lb, _ = loss_and_grads(plain, batch)
    torch.testing.assert_close(la, lb, rtol=0, atol=ATOL)
    for (n, p), (_, q) in zip(one_p.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=ATOL, msg=n)


def test_layernorm_1p_with_rmsnorm_is_refused_naming_both_flags():
    with pytest.raises(ArgumentsError, match="--apply-layernorm-1p.*--normalization RMSNorm"):
        _validated("--apply-layernorm-1p", "--normalization", "RMSNorm")
    with pytest.raises(ConfigError, match="--apply-layernorm-1p"):
        make_config(apply_layernorm_1p=True, normalization="RMSNorm")


# ---- --squared-relu ------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", [True, False])
def test_squared_relu_mlp_against_formula(fusion):
    model = _gpt(squared_relu=True, bias_gelu_fusion=fusion)
    mlp = model.language_model.encoder.layers[0].mlp
    with torch.no_grad():
        mlp.dense_h_to_4h.bias.normal_()
    x = torch.randn(6, 2, 32, dtype=torch.float64)
    out, bias = mlp(x)
    h = x @ mlp.dense_h_to_4h.weight.T + mlp.dense_h_to_4h.bias
    want = torch.clamp(h, min=0) ** 2 @ mlp.dense_4h_to_h.weight.T
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=ATOL)
    assert bias is mlp.dense_4h_to_h.bias


@pytest.mark.parametrize("other", [["--swiglu"], ["--openai-gelu"]])
def test_squared_relu_with_another_activation_is_refused(other):
    with pytest.raises(ArgumentsError, match=f"--squared-relu.*{other[0]}"):
        _validated("--squared-relu", *other)


# ---- rotary: --rotary-interleaved, --rotary-base, --rotary-seq-len-interpolation-factor ---------


def _rotary_reference(t, d, base, pair, factor=1.0):
    """Rotate channel pairs ``pair(i)`` of ``t`` [s, ...] by ``(p / factor) * base^(-2i/d)``."""
    want = t.clone()
    for p in range(t.shape[0]):
        for i in range(d // 2):
            angle = (p / factor) * base ** (-2 * i / d)
            a_idx, c_idx = pair(i)
            a, c = t[p, ..., a_idx], t[p, ..., c_idx]
            want[p, ..., a_idx] = a * math.cos(angle) - c * math.sin(angle)
            want[p, ..., c_idx] = c * math.cos(angle) + a * math.sin(angle)
    return want


def test_rotary_interleaved_rotates_neighbouring_pairs():
    d, base, s = 6, 100, 5
    freqs = RotaryEmbedding(d, base, rotary_interleaved=True)(s)
    t = torch.randn(s, 2, 3, 8, dtype=torch.float64)
    got = apply_rotary_pos_emb(t, freqs, rotary_interleaved=True)
    want = _rotary_reference(t, d, base, lambda i: (2 * i, 2 * i + 1))
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)   # channels 6, 7 pass through


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_base_and_interpolation_factor_against_formula(interleaved):
    d, base, factor, s = 8, 500, 4, 7
    rope = RotaryEmbedding(d, base, interleaved, seq_len_interpolation_factor=factor)
    t = torch.randn(s, 1, 2, d, dtype=torch.float64)
    got = apply_rotary_pos_emb(t, rope(s), interleaved)
    pair = (lambda i: (2 * i, 2 * i + 1)) if interleaved else (lambda i: (i, i + d // 2))
    torch.testing.assert_close(got, _rotary_reference(t, d, base, pair, factor), rtol=0,
                               atol=ATOL)
    # With an offset (generation), position p + offset is scaled the same way.
    angles = rope(3, offset=4)[:, 0, 0, 0]
    torch.testing.assert_close(angles, torch.tensor([4 / factor, 5 / factor, 6 / factor],
                                                    dtype=torch.float64), rtol=0, atol=ATOL)


def test_rotary_flags_reach_the_model():
    cfg = _model_config("--position-embedding-type", "rope", "--rotary-base", "500",
                        "--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "2")
    assert (cfg.rotary_base, cfg.rotary_interleaved, cfg.rotary_seq_len_interpolation_factor) \
        == (500, True, 2)
    cfg.params_dtype = torch.float64
    model = GPTModel(cfg, single_process_state())
    rope = model.language_model.rotary_pos_emb
    want = RotaryEmbedding(8, 500, True, 2)(16)
    assert torch.equal(rope(16), want)
    assert model.language_model.encoder.layers[0].self_attention.rotary_interleaved


def _halves_to_interleaved_rows(d):
    """Row order of a head that makes interleaved rotary equal the halves rotary: new row 2i is
    old row i and new row 2i + 1 is old row i + d/2."""
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).flatten()


def test_rotary_interleaved_model_equals_halves_model_with_permuted_qk_rows():
    over = dict(position_embedding_type="rope")
    halves = _gpt(**over)
    inter = _gpt(rotary_interleaved=True, **over)
    heads, d = 4, 8
    perm = _halves_to_interleaved_rows(d)

    def permute(name, t):
        if "query_key_value" not in name:
            return t
        rows = t.view(heads, 3, d, *t.shape[1:]).clone()      # [np, (q, k, v), hn, ...]
        rows[:, :2] = rows[:, :2, perm]
        return rows.view(t.shape)

    _copy_weights(halves, inter, permute)
    with torch.no_grad():
        for m in (halves, inter):
            for layer in m.language_model.encoder.layers:
                layer.self_attention.query_key_value.bias.zero_()
    batch = make_batch()
    la, _ = loss_and_grads(halves, batch)
    lb, _ = loss_and_grads(inter, batch)
    torch.testing.assert_close(la, lb, rtol=0, atol=ATOL)
    assert not torch.equal(la, loss_and_grads(_gpt(rotary_interleaved=True, **over), batch)[0])


# ---- --init-method-xavier-uniform ----------------------------------------------------------------


def test_xavier_uniform_covers_every_weight_megatron_initialises():
    cfg = dict(init_method_xavier_uniform=True, untie_embeddings_and_output_weights=True,
               swiglu=True)
    model = _gpt(**cfg)
    ffn = model.config.ffn_hidden_size
    full_shapes = {
        "embedding.word_embeddings.weight": (128, 32),
        "embedding.position_embeddings.weight": (16, 32),
        "self_attention.query_key_value.weight": (96, 32),
        "self_attention.dense.weight": (32, 32),
        "mlp.dense_h_to_4h.weight": (2 * ffn, 32),
        "mlp.dense_4h_to_h.weight": (32, ffn),
        "output_layer.weight": (128, 32),
    }
    seen = set()
    for name, p in model.named_parameters():
        key = next((k for k in full_shapes if name.endswith(k)), None)
        if key is None:
            continue
        seen.add(key)
        fan_out, fan_in = full_shapes[key]
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        assert p.abs().max() <= bound, name
        # Uniform on [-a, a]: the largest of n >= 512 draws is within a few 1/n of a, and the
        # standard deviation is a / sqrt(3) (a normal init of std 0.02 fails both).
        assert p.abs().max() > 0.97 * bound, name
        torch.testing.assert_close(p.std().item(), bound / math.sqrt(3), rtol=0.1, atol=0,
                                   msg=name)
    assert seen == set(full_shapes)
    default = _gpt()
    weight = default.language_model.encoder.layers[0].self_attention.query_key_value.weight
    assert abs(weight.std().item() - 0.02) < 0.003      # default unchanged: N(0, 0.02^2)


def test_xavier_uniform_flag_reaches_the_config():
    assert _model_config("--init-method-xavier-uniform").init_method_xavier_uniform
    assert not _model_config().init_method_xavier_uniform


# ---- --apply-query-key-layer-scaling, --attention-softmax-in-fp32 --------------------------------


def _naive_causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal) v in fp64, per head: [s, b, np, hn] -> [s, b, np*hn]."""
    s, b, np_, hn = q.shape
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) / math.sqrt(hn)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bhij,jbhd->ibhd", torch.softmax(scores, -1), v)
    return ctx.reshape(s, b, np_ * hn)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layer_number", [1, 3])
def test_query_key_layer_scaling_is_the_same_function(fused, layer_number):
    cfg = make_config(apply_query_key_layer_scaling=True, masked_softmax_fusion=fused)
    assert cfg.attention_softmax_in_fp32
    core = CoreAttention(cfg, layer_number, 4)
    assert core.norm_factor == pytest.approx(math.sqrt(8) * layer_number)
    assert core.scale_mask_softmax.scale == layer_number
    assert core.scale_mask_softmax.softmax_in_fp32
    q, k, v = (torch.randn(6, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(core(q, k, v, None), _naive_causal_attention(q, k, v), rtol=0,
                               atol=ATOL)


def test_query_key_layer_scaling_flags_and_softmax_in_fp32():
    assert not _validated().apply_query_key_layer_scaling
    assert not _validated("--no-query-key-layer-scaling").apply_query_key_layer_scaling
    args = _validated("--apply-query-key-layer-scaling")
    assert args.apply_query_key_layer_scaling and args.attention_softmax_in_fp32
    cfg = _model_config("--apply-query-key-layer-scaling")
    assert cfg.apply_query_key_layer_scaling and cfg.attention_softmax_in_fp32
    assert _model_config("--attention-softmax-in-fp32").attention_softmax_in_fp32
    assert not _model_config().attention_softmax_in_fp32


def test_attention_softmax_in_fp32_computes_half_scores_softmax_in_fp32():
    scores = (4 * torch.randn(2, 3, 5, 5, dtype=torch.float64)).to(torch.bfloat16)
    want = torch.softmax(scores.double().masked_fill(
        torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")), -1)
    fp32 = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, False, attention_mask_func,
                                 True, None)(scores, None)
    assert fp32.dtype == torch.bfloat16
    # fp32 arithmetic then one rounding to bf16: within half a bf16 ulp (2^-9 relative) of the
    # exact probabilities, plus fp32's own ~1e-7.
    assert ((fp32.double() - want).abs() <= want * 2.0 ** -8 + 1e-6).all()
    cfg = make_config(attention_softmax_in_fp32=True, bf16=True, params_dtype=torch.bfloat16,
                      masked_softmax_fusion=False)
    assert CoreAttention(cfg, 1, 4).scale_mask_softmax.softmax_in_fp32


# ---- --qk-layernorm ------------------------------------------------------------------------------


def _naive_attention_with_qk_norm(x, attn, heads, d, normalization):
    """Attention written out from the weights: qkv rows per head, norm over head_dim, causal."""
    s, b, _ = x.shape
    mixed = (x @ attn.query_key_value.weight.T + attn.query_key_value.bias).view(s, b, heads, 3, d)
    q, k, v = mixed[..., 0, :], mixed[..., 1, :], mixed[..., 2, :]

    def norm(t, module):
        if normalization == "RMSNorm":
            return t / torch.sqrt((t ** 2).mean(-1, keepdim=True) + 1e-5) * module.weight
        mean = t.mean(-1, keepdim=True)
        var = ((t - mean) ** 2).mean(-1, keepdim=True)
        return (t - mean) / torch.sqrt(var + 1e-5) * module.weight + module.bias

    q, k = norm(q, attn.q_layernorm), norm(k, attn.k_layernorm)
    return _naive_causal_attention(q, k, v) @ attn.dense.weight.T


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_against_naive_attention(normalization):
    model = _gpt(qk_layernorm=True, normalization=normalization)
    attn = model.language_model.encoder.layers[0].self_attention
    _randomise_norms(model)
    with torch.no_grad():
        attn.query_key_value.bias.normal_()
    x = torch.randn(6, 2, 32, dtype=torch.float64)
    out, _ = attn(x, None)
    want = _naive_attention_with_qk_norm(x, attn, 4, 8, normalization)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=ATOL)
    for p in (*attn.q_layernorm.parameters(), *attn.k_layernorm.parameters()):
        assert p.shape == (8,) and p.sum_grad_over_tp


def test_qk_layernorm_parameter_names_follow_megatron_core():
    names = [n for n, _ in _gpt(qk_layernorm=True).named_parameters()]
    prefix = "language_model.encoder.layers.1.self_attention."
    for norm in ("q_layernorm", "k_layernorm"):
        assert f"{prefix}{norm}.weight" in names and f"{prefix}{norm}.bias" in names
    rms = [n for n, _ in _gpt(qk_layernorm=True, normalization="RMSNorm").named_parameters()]
    assert f"{prefix}q_layernorm.weight" in rms and f"{prefix}q_layernorm.bias" not in rms
    assert not any("q_layernorm" in n for n, _ in _gpt().named_parameters())
    assert _model_config("--qk-layernorm").qk_layernorm


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_tensors_in_the_converter_table_match_the_model(normalization):
    meta = ModelMeta(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=4, kv_channels=8, max_position_embeddings=16,
                     vocab_size=100, padded_vocab_size=128, normalization=normalization,
                     qk_layernorm=True)
    model = _gpt(qk_layernorm=True, normalization=normalization)
    prefix = "language_model.encoder.layers.0."
    want = {n[len(prefix):]: tuple(p.shape) for n, p in model.named_parameters()
            if n.startswith(prefix)}
    assert layer_tensor_names(meta) == list(want)
    assert layer_tensor_shapes(meta) == want
    assert tp_split_rule("self_attention.q_layernorm.weight", False) is None   # replicated


@pytest.mark.parametrize("source_args", [{"apply_layernorm_1p": True}, {"squared_relu": True},
                                         {"rotary_interleaved": True},
                                         {"rotary_seq_len_interpolation_factor": 2}, {}])
def test_hf_export_refuses_numerics_flags_in_one_line(source_args):
    meta = ModelMeta(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=4, kv_channels=8, max_position_embeddings=16,
                     vocab_size=100, padded_vocab_size=128, source_args=source_args,
                     qk_layernorm=not source_args)
    flag = "--" + (next(iter(source_args)) if source_args else "qk_layernorm").replace("_", "-")
    with pytest.raises(ConversionError, match=f"^{flag}: ") as err:
        family_for_meta(meta)
    assert "\n" not in str(err.value)
    family_for_meta(ModelMeta(**{**meta.__dict__, "source_args": {}, "qk_layernorm": False}))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_parameters_are_counted_for_memory(normalization):
    from megatron.training.memory_accounting import num_parameters_on_rank

    model = _gpt(qk_layernorm=True, normalization=normalization)
    assert num_parameters_on_rank(model.config) == sum(p.numel() for p in model.parameters())


def test_qk_layernorm_uses_the_1p_form_too():
    attn = _gpt(qk_layernorm=True, apply_layernorm_1p=True).language_model.encoder.layers[0]
    assert torch.equal(attn.self_attention.q_layernorm.weight, torch.zeros(8, dtype=torch.float64))
    assert attn.self_attention.q_layernorm.apply_layernorm_1p


# ---- --decoupled-lr / --decoupled-min-lr ---------------------------------------------------------


LR, MIN_LR, DEC_LR, DEC_MIN_LR, INIT_LR = 1e-3, 1e-4, 5e-3, 2e-4, 1e-5
WARMUP, DECAY = 10, 100


def _schedule(max_lr, min_lr, n):
    """Warmup from INIT_LR, then cosine from max_lr to min_lr, written out."""
    if n <= WARMUP:
        return INIT_LR + (max_lr - INIT_LR) * n / WARMUP
    if n > DECAY:
        return min_lr
    ratio = (n - WARMUP) / (DECAY - WARMUP)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _scheduled_groups(model, **decoupled):
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, **decoupled)
    opt = torch.optim.SGD(get_param_groups([model], config), lr=LR)
    sched = OptimizerParamScheduler(opt, init_lr=INIT_LR, max_lr=LR, min_lr=MIN_LR,
                                    lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=DECAY, wd_incr_style="constant")
    return opt, sched


def _names_of(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("dec_min", [DEC_MIN_LR, None])
def test_decoupled_lr_follows_the_schedule_for_embedding_and_output(dec_min):
    model = _gpt(untie_embeddings_and_output_weights=True)
    opt, sched = _scheduled_groups(model, decoupled_lr=DEC_LR, decoupled_min_lr=dec_min)
    ref_opt, ref_sched = _scheduled_groups(model)
    decoupled = [g for g in opt.param_groups if g["is_decoupled_lr"]]
    names = set().union(*(_names_of(model, g) for g in decoupled))
    assert names == {"language_model.embedding.word_embeddings.weight",
                     "language_model.output_layer.weight"}
    others = [g for g in opt.param_groups if not g["is_decoupled_lr"]]
    assert len(others) == len(ref_opt.param_groups) == 2
    want_min = MIN_LR if dec_min is None else dec_min
    for n in (0, 1, 5, 10, 11, 40, 99, 100, 101, 150):
        sched.num_steps = n - 1
        sched.step(1)
        ref_sched.num_steps = n - 1
        ref_sched.step(1)
        for g in decoupled:
            assert g["lr"] == pytest.approx(_schedule(DEC_LR, want_min, n), rel=1e-12), n
        for g, ref in zip(others, ref_opt.param_groups):
            assert g["lr"] == ref["lr"] == pytest.approx(_schedule(LR, MIN_LR, n), rel=1e-12)
            assert g["weight_decay"] == ref["weight_decay"]


def test_decoupled_lr_marks_the_head_copy_on_the_last_stage_and_not_positions():
    cfg = make_config(num_layers=2)
    last = GPTModel(cfg, single_process_state(2, 1), pre_process=False, post_process=True)
    first = GPTModel(cfg, single_process_state(2, 0), pre_process=True, post_process=False)
    config = OptimizerConfig(lr=LR, decoupled_lr=DEC_LR)
    for model, name in ((last, "word_embeddings_for_head.weight"),
                        (first, "language_model.embedding.word_embeddings.weight")):
        groups = get_param_groups([model], config)
        decoupled = set().union(*(_names_of(model, g) for g in groups if g["is_decoupled_lr"]))
        assert decoupled == {name}
    # Without the flag the groups are exactly as before: no new keys, two groups.
    plain = get_param_groups([first], OptimizerConfig(lr=LR))
    assert len(plain) == 2 and all(set(g) == {"params", "wd_mult", "lr_mult", "lr",
                                              "weight_decay"} for g in plain)


def test_decoupled_lr_flags_are_checked():
    with pytest.raises(ArgumentsError, match="--decoupled-min-lr"):
        _validated("--lr", "1e-3", "--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3")
    with pytest.raises(ConfigError, match="--decoupled-lr"):
        OptimizerConfig(lr=LR, decoupled_lr=-1.0)

"""Megatron-Core's attention variants --qk-l2-norm, --attention-output-gate and --no-rope-freq,
and --embedding-init-method-std: a ParallelAttention against naive fp64 attention written out
here (its own rotary, its own weightless RMS norm, the gate rows read per query group in
Megatron-Core's [queries, gates, key, value] order), and a whole GPT against one built without
the flag.
"""

import argparse
import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.core.utils import init_method_normal
from megatron.model.attention import ParallelAttention
from megatron.model.gpt_model import GPTModel
from megatron.model.rotary_pos_embedding import build_rotary_embedding
from megatron.training.arguments import build_parser, parse_no_rope_freq
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

HEADS, GROUPS, HN, HIDDEN, SEQ, BATCH = 4, 2, 8, 32, 6, 2


def _config(**kw):
    base = dict(num_attention_heads=HEADS, num_query_groups=GROUPS,
                position_embedding_type="rope", num_layers=4, normalization="RMSNorm",
                add_bias_linear=False, layernorm_epsilon=1e-6)
    base.update(kw)
    return make_config(**base)


def _attention(config, layer_number=1):
    torch.manual_seed(0)
    init = init_method_normal(0.3)
    return ParallelAttention(config, layer_number, None, 1, False, init, init).eval()


def _naive_rope(x, theta=10000.0):
    """x [s, b, n, d] rotated by position (the two halves, as Megatron's default)."""
    s, d = x.size(0), x.size(-1)
    out = torch.empty_like(x)
    for p in range(s):
        for i in range(d // 2):
            angle = p / theta ** (2 * i / d)
            c, sn = math.cos(angle), math.sin(angle)
            a, b = x[p, ..., i], x[p, ..., i + d // 2]
            out[p, ..., i] = a * c - b * sn
            out[p, ..., i + d // 2] = b * c + a * sn
    return out


def _naive_attention(attn, x, *, l2=False, gate=False, rope=True, eps=1e-6):
    """fp64 self-attention from ``attn``'s weights, one query group at a time."""
    w = attn.query_key_value.weight.detach().double()             # [rows, h]
    per = HEADS // GROUPS
    rows = (2 * per if gate else per) * HN + 2 * HN
    s, b, _ = x.shape
    q, g, k, v = [], [], [], []
    for group in range(GROUPS):
        block = w[group * rows:(group + 1) * rows]
        q.append(block[:per * HN]); at = per * HN
        if gate:
            g.append(block[at:at + per * HN]); at += per * HN
        k.append(block[at:at + HN]); v.append(block[at + HN:at + 2 * HN])
    x = x.double()
    query = (x @ torch.cat(q).T).view(s, b, HEADS, HN)
    key = (x @ torch.cat(k).T).view(s, b, GROUPS, HN)
    value = (x @ torch.cat(v).T).view(s, b, GROUPS, HN)
    if l2:
        query = query / torch.sqrt((query ** 2).mean(-1, keepdim=True) + eps)
        key = key / torch.sqrt((key ** 2).mean(-1, keepdim=True) + eps)
    if rope:
        query, key = _naive_rope(query), _naive_rope(key)
    key = key.repeat_interleave(per, dim=2)
    value = value.repeat_interleave(per, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) / math.sqrt(HN)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    context = torch.einsum("bhst,tbhd->sbhd", probs, value).reshape(s, b, HEADS * HN)
    if gate:
        context = context * torch.sigmoid(x @ torch.cat(g).T)
    return context @ attn.dense.weight.detach().double().T


def _run(attn, config, x):
    rotary = build_rotary_embedding(config)(SEQ)
    out, _ = attn(x, None, rotary)
    return out


def test_flags_parse_as_megatron_and_bad_values_are_refused():
    parser = build_parser()
    args = parser.parse_args(["--qk-l2-norm", "--attention-output-gate", "--no-rope-freq",
                              "[0,1]*2", "--embedding-init-method-std", "0.5"])
    assert (args.qk_l2_norm, args.attention_output_gate, args.no_rope_freq,
            args.embedding_init_method_std) == (True, True, (0, 1, 0, 1), 0.5)
    defaults = parser.parse_args([])
    assert (defaults.qk_l2_norm, defaults.attention_output_gate, defaults.no_rope_freq,
            defaults.embedding_init_method_std) == (False, False, None, None)
    assert parse_no_rope_freq("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="--no-rope-freq"):
        parse_no_rope_freq("[0,2]")
    with pytest.raises(ConfigError, match="--no-rope-freq 3: an int must"):
        _config(no_rope_freq=3)
    with pytest.raises(ConfigError, match="one 1 \\(no rope\\) or 0 per layer"):
        _config(no_rope_freq=(0, 1))
    with pytest.raises(ConfigError, match="needs --position-embedding-type rope"):
        _config(no_rope_freq=2, position_embedding_type="learned_absolute")
    with pytest.raises(ConfigError, match="--attention-output-gate applies to standard"):
        _config(attention_output_gate=True, multi_latent_attention=True, num_query_groups=None)
    with pytest.raises(ConfigError, match="--embedding-init-method-std must be >= 0"):
        _config(embedding_init_method_std=-1.0)


def test_no_rope_layers_follow_megatrons_pattern():
    every_second = _config(no_rope_freq=2)
    assert [every_second.layer_uses_rope(n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    listed = _config(no_rope_freq=(1, 0, 0, 1))
    assert [listed.layer_uses_rope(n) for n in (1, 2, 3, 4)] == [False, True, True, False]
    assert _config().layer_uses_rope(4)


@pytest.mark.parametrize("l2,gate", [(True, False), (False, True), (True, True)])
def test_attention_matches_naive_fp64(l2, gate):
    config = _config(qk_l2_norm=l2, attention_output_gate=gate)
    attn = _attention(config)
    extra = HEADS * HN if gate else 0
    assert attn.query_key_value.weight.shape == ((HEADS + 2 * GROUPS) * HN + extra, HIDDEN)
    assert not any("layernorm" in n for n, _ in attn.named_parameters())   # L2 norm: no weight
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    want = _naive_attention(attn, x, l2=l2, gate=gate)
    torch.testing.assert_close(_run(attn, config, x), want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(want, _naive_attention(attn, x, l2=not l2, gate=gate))


def test_l2_norm_keeps_bf16_inputs_close_to_fp64():
    config = _config(qk_l2_norm=True)
    attn = _attention(config)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    q = attn.q_layernorm(x.to(torch.bfloat16))
    assert q.dtype == torch.bfloat16
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(q.double(), want, rtol=1e-2, atol=1e-2)


def test_no_rope_layer_ignores_the_rotary_angles():
    config = _config(no_rope_freq=2)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    for layer, rope in ((1, True), (2, False)):
        attn = _attention(config, layer)
        want = _naive_attention(attn, x, rope=rope)
        torch.testing.assert_close(_run(attn, config, x), want, rtol=1e-10, atol=1e-10)


def test_gated_gpt_trains_and_keeps_megatron_keys():
    """A whole gated, L2-normed GPT: the keys are those of a plain one (the gate lives in the
    QKV weight), and a backward reaches every parameter."""
    plain = GPTModel(_config(), single_process_state())
    gated = GPTModel(_config(attention_output_gate=True, qk_l2_norm=True, no_rope_freq=2),
                     single_process_state())
    assert list(plain.state_dict()) == list(gated.state_dict())
    ids, pos, labels = make_batch()
    gated.train()
    gated(ids, pos, None, labels=labels).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gated.parameters())


def test_embedding_init_std_scales_only_the_embeddings():
    """The same draws scaled by std / init-method-std: N(0, s^2) is s times N(0, 1)."""
    base = GPTModel(make_config(untie_embeddings_and_output_weights=True),
                    single_process_state()).state_dict()
    wide = GPTModel(make_config(untie_embeddings_and_output_weights=True,
                                embedding_init_method_std=0.5),
                    single_process_state()).state_dict()
    for name, tensor in base.items():
        if "embeddings" in name:
            torch.testing.assert_close(wide[name], tensor * (0.5 / 0.02), rtol=1e-12, atol=0)
        else:
            assert torch.equal(wide[name], tensor), name


@pytest.mark.parametrize("flag,value", [("attention_output_gate", True), ("qk_l2_norm", True),
                                        ("no_rope_freq", 4)])
def test_conversion_refuses_the_variants_in_one_line(flag, value):
    """A converter would read the gated QKV rows as plain ones: refused, naming the flag."""
    import types

    from megatron.convert.megatron_io import ConversionError, _meta_from_args

    src = types.SimpleNamespace(args=argparse.Namespace(**{flag: value}, num_layers=4),
                                file=lambda *ranks: "iter_0000001/mp_rank_00/model_optim_rng.pt")
    with pytest.raises(ConversionError, match=f"--{flag.replace('_', '-')}: this attention "
                                              "variant has no converter target"):
        _meta_from_args(src, None)

"""Rotary variants (Llama 3.1 ``--use-rope-scaling``, ``--position-embedding-type yarn``) against
references written out here in float64 with Python's ``math`` (one channel at a time, from the
published formulas), and against ``transformers``' own frequency functions.

Our frequencies are computed in float64, so against the fp64 reference 1e-14 relative is the
bar; ``transformers`` computes them in float32, hence 1e-6 relative there. A wrong constant or
ramp moves some frequency by a factor of up to ``factor`` (>= 2 here).
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.model.rotary_pos_embedding import (RotaryEmbedding, YarnSettings,
                                                 apply_rotary_pos_emb, build_rotary_embedding,
                                                 rotary_attention_scale)
from tests.unit.test_numerics_flags import _model_config


def reference_llama3(dim, base, factor):
    """Llama 3.1's frequencies, channel by channel: low / high frequency factors 1 / 4 and 8192
    original positions (Megatron-Core's constants)."""
    out = []
    for i in range(0, dim, 2):
        f = base ** (-i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            out.append(f)
        elif wavelen > 8192 / 1:
            out.append(f / factor)
        else:
            a = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - a) * f / factor + a * f)
    return out


def reference_yarn(dim, base, s, original, beta_fast, beta_slow, round_to_int):
    """YaRN's frequencies, channel by channel, from the paper's ramp between the channels that
    turn beta_fast and beta_slow times over the original positions."""
    def channel(r):
        return dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(base))
    lo, hi = channel(beta_fast), channel(beta_slow)
    if round_to_int:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for j in range(dim // 2):
        f = base ** (-2 * j / dim)
        ramp = min(max((j - lo) / (hi - lo), 0.0), 1.0)
        out.append(f * (1 - ramp) + f / s * ramp)
    return out


def reference_concentration(s, mscale, mscale_all_dim):
    def m(k):
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0
    return m(mscale) / m(mscale_all_dim)


def _close(got, want, rtol):
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got.to(torch.float64).cpu(), want, rtol=rtol, atol=0)


@pytest.mark.parametrize("factor, base, dim", [(8.0, 500000, 128), (2.0, 10000, 64),
                                               (32.0, 1000000, 96)])
def test_llama3_frequencies_match_the_fp64_formula(factor, base, dim):
    rope = RotaryEmbedding(dim, base, rope_scaling_factor=factor)
    want = reference_llama3(dim, base, factor)
    _close(rope.inv_freq, want, 1e-14)
    plain = [base ** (-i / dim) for i in range(0, dim, 2)]
    # All three regimes are exercised: kept, divided, blended.
    kinds = {("kept" if w == p else "divided" if math.isclose(w, p / factor) else "blended")
             for w, p in zip(want, plain)}
    assert kinds == {"kept", "divided", "blended"}


@pytest.mark.parametrize("round_to_int", [True, False])
@pytest.mark.parametrize("s, original, beta_fast, beta_slow, base, dim", [
    (4.0, 64, 32.0, 1.0, 10000, 32), (8.0, 4096, 16.0, 2.0, 1000000, 128),
    (40.0, 4096, 32.0, 1.0, 10000, 64)])
def test_yarn_frequencies_match_the_fp64_formula(s, original, beta_fast, beta_slow, base, dim,
                                                 round_to_int):
    yarn = YarnSettings(scaling_factor=s, original_max_position_embeddings=original,
                        beta_fast=beta_fast, beta_slow=beta_slow,
                        correction_range_round_to_int=round_to_int)
    rope = RotaryEmbedding(dim, base, yarn=yarn)
    want = reference_yarn(dim, base, s, original, beta_fast, beta_slow, round_to_int)
    _close(rope.inv_freq, want, 1e-14)
    plain = [base ** (-2 * j / dim) for j in range(dim // 2)]
    assert want[0] == plain[0] and not math.isclose(want[-1], plain[-1])


@pytest.mark.parametrize("s, mscale, mscale_all_dim", [(4.0, 1.0, 0.0), (40.0, 0.707, 0.707),
                                                       (16.0, 1.0, 0.5), (0.5, 1.0, 0.0)])
def test_yarn_concentration_multiplies_cos_and_sin(s, mscale, mscale_all_dim):
    want = reference_concentration(s, mscale, mscale_all_dim)
    yarn = YarnSettings(scaling_factor=s, mscale=mscale, mscale_all_dim=mscale_all_dim)
    assert yarn.concentration == pytest.approx(want, rel=1e-15)
    dim, seq = 16, 12
    freqs = RotaryEmbedding(dim, 100, yarn=yarn)(seq)                    # [s, 1, 1, d]
    t = torch.randn(seq, 2, 3, dim, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    got = apply_rotary_pos_emb(t, freqs, mscale=yarn.concentration)
    inv = reference_yarn(dim, 100, s, 4096, 32.0, 1.0, True)
    want_t = torch.empty_like(t)
    for p in range(seq):
        for j in range(dim // 2):
            c, n = math.cos(p * inv[j]) * want, math.sin(p * inv[j]) * want
            x, y = t[p, ..., j], t[p, ..., j + dim // 2]
            want_t[p, ..., j] = x * c - y * n
            want_t[p, ..., j + dim // 2] = y * c + x * n
    torch.testing.assert_close(got, want_t, rtol=0, atol=1e-12)


def _hf_config(**kw):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                    max_position_embeddings=256, **kw)


def test_llama3_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(32, 500000, rope_scaling_factor=8.0).inv_freq
    assert scale == 1.0
    torch.testing.assert_close(ours.float().cpu(), theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_and_scale_match_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16.0,
        "beta_slow": 2.0, "original_max_position_embeddings": 64, "truncate": truncate})
    theirs, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    yarn = YarnSettings(scaling_factor=4.0, original_max_position_embeddings=64,
                        beta_fast=16.0, beta_slow=2.0, correction_range_round_to_int=truncate)
    torch.testing.assert_close(RotaryEmbedding(32, 10000, yarn=yarn).inv_freq.float().cpu(),
                               theirs, rtol=1e-6, atol=0)
    assert yarn.concentration == pytest.approx(scale, rel=1e-12)


def test_flags_reach_the_model_config_and_the_embedding():
    config = _model_config("--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                           "--yarn-original-max-position-embeddings", "8", "--yarn-beta-fast",
                           "8", "--yarn-beta-slow", "2", "--mscale", "0.5",
                           "--mscale-all-dim", "0.25", "--no-yarn-correction-range-round-to-int")
    yarn = YarnSettings.from_config(config)
    assert yarn == YarnSettings(4.0, 8, 8.0, 2.0, 0.5, 0.25, False)
    assert rotary_attention_scale(config) == pytest.approx(
        reference_concentration(4.0, 0.5, 0.25), rel=1e-15)
    _close(build_rotary_embedding(config).inv_freq,
           reference_yarn(config.kv_channels, 10000, 4.0, 8, 8.0, 2.0, False), 1e-14)
    # Unset YaRN flags take Megatron-Core's defaults.
    assert YarnSettings.from_config(_model_config("--position-embedding-type", "yarn")) == \
        YarnSettings(1.0, 4096, 32.0, 1.0, 1.0, 0.0, True)
    llama3 = _model_config("--position-embedding-type", "rope", "--use-rope-scaling",
                           "--rope-scaling-factor", "2")
    assert rotary_attention_scale(llama3) == 1.0
    _close(build_rotary_embedding(llama3).inv_freq, reference_llama3(8, 10000, 2.0), 1e-14)
    plain = _model_config("--position-embedding-type", "rope", "--rope-scaling-factor", "2")
    _close(build_rotary_embedding(plain).inv_freq,
           [10000 ** (-i / 8) for i in range(0, 8, 2)], 1e-14)


@pytest.mark.parametrize("extra, flag", [
    (dict(use_rope_scaling=True), "--use-rope-scaling"),
    (dict(rotary_percent=0.5), "--rotary-percent"),
    (dict(rotary_interleaved=True), "--rotary-interleaved"),
    (dict(rotary_seq_len_interpolation_factor=2), "--rotary-seq-len-interpolation-factor"),
    (dict(yarn_rotary_scaling_factor=0.0), "--rotary-scaling-factor"),
    (dict(yarn_beta_fast=-1.0), "--yarn-beta-fast")])
def test_yarn_refuses_what_it_cannot_combine_with(extra, flag):
    with pytest.raises(ConfigError, match=flag):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                          padded_vocab_size=16, max_position_embeddings=8, seq_length=8,
                          position_embedding_type="yarn", **extra)


@pytest.mark.parametrize("overrides", [
    dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
         yarn_original_max_position_embeddings=8, yarn_mscale=0.8, yarn_mscale_all_dim=0.3),
    dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=4.0,
         rotary_base=500000)], ids=["yarn", "llama3"])
def test_cached_decoding_gives_the_full_forward_logits(overrides):
    """Positions after a key/value cache take the angles (and YaRN's factor) of their offset."""
    from megatron.text_generation.inference_params import InferenceParams
    from tests.unit.test_convert_hf import SEQ, VOCAB, build_model

    _, model = build_model(seed=5, normalization="RMSNorm", swiglu=True, **overrides)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        full = model(ids, pos, None)
        cache, prompt = InferenceParams(2, SEQ), SEQ - 4
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_params=cache)]
        cache.sequence_len_offset = prompt
        for i in range(prompt, SEQ):
            steps.append(model(ids[:, i:i + 1], pos[:, i:i + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_rope_angles_stay_real_in_a_meta_device_build():
    """--init-model-with-meta-device fills only parameters and buffers afterwards: the angle
    table (config-derived, no model state) must be real and the same as an ordinary build's."""
    from megatron.core import meta_init

    with meta_init.building(real=None):
        meta_built = RotaryEmbedding(16, rotary_base=500000, rope_scaling_factor=8.0)
    ordinary = RotaryEmbedding(16, rotary_base=500000, rope_scaling_factor=8.0)
    assert not meta_built.inv_freq.is_meta
    assert torch.equal(meta_built(12), ordinary(12))
    reference = reference_llama3(16, 500000, 8.0)
    torch.testing.assert_close(ordinary.inv_freq, torch.tensor(reference, dtype=torch.float64))

"""Rescaled rotaries through Hugging Face folders: ``--use-rope-scaling`` as transformers'
``llama3`` rope type and ``--position-embedding-type yarn`` as ``yarn``, with the same logits in
transformers' own forward (Llama, Qwen2, Qwen3; float32, 1e-5 as in test_convert_hf), the flags
back bit for bit, and configs Megatron's flags cannot express refused by key and value.

Each case also checks that the rescaling really moves the logits (by far more than the
tolerance), so a converter that dropped it would fail.
"""

import dataclasses
import json
import math
import os

import pytest
import torch

from megatron.convert.hf import load_hf
from megatron.convert.schema import ConversionError
from tests.unit.test_convert_hf import (LLAMA, SEQ, VOCAB, assert_same_logits, build_model,
                                        export, make_meta)

transformers = pytest.importorskip("transformers")

# head_dim 8 and base 500000: frequencies with wavelengths 6, 167, 4445 and 118000, i.e. one
# kept, one blended and one divided by Llama 3.1's rule (kept below 2048, divided above 8192).
LLAMA3 = dict(LLAMA, rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=8.0)
# A ramp that passes through the middle of the 4 channels (lo = 0.4, hi = 1.6 unrounded).
YARN = dict(LLAMA, rotary_base=10000, position_embedding_type="yarn",
            yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=64,
            yarn_beta_fast=4.0, yarn_beta_slow=0.25, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
            yarn_correction_range_round_to_int=False)
FAMILIES = {"llama": ({}, "LlamaForCausalLM"),
            "qwen2": (dict(add_qkv_bias=True), "Qwen2ForCausalLM"),
            "qwen3": (dict(qk_layernorm=True), "Qwen3ForCausalLM")}


def _meta(cfg):
    return make_meta(cfg, qk_layernorm=cfg.qk_layernorm, use_rope_scaling=cfg.use_rope_scaling,
                     rope_scaling_factor=cfg.rope_scaling_factor,
                     rotary_scaling_factor=cfg.yarn_rotary_scaling_factor,
                     yarn_original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
                     yarn_beta_fast=cfg.yarn_beta_fast, yarn_beta_slow=cfg.yarn_beta_slow,
                     mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim,
                     yarn_correction_range_round_to_int=cfg.yarn_correction_range_round_to_int)


def _logits(model):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids, torch.arange(SEQ).expand(2, SEQ), None)


def _unscaled(overrides):
    plain = {k: v for k, v in overrides.items()
             if not k.startswith(("yarn_", "use_rope", "rope_scaling"))}
    return dict(plain, position_embedding_type="rope")


@pytest.mark.parametrize("variant", ["llama3", "yarn", "yarn_rounded_mscales"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rescaled_rotary_logits_match_transformers(tmp_path, family, variant):
    extra, architecture = FAMILIES[family]
    overrides = dict(LLAMA3 if variant == "llama3" else YARN, **extra)
    if variant == "yarn_rounded_mscales":
        overrides.update(yarn_correction_range_round_to_int=True, yarn_mscale=0.8,
                         yarn_mscale_all_dim=0.3)
    cfg, model = build_model(seed=21, **overrides)
    _, plain = build_model(seed=21, **_unscaled(overrides))
    assert (_logits(model) - _logits(plain)).abs().max() > 1e-3
    folder = export(tmp_path, model, _meta(cfg))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    rope = config["rope_parameters"]
    assert config["model_type"] == family and rope["rope_type"] == variant.split("_")[0]
    assert config["rope_scaling"] == rope
    assert_same_logits(model, getattr(transformers, architecture), folder)


@pytest.mark.parametrize("variant", ["llama3", "yarn", "yarn_mscale_only"])
def test_rescaled_rotary_flags_round_trip(tmp_path, variant):
    overrides = dict(LLAMA3 if variant == "llama3" else YARN)
    if variant == "yarn_mscale_only":
        # transformers ignores mscale without mscale_all_dim; the written attention_factor
        # carries Megatron's value and reads back as the same --mscale.
        overrides.update(yarn_mscale=0.5)
    cfg, model = build_model(seed=22, **overrides)
    meta = _meta(cfg)
    back = next(load_hf(export(tmp_path, model, meta))).meta
    for name, value in meta.rope_scaling_fields.items():
        exact = value is None or isinstance(value, bool)
        assert getattr(back, name) == (value if exact else pytest.approx(value, rel=1e-14)), name
    assert back.position_embedding_type == meta.position_embedding_type


def _write_rope(folder, **rope):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("rope_scaling", None)
    config["rope_parameters"] = dict(config["rope_parameters"], **rope)
    with open(path, "w") as f:
        json.dump(config, f)


LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


@pytest.mark.parametrize("key, value", [("low_freq_factor", 2.0), ("high_freq_factor", 8.0),
                                        ("original_max_position_embeddings", 4096)])
def test_llama3_settings_megatron_fixes_are_refused_by_key_and_value(tmp_path, key, value):
    cfg, model = build_model(seed=23, **LLAMA)
    folder = export(tmp_path, model, make_meta(cfg))
    _write_rope(folder, **LLAMA31)
    meta = next(load_hf(folder)).meta
    assert (meta.use_rope_scaling, meta.rope_scaling_factor) == (True, 8.0)
    _write_rope(folder, **{key: value})
    with pytest.raises(ConversionError, match=rf"'rope_parameters\.{key}' is {value!r}"):
        load_hf(folder)


def test_yarn_settings_are_read_as_transformers_reads_them(tmp_path):
    cfg, model = build_model(seed=24, **LLAMA)
    folder = export(tmp_path, model, make_meta(cfg))
    _write_rope(folder, rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
    meta = next(load_hf(folder)).meta
    # Unset betas and truncate take transformers' defaults; no attention_factor and no
    # mscale_all_dim: the factor m(1) = 0.1 ln 4 + 1, Megatron's --mscale 1 --mscale-all-dim 0.
    assert dataclasses.asdict(meta)["position_embedding_type"] == "yarn"
    assert (meta.rotary_scaling_factor, meta.yarn_original_max_position_embeddings,
            meta.yarn_beta_fast, meta.yarn_beta_slow, meta.mscale, meta.mscale_all_dim,
            meta.yarn_correction_range_round_to_int) == (4.0, 8, 32.0, 1.0, 1.0, 0.0, True)
    # An attention_factor alone is matched by --mscale with --mscale-all-dim 0.
    _write_rope(folder, attention_factor=1.25)
    meta = next(load_hf(folder)).meta
    assert meta.mscale_all_dim == 0.0
    assert 0.1 * meta.mscale * math.log(4.0) + 1 == pytest.approx(1.25, rel=1e-14)
    _write_rope(folder, attention_factor=None, mscale="big", mscale_all_dim=1.0)
    with pytest.raises(ConversionError, match=r"'rope_parameters\.mscale' is 'big'"):
        load_hf(folder)
    _write_rope(folder, factor=1.0, mscale=None, mscale_all_dim=None, attention_factor=1.5)
    with pytest.raises(ConversionError, match=r"'rope_parameters\.attention_factor' is 1\.5"):
        load_hf(folder)
    _write_rope(folder, rope_type="dynamic")
    with pytest.raises(ConversionError, match=r"'rope_parameters\.rope_type' is 'dynamic'"):
        load_hf(folder)


@pytest.mark.parametrize("overrides, flag", [
    (dict(position_embedding_type="rope", rotary_percent=0.5, use_rope_scaling=True,
          rotary_base=500), "--use-rope-scaling: GPTNeoXForCausalLM"),
    (dict(position_embedding_type="yarn", swiglu=True, add_bias_linear=False),
     "--position-embedding-type yarn: StableLmForCausalLM")])
def test_families_without_rescaled_rotary_refuse_it(tmp_path, overrides, flag):
    from megatron.convert.hf import family_for_meta

    cfg, _ = build_model(seed=0, **overrides)
    with pytest.raises(ConversionError, match=flag):
        family_for_meta(_meta(cfg))


@pytest.mark.parametrize("rope_scaling, want", [
    # Llama 3.1's own config.json: the older key, rope_theta at the top level.
    (dict(LLAMA31), dict(position_embedding_type="rope", use_rope_scaling=True,
                         rope_scaling_factor=8.0, rotary_base=500000)),
    # Qwen2.5's long-context recipe: "type" rather than "rope_type".
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=8),
     dict(position_embedding_type="yarn", rotary_scaling_factor=4.0,
          yarn_original_max_position_embeddings=8, rotary_base=500000))])
def test_published_config_spellings_are_read(tmp_path, rope_scaling, want):
    cfg, model = build_model(seed=25, **dict(LLAMA, rotary_base=500000))
    folder = export(tmp_path, model, make_meta(cfg))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["rope_parameters"]
    config.update(rope_scaling=rope_scaling, rope_theta=500000.0)
    with open(path, "w") as f:
        json.dump(config, f)
    meta = next(load_hf(folder)).meta
    assert {name: getattr(meta, name) for name in want} == want

"""Dense Qwen2 (``--add-qkv-bias --disable-bias-linear``) and Qwen3 (``--qk-layernorm``) models
as Hugging Face ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` folders and back: the same logits in
transformers (float32, 1e-5, see test_convert_hf), every tensor bit for bit after a round
trip, and what the families cannot compute refused by flag or config key.
"""

import dataclasses
import json
import os
import types

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError, ModelMeta
from tests.unit.test_convert_hf import (LLAMA, NOT_ROUND_TRIPPED, VOCAB, assert_same_logits,
                                        build_model, canonical_pieces, export, make_meta)

transformers = pytest.importorskip("transformers")

QWEN2 = dict(LLAMA, add_qkv_bias=True)
QWEN3 = dict(LLAMA, qk_layernorm=True)


def _build(seed, **overrides):
    cfg, model = build_model(seed=seed, **overrides)
    return make_meta(cfg, qk_layernorm=cfg.qk_layernorm), model


def _config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("untied, kv_channels", [(False, None), (True, None), (True, 12)])
def test_qwen2_logits_match_transformers(tmp_path, untied, kv_channels):
    meta, model = _build(11, **QWEN2, untie_embeddings_and_output_weights=untied,
                         kv_channels=kv_channels)
    folder = export(tmp_path, model, meta)
    config = _config(folder)
    assert config["model_type"] == "qwen2" and config["use_sliding_window"] is False
    assert "attention_bias" not in config and config["tie_word_embeddings"] == (not untied)
    assert config["head_dim"] == meta.kv_channels
    assert_same_logits(model, transformers.Qwen2ForCausalLM, folder)


@pytest.mark.parametrize("kv_channels", [None, 12])
def test_qwen3_logits_match_transformers(tmp_path, kv_channels):
    """The q / k norms are RMSNorms over head_dim before the rotary; a head_dim other than
    hidden / heads is written explicitly (transformers' Qwen3 default is 128)."""
    meta, model = _build(12, **QWEN3, kv_channels=kv_channels,
                         untie_embeddings_and_output_weights=True)
    norm = model.language_model.encoder.layers[0].self_attention.q_layernorm.weight
    assert (norm - 1).abs().max() > 0.1                 # perturbed away from ones
    folder = export(tmp_path, model, meta)
    config = _config(folder)
    assert config["model_type"] == "qwen3" and config["head_dim"] == meta.kv_channels
    assert config["attention_bias"] is False
    assert_same_logits(model, transformers.Qwen3ForCausalLM, folder)


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_megatron_qwen_megatron_is_bit_identical(tmp_path, case):
    meta, model = _build(13, **(QWEN2 if case == "qwen2" else QWEN3))
    source = canonical_pieces(model, meta)
    if case == "qwen3":
        assert "self_attention.k_layernorm.weight" in source[2].tensors
    save_hf(iter(source), str(tmp_path / "hf"), allow_no_tokenizer=True)
    back = list(load_hf(str(tmp_path / "hf")))
    assert [(p.kind, p.index) for p in back] == [(p.kind, p.index) for p in source]
    for field in dataclasses.fields(ModelMeta):
        if field.name not in NOT_ROUND_TRIPPED:
            assert getattr(back[0].meta, field.name) == getattr(meta, field.name), field.name
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), want.kind
        for name, tensor in want.tensors.items():
            if want.kind == "embeddings":
                tensor = tensor[:VOCAB]
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


def _meta_piece(meta):
    return types.SimpleNamespace(kind="meta", meta=meta, index=None)


@pytest.mark.parametrize("overrides, match", [
    (dict(QWEN3, add_qkv_bias=True), "Qwen3ForCausalLM.*linear biases"),
    (dict(QWEN3, normalization="LayerNorm"), "^--qk-layernorm: only Qwen3"),
    (dict(QWEN3, position_embedding_type="learned_absolute"), "^--qk-layernorm: only Qwen3"),
])
def test_what_qwen_cannot_compute_is_refused(tmp_path, overrides, match):
    meta, _ = _build(0, **overrides)
    with pytest.raises(ConversionError, match=match) as err:
        save_hf(iter([_meta_piece(meta)]), str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert "\n" not in str(err.value) and not os.path.exists(tmp_path / "hf")


def test_biases_everywhere_make_a_llama_not_a_qwen2():
    from megatron.convert.hf import family_for_meta

    assert family_for_meta(_build(0, **dict(QWEN2, add_bias_linear=True))[0]).MODEL_TYPE == "llama"
    assert family_for_meta(_build(0, **QWEN2)[0]).MODEL_TYPE == "qwen2"


def test_qwen_configs_our_model_cannot_compute_are_refused(tmp_path):
    meta, model = _build(14, **QWEN3)
    folder = export(tmp_path, model, meta)
    path = os.path.join(folder, "config.json")
    original = _config(folder)
    for key, value in (("use_sliding_window", True), ("attention_bias", True)):
        with open(path, "w") as f:
            json.dump(dict(original, **{key: value}), f)
        with pytest.raises(ConversionError, match=rf"'{key}' is {value!r}"):
            load_hf(folder)
    without = {k: v for k, v in original.items() if k != "head_dim"}
    with open(path, "w") as f:
        json.dump(without, f)
    # transformers' Qwen3 default head_dim is 128, not hidden / heads: the weights disagree.
    assert next(load_hf(folder)).meta.kv_channels == 128
    with pytest.raises(ConversionError, match="q_proj.weight"):
        list(load_hf(folder))

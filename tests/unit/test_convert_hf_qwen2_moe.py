"""MoE models with a gated shared expert as Hugging Face ``Qwen2MoeForCausalLM`` folders and
back: the same logits in transformers (config built offline from the written folder), every
tensor bit for bit on import, and models Qwen2-MoE cannot compute refused by flag.
"""

import dataclasses
import json
import os
import types

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError, ModelMeta
from tests.unit.test_convert_hf import (NOT_ROUND_TRIPPED, VOCAB, assert_same_logits,
                                        canonical_pieces, export)
from tests.unit.test_convert_hf_mixtral import MOE_FFN, build_moe_model, moe_meta

transformers = pytest.importorskip("transformers")

SHARED = 40


def build(seed, pre_softmax=False, qkv_bias=True):
    cfg, model = build_moe_model(seed=seed, moe_shared_expert_intermediate_size=SHARED,
                                 moe_shared_expert_gate=True,
                                 moe_router_pre_softmax=pre_softmax,
                                 model_overrides=dict(add_qkv_bias=qkv_bias))
    meta = moe_meta(cfg, moe_shared_expert_intermediate_size=SHARED,
                    moe_shared_expert_gate=True, moe_router_pre_softmax=pre_softmax)
    return meta, model


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_qwen2_moe_logits_match_transformers(tmp_path, pre_softmax):
    meta, model = build(seed=3, pre_softmax=pre_softmax)
    folder = export(tmp_path, model, meta)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "qwen2_moe" and config["qkv_bias"]
    assert config["norm_topk_prob"] == (not pre_softmax)
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (
        MOE_FFN, SHARED)
    assert_same_logits(model, transformers.Qwen2MoeForCausalLM, folder)


def test_megatron_qwen2_moe_megatron_is_bit_identical(tmp_path):
    meta, model = build(seed=5, pre_softmax=True)
    source = canonical_pieces(model, meta)
    save_hf(iter(source), str(tmp_path / "hf"), allow_no_tokenizer=True)
    back = list(load_hf(str(tmp_path / "hf")))
    assert [(p.kind, p.index) for p in back] == [(p.kind, p.index) for p in source]
    # The dense --ffn-hidden-size computes nothing here; the import sets it to the shared size.
    for field in dataclasses.fields(ModelMeta):
        if field.name not in NOT_ROUND_TRIPPED | {"ffn_hidden_size"}:
            assert getattr(back[0].meta, field.name) == getattr(meta, field.name), field.name
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), want.kind
        for name, tensor in want.tensors.items():
            if want.kind == "embeddings":
                tensor = tensor[:VOCAB]
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


def test_ungated_shared_expert_is_refused(tmp_path):
    meta, _ = build(seed=0)
    meta = dataclasses.replace(meta, moe_shared_expert_gate=False)
    with pytest.raises(ConversionError, match="Qwen2MoeForCausalLM.*--moe-shared-expert-gate"):
        save_hf(iter([types.SimpleNamespace(kind="meta", meta=meta, index=None)]),
                str(tmp_path / "hf"), allow_no_tokenizer=True)


def build_mixed(seed, freq):
    """:func:`build` with dense layers between the MoE ones (``--moe-layer-freq`` ``freq``)."""
    cfg, model = build_moe_model(seed=seed, moe_shared_expert_intermediate_size=SHARED,
                                 moe_shared_expert_gate=True, moe_layer_freq=freq,
                                 model_overrides=dict(add_qkv_bias=True))
    meta = moe_meta(cfg, moe_shared_expert_intermediate_size=SHARED,
                    moe_shared_expert_gate=True,
                    moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq)
    return meta, model


@pytest.mark.parametrize("freq, dense", [(2, [1]), ((0, 1), [0])], ids=["int", "list"])
def test_dense_layers_export_as_mlp_only_layers_with_logits_parity(tmp_path, freq, dense):
    """transformers makes layer i sparse when i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; its dense layers are plain SwiGLU MLPs of
    intermediate_size, our dense MLP of --ffn-hidden-size."""
    meta, model = build_mixed(seed=7, freq=freq)
    layers = model.language_model.encoder.layers
    assert type(layers[dense[0]].mlp) is not type(layers[1 - dense[0]].mlp)
    folder = export(tmp_path, model, meta)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, dense)
    assert config["intermediate_size"] == meta.ffn_hidden_size != SHARED
    assert_same_logits(model, transformers.Qwen2MoeForCausalLM, folder)


@pytest.mark.parametrize("freq", [2, (0, 1)], ids=["int", "list"])
def test_mixed_layers_round_trip_bit_identical_in_megatrons_form(tmp_path, freq):
    meta, model = build_mixed(seed=9, freq=freq)
    source = canonical_pieces(model, meta)
    save_hf(iter(source), str(tmp_path / "hf"), allow_no_tokenizer=True)
    back = list(load_hf(str(tmp_path / "hf")))
    assert back[0].meta.moe_layer_freq == (2 if freq == 2 else [0, 1])
    assert back[0].meta.ffn_hidden_size == meta.ffn_hidden_size
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), (want.kind, want.index)
        for name, tensor in want.tensors.items():
            if want.kind == "embeddings":
                tensor = tensor[:VOCAB]
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


def test_a_sparse_step_folder_reads_as_megatrons_list():
    """decoder_sparse_step 2 makes layers 1, 3 sparse: not Megatron's integer form (0, 2)."""
    from megatron.convert.hf_common import ConfigView
    from megatron.convert.hf_qwen2_moe import _moe_layer_freq

    view = ConfigView({"decoder_sparse_step": 2, "mlp_only_layers": []}, "config.json")
    assert _moe_layer_freq(view, 4) == [0, 1, 0, 1]
    view = ConfigView({"decoder_sparse_step": 1, "mlp_only_layers": [1, 3]}, "config.json")
    assert _moe_layer_freq(view, 4) == 2

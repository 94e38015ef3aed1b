"""MoE models with per-head q / k norms (``--qk-layernorm``) as Hugging Face
``Qwen3MoeForCausalLM`` folders and back: the same logits in transformers (float32, 1e-5, see
test_convert_hf), every tensor bit for bit on import, and what Qwen3-MoE cannot compute refused.
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
from tests.unit.test_convert_hf_rope import LLAMA, YARN
from tests.unit.test_convert_hf_rope import _meta as rope_meta

transformers = pytest.importorskip("transformers")

YARN_ONLY = {k: v for k, v in YARN.items() if k not in LLAMA}


def build(seed, pre_softmax=False, freq=1, **model_overrides):
    cfg, model = build_moe_model(seed=seed, moe_router_pre_softmax=pre_softmax,
                                 moe_layer_freq=freq,
                                 model_overrides=dict(qk_layernorm=True, **model_overrides))
    meta = moe_meta(cfg, qk_layernorm=True, moe_router_pre_softmax=pre_softmax,
                    moe_layer_freq=freq, **rope_meta(cfg).rope_scaling_fields)
    return meta, model


@pytest.mark.parametrize("pre_softmax, freq, rope", [(False, 1, {}), (True, 1, {}), (False, 2, {}),
                                                     (False, 1, YARN_ONLY)],
                         ids=["renormalised", "pre_softmax", "dense_layer_1", "yarn"])
def test_qwen3_moe_logits_match_transformers(tmp_path, pre_softmax, freq, rope):
    meta, model = build(seed=41, pre_softmax=pre_softmax, freq=freq, **rope)
    folder = export(tmp_path, model, meta)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "qwen3_moe" and config["moe_intermediate_size"] == MOE_FFN
    assert config["norm_topk_prob"] == (not pre_softmax)
    assert config["mlp_only_layers"] == ([] if freq == 1 else [1])
    assert_same_logits(model, transformers.Qwen3MoeForCausalLM, folder)


@pytest.mark.parametrize("freq", [1, 2])
def test_megatron_qwen3_moe_megatron_is_bit_identical(tmp_path, freq):
    meta, model = build(seed=42, pre_softmax=True, freq=freq)
    source = canonical_pieces(model, meta)
    save_hf(iter(source), str(tmp_path / "hf"), allow_no_tokenizer=True)
    back = list(load_hf(str(tmp_path / "hf")))
    assert [(p.kind, p.index) for p in back] == [(p.kind, p.index) for p in source]
    for field in dataclasses.fields(ModelMeta):
        if field.name not in NOT_ROUND_TRIPPED:
            assert getattr(back[0].meta, field.name) == getattr(meta, field.name), field.name
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), (want.kind, want.index)
        for name, tensor in want.tensors.items():
            if want.kind == "embeddings":
                tensor = tensor[:VOCAB]
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


def test_shared_expert_and_qkv_bias_are_refused(tmp_path):
    meta, _ = build(seed=0)
    for fields, match in ((dict(moe_shared_expert_intermediate_size=40),
                           "Qwen3MoeForCausalLM.*no shared expert"),
                          (dict(add_qkv_bias=True), "Qwen3MoeForCausalLM.*linear biases")):
        bad = dataclasses.replace(meta, **fields)
        with pytest.raises(ConversionError, match=match):
            save_hf(iter([types.SimpleNamespace(kind="meta", meta=bad, index=None)]),
                    str(tmp_path / "hf"), allow_no_tokenizer=True)

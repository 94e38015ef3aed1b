"""Mixture-of-experts models as Hugging Face ``MixtralForCausalLM`` folders and back.

A tiny rope + RMSNorm + SwiGLU MoE model of this project, exported, must give the same logits
in transformers' Mixtral (built offline from the written config.json), and importing the folder
must give back every tensor bit for bit. Routings Mixtral cannot compute are refused.
"""

import dataclasses
import json
import os
import types

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError, ModelMeta
from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.model.moe.config import MoEConfig
from tests.unit.test_convert_hf import (LLAMA, NOT_ROUND_TRIPPED, PADDED, SEQ, VOCAB,
                                        assert_same_logits, canonical_pieces, export, make_meta)

transformers = pytest.importorskip("transformers")

EXPERTS, TOPK, MOE_FFN = 4, 2, 24


def build_moe_model(seed=0, model_overrides=None, **moe):
    """A 2-layer float32 MoE GPTModel (hidden 32, 4 heads, 2 query groups, 4 experts, top-2)
    with every parameter perturbed, so routing is far from uniform; ``model_overrides`` change
    the TransformerConfig, ``moe`` the MoEConfig."""
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=PADDED, max_position_embeddings=SEQ,
                            seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=torch.float32, **dict(LLAMA, **(model_overrides or {})))
    moe_config = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                           moe_ffn_hidden_size=MOE_FFN, **moe)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(cfg, pstate, parallel_output=False, init_seed=seed, moe_config=moe_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return cfg, model.eval()


def moe_meta(cfg, **fields):
    return make_meta(cfg, num_experts=EXPERTS, moe_router_topk=TOPK,
                     moe_ffn_hidden_size=MOE_FFN, **fields)


def test_mixtral_logits_match_transformers(tmp_path):
    cfg, model = build_moe_model(seed=3)
    folder = export(tmp_path, model, moe_meta(cfg))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (EXPERTS, TOPK)
    assert config["intermediate_size"] == MOE_FFN and config["num_key_value_heads"] == 2
    assert_same_logits(model, transformers.MixtralForCausalLM, folder)


def test_megatron_mixtral_megatron_is_bit_identical(tmp_path):
    cfg, model = build_moe_model(seed=5)
    meta = moe_meta(cfg, untie_embeddings_and_output_weights=False)
    source = canonical_pieces(model, meta)
    save_hf(iter(source), str(tmp_path / "hf"), allow_no_tokenizer=True)
    back = list(load_hf(str(tmp_path / "hf")))
    assert [(p.kind, p.index) for p in back] == [(p.kind, p.index) for p in source]
    # Every layer is an MoE layer, so the dense --ffn-hidden-size computes nothing; Mixtral
    # carries the experts' size only, and the import sets both to it.
    assert back[0].meta.ffn_hidden_size == back[0].meta.moe_ffn_hidden_size == MOE_FFN
    for field in dataclasses.fields(ModelMeta):
        if field.name not in NOT_ROUND_TRIPPED | {"ffn_hidden_size"}:
            assert getattr(back[0].meta, field.name) == getattr(meta, field.name), field.name
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), want.kind
        for name, tensor in want.tensors.items():
            if want.kind == "embeddings":
                tensor = tensor[:VOCAB]
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


@pytest.mark.parametrize("fields, flag", [
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor 2.0"),
    (dict(add_bias_linear=True), "linear biases"),
    (dict(source_args={"moe_expert_capacity_factor": 1.0}), "--moe-expert-capacity-factor 1.0"),
    (dict(source_args={"moe_layer_freq": 2}), "--moe-layer-freq 2"),
    (dict(moe_layer_freq=[0, 1]), r"--moe-layer-freq \[0, 1\] \(every Mixtral layer"),
    (dict(source_args={"moe_shared_expert_intermediate_size": 8}),
     "--moe-shared-expert-intermediate-size 8"),
])
def test_routing_mixtral_cannot_compute_is_refused(tmp_path, fields, flag):
    cfg, _ = build_moe_model()
    meta = moe_meta(cfg, **fields)
    with pytest.raises(ConversionError, match="MixtralForCausalLM.*" + flag.replace(".", r"\.")):
        save_hf(iter([types.SimpleNamespace(kind="meta", meta=meta, index=None)]),
                str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert not os.path.exists(tmp_path / "hf")


def _safetensors(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_mixtral_folder_through_megatron_tp2_and_torch_dist_comes_back_bit_for_bit(tmp_path):
    from megatron.training import checkpointing
    from megatron.checkpoint.safe_unpickle import torch_load
    from tools.checkpoint.convert import main

    cfg, model = build_moe_model(seed=7)
    folder = export(tmp_path, model, moe_meta(cfg))
    common = ["--model-type", "GPT"]
    vocab = ["--true-vocab-size", str(VOCAB)]    # the export wrote no tokenizer to learn it from
    tp2, dist, back = (str(tmp_path / name) for name in ("tp2", "dist", "back"))
    assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                          "--target-tensor-parallel-size", "2"]) == 0
    assert main(common + ["--load-dir", tp2, "--save-dir", dist, "--target-ckpt-format",
                          "torch_dist", "--target-tensor-parallel-size", "1"] + vocab) == 0
    assert main(common + ["--saver", "hf", "--load-dir", dist, "--save-dir", back,
                          "--allow-no-tokenizer"] + vocab) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    iteration, release = checkpointing.read_tracker(tp2)
    path = checkpointing.checkpoint_file(tp2, iteration, 0, 0, 1, release)
    args = torch_load(path)["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            args.expert_tensor_parallel_size) == (EXPERTS, TOPK, MOE_FFN, 2)


def test_megatrons_moe_file_is_refused_for_hf_in_one_line(tmp_path, capsys):
    from tests.functional.test_megatron_written import fixture_dir
    from tools.checkpoint.convert import main

    with pytest.raises(SystemExit):
        main(["--model-type", "GPT", "--saver", "hf", "--load-dir",
              fixture_dir("mcore_dist_moe_ep1"), "--save-dir", str(tmp_path / "hf"),
              "--allow-no-tokenizer"])
    err = capsys.readouterr().err.strip()
    assert "MixtralForCausalLM" in err and "--normalization LayerNorm (Mixtral" in err
    assert "--position-embedding-type learned_absolute" in err
    assert len(err.splitlines()) == 1

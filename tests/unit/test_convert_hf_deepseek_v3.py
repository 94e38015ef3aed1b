"""DeepSeek-V3 Hugging Face folders (``DeepseekV3ForCausalLM``, built here from a tiny config,
never downloaded) through the converter: a folder with a dense first layer and MoE layers
(grouped sigmoid routing, non-zero expert-score correction biases, a scaling factor, shared
experts) imported gives our model transformers' logits; exported again, and through a TP=2
Megatron checkpoint, it comes back bit for bit; config values our flags cannot express are
refused by key."""

import json
import os
import types

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

VOCAB, SEQ = 64, 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
              num_experts_per_tok=4, n_shared_experts=2, routed_scaling_factor=2.5,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_folder(tmp_path, name="hf", q_lora_rank=12, **overrides):
    """A saved float32 DeepseekV3ForCausalLM with every weight and expert bias perturbed."""
    config = DeepseekV3Config(**dict(CONFIG, q_lora_rank=q_lora_rank, **overrides))
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.3)
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    folder = str(tmp_path / name)
    model.save_pretrained(folder)
    return folder, model


def our_model(meta, mtp_num_layers=None):
    """Our GPTModel for an imported ``meta`` (with ``mtp_num_layers`` MTP depths)."""
    from megatron.core.config import TransformerConfig
    from megatron.model import GPTModel
    from megatron.model.moe.config import MoEConfig

    cfg = TransformerConfig(
        num_layers=meta.num_layers, hidden_size=meta.hidden_size,
        num_attention_heads=meta.num_attention_heads, padded_vocab_size=meta.padded_vocab_size,
        max_position_embeddings=meta.max_position_embeddings, seq_length=SEQ,
        ffn_hidden_size=meta.ffn_hidden_size, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", layernorm_epsilon=meta.norm_epsilon, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
        position_embedding_type=meta.position_embedding_type, rotary_base=meta.rotary_base,
        multi_latent_attention=True, q_lora_rank=meta.q_lora_rank,
        kv_lora_rank=meta.kv_lora_rank, qk_head_dim=meta.qk_head_dim,
        qk_pos_emb_head_dim=meta.qk_pos_emb_head_dim, v_head_dim=meta.v_head_dim,
        **_yarn(meta))
    moe = meta.num_experts and MoEConfig(
        num_moe_experts=meta.num_experts, moe_router_topk=meta.moe_router_topk,
        moe_ffn_hidden_size=meta.moe_ffn_hidden_size, moe_layer_freq=meta.moe_layer_freq,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=meta.moe_router_num_groups,
        moe_router_group_topk=meta.moe_router_group_topk,
        moe_router_topk_scaling_factor=meta.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=meta.moe_shared_expert_intermediate_size)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    return GPTModel(cfg, pstate, parallel_output=False,
                    moe_config=moe if meta.num_experts else None,
                    mtp_num_layers=mtp_num_layers).eval()


def _yarn(meta):
    if meta.position_embedding_type != "yarn":
        return {}
    return dict(yarn_rotary_scaling_factor=meta.rotary_scaling_factor,
                yarn_original_max_position_embeddings=meta.yarn_original_max_position_embeddings,
                yarn_beta_fast=meta.yarn_beta_fast, yarn_beta_slow=meta.yarn_beta_slow,
                yarn_mscale=meta.mscale, yarn_mscale_all_dim=meta.mscale_all_dim)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.9, "mscale_all_dim": 0.7}


def _state_dict(pieces):
    top = {"embeddings": "language_model.embedding.",
           "final_norm": "language_model.encoder.final_layernorm.",
           "output_layer": "language_model.output_layer."}
    sd = {}
    for piece in pieces[1:]:
        prefix = (f"language_model.encoder.layers.{piece.index}." if piece.kind == "layer"
                  else top[piece.kind])
        for name, tensor in piece.tensors.items():
            sd[prefix + name + (".weight" if piece.kind == "embeddings" else "")] = tensor
    return sd


@pytest.mark.parametrize("q_lora_rank, rope", [(None, None), (12, None), (12, YARN)])
def test_imported_deepseek_v3_gives_transformers_logits(tmp_path, q_lora_rank, rope):
    extra = {"rope_parameters": dict(rope)} if rope else {}
    folder, theirs = hf_folder(tmp_path, q_lora_rank=q_lora_rank, **extra)
    pieces = list(load_hf(folder))
    meta = pieces[0].meta
    assert meta.multi_latent_attention and meta.moe_layer_freq == [0, 1, 1]
    assert meta.position_embedding_type == ("yarn" if rope else "rope")
    assert (meta.moe_router_num_groups, meta.moe_router_group_topk) == (4, 2)
    assert meta.moe_shared_expert_intermediate_size == 32
    ours = our_model(meta)
    missing, unexpected = ours.load_state_dict(_state_dict(pieces), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    bias = ours.language_model.encoder.layers[1].mlp.router.expert_bias
    assert bias.abs().min() > 0
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids, torch.arange(SEQ).expand(2, SEQ), None)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _safetensors(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_dense_only_folder_gives_transformers_logits(tmp_path):
    folder, theirs = hf_folder(tmp_path, first_k_dense_replace=3)
    pieces = list(load_hf(folder))
    assert not pieces[0].meta.num_experts
    ours = our_model(pieces[0].meta)
    ours.load_state_dict(_state_dict(pieces), strict=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids, torch.arange(SEQ).expand(2, SEQ), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first_dense, dtype", [(1, "float32"), (3, "float32"),
                                                 (1, "bfloat16")])
def test_export_gives_back_every_tensor_bit_for_bit(tmp_path, first_dense, dtype):
    """Also in bfloat16, where the expert bias stays float32 as transformers keeps it."""
    folder, _ = hf_folder(tmp_path, first_k_dense_replace=first_dense)
    if dtype == "bfloat16":
        DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(
            folder)
    save_hf(load_hf(folder), str(tmp_path / "back"), allow_no_tokenizer=True)
    want, got = _safetensors(folder), _safetensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(os.path.join(tmp_path / "back", "config.json")) as f:
        config = json.load(f)
    if first_dense == 3:
        return
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert [k for k in want if got[k].dtype != want[k].dtype] == []
    for key in ("first_k_dense_replace", "n_group", "topk_group", "n_shared_experts",
                "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "v_head_dim"):
        assert config[key] == CONFIG.get(key, 12), key


@pytest.mark.parametrize("fmt, pp", [("torch", 1), ("torch", 3), ("torch_dist", 1),
                                     ("torch_dist", 3)])
def test_folder_through_megatron_tp2_comes_back_bit_for_bit(tmp_path, fmt, pp):
    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.training import checkpointing
    from tools.checkpoint.convert import main

    folder, _ = hf_folder(tmp_path)
    tp2, back = str(tmp_path / "tp2"), str(tmp_path / "back")
    common, vocab = ["--model-type", "GPT"], ["--true-vocab-size", str(VOCAB)]
    assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                          "--target-tensor-parallel-size", "2", "--target-ckpt-format",
                          fmt, "--target-pipeline-parallel-size", str(pp)]) == 0
    assert main(common + ["--saver", "hf", "--load-dir", tp2, "--save-dir", back,
                          "--allow-no-tokenizer"] + vocab) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    if fmt == "torch_dist" or pp > 1:
        return
    iteration, release = checkpointing.read_tracker(tp2)
    args = torch_load(checkpointing.checkpoint_file(tp2, iteration, 1, 0, 1, release))["args"]
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim) == (True, 12, 16, 8, 4, 6)
    assert (args.moe_router_num_groups, args.moe_router_group_topk,
            args.moe_router_enable_expert_bias, args.moe_router_score_function) == (
                4, 2, True, "sigmoid")


def test_torch_dist_checkpoint_loads_into_our_model_with_transformers_logits(tmp_path):
    """The converter's Megatron-Core keys are those the training's own loader reads."""
    from megatron.checkpoint.dist import ChunkLayout, DistCheckpointReader, load_model_state
    from tools.checkpoint.convert import main

    folder, theirs = hf_folder(tmp_path)
    dist = str(tmp_path / "dist")
    assert main(["--model-type", "GPT", "--loader", "hf", "--load-dir", folder, "--save-dir",
                 dist, "--target-ckpt-format", "torch_dist"]) == 0
    meta = next(load_hf(folder)).meta
    ours = our_model(meta)
    (iteration_dir,) = [d for d in os.listdir(dist) if d.startswith(("iter_", "release"))]
    reader = DistCheckpointReader(os.path.join(dist, iteration_dir))
    layout = ChunkLayout(num_layers=3, num_experts=8, swiglu=True, per_layer=True, mla=True)
    ours.load_state_dict(load_model_state(reader, ours.state_dict_for_save_checkpoint(),
                                          layout), strict=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids, torch.arange(SEQ).expand(2, SEQ), None)
    torch.testing.assert_close(got[..., :VOCAB], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, key", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(num_experts_per_tok=2), "num_experts_per_tok"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_values_our_flags_cannot_express_are_refused_by_key(tmp_path, overrides, key):
    config = DeepseekV3Config(**dict(CONFIG, q_lora_rank=12, **overrides))
    os.makedirs(tmp_path / "hf")
    config.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConversionError, match=key):
        next(load_hf(str(tmp_path / "hf")))


def test_a_folder_without_the_mtp_weights_its_config_promises_imports_without_them(tmp_path):
    """transformers saves ``num_nextn_predict_layers`` but no MTP weights: such a folder
    imports as the main model; one holding part of a depth names the missing tensor."""
    from safetensors.torch import save_file

    folder, _ = hf_folder(tmp_path, num_nextn_predict_layers=1)
    pieces = list(load_hf(folder))
    assert pieces[0].meta.mtp_num_layers == 0
    assert [p.kind for p in pieces].count("mtp") == 0
    tensors = _safetensors(folder)
    tensors["model.layers.3.eh_proj.weight"] = torch.ones(32, 64)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model\.layers\.3\.enorm\.weight"):
        list(load_hf(folder))


def test_megatron_mtp_checkpoint_without_latent_attention_is_refused_for_hf(tmp_path, capsys):
    """Megatron's DeepSeek-V3-style file has plain attention: no Hugging Face architecture
    here holds its MTP layer, so the HF saver refuses it in one line."""
    from tests.functional.test_megatron_written import fixture_dir
    from tools.checkpoint.convert import main

    with pytest.raises(SystemExit):
        main(["--model-type", "GPT", "--saver", "hf", "--allow-no-tokenizer",
              "--true-vocab-size", "256", "--load-dir", fixture_dir("mcore_dist_dsv3_mtp"),
              "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert "--mtp-num-layers 1" in err and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("change, flag", [
    (dict(qk_layernorm=False), "--qk-layernorm"),
    (dict(add_bias_linear=True), "linear biases"),
    (dict(moe_router_topk=3), "--moe-router-topk 3"),
    (dict(moe_router_enable_expert_bias=False), "--moe-router-enable-expert-bias"),
    (dict(moe_layer_freq=[1, 0, 1]), "--moe-layer-freq"),
    (dict(position_embedding_type="learned_absolute"), "learned_absolute"),
])
def test_models_deepseek_v3_cannot_compute_are_refused_before_writing(tmp_path, change, flag):
    import dataclasses

    folder, _ = hf_folder(tmp_path)
    meta = dataclasses.replace(next(load_hf(folder)).meta, **change)
    with pytest.raises(ConversionError, match="DeepseekV3ForCausalLM.*" + flag):
        save_hf(iter([types.SimpleNamespace(kind="meta", meta=meta, index=None)]),
                str(tmp_path / "out"), allow_no_tokenizer=True)
    assert not os.path.exists(tmp_path / "out")


def _fuse_down_projections(tree):
    """A --ckpt-format torch model state as a --mla-down-proj-fusion run writes it: each
    layer's two down projections stacked into ``linear_qkv_down_proj.weight``."""
    q_name, kv_name = "linear_q_down_proj.weight", "linear_kv_down_proj.weight"
    for key in [k for k in tree if isinstance(k, str) and k.endswith(q_name)]:
        base = key[:-len(q_name)]
        tree[base + "linear_qkv_down_proj.weight"] = torch.cat(
            (tree.pop(key), tree.pop(base + kv_name)))
    for value in tree.values():
        if isinstance(value, dict):
            _fuse_down_projections(value)


def test_torch_checkpoint_of_a_fused_down_projection_run_exports_the_same_folder(tmp_path):
    """The converter reads a fused torch-format state's down projections as its rows split at
    --q-lora-rank (the export is bit for bit the folder imported)."""
    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.training import checkpointing
    from tools.checkpoint.convert import main

    folder, _ = hf_folder(tmp_path)
    tp2, back = str(tmp_path / "tp2"), str(tmp_path / "back")
    common = ["--model-type", "GPT"]
    assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                          "--target-tensor-parallel-size", "2"]) == 0
    iteration, release = checkpointing.read_tracker(tp2)
    for tp_rank in range(2):
        path = checkpointing.checkpoint_file(tp2, iteration, tp_rank, 0, 1, release)
        state = torch_load(path)
        _fuse_down_projections(state["model"])
        state["args"].mla_down_proj_fusion = True
        torch.save(state, path)
    assert "linear_qkv_down_proj" in str(list(torch_load(path)["model"]["language_model"]
                                              ["encoder"]))
    assert main(common + ["--saver", "hf", "--load-dir", tp2, "--save-dir", back,
                          "--allow-no-tokenizer", "--true-vocab-size", str(VOCAB)]) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

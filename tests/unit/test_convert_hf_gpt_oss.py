"""gpt-oss (``GptOssForCausalLM``) imported into our model and exported back, against
transformers' own forward.

A tiny random gpt-oss is built offline from a transformers config (2 layers: the first looks
through a 4-key window, the second sees everything; 4 experts, top 2; attention sinks; biases;
experts clamped at 0.5 so that the clamp bites on these order-one activations), saved by
transformers and imported with ``load_hf`` into a GPTModel built from our flags
(``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 0.5 --softmax-type
learnable --window-size 3,0 --window-attn-skip-freq [1,0]``). Both forwards are compared in
float32 (1e-5: the same function by two codes, other summation orders). Exporting the import
gives the same files bit for bit, directly and through Megatron checkpoints (TP 2, EP 2,
torch_dist); our own gpt-oss model exported loads in transformers with our logits. Settings
our model cannot represent are refused by field (import) or flag (export).
"""

import dataclasses
import json
import os
import types

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError
from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.model.moe.config import MoEConfig
from tests.unit.test_convert_hf import NOT_ROUND_TRIPPED, VOCAB, canonical_pieces

transformers = pytest.importorskip("transformers")

SEQ, WINDOW, EXPERTS, TOPK, FFN, LIMIT = 16, 4, 4, 2, 24, 0.5
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4}


def hf_gpt_oss(folder, seed=0, **overrides):
    """A 2-layer float32 GptOssForCausalLM saved in ``folder``, every weight perturbed so that
    activations are of order one and routing is far from uniform."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=FFN, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_local_experts=EXPERTS, num_experts_per_tok=TOPK, sliding_window=WINDOW,
              max_position_embeddings=SEQ, rms_norm_eps=1e-5, swiglu_limit=LIMIT,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return model


def our_config(meta) -> TransformerConfig:
    return TransformerConfig(
        num_layers=meta.num_layers, hidden_size=meta.hidden_size,
        num_attention_heads=meta.num_attention_heads, padded_vocab_size=meta.padded_vocab_size,
        max_position_embeddings=meta.max_position_embeddings, seq_length=SEQ,
        ffn_hidden_size=meta.ffn_hidden_size, num_query_groups=meta.num_query_groups,
        kv_channels=meta.kv_channels, hidden_dropout=0.0, attention_dropout=0.0,
        position_embedding_type=meta.position_embedding_type, rotary_base=meta.rotary_base,
        yarn_rotary_scaling_factor=meta.rotary_scaling_factor,
        yarn_original_max_position_embeddings=meta.yarn_original_max_position_embeddings,
        yarn_beta_fast=meta.yarn_beta_fast, yarn_beta_slow=meta.yarn_beta_slow,
        yarn_mscale=meta.mscale, yarn_mscale_all_dim=meta.mscale_all_dim,
        yarn_correction_range_round_to_int=meta.yarn_correction_range_round_to_int,
        normalization="RMSNorm", layernorm_epsilon=meta.norm_epsilon,
        quick_geglu=meta.quick_geglu, glu_linear_offset=meta.glu_linear_offset,
        activation_func_clamp_value=meta.activation_func_clamp_value,
        add_bias_linear=meta.add_bias_linear,
        untie_embeddings_and_output_weights=meta.untie_embeddings_and_output_weights,
        window_size=meta.window_size, window_attn_skip_freq=meta.window_attn_skip_freq,
        softmax_type=meta.softmax_type, params_dtype=torch.float32)


def _pstate():
    return types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                 virtual_pp_size=None, virtual_pp_rank=None)


def our_model(pieces):
    """A GPTModel built from an imported stream's meta, holding its tensors."""
    meta = pieces[0].meta
    moe = MoEConfig(num_moe_experts=meta.num_experts, moe_router_topk=meta.moe_router_topk,
                    moe_ffn_hidden_size=meta.moe_ffn_hidden_size)
    model = GPTModel(our_config(meta), _pstate(), parallel_output=False, init_seed=0,
                     moe_config=moe)
    state = {}
    for piece in pieces[1:]:
        prefix = {"embeddings": "language_model.embedding.",
                  "layer": f"language_model.encoder.layers.{piece.index}.",
                  "final_norm": "language_model.encoder.final_layernorm.",
                  "output_layer": "language_model.output_layer."}[piece.kind]
        for name, tensor in piece.tensors.items():
            name = name + ".weight" if piece.kind == "embeddings" else name
            state[prefix + name] = tensor
    model.load_state_dict(state)
    return model.eval()


def _logits(hf_model, ours):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits                                       # [b, s, V]
        got = ours(ids, torch.arange(SEQ).expand(2, SEQ), None)[..., :VOCAB]
    return want, got


def _safetensors(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _replace_meta(pieces, **fields):
    return [dataclasses.replace(pieces[0], meta=dataclasses.replace(pieces[0].meta,
                                                                    **fields))] + pieces[1:]


@pytest.mark.parametrize("rope", [None, YARN], ids=["default_rope", "yarn"])
def test_imported_gpt_oss_computes_transformers_logits(tmp_path, rope):
    overrides = {} if rope is None else dict(rope_parameters=rope)
    reference = hf_gpt_oss(str(tmp_path / "hf"), **overrides)
    pieces = list(load_hf(str(tmp_path / "hf")))
    meta = pieces[0].meta
    assert (meta.window_size, meta.window_attn_skip_freq) == ((WINDOW - 1, 0), (1, 0))
    assert (meta.quick_geglu, meta.glu_linear_offset, meta.activation_func_clamp_value,
            meta.softmax_type, meta.add_bias_linear) == (True, 1.0, LIMIT, "learnable", True)
    assert meta.position_embedding_type == ("rope" if rope is None else "yarn")
    want, got = _logits(reference, our_model(pieces))
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # each part matters: without the window, the clamp or the offset the logits move
    for fields in (dict(window_size=None, window_attn_skip_freq=None),
                   dict(activation_func_clamp_value=100.0),
                   dict(glu_linear_offset=0.0)):
        other = our_model(_replace_meta(pieces, **fields))
        assert (_logits(reference, other)[1] - want).abs().max() > 1e-2, fields


def test_expert_layout_is_transformers_interleaved_gate_up(tmp_path):
    """Expert J's fc1 rows [gate; linear] are gate_up_proj[J]'s even and odd columns."""
    hf_gpt_oss(str(tmp_path / "hf"), seed=5)
    stored = _safetensors(str(tmp_path / "hf"))
    layer = list(load_hf(str(tmp_path / "hf")))[3].tensors             # layer 1
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"]          # [E, h, 2 f]
    bias = stored["model.layers.1.mlp.experts.gate_up_proj_bias"]        # [E, 2 f]
    fc1 = layer["mlp.experts.local_experts.3.linear_fc1.weight"]         # [2 f, h]
    assert torch.equal(fc1[:FFN], gate_up[3][:, 0::2].t())
    assert torch.equal(fc1[FFN:], gate_up[3][:, 1::2].t())
    assert torch.equal(layer["mlp.experts.local_experts.3.linear_fc1.bias"][FFN:],
                       bias[3][1::2])
    assert torch.equal(layer["mlp.experts.local_experts.3.linear_fc2.weight"],
                       stored["model.layers.1.mlp.experts.down_proj"][3].t())
    assert torch.equal(layer["self_attention.core_attention.softmax_offset"],
                       stored["model.layers.1.self_attn.sinks"])


def test_import_then_export_gives_the_same_folder(tmp_path):
    reference = hf_gpt_oss(str(tmp_path / "hf"), seed=2, rope_parameters=YARN)
    save_hf(load_hf(str(tmp_path / "hf")), str(tmp_path / "back"), allow_no_tokenizer=True)
    want, got = _safetensors(str(tmp_path / "hf")), _safetensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(tmp_path / "back" / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "gpt_oss" and config["sliding_window"] == WINDOW
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    back = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                          dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, reference(ids).logits)


def _gpt_oss_meta(cfg):
    from tests.unit.test_convert_hf import make_meta

    return make_meta(cfg, quick_geglu=True, glu_linear_offset=1.0,
                     activation_func_clamp_value=LIMIT, softmax_type="learnable",
                     window_size=cfg.window_size, window_attn_skip_freq=cfg.window_attn_skip_freq,
                     num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN)


def _our_gpt_oss(seed, skip_freq):
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        padded_vocab_size=128, max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=FFN,
        hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
        rotary_base=500, normalization="RMSNorm", quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=LIMIT, softmax_type="learnable", window_size=(2, 0),
        window_attn_skip_freq=skip_freq, untie_embeddings_and_output_weights=True,
        params_dtype=torch.float32)
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN)
    model = GPTModel(cfg, _pstate(), parallel_output=False, init_seed=seed, moe_config=moe)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return cfg, model.eval()


@pytest.mark.parametrize("skip_freq, types_", [(2, ["sliding_attention", "full_attention"]),
                                               (None, ["sliding_attention"] * 2)])
def test_our_gpt_oss_model_exports_with_its_logits(tmp_path, skip_freq, types_):
    cfg, model = _our_gpt_oss(seed=6, skip_freq=skip_freq)
    folder = str(tmp_path / "hf")
    save_hf(iter(canonical_pieces(model, _gpt_oss_meta(cfg))), folder, allow_no_tokenizer=True)
    theirs, info = transformers.GptOssForCausalLM.from_pretrained(
        folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert theirs.config.layer_types == types_ and theirs.config.sliding_window == 3
    want, got = _logits(theirs.eval(), model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    meta = list(load_hf(folder))[0].meta          # the import reads back what was written
    for field in dataclasses.fields(meta):
        if field.name not in NOT_ROUND_TRIPPED | {"window_attn_skip_freq", "ffn_hidden_size"}:
            assert getattr(meta, field.name) == getattr(_gpt_oss_meta(cfg), field.name), field


def test_gpt_oss_through_megatron_tp2_ep2_and_torch_dist_comes_back_bit_for_bit(tmp_path):
    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.training import checkpointing
    from tools.checkpoint.convert import main

    folder = str(tmp_path / "hf")
    hf_gpt_oss(folder, seed=4, rope_parameters=YARN)
    common, vocab = ["--model-type", "GPT"], ["--true-vocab-size", str(VOCAB)]
    tp2, dist, back = (str(tmp_path / name) for name in ("tp2", "dist", "back"))
    assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                          "--target-tensor-parallel-size", "2",
                          "--target-expert-parallel-size", "2"]) == 0
    assert main(common + ["--load-dir", tp2, "--save-dir", dist, "--target-ckpt-format",
                          "torch_dist", "--target-tensor-parallel-size", "1"] + vocab) == 0
    assert main(common + ["--saver", "hf", "--load-dir", dist, "--save-dir", back,
                          "--allow-no-tokenizer"] + vocab) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # Megatron-Core's keys and global shapes for the router and expert biases
    from torch.distributed.checkpoint import FileSystemReader

    iteration, release = checkpointing.read_tracker(dist)
    folder_dist = os.path.dirname(checkpointing.checkpoint_file(dist, iteration, 0, 0, 1,
                                                                 release))
    while not os.path.exists(os.path.join(folder_dist, ".metadata")):
        folder_dist = os.path.dirname(folder_dist)
    shapes = {k: tuple(v.size) for k, v in
              FileSystemReader(folder_dist).read_metadata().state_dict_metadata.items()
              if hasattr(v, "size")}
    prefix = "decoder.layers.mlp."
    assert shapes[prefix + "router.bias"] == (2, EXPERTS)
    assert shapes[prefix + "experts.experts.linear_fc1.bias"] == (2, EXPERTS, 2 * FFN)
    assert shapes[prefix + "experts.experts.linear_fc2.bias"] == (2, EXPERTS, 32)
    assert shapes["decoder.layers.self_attention.core_attention.softmax_offset"] == (2, 4)
    iteration, release = checkpointing.read_tracker(tp2)
    path = checkpointing.checkpoint_file(tp2, iteration, 1, 0, 1, release, ep_rank=1, ep_size=2)
    args = torch_load(path)["args"]
    assert (args.quick_geglu, args.glu_linear_offset, args.activation_func_clamp_value,
            args.softmax_type, args.window_size, args.num_experts,
            args.expert_model_parallel_size) == (True, 1.0, LIMIT, "learnable",
                                                 (WINDOW - 1, 0), EXPERTS, 2)


@pytest.mark.parametrize("changes, pattern", [
    (dict(swiglu_alpha=1.0), r"'swiglu_alpha' is 1.0; only 1.702"),
    (dict(attention_bias=False), r"'attention_bias' is False"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), r"'layer_types' is"),
    (dict(sliding_window=None), r"'sliding_window' is None"),
])
def test_gpt_oss_settings_we_cannot_represent_are_refused_at_import(tmp_path, changes, pattern):
    folder = tmp_path / "hf"
    hf_gpt_oss(str(folder), seed=3)
    path = folder / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
    with pytest.raises(ConversionError, match=pattern) as err:
        load_hf(str(folder))
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("fields, pattern", [
    (dict(activation_func_clamp_value=None), r"GptOssForCausalLM.*no --activation-func-clamp"),
    (dict(glu_linear_offset=0.5), r"GptOssForCausalLM.*--glu-linear-offset 0.5"),
    (dict(softmax_type="vanilla"), r"GptOssForCausalLM.*--softmax-type vanilla"),
    (dict(add_bias_linear=False), r"GptOssForCausalLM.*--disable-bias-linear"),
    (dict(moe_router_pre_softmax=True), r"GptOssForCausalLM.*--moe-router-pre-softmax"),
    (dict(window_size=(2, 1)), r"GptOssForCausalLM.*--window-size 2,1"),
    (dict(num_experts=None), r"--quick-geglu: only GptOssForCausalLM"),
    (dict(quick_geglu=False, swiglu=True), r"--glu-linear-offset: only GptOssForCausalLM"),
])
def test_what_gpt_oss_cannot_express_is_refused_at_export(tmp_path, fields, pattern):
    cfg, _ = _our_gpt_oss(seed=0, skip_freq=2)
    meta = dataclasses.replace(_gpt_oss_meta(cfg), **fields)
    with pytest.raises(ConversionError, match=pattern):
        save_hf(iter([types.SimpleNamespace(kind="meta", meta=meta, index=None)]),
                str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert not os.path.exists(tmp_path / "hf")

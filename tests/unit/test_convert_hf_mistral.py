"""Mistral (``MistralForCausalLM``: Llama with a sliding window) imported into our model and
exported back, against transformers' own forward.

A tiny random Mistral is built offline from a config whose window (4 keys) is much shorter than
the sequence (16), saved by transformers, imported with ``load_hf`` into a GPTModel with
``--window-size 3,0``, and both forwards are compared in float32 (1e-5: the same function
computed by two codes, other summation orders). The import exported again must give the same
files bit for bit, through Megatron checkpoints (TP 2) as well. Mixtral's ``sliding_window``
means the same and is checked the same way; what neither can express is refused by flag.
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
from tests.unit.test_convert_hf import LLAMA, VOCAB, build_model, canonical_pieces, make_meta

transformers = pytest.importorskip("transformers")

SEQ, WINDOW = 16, 4


def hf_mistral(folder, seed=0, **overrides):
    """A 2-layer float32 MistralForCausalLM saved in ``folder``, weights perturbed so that
    activations are of order one."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
              sliding_window=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return model


def our_model(pieces):
    """A GPTModel built from an imported stream's meta, holding its tensors."""
    meta = pieces[0].meta
    cfg = TransformerConfig(
        num_layers=meta.num_layers, hidden_size=meta.hidden_size,
        num_attention_heads=meta.num_attention_heads, padded_vocab_size=meta.padded_vocab_size,
        max_position_embeddings=meta.max_position_embeddings, seq_length=SEQ,
        ffn_hidden_size=meta.ffn_hidden_size, num_query_groups=meta.num_query_groups,
        kv_channels=meta.kv_channels, hidden_dropout=0.0, attention_dropout=0.0,
        position_embedding_type="rope", rotary_base=meta.rotary_base, normalization="RMSNorm",
        layernorm_epsilon=meta.norm_epsilon, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=meta.untie_embeddings_and_output_weights,
        window_size=meta.window_size, params_dtype=torch.float32)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(cfg, pstate, parallel_output=False, init_seed=0)
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


def test_imported_mistral_computes_transformers_logits(tmp_path):
    reference = hf_mistral(str(tmp_path / "hf"))
    pieces = list(load_hf(str(tmp_path / "hf")))
    assert pieces[0].meta.window_size == (WINDOW - 1, 0)
    want, got = _logits(reference, our_model(pieces))
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the window matters: the same weights with full attention give other logits
    unwindowed = our_model([dataclasses.replace(pieces[0], meta=dataclasses.replace(
        pieces[0].meta, window_size=None))] + pieces[1:])
    assert (_logits(reference, unwindowed)[1] - want).abs().max() > 1e-2


def test_mistral_without_a_window_is_plain_causal(tmp_path):
    reference = hf_mistral(str(tmp_path / "hf"), seed=1, sliding_window=None)
    pieces = list(load_hf(str(tmp_path / "hf")))
    assert pieces[0].meta.window_size is None
    want, got = _logits(reference, our_model(pieces))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_import_then_export_gives_the_same_folder(tmp_path):
    hf_mistral(str(tmp_path / "hf"), seed=2)
    save_hf(load_hf(str(tmp_path / "hf")), str(tmp_path / "back"), allow_no_tokenizer=True)
    want, got = _safetensors(str(tmp_path / "hf")), _safetensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(tmp_path / "back" / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "mistral" and config["sliding_window"] == WINDOW
    back = transformers.MistralForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert back.config.sliding_window == WINDOW


def test_our_windowed_model_exports_as_mistral(tmp_path):
    cfg, model = build_model(seed=6, **dict(LLAMA, untie_embeddings_and_output_weights=True),
                             window_size=(2, 0), window_attn_skip_freq=(1, 1))
    meta = make_meta(cfg, window_size=(2, 0), window_attn_skip_freq=(1, 1))
    folder = str(tmp_path / "hf")
    save_hf(iter(canonical_pieces(model, meta)), folder, allow_no_tokenizer=True)
    theirs = transformers.MistralForCausalLM.from_pretrained(folder).eval()
    assert theirs.config.sliding_window == 3
    want, got = _logits(theirs, model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fields, pattern", [
    (dict(window_attn_skip_freq=2), r"MistralForCausalLM.*--window-attn-skip-freq 2"),
    (dict(window_size=(3, 1)), r"MistralForCausalLM.*--window-size 3,1 \(the window looks "
                               r"back only"),
    (dict(softmax_type="learnable"), r"--softmax-type learnable: no Hugging Face"),
    (dict(normalization="LayerNorm"), r"--window-size 3,0: .* only MistralForCausalLM and "
                                      r"MixtralForCausalLM"),
    (dict(num_experts=4, moe_shared_expert_intermediate_size=8), r"--window-size 3,0: .*"
                                                                 r"without a shared expert"),
    (dict(num_experts=4, window_attn_skip_freq=(1, 0)),
     r"MixtralForCausalLM.*--window-attn-skip-freq \(1, 0\)"),
    (dict(add_bias_linear=True), r"MistralForCausalLM.*linear biases"),
])
def test_windows_mistral_cannot_express_are_refused(tmp_path, fields, pattern):
    cfg, _ = build_model(**LLAMA)
    meta = make_meta(cfg, **dict(dict(window_size=(3, 0)), **fields))
    with pytest.raises(ConversionError, match=pattern):
        save_hf(iter([types.SimpleNamespace(kind="meta", meta=meta, index=None)]),
                str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert not os.path.exists(tmp_path / "hf")


def test_bad_windows_are_refused_at_import(tmp_path):
    folder = tmp_path / "hf"
    hf_mistral(str(folder), seed=3)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for changes, pattern in ((dict(sliding_window=0), r"'sliding_window' is 0"),
                             (dict(attention_bias=True), r"'attention_bias' is True")):
        path.write_text(json.dumps(dict(config, **changes)))
        with pytest.raises(ConversionError, match=pattern):
            load_hf(str(folder))


def test_mistral_through_megatron_tp2_comes_back_bit_for_bit(tmp_path):
    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.training import checkpointing
    from tools.checkpoint.convert import main

    folder = str(tmp_path / "hf")
    hf_mistral(folder, seed=4)
    common = ["--model-type", "GPT"]
    tp2, back = str(tmp_path / "tp2"), str(tmp_path / "back")
    assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                          "--target-tensor-parallel-size", "2"]) == 0
    assert main(common + ["--saver", "hf", "--load-dir", tp2, "--save-dir", back,
                          "--allow-no-tokenizer", "--true-vocab-size", str(VOCAB)]) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert [k for k in want if not torch.equal(got[k], want[k])] == [] and got.keys() == want.keys()
    iteration, release = checkpointing.read_tracker(tp2)
    args = torch_load(checkpointing.checkpoint_file(tp2, iteration, 0, 0, 1, release))["args"]
    assert (args.window_size, args.window_attn_skip_freq, args.softmax_type) == (
        (WINDOW - 1, 0), None, "vanilla")


def test_windowed_moe_model_exports_as_mixtral_and_comes_back(tmp_path):
    """Mixtral's sliding_window means the same as Mistral's: our MoE model with a window gives
    transformers' Mixtral logits, and the folder imports with the window."""
    from tests.unit.test_convert_hf_mixtral import build_moe_model, moe_meta

    cfg, model = build_moe_model(seed=8, model_overrides=dict(window_size=(2, 0)))
    meta = moe_meta(cfg, window_size=(2, 0))
    folder = str(tmp_path / "hf")
    save_hf(iter(canonical_pieces(model, meta)), folder, allow_no_tokenizer=True)
    theirs = transformers.MixtralForCausalLM.from_pretrained(folder).eval()
    assert theirs.config.sliding_window == 3
    want, got = _logits(theirs, model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert next(iter(load_hf(folder))).meta.window_size == (2, 0)
    unwindowed = build_moe_model(seed=8)[1]
    assert (_logits(theirs, unwindowed)[1] - want).abs().max() > 1e-2

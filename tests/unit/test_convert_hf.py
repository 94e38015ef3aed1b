"""Hugging Face export and import (megatron.convert.hf) against transformers' own models.

A tiny GPTModel (TP = PP = 1) is turned into the canonical stream straight from its checkpoint
dict, written with ``save_hf``, and loaded by ``transformers`` (``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``GPTNeoXForCausalLM``, ``StableLmForCausalLM``, ``AutoTokenizer``) as an
independent reference. Parameters are perturbed
(std 0.2, layer norms included) so that activations are of order one and any wrong transpose,
head order or activation shows: e.g. erf GeLU in place of our tanh GeLU moves the logits by
~1e-3. The same float32 function computed by two codes differs by ~3e-6 here (other summation
orders), hence the 1e-5 tolerance. ``load_hf`` is checked to give back every tensor bit for bit.
"""

import dataclasses
import inspect
import io
import json
import os
import textwrap
import types

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.convert.hf import load_hf, save_hf  # noqa: E402
from megatron.convert.schema import ConversionError, ModelMeta, Piece  # noqa: E402
from megatron.core.config import TransformerConfig  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.module import flatten_state_dict  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB, PADDED, SEQ = 100, 128, 16
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, num_query_groups=2, ffn_hidden_size=48, rotary_base=500)
# rope + LayerNorm: GeLU -> GPT-NeoX, SwiGLU -> StableLM; both with partial rotary.
NEOX = dict(position_embedding_type="rope", rotary_percent=0.5, rotary_base=500)
STABLELM = dict(position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                num_query_groups=2, ffn_hidden_size=48, rotary_percent=0.5, rotary_base=500)
STDLIB_TEXT = inspect.getsource(textwrap) + "\n  naïve café — 数学 \t tabs\n\n 12345 !!"


def build_model(seed=0, **overrides):
    """A 2-layer float32 GPTModel (hidden 32, 4 heads) with every parameter perturbed."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=PADDED,
              max_position_embeddings=SEQ, seq_length=SEQ, hidden_dropout=0.0,
              attention_dropout=0.0, params_dtype=torch.float32)
    kw.update(overrides)
    cfg = TransformerConfig(**kw)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(cfg, pstate, parallel_output=False, init_seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return cfg, model.eval()


def make_meta(cfg, vocab=VOCAB, **fields):
    meta = ModelMeta(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, vocab_size=vocab,
        padded_vocab_size=cfg.padded_vocab_size,
        position_embedding_type=cfg.position_embedding_type, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, add_qkv_bias=cfg.add_qkv_bias,
        normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon,
        swiglu=cfg.swiglu, openai_gelu=cfg.openai_gelu, add_bias_linear=cfg.add_bias_linear,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        params_dtype=cfg.params_dtype, seq_length=cfg.seq_length,
        tokenizer_type="NullTokenizer")
    return dataclasses.replace(meta, **fields)


def canonical_pieces(model, meta):
    """The canonical stream of a TP=1 / PP=1 model, read off its checkpoint dict."""
    sd = flatten_state_dict(model.state_dict_for_save_checkpoint())

    def under(prefix):
        return {k[len(prefix):]: v.detach().to(meta.params_dtype) for k, v in sd.items()
                if k.startswith(prefix)}

    emb = under("language_model.embedding.")
    pieces = [Piece("meta", meta=meta), Piece("embeddings", {
        k.split(".")[0]: v for k, v in emb.items()})]
    pieces += [Piece("layer", under(f"language_model.encoder.layers.{i}."), index=i)
               for i in range(meta.num_layers)]
    pieces.append(Piece("final_norm", under("language_model.encoder.final_layernorm.")))
    if meta.untie_embeddings_and_output_weights:
        pieces.append(Piece("output_layer", under("language_model.output_layer.")))
    return pieces


def export(tmp_path, model, meta, name="hf", **kwargs):
    folder = str(tmp_path / name)
    kwargs.setdefault("allow_no_tokenizer", True)
    save_hf(iter(canonical_pieces(model, meta)), folder, **kwargs)
    return folder


def assert_same_logits(ours, hf_class, folder):
    theirs, info = hf_class.from_pretrained(folder, output_loading_info=True,
                                            dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        want = ours(ids, pos, None)                                   # [b, s, padded V]
        got = theirs.eval()(ids).logits                               # [b, s, V]
    assert got.shape == (2, SEQ, VOCAB)
    assert want[..., :VOCAB].abs().max() > 1.0       # activations really are of order one
    torch.testing.assert_close(got, want[..., :VOCAB], rtol=0, atol=1e-5)


# ---- 1, 2: transformers computes what our model computes ---------------------------------------


@pytest.mark.parametrize("openai_gelu", [False, True])
def test_gpt2_logits_match_transformers(tmp_path, openai_gelu):
    cfg, model = build_model(openai_gelu=openai_gelu)
    folder = export(tmp_path, model, make_meta(cfg))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "gpt2" and config["vocab_size"] == VOCAB
    assert config["n_inner"] == 128 and config["n_positions"] == SEQ
    assert config["activation_function"] == ("gelu_new" if openai_gelu else "gelu_pytorch_tanh")
    assert_same_logits(model, transformers.GPT2LMHeadModel, folder)


@pytest.mark.parametrize("variant", ["untied", "tied", "biases"])
def test_llama_logits_match_transformers(tmp_path, variant):
    overrides = dict(LLAMA, untie_embeddings_and_output_weights=variant == "untied",
                     add_bias_linear=variant == "biases")
    cfg, model = build_model(seed=2, **overrides)
    folder = export(tmp_path, model, make_meta(cfg))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] == (variant != "untied")
    assert config["attention_bias"] == config["mlp_bias"] == (variant == "biases")
    assert_same_logits(model, transformers.LlamaForCausalLM, folder)


def _config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("variant", ["partial_untied", "full_tied_openai_gelu", "no_biases"])
def test_neox_logits_match_transformers(tmp_path, variant):
    """Also checks that GPT-NeoX's fused query_key_value is Megatron's per-head [q; k; v]."""
    overrides = dict(NEOX, untie_embeddings_and_output_weights=variant == "partial_untied",
                     add_bias_linear=variant != "no_biases")
    if variant == "full_tied_openai_gelu":
        overrides.update(rotary_percent=1.0, openai_gelu=True)
    cfg, model = build_model(seed=6, **overrides)
    folder = export(tmp_path, model, make_meta(cfg))
    config = _config(folder)
    assert config["model_type"] == "gpt_neox" and config["use_parallel_residual"] is False
    assert config["rotary_pct"] == overrides["rotary_percent"]
    assert config["attention_bias"] == (variant != "no_biases")
    assert config["hidden_act"] == ("gelu_new" if variant == "full_tied_openai_gelu"
                                    else "gelu_pytorch_tanh")
    assert config["tie_word_embeddings"] == (variant != "partial_untied")
    assert_same_logits(model, transformers.GPTNeoXForCausalLM, folder)


@pytest.mark.parametrize("variant", ["gqa_untied", "gqa_qkv_bias_tied", "mha_full_rotary"])
def test_stablelm_logits_match_transformers(tmp_path, variant):
    overrides = dict(STABLELM, untie_embeddings_and_output_weights=variant == "gqa_untied",
                     add_qkv_bias=variant == "gqa_qkv_bias_tied")
    if variant == "mha_full_rotary":
        overrides.update(num_query_groups=4, rotary_percent=1.0)
    cfg, model = build_model(seed=7, **overrides)
    folder = export(tmp_path, model, make_meta(cfg))
    config = _config(folder)
    assert config["model_type"] == "stablelm" and config["qk_layernorm"] is False
    assert config["num_key_value_heads"] == overrides["num_query_groups"]
    assert config["partial_rotary_factor"] == overrides["rotary_percent"]
    assert config["use_qkv_bias"] == (variant == "gqa_qkv_bias_tied")
    assert_same_logits(model, transformers.StableLmForCausalLM, folder)


def test_sharded_folder_loads_in_transformers(tmp_path):
    cfg, model = build_model(seed=3, **LLAMA)
    folder = export(tmp_path, model, make_meta(cfg), max_shard_size=20_000)
    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert "model.safetensors" not in files
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_logits(model, transformers.LlamaForCausalLM, folder)
    # a second export with one file, told to overwrite, replaces the shards
    export(tmp_path, model, make_meta(cfg), overwrite=True)
    assert not [f for f in os.listdir(folder) if f.startswith("model-")]


# ---- 3: Megatron -> HF -> Megatron -------------------------------------------------------------

# Fields HF folders cannot carry: the padded size comes back as vocab_size (the Megatron saver
# pads again), and the tokenizer fields describe the folder's files (none for NullTokenizer).
# An MoE config always states router_aux_loss_coef, so a meta without a coefficient (None)
# comes back with the 0.0 written for it (test_convert_hf_authored checks a set one).
NOT_ROUND_TRIPPED = {"padded_vocab_size", "tokenizer_type", "vocab_file", "merge_file",
                     "tokenizer_model", "moe_aux_loss_coeff"}


ROUND_TRIP_CASES = {
    "gpt2": dict(openai_gelu=True), "gpt2_bf16": dict(openai_gelu=True),
    "llama_untied": dict(LLAMA, untie_embeddings_and_output_weights=True), "llama_sharded": LLAMA,
    "neox_untied": dict(NEOX, untie_embeddings_and_output_weights=True),
    "neox_no_biases": dict(NEOX, add_bias_linear=False, openai_gelu=True),
    "stablelm_qkv_bias": dict(STABLELM, add_qkv_bias=True,
                              untie_embeddings_and_output_weights=True),
}


@pytest.mark.parametrize("case", ROUND_TRIP_CASES)
def test_megatron_hf_megatron_is_bit_identical(tmp_path, case):
    overrides = ROUND_TRIP_CASES[case]
    cfg, model = build_model(seed=4, **overrides)
    meta = make_meta(cfg, params_dtype=torch.bfloat16 if case == "gpt2_bf16" else torch.float32)
    source = canonical_pieces(model, meta)
    shard = dict(max_shard_size=10_000) if case == "llama_sharded" else {}
    back = list(load_hf(export(tmp_path, model, meta, **shard)))

    assert [(p.kind, p.index) for p in back] == [(p.kind, p.index) for p in source]
    got_meta = back[0].meta
    assert got_meta.padded_vocab_size == VOCAB and got_meta.tokenizer_type is None
    for field in dataclasses.fields(ModelMeta):
        if field.name not in NOT_ROUND_TRIPPED:
            assert getattr(got_meta, field.name) == getattr(meta, field.name), field.name
    for want, got in zip(source[1:], back[1:]):
        assert want.tensors.keys() == got.tensors.keys(), want.kind
        for name, tensor in want.tensors.items():
            if name in ("word_embeddings", "weight") and want.kind in ("embeddings",
                                                                      "output_layer"):
                tensor = tensor[:VOCAB]        # padding rows are dropped by the export
            assert got.tensors[name].dtype == meta.params_dtype
            assert torch.equal(got.tensors[name], tensor), (want.kind, want.index, name)


def test_original_gpt2_names_and_extra_tensors_load(tmp_path):
    """GPT2Model files name tensors without ``transformer.`` and may hold attention-mask buffers
    and a copy of the tied lm_head; all read the same."""
    from safetensors.torch import load_file, save_file

    cfg, model = build_model(seed=5)
    folder = export(tmp_path, model, make_meta(cfg))
    want = list(load_hf(folder))
    path = os.path.join(folder, "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, SEQ, SEQ)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    got = list(load_hf(folder))
    for a, b in zip(want[1:], got[1:], strict=True):
        assert a.tensors.keys() == b.tensors.keys()
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


# ---- 4: tokenizers -------------------------------------------------------------------------------


def test_gpt2_bpe_tokenizer_matches_ours(tmp_path):
    from megatron.tokenizer import gpt2_vocab_files
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    vocab_file, merge_file = gpt2_vocab_files()
    cfg, model = build_model(num_layers=1, hidden_size=8, num_attention_heads=2,
                             padded_vocab_size=50304)
    meta = make_meta(cfg, vocab=50257, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                     merge_file=merge_file)
    folder = export(tmp_path, model, meta, allow_no_tokenizer=False)
    ours = GPT2BPETokenizer(vocab_file, merge_file)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = ours.tokenize(STDLIB_TEXT)
    assert len(ids) > 500
    assert theirs(STDLIB_TEXT)["input_ids"] == ids
    assert theirs.eos_token_id == ours.eod == 50256
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == 50256
    loaded = next(load_hf(folder)).meta
    assert loaded.tokenizer_type == "GPT2BPETokenizer"
    for field, source in (("vocab_file", vocab_file), ("merge_file", merge_file)):
        path = getattr(loaded, field)
        assert os.path.dirname(path) == os.path.abspath(folder)
        with open(path, "rb") as a, open(source, "rb") as b:
            assert a.read() == b.read()


def _train_sentencepiece(path):
    import sentencepiece

    model = io.BytesIO()
    lines = [line for line in STDLIB_TEXT.splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=200, model_type="bpe",
        minloglevel=2)
    path.write_bytes(model.getvalue())


def _train_tokenizer_json(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(STDLIB_TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPTSentencePieceTokenizer",
                                  "Llama2Tokenizer"])
def test_other_tokenizers_match_ours(tmp_path, kind):
    from megatron.tokenizer import build_tokenizer

    source = tmp_path / ("tokenizer.json" if kind == "HuggingFaceTokenizer" else "sp.model")
    (_train_tokenizer_json if kind == "HuggingFaceTokenizer" else _train_sentencepiece)(source)
    ours = build_tokenizer(types.SimpleNamespace(tokenizer_type=kind, tokenizer_model=str(source),
                                                 padded_vocab_size=None, rank=1))
    cfg, model = build_model(padded_vocab_size=384, **LLAMA)
    meta = make_meta(cfg, vocab=ours.vocab_size, tokenizer_type=kind,
                     tokenizer_model=str(source))
    folder = export(tmp_path, model, meta, allow_no_tokenizer=False)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = ours.tokenize(STDLIB_TEXT)
    assert len(ids) > 500 and theirs(STDLIB_TEXT)["input_ids"] == ids
    assert next(load_hf(folder)).meta.tokenizer_type == kind


# ---- 5: errors name what is wrong ----------------------------------------------------------------


def _meta_only(tmp_path, meta, **kwargs):
    folder = tmp_path / "out"
    save_hf(iter([Piece("meta", meta=meta)]), str(folder), **kwargs)
    return folder


@pytest.mark.parametrize("overrides,pattern", [
    (dict(untie_embeddings_and_output_weights=True),
     r"GPT2LMHeadModel.*--untie-embeddings-and-output-weights"),
    (dict(add_bias_linear=False), r"--disable-bias-linear"),
    (dict(num_query_groups=2), r"--num-query-groups 2"),
    (dict(position_embedding_type="rope", normalization="RMSNorm"),
     r"LlamaForCausalLM.*GeLU MLP without --swiglu"),
    (dict(position_embedding_type="rope", num_query_groups=2),
     r"^--group-query-attention --num-query-groups 2 .*GeLU MLP"),
    (dict(position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=True),
     r"GPTNeoXForCausalLM.*--add-qkv-bias"),
    (dict(position_embedding_type="rope", swiglu=True),
     r"StableLmForCausalLM.*without --disable-bias-linear"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
          rotary_percent=0.5), r"--rotary-percent 0.5"),
    (dict(position_embedding_type="none"), r"--position-embedding-type none"),
])
def test_unexpressible_models_are_refused_before_writing(tmp_path, overrides, pattern):
    cfg, _ = build_model()
    with pytest.raises(ConversionError, match=pattern) as err:
        _meta_only(tmp_path, make_meta(cfg, **overrides), allow_no_tokenizer=True)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_tokenizer_errors(tmp_path):
    cfg, _ = build_model()
    missing = str(tmp_path / "nowhere" / "vocab.json")
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    meta = make_meta(cfg, tokenizer_type="GPT2BPETokenizer", vocab_file=missing,
                     merge_file=str(merges))
    with pytest.raises(ConversionError, match=r"--vocab-file '" + missing + "'"):
        _meta_only(tmp_path, meta)
    with pytest.raises(ConversionError, match=r"--merge-file"):
        _meta_only(tmp_path, dataclasses.replace(meta, vocab_file=str(merges), merge_file=None))
    with pytest.raises(ConversionError, match=r"NullTokenizer.*allow_no_tokenizer=True"):
        _meta_only(tmp_path, make_meta(cfg))
    assert not (tmp_path / "out").exists()


def test_stream_errors(tmp_path):
    cfg, model = build_model()
    pieces = canonical_pieces(model, make_meta(cfg))
    del pieces[2].tensors["mlp.dense_4h_to_h.bias"]
    with pytest.raises(ConversionError, match=r"layer 0 has tensors"):
        save_hf(iter(pieces), str(tmp_path / "a"), allow_no_tokenizer=True)
    pieces = canonical_pieces(model, make_meta(cfg))
    with pytest.raises(ConversionError, match=r"expected layer 1, got final_norm"):
        save_hf(iter(pieces[:3] + pieces[4:]), str(tmp_path / "b"), allow_no_tokenizer=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_load_errors(tmp_path):
    cfg, model = build_model()
    folder = export(tmp_path, model, make_meta(cfg))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    os.remove(config_path)
    with pytest.raises(ConversionError, match=r"config\.json: missing"):
        load_hf(folder)

    def write(**changes):
        with open(config_path, "w") as f:
            json.dump({**config, **changes}, f)

    write(model_type="t5")
    with pytest.raises(ConversionError, match=r"config\.json: 'model_type' is 't5'"):
        load_hf(folder)
    write(activation_function="gelu")
    with pytest.raises(ConversionError, match=r"'activation_function' is 'gelu'"):
        load_hf(folder)
    write(n_inner=64)
    with pytest.raises(ConversionError, match=r"'transformer.h.0.mlp.c_fc.weight' has shape "
                                              r"\[32, 128\]; config.json implies \[32, 64\]"):
        list(load_hf(folder))
    write()
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ConversionError, match=r"model\.safetensors"):
        load_hf(folder)


def test_neox_and_stablelm_load_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, model = build_model(**dict(NEOX, add_bias_linear=False))
    folder = export(tmp_path, model, make_meta(cfg))
    config_path, config = os.path.join(folder, "config.json"), _config(folder)

    def write(**changes):
        with open(config_path, "w") as f:
            json.dump({key: value for key, value in {**config, **changes}.items()
                       if value is not None}, f)

    for key, value in (("use_parallel_residual", True), ("hidden_act", "gelu")):
        write(**{key: value})
        with pytest.raises(ConversionError, match=rf"'{key}' is {value!r}"):
            load_hf(folder)
    write(rope_parameters=None)             # older configs: rotary_pct / rotary_emb_base only
    meta = next(load_hf(folder)).meta
    assert (meta.rotary_percent, meta.rotary_base) == (0.5, 500)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"][0] = 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"layers\.1\.mlp\.dense_4h_to_h\.bias is not zero"):
        list(load_hf(folder))

    cfg, model = build_model(**STABLELM)
    folder = export(tmp_path, model, make_meta(cfg), name="stablelm")
    config_path, config = os.path.join(folder, "config.json"), _config(folder)
    write(qk_layernorm=True)
    with pytest.raises(ConversionError, match=r"'qk_layernorm' is True"):
        load_hf(folder)

"""BERT to and from Hugging Face (megatron.convert.hf with hf_bert) against transformers' models.

A tiny BertModel (TP = PP = 1) is turned into the canonical stream straight from its checkpoint
dict, written with ``save_hf`` and loaded by ``transformers`` as the independent reference:
``BertForPreTraining`` for post-LN (``--apply-residual-connection-post-layernorm``),
``MegatronBertForPreTraining`` for pre-LN, their ``*ForMaskedLM`` without the binary head.
Every parameter is perturbed (std 0.2, layer norms and biases included) so that activations are
of order one and a misplaced norm, head or transpose shows (each moves logits by > 1e-2).
Batches hold padding (HF gets ``attention_mask`` and ``token_type_ids``); masked-LM logits are
compared at the real tokens (our padded queries attend to nothing, HF's to the real keys: both
outputs there are meaningless) and sentence-order logits per sequence. The same float32 function
computed by two codes differs by a few 1e-6 here (other summation orders), hence 1e-5.

GeLU: ours is the tanh approximation in the MLP and the LM head alike, HF's
``gelu_pytorch_tanh`` (``gelu_new`` with ``--openai-gelu``); HF's erf ``gelu`` would move these
logits by ~1e-3, far outside the tolerance.
"""

import dataclasses
import json
import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.convert.hf import load_hf, save_hf  # noqa: E402
from megatron.convert.megatron_io import load_megatron, save_megatron  # noqa: E402
from megatron.convert.schema import ConversionError, ModelMeta, Piece  # noqa: E402
from megatron.core.config import TransformerConfig  # noqa: E402
from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.module import flatten_state_dict  # noqa: E402

transformers = pytest.importorskip("transformers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a of to and in is it that was for on are with as his they at be this from have "
         "or by one had not but what all were when we there can an your which their said if do "
         "will each about how up out them then she many some so these would other into has "
         "more her two like him see time could no make than first been its who now people my "
         "made over did down only way find use may water long little very after").split()
PIECES = ["##s", "##ing", "##ed", "##er", "##ly", "##est", "##ness"]
VOCAB_LINES = SPECIALS + WORDS[:98 - len(SPECIALS) - len(PIECES)] + PIECES
VOCAB = len(VOCAB_LINES) + 2       # our tokenizer appends [BOS] and [EOS]
PADDED, SEQ, H = 128, 16, 32


@pytest.fixture
def vocab_file(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB_LINES) + "\n", encoding="utf-8")
    return str(path)


def build_bert(post_ln=True, binary_head=True, openai_gelu=False, seed=0):
    """A 2-layer float32 BertModel (hidden 32, 4 heads) with every parameter perturbed."""
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4,
                            padded_vocab_size=PADDED, max_position_embeddings=SEQ,
                            seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=torch.float32, openai_gelu=openai_gelu,
                            apply_residual_connection_post_layernorm=post_ln)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = BertModel(cfg, pstate, num_tokentypes=2 if binary_head else 0,
                      add_binary_head=binary_head, parallel_output=False, init_seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return cfg, model.eval()


def make_meta(cfg, model, vocab_file, **fields):
    meta = ModelMeta(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, vocab_size=VOCAB,
        padded_vocab_size=cfg.padded_vocab_size, norm_epsilon=cfg.layernorm_epsilon,
        openai_gelu=cfg.openai_gelu,
        apply_residual_connection_post_layernorm=cfg.apply_residual_connection_post_layernorm,
        params_dtype=cfg.params_dtype, seq_length=cfg.seq_length,
        tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab_file, model_type="BERT",
        num_tokentypes=model.language_model.embedding.num_tokentypes,
        bert_binary_head=model.add_binary_head)
    return dataclasses.replace(meta, **fields)


def canonical_pieces(model, meta):
    """The canonical stream of a TP=1 / PP=1 BertModel, read off its checkpoint dict."""
    sd = flatten_state_dict(model.state_dict_for_save_checkpoint())

    def under(prefix):
        return {k[len(prefix):]: v.detach().clone() for k, v in sd.items()
                if k.startswith(prefix)}

    emb = under("language_model.embedding.")
    pieces = [Piece("meta", meta=meta),
              Piece("embeddings", {k.split(".")[0]: v for k, v in emb.items()})]
    pieces += [Piece("layer", under(f"language_model.encoder.layers.{i}."), index=i)
               for i in range(meta.num_layers)]
    pieces.append(Piece("final_norm", under("language_model.encoder.final_layernorm.")))
    if meta.bert_binary_head:
        pieces.append(Piece("pooler", under("language_model.pooler.")))
    pieces.append(Piece("lm_head", under("lm_head.")))
    if meta.bert_binary_head:
        pieces.append(Piece("binary_head", under("binary_head.")))
    return pieces


def export(tmp_path, model, meta, name="hf"):
    folder = str(tmp_path / name)
    save_hf(iter(canonical_pieces(model, meta)), folder)
    return folder


def batch(with_types):
    """Two sequences of SEQ tokens, the second with 5 padding positions at the end."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0
    ids[1, SEQ - 5:] = 0
    types = torch.zeros(2, SEQ, dtype=torch.long)
    if with_types:
        types[0, 6:] = 1
        types[1, 4:SEQ - 5] = 1
    return ids, mask, types


def hf_outputs(folder, ids, mask, types):
    """(MLM logits [b, s, V], seq-relationship logits [b, 2] or None, the HF model)."""
    with open(os.path.join(folder, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    model, info = getattr(transformers, architecture).from_pretrained(
        folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    return logits, getattr(out, "seq_relationship_logits", None), model


CASES = [  # post_ln, binary head, openai_gelu, the class transformers must build
    (True, True, False, "BertForPreTraining"),
    (True, True, True, "BertForPreTraining"),
    (False, True, False, "MegatronBertForPreTraining"),
    (False, True, True, "MegatronBertForPreTraining"),
    (True, False, True, "BertForMaskedLM"),
    (False, False, False, "MegatronBertForMaskedLM"),
]


@pytest.mark.parametrize("post_ln,binary_head,openai_gelu,architecture", CASES)
def test_transformers_computes_what_our_bert_computes(tmp_path, vocab_file, post_ln,
                                                      binary_head, openai_gelu, architecture):
    cfg, model = build_bert(post_ln, binary_head, openai_gelu)
    meta = make_meta(cfg, model, vocab_file)
    folder = export(tmp_path, model, meta)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == [architecture]
    assert config["hidden_act"] == ("gelu_new" if openai_gelu else "gelu_pytorch_tanh")
    assert config["vocab_size"] == VOCAB and config["layer_norm_eps"] == 1e-5
    assert config["type_vocab_size"] == (2 if binary_head else 1)
    assert config["pad_token_id"] == 0 and config["max_position_embeddings"] == SEQ

    ids, mask, types = batch(binary_head)
    with torch.no_grad():
        want_lm, want_sop = model(ids, mask, types if binary_head else None)   # [b, s, 128]
    got_lm, got_sop, hf = hf_outputs(folder, ids, mask, types)
    assert type(hf).__name__ == architecture
    real = mask.bool()
    assert got_lm.shape == (2, SEQ, VOCAB)
    assert want_lm[real][:, :VOCAB].abs().max() > 1.0        # activations of order one
    torch.testing.assert_close(got_lm[real], want_lm[real][:, :VOCAB], rtol=0, atol=1e-5)
    if binary_head:
        assert want_sop.abs().max() > 0.1
        torch.testing.assert_close(got_sop, want_sop, rtol=0, atol=1e-5)
    else:
        assert want_sop is None and got_sop is None


def test_erf_gelu_folders_are_read_approximately_with_a_note(tmp_path, vocab_file, capfd):
    """A published BERT's ``gelu`` (erf) is read as our tanh GeLU, saying so; the two models
    differ by far more than the tolerance above, so that test does check the activation."""
    cfg, model = build_bert()
    folder = export(tmp_path, model, make_meta(cfg, model, vocab_file))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "hidden_act": "gelu"}, f)
    meta = next(load_hf(folder)).meta
    assert meta.openai_gelu is False
    assert "'hidden_act' is 'gelu', the exact (erf) GeLU" in capfd.readouterr().err
    ids, mask, types = batch(True)
    with torch.no_grad():
        want, _ = model(ids, mask, types)
    got, _, _ = hf_outputs(folder, ids, mask, types)
    real = mask.bool()
    assert 1e-4 < (got[real] - want[real][:, :VOCAB]).abs().max() < 5e-2


def _stream_tensors(pieces):
    return {(p.kind, p.index, name): t for p in pieces if p.kind != "meta"
            for name, t in p.tensors.items()}


@pytest.mark.parametrize("post_ln,binary_head", [(True, True), (False, False)])
def test_hf_round_trip_is_bit_identical(tmp_path, vocab_file, post_ln, binary_head):
    """Megatron -> HF -> canonical gives every tensor back bit for bit (vocabulary tables trimmed
    to the tokenizer's rows); -> Megatron at TP=1 loads strictly into a BertModel whose state
    equals the original but for the (zero) padding rows."""
    cfg, model = build_bert(post_ln, binary_head, openai_gelu=not binary_head)
    meta = make_meta(cfg, model, vocab_file)
    folder = export(tmp_path, model, meta)
    pieces = list(load_hf(folder))
    back = pieces[0].meta
    for field in ("model_type", "num_tokentypes", "bert_binary_head", "openai_gelu",
                  "apply_residual_connection_post_layernorm", "norm_epsilon", "num_layers",
                  "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                  "max_position_embeddings", "tokenizer_type"):
        assert getattr(back, field) == getattr(meta, field), field
    assert back.vocab_file == os.path.join(folder, "vocab.txt")
    want = _stream_tensors(canonical_pieces(model, meta))
    got = _stream_tensors(pieces)
    assert sorted(got, key=str) == sorted(want, key=str)
    vocab_tables = {("embeddings", None, "word_embeddings"), ("lm_head", None, "bias")}
    for key, tensor in want.items():
        expected = tensor[:VOCAB] if key in vocab_tables else tensor
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key

    out = str(tmp_path / "megatron")
    save_megatron(iter(pieces), out, 1, 1)
    from megatron.training.checkpointing import checkpoint_file, load_state_file

    state = load_state_file(checkpoint_file(out, 0, 0, 0, 1, release=True))
    assert state["args"].bert_binary_head == binary_head
    assert state["args"].padded_vocab_size == PADDED
    _, fresh = build_bert(post_ln, binary_head, seed=5)
    fresh.load_state_dict(state["model"], strict=True)
    original = flatten_state_dict(model.state_dict_for_save_checkpoint())
    for key, tensor in flatten_state_dict(fresh.state_dict_for_save_checkpoint()).items():
        if key in ("language_model.embedding.word_embeddings.weight", "lm_head.bias"):
            assert torch.equal(tensor[:VOCAB], original[key][:VOCAB]), key
            assert not tensor[VOCAB:].any(), key
        else:
            assert torch.equal(tensor, original[key]), key


def test_tokenizer_files_load_offline_and_encode_alike(tmp_path, vocab_file):
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    cfg, model = build_bert()
    for kind, lower in (("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)):
        folder = export(tmp_path, model, make_meta(cfg, model, vocab_file, tokenizer_type=kind),
                        name=kind)
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        ours = BertWordPieceTokenizer(vocab_file, lower_case=lower)
        text = "The people made water, and THEN they findest the finding way! Über time: 2 ×"
        got = theirs(text, add_special_tokens=False)["input_ids"]
        assert got == ours.tokenize(text) and len(got) > 10
        assert 1 in got and VOCAB_LINES.index("##est") in got      # [UNK] and a word piece
        assert theirs.pad_token_id == 0 and theirs.cls_token_id == 2
        assert theirs.sep_token_id == 3 and theirs.mask_token_id == 4
        with open(os.path.join(folder, "vocab.txt"), "rb") as f, open(vocab_file, "rb") as g:
            assert f.read() == g.read()
        meta = next(load_hf(folder)).meta
        assert meta.tokenizer_type == kind and meta.vocab_size == VOCAB


@pytest.mark.parametrize("overrides,pattern", [
    (dict(position_embedding_type="rope"), r"BertForPreTraining.*--position-embedding-type rope"),
    (dict(normalization="RMSNorm"), r"--normalization RMSNorm"),
    (dict(swiglu=True), r"--swiglu"),
    (dict(add_bias_linear=False), r"--disable-bias-linear"),
    (dict(num_query_groups=2), r"--num-query-groups 2"),
    (dict(apply_residual_connection_post_layernorm=False, kv_channels=16),
     r"MegatronBertForPreTraining.*--kv-channels 16"),
])
def test_unexpressible_berts_are_refused_before_writing(tmp_path, vocab_file, overrides,
                                                        pattern):
    cfg, model = build_bert()
    meta = make_meta(cfg, model, vocab_file, **overrides)
    with pytest.raises(ConversionError, match=pattern):
        save_hf(iter([Piece("meta", meta=meta)]), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_hf_berts_we_cannot_compute_are_refused(tmp_path, vocab_file):
    from safetensors.torch import load_file, save_file

    cfg, model = build_bert()
    folder = export(tmp_path, model, make_meta(cfg, model, vocab_file))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)

    def write(**changes):
        with open(config_path, "w") as f:
            json.dump({**config, **changes}, f)

    for key, value, expected in (("hidden_act", "relu", "a GeLU"),
                                 ("is_decoder", True, "False"),
                                 ("position_embedding_type", "relative_key", "'absolute'")):
        write(**{key: value})
        with pytest.raises(ConversionError, match=f"'{key}' is .*only {expected}"):
            load_hf(folder)
    write()
    weights_path = os.path.join(folder, "model.safetensors")
    weights = load_file(weights_path)
    weights["cls.predictions.decoder.weight"] = weights[
        "bert.embeddings.word_embeddings.weight"] + 1
    save_file(weights, weights_path, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="cls.predictions.decoder.weight differs"):
        list(load_hf(folder))


def test_megatron_stream_of_a_bert_round_trips_through_tp2(tmp_path, vocab_file):
    """save_megatron at TP=2 splits the lm_head bias like the vocabulary and replicates the
    other BERT tensors; load_megatron joins them back bit for bit."""
    cfg, model = build_bert()
    meta = make_meta(cfg, model, vocab_file, make_vocab_size_divisible_by=64,
                     iteration=3, source_args={"tensor_model_parallel_size": 1})
    out = str(tmp_path / "tp2")
    save_megatron(iter(canonical_pieces(model, meta)), out, 2, 1)
    from megatron.training.checkpointing import checkpoint_file, load_state_file

    ranks = [flatten_state_dict(load_state_file(checkpoint_file(out, 3, t, 0, 1))["model"])
             for t in range(2)]
    original = flatten_state_dict(model.state_dict_for_save_checkpoint())
    assert torch.equal(torch.cat([r["lm_head.bias"] for r in ranks]), original["lm_head.bias"])
    assert ranks[0]["lm_head.bias"].shape == (PADDED // 2,)
    for key in ("lm_head.dense.weight", "language_model.pooler.dense.bias", "binary_head.weight",
                "language_model.embedding.tokentype_embeddings.weight"):
        assert torch.equal(ranks[0][key], original[key]) and torch.equal(ranks[1][key],
                                                                         original[key]), key
    pieces = list(load_megatron(out, true_vocab_size=VOCAB))
    assert pieces[0].meta.model_type == "BERT" and pieces[0].meta.num_tokentypes == 2
    want = _stream_tensors(canonical_pieces(model, meta))
    got = _stream_tensors(pieces)
    assert sorted(got, key=str) == sorted(want, key=str)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key

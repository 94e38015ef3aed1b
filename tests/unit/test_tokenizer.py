"""Tokenizers: ids against independent implementations, round trips, Megatron's vocab padding.

References: the ``tokenizers`` library's byte-level BPE and WordPiece built from the same files,
tiktoken's own data-gym loader, sentencepiece's processor, the ``punkt`` package's own splitter,
hand-computed WordPiece ids, and GPT-2's published ids for "Hello world".
"""

import argparse
import math
import json
import os

import pytest

from megatron.tokenizer import (TokenizerError, build_tokenizer, gpt2_vocab_files,
                                vocab_size_with_padding)

TRICKY_TEXTS = [
    "Hello world",
    "",
    "  leading and trailing spaces  ",
    "it's they're we've I'm you'll he'd",
    "tabs\tand\nnewlines\r\n\n\n   indented",
    "unicode: café naïve 日本語 emoji 🙂 Ω≈ç√",
    "<|endoftext|> appears as text",
    "numbers 1234567890 3.14159 -42",
]


def namespace(**kwargs):
    defaults = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, vocab_extra_ids=0, make_vocab_size_divisible_by=128,
                    tensor_model_parallel_size=1, rank=1)
    defaults.update(kwargs)
    return argparse.Namespace(**defaults)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts), encoding="utf-8")


@pytest.fixture(scope="module")
def stdlib_texts(tmp_path_factory):
    """A few standard-library source files, via tools/build_stdlib_corpus.py."""
    from tools import build_stdlib_corpus

    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    assert build_stdlib_corpus.main(["--output", str(path), "--max-files", "6"]) == 0
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    assert len(texts) == 6
    return texts


@pytest.fixture(scope="module")
def gpt2():
    vocab, merges = gpt2_vocab_files()
    return build_tokenizer(namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                     merge_file=merges))


def byte_level_reference(vocab_file, merges_file):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reference = Tokenizer(models.BPE.from_file(vocab_file, merges_file))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    return reference


def test_gpt2_matches_tokenizers_byte_level_bpe(gpt2, stdlib_texts):
    reference = byte_level_reference(*gpt2_vocab_files())
    for text in stdlib_texts + TRICKY_TEXTS:
        ids = gpt2.tokenize(text)
        assert ids == reference.encode(text).ids
        assert gpt2.detokenize(ids) == text
        flat, lengths = gpt2.tokenize_batch_flat([text, text])
        assert lengths.tolist() == [len(ids), len(ids)] and flat.tolist() == ids + ids


def test_gpt2_known_ids_and_vocab(gpt2):
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256 == gpt2.vocab["<|endoftext|>"]
    assert gpt2.inv_vocab[995] == "\u0120world"
    assert gpt2.detokenize([gpt2.eod]) == "<|endoftext|>"
    # A lone surrogate (legal as a JSON escape) is encoded the same way on both paths.
    assert gpt2.tokenize_batch_flat(["a\ud800b"])[0].tolist() == gpt2.tokenize("a\ud800b")
    with pytest.raises(NotImplementedError, match="CLS"):
        gpt2.cls


def test_gpt2_ranks_equal_tiktoken_loader(monkeypatch):
    """Our reading of vocab.json/merges.txt equals tiktoken's own data-gym loader."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    from megatron.tokenizer.gpt2_bpe import mergeable_ranks, read_merges

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache files written
    vocab_file, merges_file = gpt2_vocab_files()
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    ranks, rank_to_id = mergeable_ranks(vocab, read_merges(merges_file))
    assert rank_to_id is None
    assert ranks == data_gym_to_mergeable_bpe_ranks(merges_file, vocab_file)


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory, stdlib_texts):
    from tools import train_tokenizer

    folder = tmp_path_factory.mktemp("bpe")
    corpus = folder / "corpus.jsonl"
    write_jsonl(corpus, stdlib_texts)
    out = folder / "tok"
    assert train_tokenizer.main(["--input", str(corpus), "--json-keys", "content",
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "600",
                                 "--output", str(out)]) == 0
    return str(out / "vocab.json"), str(out / "merges.txt")


def test_trained_bpe_loads_and_matches(trained_bpe, stdlib_texts):
    vocab_file, merges_file = trained_bpe
    args = namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                     merge_file=merges_file)
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 600 and tokenizer.eod == 0
    assert args.padded_vocab_size == 640
    reference = byte_level_reference(vocab_file, merges_file)
    for text in stdlib_texts[:3] + TRICKY_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text).ids
        assert tokenizer.detokenize(ids) == text


def test_bpe_with_ids_out_of_merge_order(trained_bpe, stdlib_texts, tmp_path):
    """Ids that do not follow merge priority take the rank -> id translation path."""
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    vocab_file, merges_file = trained_bpe
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    order = sorted(vocab, key=vocab.get)
    permuted = {token: len(order) - 1 - i for i, token in enumerate(order)}  # reversed ids
    shuffled = tmp_path / "vocab.json"
    shuffled.write_text(json.dumps(permuted), encoding="utf-8")
    tokenizer = GPT2BPETokenizer(str(shuffled), merges_file)
    assert tokenizer._rank_to_id is not None
    reference = byte_level_reference(str(shuffled), merges_file)
    for text in stdlib_texts[:2] + TRICKY_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text).ids
        assert tokenizer.tokenize_batch_flat([text])[0].tolist() == ids
        assert tokenizer.detokenize(ids) == text


@pytest.mark.parametrize("tp, expected", [(1, 50304), (2, 50432), (8, 51200)])
def test_padded_vocab_size(tp, expected, capsys):
    args = namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp, rank=0)
    assert vocab_size_with_padding(50257, args) == expected
    assert capsys.readouterr().out.strip() == (
        f"> padded vocab (size: 50257) with {expected - 50257} dummy tokens (new size: {expected})")
    args.rank = 3
    assert vocab_size_with_padding(50257, args) == expected
    assert capsys.readouterr().out == ""


def test_build_sets_padding_once(capsys):
    vocab, merges = gpt2_vocab_files()
    args = namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, rank=0,
                     make_vocab_size_divisible_by=64, tensor_model_parallel_size=1)
    build_tokenizer(args)
    assert args.padded_vocab_size == 50304
    out = capsys.readouterr().out
    assert "> building GPT2BPETokenizer tokenizer ..." in out and "with 47 dummy tokens" in out
    args.padded_vocab_size = 60000  # e.g. restored from a checkpoint: kept
    build_tokenizer(args)
    assert args.padded_vocab_size == 60000


def test_null_tokenizer():
    """Today's Megatron: --vocab-size N gives N ids, the last one the end of document."""
    args = namespace(tokenizer_type="NullTokenizer", vocab_size=1000)
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.eos) == (1000, 999, 999)
    assert args.padded_vocab_size == 1024
    assert args.null_tokenizer_eod_id == 999        # recorded, so a checkpoint says which
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.tokenize("") == []
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    flat, lengths = tokenizer.tokenize_batch_flat(["1 2", "", "7"])
    assert flat.tolist() == [1, 2, 7] and lengths.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="space-separated integers"):
        tokenizer.tokenize("one two")


def test_null_tokenizer_with_an_end_of_document_id_counts_it_in_the_vocabulary():
    args = namespace(tokenizer_type="NullTokenizer", vocab_size=200, null_tokenizer_eod_id=199)
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == (200, 199)
    args = namespace(tokenizer_type="NullTokenizer", vocab_size=200, null_tokenizer_eod_id=7)
    assert build_tokenizer(args).eod == 7
    # The end of document appended after the data ids: the older convention.
    args = namespace(tokenizer_type="NullTokenizer", vocab_size=199, null_tokenizer_eod_id=199)
    assert (build_tokenizer(args).vocab_size, args.null_tokenizer_eod_id) == (200, 199)
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id 201 .*--vocab-size 200"):
        build_tokenizer(namespace(tokenizer_type="NullTokenizer", vocab_size=200,
                                  null_tokenizer_eod_id=201))


@pytest.mark.parametrize("fields, convention", [
    # This project before it recorded the id, and Megatron's legacy tokenizer: appended.
    (dict(vocab_size=199, null_tokenizer_eod_id=None), (200, 199)),
    (dict(vocab_size=199), (200, 199)),
    # Megatron-Core's tokenizers (their args carry null_tokenizer_pad_id): within.
    (dict(vocab_size=200, null_tokenizer_pad_id=-1), (200, 199)),
    # Recorded explicitly: as recorded.
    (dict(vocab_size=200, null_tokenizer_eod_id=199), (200, 199)),
    (dict(vocab_size=200, null_tokenizer_eod_id=200), (201, 200)),
])
def test_null_tokenizer_of_saved_args_keeps_the_convention_they_were_written_with(fields,
                                                                                  convention):
    from megatron.training import checkpointing

    saved = argparse.Namespace(tokenizer_type="NullTokenizer", **fields)
    args = checkpointing.megatron_args(saved)
    args.rank = 1
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == convention


@pytest.mark.parametrize("folder", ["legacy_tp1", "mcore_dist_tp1"])
def test_null_tokenizer_of_a_megatron_checkpoint_is_the_one_megatron_built(folder):
    """The 2023 writer was given --vocab-size 199, the 2026 one (Megatron-Core's tokenizers)
    200; Megatron built a vocabulary of 200 with end-of-document 199 both times (flags.json)."""
    from megatron.checkpoint.dist.reader import is_dist_checkpoint
    from megatron.training import checkpointing

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "megatron_written", folder)
    with open(os.path.join(root, "flags.json")) as f:
        flags = json.load(f)
    tracked = checkpointing.read_tracker(root)
    iter_dir = os.path.join(root, checkpointing.checkpoint_dir_name(*tracked))
    if is_dist_checkpoint(iter_dir):
        from megatron.checkpoint import torch_dist

        saved = torch_dist.saved_args(iter_dir)
    else:
        saved = checkpointing.load_state_file(
            os.path.join(iter_dir, "mp_rank_00", "model_optim_rng.pt"))["args"]
    args = checkpointing.megatron_args(saved)
    args.rank = 1
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == (flags["tokenizer_vocab_size"],
                                                     flags["eod_id"]) == (200, 199)


WORDPIECE_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",", "world", "##s", "un",
                   "##aff", "##able", ".", "Hello"]


@pytest.fixture
def wordpiece_vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(WORDPIECE_VOCAB) + "\n", encoding="utf-8")
    return str(path)


def test_bert_wordpiece_lower_case(wordpiece_vocab):
    args = namespace(tokenizer_type="BertWordPieceLowerCase", vocab_file=wordpiece_vocab,
                     vocab_extra_ids=2)
    tokenizer = build_tokenizer(args)
    # Worked by hand from the vocabulary above: "Hello" lower-cased, "worlds" = world ##s,
    # "Unaffable" = un ##aff ##able, unknown "zzz" -> [UNK].
    assert tokenizer.tokenize("Hello, Worlds UNAFFABLE zzz.") == [5, 6, 7, 8, 9, 10, 11, 1, 12]
    assert tokenizer.detokenize([5, 6, 7, 8, 9, 10, 11]) == "hello , worlds unaffable"
    assert (tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask) == (2, 3, 0, 4)
    assert (tokenizer.bos, tokenizer.eos) == (14, 15)  # [BOS], [EOS] appended as Megatron does
    assert tokenizer.additional_special_tokens_ids == [16, 17]
    assert tokenizer.vocab_size == len(WORDPIECE_VOCAB) + 4
    assert args.padded_vocab_size == 128
    with pytest.raises(NotImplementedError, match="end-of-document"):
        tokenizer.eod


def test_bert_wordpiece_case(wordpiece_vocab):
    tokenizer = build_tokenizer(namespace(tokenizer_type="BertWordPieceCase",
                                          vocab_file=wordpiece_vocab))
    assert tokenizer.tokenize("Hello hello World") == [13, 5, 1]


def test_trained_wordpiece_loads(tmp_path, stdlib_texts):
    from tokenizers import BertWordPieceTokenizer

    from tools import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, stdlib_texts)
    vocab_file = str(tmp_path / "wp" / "vocab.txt")
    assert train_tokenizer.main(["--input", str(corpus), "--json-keys", "content",
                                 "--tokenizer-type", "BertWordPieceLowerCase",
                                 "--vocab-size", "500",
                                 "--output", vocab_file]) == 0
    tokenizer = build_tokenizer(namespace(tokenizer_type="BertWordPieceLowerCase",
                                          vocab_file=vocab_file))
    reference = BertWordPieceTokenizer(vocab_file, lowercase=True)
    for text in stdlib_texts[:3]:
        assert tokenizer.tokenize(text) == reference.encode(text, add_special_tokens=False).ids


def test_sentencepiece(tmp_path, stdlib_texts):
    import sentencepiece

    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for t in stdlib_texts for line in t.splitlines()
                                if line.strip()]),
        model_prefix=prefix, vocab_size=300, model_type="bpe", character_coverage=1.0,
        minloglevel=2)
    args = namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=prefix + ".model",
                     vocab_extra_ids=1)
    tokenizer = build_tokenizer(args)
    processor = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
    # <CLS> <SEP> <EOD> <MASK>, <PAD> (the model has no pad piece) and <extra_id_0> are appended.
    assert tokenizer.vocab_size == processor.get_piece_size() + 6
    assert tokenizer.eod == tokenizer.vocab["<EOD>"] == processor.get_piece_size() + 2
    assert tokenizer.bos == processor.bos_id() and tokenizer.eos == processor.eos_id()
    text = "def main(): return None"
    assert tokenizer.tokenize(text) == processor.encode_as_ids(text)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == \
        processor.decode_ids(processor.encode_as_ids(text))
    mixed = "import os<EOD>print(1)</s>"
    assert tokenizer.tokenize(mixed) == (processor.encode_as_ids("import os") + [tokenizer.eod]
                                         + processor.encode_as_ids("print(1)") + [tokenizer.eos])
    # The GPT and Llama 2 variants add nothing to the vocabulary and use the model's eos as eod.
    gpt = build_tokenizer(namespace(tokenizer_type="GPTSentencePieceTokenizer",
                                    tokenizer_model=prefix + ".model"))
    llama = build_tokenizer(namespace(tokenizer_type="Llama2Tokenizer",
                                      tokenizer_model=prefix + ".model"))
    for variant in (gpt, llama):
        assert variant.vocab_size == processor.get_piece_size()
        assert variant.eod == processor.eos_id() and variant.cls == -1
    assert gpt.tokenize(mixed) == processor.encode_as_ids(mixed)
    assert llama.tokenize(text) == [processor.bos_id()] + processor.encode_as_ids(text)
    assert gpt.detokenize(gpt.tokenize(text)) == processor.decode_ids(processor.encode_as_ids(text))


def test_huggingface_tokenizer_json(tmp_path, gpt2, stdlib_texts):
    reference = byte_level_reference(*gpt2_vocab_files())
    folder = tmp_path / "hf"
    folder.mkdir()
    reference.save(str(folder / "tokenizer.json"))
    args = namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 50257 and args.padded_vocab_size == 50304
    assert tokenizer.eod == 50256
    for text in stdlib_texts[:2] + TRICKY_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == gpt2.tokenize(text)
        assert tokenizer.detokenize(ids) == text
    # The file itself works too, and a named eos token takes precedence.
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Hello"}}))
    direct = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                       tokenizer_model=str(folder / "tokenizer.json")))
    assert direct.eod == 15496


def test_huggingface_without_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    tokenizer = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model=str(path)))
    assert tokenizer.tokenize("a b c") == [0, 1, 2]
    with pytest.raises(NotImplementedError, match="no end-of-document id"):
        tokenizer.eod


def test_build_errors(tmp_path):
    with pytest.raises(ValueError,
                       match="--vocab-file is required for --tokenizer-type GPT2BPETokenizer"):
        build_tokenizer(namespace(tokenizer_type="GPT2BPETokenizer"))
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="--vocab-file .*nope.json"):
        build_tokenizer(namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=missing,
                                  merge_file=missing))
    with pytest.raises(TokenizerError, match="'Foo' is not implemented"):
        build_tokenizer(namespace(tokenizer_type="Foo"))
    with pytest.raises(TokenizerError, match="no --tokenizer-type given; give one of "):
        build_tokenizer(namespace(tokenizer_type=None))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                  tokenizer_model=str(tmp_path)))


def test_gpt2_vocab_files_are_gpt2():
    vocab, merges = gpt2_vocab_files()
    assert os.path.basename(vocab) == "encoder.json" and os.path.basename(merges) == "vocab.bpe"
    with open(merges, encoding="utf-8") as f:
        assert f.readline().startswith("#version") and f.readline().split() == ["\u0120", "t"]


def test_sentence_splitter_matches_punkt_package():
    """NLTK's Punkt with the bundled parameters splits as the punkt package's own splitter."""
    import punkt

    from megatron.tokenizer.sentence_splitter import SentenceSplitter

    text = ("Dr. Smith arrived at 5 p.m. on Jan. 3rd. He met Mr. Jones, who works for the U.S. "
            "government. They talked.\nThen they left!  Did they return? No. The end.")
    sentences = SentenceSplitter("english").split(text)
    assert sentences == punkt.sent_tokenize(text, "english")
    assert len(sentences) == 7 and sentences[0] == "Dr. Smith arrived at 5 p.m. on Jan. 3rd."
    kept = SentenceSplitter("english", keep_newlines=True).split(text)
    assert "".join(kept) == text.rstrip()  # nothing lost: whitespace stays with the sentence before
    assert kept[2] == "They talked.\n"
    with pytest.raises(ValueError, match="--lang 'klingon'"):
        SentenceSplitter("klingon")


# ------------------------------------------------------------------------------- TikTokenizer
# Megatron's --tiktoken-pattern regexes, written out here as the reference reads them.
TIKTOKEN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
TIKTOKEN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
               r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TIKTOKEN_MERGES = 3000   # GPT-2's first merges: a small but real byte-level BPE


@pytest.fixture(scope="module")
def gpt2_ranks():
    """GPT-2's ranks as tiktoken's own loader reads them: single bytes, then the merges."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab_file, merges_file = gpt2_vocab_files()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", "")       # no cache files written
        return data_gym_to_mergeable_bpe_ranks(merges_file, vocab_file)


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory, gpt2_ranks):
    """Megatron's vocabulary layout from GPT-2's first merges: entry i has rank i, entries
    0..255 are the bytes in order, the merges follow in GPT-2's priority order."""
    import base64

    merges = sorted((r, t) for t, r in gpt2_ranks.items() if len(t) > 1)[:TIKTOKEN_MERGES]
    tokens = [bytes([b]) for b in range(256)] + [t for _, t in merges]
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path), tokens


def tiktoken_args(path, **kw):
    values = dict(tokenizer_type="TikTokenizer", tokenizer_model=path, tiktoken_pattern="v2",
                  tiktoken_num_special_tokens=1000, special_tokens=None)
    values.update(kw)
    return namespace(**values)


def reference_encoding(tokens, pattern, specials):
    """tiktoken built directly: token i of the file has id len(specials) + i."""
    import tiktoken

    offset = len(specials)
    return tiktoken.Encoding(name="reference", pat_str=pattern,
                             mergeable_ranks={t: offset + i for i, t in enumerate(tokens)},
                             special_tokens={s: i for i, s in enumerate(specials)})


@pytest.mark.parametrize("pattern, regex", [("v1", TIKTOKEN_V1), ("v2", TIKTOKEN_V2)],
                         ids=["v1", "v2"])
def test_tiktokenizer_ids_match_tiktoken_with_the_offset(tiktoken_vocab, stdlib_texts, pattern,
                                                          regex):
    path, tokens = tiktoken_vocab
    size = 1000 + len(tokens)
    args = tiktoken_args(path, tiktoken_pattern=pattern, vocab_size=size)
    tokenizer = build_tokenizer(args)
    specials = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    specials += [f"<SPECIAL_{k}>" for k in range(7, 1000)]
    reference = reference_encoding(tokens, regex, specials)
    assert tokenizer.vocab_size == size and args.padded_vocab_size == 4352  # 34 x 128
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (0, 1, 2, 2)
    assert (tokenizer.mask, tokenizer.pad, tokenizer.cls, tokenizer.sep) == (3, 4, 5, 6)
    for text in stdlib_texts + TRICKY_TEXTS + ["a <s> b </s><SPECIAL_999>"]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text, allowed_special="all"), text[:60]
        assert all(0 <= i < size for i in ids)
        assert tokenizer.detokenize(ids) == text
        flat, lengths = tokenizer.tokenize_batch_flat([text, "", text])
        assert lengths.tolist() == [len(ids), 0, len(ids)] and flat.tolist() == ids + ids
    assert tokenizer.tokenize("<s>") == [1]          # special text is the special token
    assert tokenizer.vocab["<pad>"] == 4 and tokenizer.vocab["the"] == 1000 + tokens.index(b"the")
    assert tokenizer.inv_vocab[2] == "</s>"


def test_tiktokenizer_segments_as_gpt2_ranks_do(tiktoken_vocab, gpt2_ranks, stdlib_texts):
    """Only the order of ranks matters to byte-pair merging: the file's re-ranked bytes and
    merges cut text into the same pieces as GPT-2's own ranks (restricted to the same
    tokens) do under the same pattern."""
    import tiktoken

    path, tokens = tiktoken_vocab
    tokenizer = build_tokenizer(tiktoken_args(path, vocab_size=1000 + len(tokens)))
    kept = set(tokens)
    gpt2 = tiktoken.Encoding(name="gpt2-prefix", pat_str=TIKTOKEN_V2, special_tokens={},
                             mergeable_ranks={t: r for t, r in gpt2_ranks.items() if t in kept})
    for text in stdlib_texts + TRICKY_TEXTS:
        pieces = [tokens[i - 1000] for i in tokenizer.tokenize(text)]
        assert pieces == [gpt2.decode_single_token_bytes(i) for i in gpt2.encode_ordinary(text)]


def test_tiktokenizer_special_tokens_and_a_shorter_vocabulary(tiktoken_vocab):
    """--tiktoken-num-special-tokens 10 with named specials; --vocab-size cuts the file."""
    path, tokens = tiktoken_vocab
    names = ["<s>", "</s>", "<unk>", "<|im_start|>"]
    args = tiktoken_args(path, vocab_size=10 + 400, tiktoken_num_special_tokens=10,
                         special_tokens=names)
    tokenizer = build_tokenizer(args)
    specials = names + [f"<SPECIAL_{k}>" for k in range(4, 10)]
    reference = reference_encoding(tokens[:400], TIKTOKEN_V2, specials)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.unk, tokenizer.vocab_size) == (0, 1, 2, 410)
    with pytest.raises(NotImplementedError, match="<pad>"):
        tokenizer.pad
    for text in TRICKY_TEXTS + ["<|im_start|>user"]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text, allowed_special="all")
        assert max(ids, default=0) < 410


def test_tiktokenizer_flags_parse_as_megatrons():
    from megatron.training.arguments import parse_args

    args = parse_args(argv=["--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v1",
                            "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"])
    assert (args.tiktoken_pattern, args.tiktoken_num_special_tokens) == ("v1", 1000)
    assert args.special_tokens == ["<unk>", "<s>", "</s>"]
    older = parse_args(argv=["--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<x>"])
    assert older.special_tokens == ["<unk>", "<s>", "</s>", "<x>"]


def _vocab_file(tmp_path, entries, raw=None):
    path = tmp_path / "bad.json"
    path.write_text(raw if raw is not None else json.dumps(entries), encoding="utf-8")
    return str(path)


def _byte_entries(n=256):
    import base64

    return [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": ""}
            for i in range(n)]


@pytest.mark.parametrize("case, match", [
    ("not json", r"bad\.json: not JSON"),
    ("a dict", r"bad\.json: expected a JSON list"),
    ("extra key", r"bad\.json: entry 3 has \['extra', 'rank', 'token_bytes', 'token_str'\]"),
    ("rank", r"bad\.json: entry 5 has rank 6"),
    ("bytes order", r"bad\.json: entry 65 is b'B'; the first 256 entries must be the single"),
    ("base64", r"bad\.json: entry 7: token_bytes '\*\*' is not base64"),
    ("repeat", r"bad\.json: entry 256 repeats the token b'a' of entry 97"),
    ("too short", r"bad\.json: holds 256 tokens, but --vocab-size 2000 .* pass --vocab-size 1256"),
])
def test_tiktokenizer_bad_vocabulary_names_file_and_entry(tmp_path, case, match):
    import base64

    entries = _byte_entries()
    raw = None
    if case == "not json":
        raw = "[{"
    elif case == "a dict":
        raw = "{}"
    elif case == "extra key":
        entries[3]["extra"] = 1
    elif case == "rank":
        entries[5]["rank"] = 6
    elif case == "bytes order":
        entries[65]["token_bytes"] = base64.b64encode(b"B").decode()
    elif case == "base64":
        entries[7]["token_bytes"] = "**"
    elif case == "repeat":
        entries.append({"rank": 256, "token_bytes": base64.b64encode(b"a").decode(),
                        "token_str": "a"})
    path = _vocab_file(tmp_path, entries, raw)
    size = 2000 if case == "too short" else 1257
    with pytest.raises(ValueError, match=match):
        build_tokenizer(tiktoken_args(path, vocab_size=size))


def test_tiktokenizer_bad_flags_are_named(tmp_path):
    path = _vocab_file(tmp_path, _byte_entries())
    with pytest.raises(ValueError, match="--tiktoken-pattern v1|v2 is required"):
        build_tokenizer(tiktoken_args(path, vocab_size=1256, tiktoken_pattern=None))
    with pytest.raises(ValueError, match="must include </s>"):
        build_tokenizer(tiktoken_args(path, vocab_size=1256, special_tokens=["<unk>", "<s>"]))
    with pytest.raises(ValueError, match="a token is named twice"):
        build_tokenizer(tiktoken_args(path, vocab_size=1256,
                                      special_tokens=["<unk>", "<s>", "</s>", "<s>"]))
    with pytest.raises(ValueError, match="--tiktoken-num-special-tokens 2 is fewer than"):
        build_tokenizer(tiktoken_args(path, vocab_size=258, tiktoken_num_special_tokens=2))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(tiktoken_args(str(tmp_path / "missing.json"), vocab_size=1256))


def _megatron_padded(size, divisible_by, tp):
    return int(math.ceil(size / (divisible_by * tp)) * divisible_by * tp)


@pytest.mark.parametrize("size,tp", [(1000, 1), (1000, 2), (50257, 1), (129, 1)])
def test_no_pad_vocab_size(size, tp):
    from megatron.tokenizer import vocab_size_with_padding

    padded = namespace(tensor_model_parallel_size=tp)
    assert vocab_size_with_padding(size, padded) == _megatron_padded(size, 128, tp)
    assert vocab_size_with_padding(size, namespace(tensor_model_parallel_size=tp,
                                                   pad_vocab_size=False)) == size


def test_no_pad_vocab_size_must_split_over_tp():
    from megatron.tokenizer import vocab_size_with_padding

    with pytest.raises(ValueError, match=r"--no-pad-vocab-size: the tokenizer's 129 ids do not "
                                         r"split over --tensor-model-parallel-size 2"):
        vocab_size_with_padding(129, namespace(tensor_model_parallel_size=2,
                                               pad_vocab_size=False))


def test_huggingface_without_its_special_tokens(tmp_path):
    """A tokenizer.json whose post-processor adds a BOS: --tokenizer-hf-no-include-special-tokens
    tokenizes as transformers' add_special_tokens=False does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "<s>": 3, "</s>": 4},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(path))
    texts = ["a b c", "b b a"]
    for flag in (False, True):
        tokenizer = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                              tokenizer_model=str(path),
                                              tokenizer_hf_no_include_special_tokens=flag))
        for text in texts:
            assert tokenizer.tokenize(text) == reference(
                text, add_special_tokens=not flag).input_ids
        flat, offsets = tokenizer.tokenize_batch_flat(texts)
        want = [reference(t, add_special_tokens=not flag).input_ids for t in texts]
        assert flat.tolist() == [i for ids in want for i in ids]
    assert reference("a", add_special_tokens=True).input_ids == [3, 0]  # the BOS is there

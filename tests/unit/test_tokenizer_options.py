"""Megatron-Core's tokenizer options: SentencePiece legacy special tokens and extra whitespace,
the tokenizer metadata file and chat templates (--use-gigatoken: tests/unit/test_gigatoken.py).

References: the sentencepiece library itself (a processor whose normaliser keeps extra spaces, the
options' stated equivalent), hand-worked piece lists, and transformers' own apply_chat_template.
SentencePiece models are trained here on standard-library source; nothing is downloaded.
"""

import argparse
import json
import os
import sysconfig

import numpy as np
import pytest

from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.metadata import read_metadata, write_metadata

spm = pytest.importorskip("sentencepiece")

SPECIALS = ["[INST]", "[/INST]", "</s>", "<unk>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONVERSATION = [{"role": "system", "content": "Wrap text."},
                {"role": "user", "content": "fill the  paragraph"},
                {"role": "assistant", "content": "width = 70"}]


def namespace(**kwargs):
    defaults = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, vocab_extra_ids=0, make_vocab_size_divisible_by=128,
                    tensor_model_parallel_size=1, rank=1)
    defaults.update(kwargs)
    return argparse.Namespace(**defaults)


def _stdlib_lines(name="textwrap.py"):
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def _train(folder, model_type, **options):
    prefix = str(folder / f"sp_{model_type}_{len(options)}")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_stdlib_lines()), model_prefix=prefix,
                                   vocab_size=200, model_type=model_type,
                                   character_coverage=1.0, minloglevel=2, **options)
    return prefix + ".model"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    return {"unigram": _train(folder, "unigram"), "bpe": _train(folder, "bpe"),
            "keeps_spaces": _train(folder, "unigram", remove_extra_whitespaces=False)}


def _spaces_kept_reference(model_file):
    """The same model with its normaliser told not to collapse spaces."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    assert proto.normalizer_spec.remove_extra_whitespaces
    proto.normalizer_spec.remove_extra_whitespaces = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _sp(model, kind="GPTSentencePieceTokenizer", **flags):
    return build_tokenizer(namespace(tokenizer_type=kind, tokenizer_model=model, **flags))


def test_legacy_splits_special_tokens_as_hand_worked(models):
    tokenizer = _sp(models["unigram"], tokenizer_sentencepiece_legacy=True,
                    special_tokens=SPECIALS)
    processor = spm.SentencePieceProcessor(model_file=models["unigram"])
    size = processor.get_piece_size()
    # [INST] and [/INST] are new ids after the model's pieces; </s> is the model's own eos piece;
    # <unk> is the model's unknown piece, which Megatron-Core counts as missing: a new id.
    assert [tokenizer.vocab[t] for t in SPECIALS] == [size, size + 1, processor.eos_id(), size + 2]
    assert tokenizer.vocab_size == size + 3
    text = "[INST] who wraps [/INST] text</s> end [INST] x"
    ids = tokenizer.tokenize(text)
    assert processor.encode_as_pieces(" who wraps ")[0] == "\u2581"
    assert [tokenizer.inv_vocab[i] for i in ids] == [
        "[INST]", "w", "h", "o", "\u2581", "wrap", "s",  # the lone "▁" after [INST] is dropped
        "[/INST]", "\u2581text", "</s>", "en", "d",
        "[INST]", "\u2581", "x"]  # ... but kept in the text after the last special token
    assert tokenizer.detokenize(ids) == "[INST] who wraps [/INST] text </s> end [INST] x"


def test_legacy_off_is_the_plain_encoding_and_refuses_special_tokens(models):
    processor = spm.SentencePieceProcessor(model_file=models["bpe"])
    text = "[INST] def wrap(text, width=70): [/INST]</s>"
    assert _sp(models["bpe"]).tokenize(text) == processor.encode_as_ids(text)
    legacy_alone = _sp(models["bpe"], tokenizer_sentencepiece_legacy=True)
    assert legacy_alone.tokenize(text) == processor.encode_as_ids(text)
    with pytest.raises(ValueError, match="--tokenizer-sentencepiece-legacy"):
        _sp(models["bpe"], special_tokens=SPECIALS)


def test_legacy_keeps_the_sentencepiece_tokenizers_own_specials(models):
    tokenizer = _sp(models["unigram"], "SentencePieceTokenizer", vocab_extra_ids=1,
                    tokenizer_sentencepiece_legacy=True, special_tokens=["[INST]", "<EOD>"])
    processor = spm.SentencePieceProcessor(model_file=models["unigram"])
    # <CLS> <SEP> <EOD> <MASK> <PAD> <extra_id_0> first, then [INST]; <EOD> keeps its id.
    inst = processor.get_piece_size() + 6
    assert tokenizer.vocab["[INST]"] == inst and tokenizer.vocab_size == inst + 1
    ids = tokenizer.tokenize("[INST] fill<EOD>wrap<CLS> text")
    # One pass over all special tokens: the lone "▁" after [INST] is dropped; not after the last.
    assert processor.encode_as_pieces(" fill")[0] == processor.encode_as_pieces("wrap")[0] == \
        "\u2581"
    assert ids == ([inst] + processor.encode_as_ids(" fill")[1:] + [tokenizer.eod]
                   + processor.encode_as_ids("wrap")[1:] + [tokenizer.cls]
                   + processor.encode_as_ids(" text"))
    plain = _sp(models["unigram"], "SentencePieceTokenizer", vocab_extra_ids=1)
    assert plain.tokenize("fill<EOD> wrap") == (processor.encode_as_ids("fill") + [plain.eod]
                                                + processor.encode_as_ids(" wrap"))


@pytest.mark.parametrize("model", ["unigram", "bpe"])
def test_extra_whitespace_kept_equals_a_normaliser_that_keeps_it(models, model):
    reference = _spaces_kept_reference(models[model])
    processor = spm.SentencePieceProcessor(model_file=models[model])
    kept = _sp(models[model], tokenizer_sentencepiece_ignore_extra_whitespaces=False)
    default = _sp(models[model])
    texts = ["x  y", "  a", "a  ", " the  text   wraps "] + _stdlib_lines()[:60]
    changed = 0
    for text in texts:
        assert kept.tokenize(text) == reference.encode_as_ids(text), text
        assert default.tokenize(text) == processor.encode_as_ids(text), text
        changed += kept.tokenize(text) != default.tokenize(text)
    assert changed > 10  # indented source lines do differ


def test_extra_whitespace_hand_worked_and_a_model_that_keeps_spaces(models):
    kept = _sp(models["unigram"], tokenizer_sentencepiece_ignore_extra_whitespaces=False)
    assert [kept.inv_vocab[i] for i in kept.tokenize("x  y")] == \
        ["\u2581", "x", "\u2581", "\u2581", "y"]
    # A model trained without collapsing spaces encodes them itself: the option changes nothing.
    processor = spm.SentencePieceProcessor(model_file=models["keeps_spaces"])
    option = _sp(models["keeps_spaces"], tokenizer_sentencepiece_ignore_extra_whitespaces=False)
    for text in ["x  y", "    return  text "]:
        assert option.tokenize(text) == processor.encode_as_ids(text)


def test_legacy_with_kept_whitespace_and_special_tokens_is_refused(models):
    with pytest.raises(ValueError, match="not built"):
        _sp(models["unigram"], tokenizer_sentencepiece_legacy=True, special_tokens=SPECIALS,
            tokenizer_sentencepiece_ignore_extra_whitespaces=False)


def test_metadata_round_trip_and_its_chat_template(models, tmp_path):
    model = str(tmp_path / "tok.model")
    with open(models["unigram"], "rb") as src, open(model, "wb") as dst:
        dst.write(src.read())
    path = write_metadata(model, "sentencepiece", model_type="gpt", chat_template=TEMPLATE)
    assert path == str(tmp_path / "tokenizer_metadata.json")
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == {"library": "sentencepiece", "class_name": None,
                                "class_path": None, "model_type": "gpt",
                                "chat_template": TEMPLATE}
    assert read_metadata(path, "Llama2Tokenizer")["chat_template"] == TEMPLATE
    with pytest.raises(FileExistsError, match="tokenizer_metadata.json"):
        write_metadata(model, "sentencepiece")
    # The file's template wins over --chat-template.
    tokenizer = _sp(model, metadata_path=path, chat_template="{{ messages }}")
    assert tokenizer.chat_template == TEMPLATE
    assert _sp(model, chat_template="{{ messages }}").chat_template == "{{ messages }}"


@pytest.mark.parametrize("content, key", [
    ('{"model_type": "gpt"}', "'library'"),
    ('{"library": "sentencepeice"}', "'library'"),
    ('{"library": "huggingface"}', "'library'"),  # not the library --tokenizer-type uses
    ('{"library": "sentencepiece", "model_type": "llama"}', "'model_type'"),
    ('{"library": "sentencepiece", "chat_template": 3}', "'chat_template'"),
    ('["sentencepiece"]', "JSON object"),
    ('{"library": "sentencepiece",', "not a JSON file"),
])
def test_malformed_metadata_is_refused_naming_file_and_key(models, tmp_path, content, key):
    path = tmp_path / "bad_metadata.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as error:
        _sp(models["unigram"], metadata_path=str(path))
    assert str(path) in str(error.value) and key in str(error.value)


def _hf_folder(folder, with_template):
    from tokenizers import Tokenizer, models as hf_models, pre_tokenizers, trainers

    tokenizer = Tokenizer(hf_models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tokenizer.train_from_iterator(_stdlib_lines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if with_template:
        config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def _ids(encoded):
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


@pytest.mark.parametrize("generation", [False, True])
def test_chat_template_equals_transformers(tmp_path, generation):
    from transformers import AutoTokenizer

    folder = _hf_folder(tmp_path / "hf", with_template=True)
    theirs = AutoTokenizer.from_pretrained(folder)
    # The folder's own template is used, ahead of --chat-template.
    ours = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=folder, chat_template="{{ messages }}"))
    assert ours.chat_template == TEMPLATE
    text = ours.apply_chat_template(CONVERSATION, tokenize=False,
                                    add_generation_prompt=generation)
    assert text == theirs.apply_chat_template(CONVERSATION, tokenize=False,
                                              add_generation_prompt=generation)
    assert "</s>" in text
    ids = ours.apply_chat_template(CONVERSATION, add_generation_prompt=generation)
    assert ids == _ids(theirs.apply_chat_template(CONVERSATION, tokenize=True,
                                                  add_generation_prompt=generation))
    assert ours.apply_chat_template(CONVERSATION, truncation=True, max_length=5) == ids[:5]


def test_chat_template_flag_on_a_folder_without_one(tmp_path):
    from transformers import AutoTokenizer

    folder = _hf_folder(tmp_path / "hf", with_template=False)
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=folder, chat_template=TEMPLATE))
    assert ours.apply_chat_template(CONVERSATION) == _ids(theirs.apply_chat_template(
        CONVERSATION, chat_template=TEMPLATE, tokenize=True))
    bare = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=folder))
    with pytest.raises(ValueError, match="--chat-template"):
        bare.apply_chat_template(CONVERSATION)


def test_sentencepiece_chat_template_renders_as_transformers_then_encodes(models):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = TEMPLATE.replace("{{ eos_token }}", "</s>")
    tokenizer = _sp(models["unigram"], "Llama2Tokenizer", chat_template=template)
    processor = spm.SentencePieceProcessor(model_file=models["unigram"])
    rendered = render_jinja_template(conversations=[CONVERSATION], chat_template=template)[0][0]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == rendered
    # No bos: Megatron-Core's wrapper encodes the rendered text as it is.
    assert tokenizer.apply_chat_template(CONVERSATION) == processor.encode_as_ids(rendered)


def test_preprocess_data_with_the_sentencepiece_options(models, tmp_path):
    from megatron.data.indexed_dataset import IndexedDataset
    from tools import preprocess_data

    texts = ["[INST] fill  the text [/INST] done", "    return  lines  "]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
             models["unigram"]]
    for extra, name in ((["--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens",
                          "[INST]", "[/INST]"], "legacy"),
                        (["--no-tokenizer-sentencepiece-ignore-extra-whitespaces"], "spaces")):
        assert preprocess_data.main(["--input", str(corpus), "--output-prefix",
                                     str(tmp_path / name), "--workers", "1"]
                                    + flags + extra) == 0
        args = preprocess_data.get_args(["--input", "x", "--output-prefix", "y"] + flags + extra)
        tokenizer = build_tokenizer(args)
        dataset = IndexedDataset(str(tmp_path / f"{name}_text_document"))
        for i, text in enumerate(texts):
            assert np.array_equal(dataset[i], tokenizer.tokenize(text))


def test_no_use_fast_builds_the_same_tokenizer_in_transformers(tmp_path):
    """--tokenizer-hf-no-use-fast has no effect: transformers 5 ignores use_fast=False."""
    from transformers import AutoTokenizer

    from megatron.training.megatron_flags_table import NO_EFFECT, ROWS

    folder = _hf_folder(tmp_path / "hf", with_template=False)
    slow_asked = AutoTokenizer.from_pretrained(folder, use_fast=False)
    fast = AutoTokenizer.from_pretrained(folder)
    assert type(slow_asked) is type(fast) and slow_asked.is_fast
    ours = build_tokenizer(namespace(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=folder))
    text = "".join(_stdlib_lines("shlex.py")[:40])
    ids = ours.tokenize(text)
    assert len(ids) > 100
    assert ids == slow_asked(text, add_special_tokens=False)["input_ids"]
    assert [row for row in ROWS if row[0] == "--tokenizer-hf-no-use-fast"][0][5] == NO_EFFECT

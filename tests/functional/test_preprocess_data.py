"""tools/preprocess_data.py end to end on a small standard-library corpus.

The reference for token contents is the tokenizer applied to each JSON line in the test; the
reference for layout is FORMATS.md section 2 (empty documents, --append-eod, input order).
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import gpt2_vocab_files
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
GPT2_EOD = 50256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few standard-library files as JSONL {"content", "path"} (tools/build_stdlib_corpus.py)."""
    from tools import build_stdlib_corpus

    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    assert build_stdlib_corpus.main(["--output", str(path), "--max-files", "8"]) == 0
    return str(path)


@pytest.fixture(scope="module")
def documents(corpus):
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer(*gpt2_vocab_files())


def preprocess(input_path, prefix, *extra, keys=("content",), tokenizer=("GPT2BPETokenizer",)):
    """Run the tool in this process; returns its exit code."""
    from tools import preprocess_data

    argv = ["--input", str(input_path), "--output-prefix", str(prefix), "--json-keys", *keys,
            "--tokenizer-type", *tokenizer, *extra]
    if tokenizer[0] == "GPT2BPETokenizer":
        vocab, merges = gpt2_vocab_files()
        argv += ["--vocab-file", vocab, "--merge-file", merges]
    return preprocess_data.main(argv)


def read_bytes(prefix):
    with open(prefix + ".bin", "rb") as b, open(prefix + ".idx", "rb") as i:
        return b.read(), i.read()


def dataset_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".idx", ".tmp")))


def test_workers_and_partitions_give_identical_files(tmp_path, corpus, documents, gpt2):
    outputs = {}
    for name, extra in {"w1": ["--workers", "1"],
                        "w2": ["--workers", "2", "--chunk-size", "2"],
                        "p2": ["--workers", "2", "--partitions", "2"]}.items():
        assert preprocess(corpus, tmp_path / name, "--append-eod", *extra) == 0
        outputs[name] = read_bytes(str(tmp_path / f"{name}_content_document"))
    assert outputs["w1"] == outputs["w2"] == outputs["p2"]
    ds = IndexedDataset(str(tmp_path / "w1_content_document"))
    assert ds.dtype == np.uint16  # GPT-2's 50257 ids fit uint16 (code 8)
    assert len(ds) == len(documents)
    assert ds.document_indices.tolist() == list(range(len(documents) + 1))
    for i, doc in enumerate(documents):  # in input order, each document + eod
        assert ds[i].tolist() == gpt2.tokenize(doc["content"]) + [GPT2_EOD]
    assert not any(n.endswith(".tmp") or n.startswith(".") for n in os.listdir(tmp_path))


def test_empty_documents_and_append_eod(tmp_path, gpt2):
    texts = ["first doc", "", "third", "", ""]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    assert preprocess(path, tmp_path / "eod", "--append-eod", keys=("text",)) == 0
    assert preprocess(path, tmp_path / "plain", keys=("text",)) == 0
    ds = IndexedDataset(str(tmp_path / "eod_text_document"))
    # D = lines + 1; an empty document adds no sequence and repeats the previous count.
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 2, 2]
    assert len(ds) == 2
    assert ds[0].tolist() == gpt2.tokenize("first doc") + [GPT2_EOD]
    assert ds[1].tolist() == gpt2.tokenize("third") + [GPT2_EOD]
    plain = IndexedDataset(str(tmp_path / "plain_text_document"))
    assert plain[0].tolist() == gpt2.tokenize("first doc") and GPT2_EOD not in plain[1].tolist()


def test_multiple_keys_and_gzip(tmp_path, corpus, documents):
    packed = tmp_path / "in.jsonl.gz"
    with open(corpus, "rb") as src, gzip.open(packed, "wb") as dst:
        dst.write(src.read())
    assert preprocess(corpus, tmp_path / "plain", keys=("content", "path")) == 0
    assert preprocess(packed, tmp_path / "gz", keys=("content", "path")) == 0
    for key in ("content", "path"):
        assert read_bytes(str(tmp_path / f"plain_{key}_document")) == \
            read_bytes(str(tmp_path / f"gz_{key}_document"))
    paths = IndexedDataset(str(tmp_path / "plain_path_document"))
    assert len(paths) == len(documents)


def test_merge_of_separately_processed_halves(tmp_path, corpus):
    from tools import merge_datasets

    with open(corpus, encoding="utf-8") as f:
        lines = f.readlines()
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, part in enumerate((lines[:3], lines[3:])):
        (tmp_path / f"half{i}.jsonl").write_text("".join(part), encoding="utf-8")
        assert preprocess(tmp_path / f"half{i}.jsonl", shards / f"half{i}", "--append-eod") == 0
    merged = str(tmp_path / "merged")
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", merged]) == 0
    assert preprocess(corpus, tmp_path / "whole", "--append-eod") == 0
    whole = read_bytes(str(tmp_path / "whole_content_document"))
    assert read_bytes(merged) == whole
    # A glob reads the matching files in sorted order, whole files per partition.
    for partitions in ("1", "2"):
        prefix = tmp_path / f"glob{partitions}"
        assert preprocess(tmp_path / "half*.jsonl", prefix, "--append-eod",
                          "--partitions", partitions, "--workers", "2") == 0
        assert read_bytes(f"{prefix}_content_document") == whole


def test_split_sentences(tmp_path, corpus, documents, gpt2):
    from megatron.tokenizer.sentence_splitter import SentenceSplitter

    assert preprocess(corpus, tmp_path / "s", "--split-sentences", "--append-eod",
                      "--workers", "2") == 0
    assert not os.path.exists(tmp_path / "s_content_document.bin")
    ds = IndexedDataset(str(tmp_path / "s_content_sentence"))
    counts = np.diff(ds.document_indices)
    assert len(counts) == len(documents) and counts.max() > 1 and counts.sum() == len(ds)
    splitter = SentenceSplitter("english")
    for d, doc in enumerate(documents[:3]):
        expected = [gpt2.tokenize(s) for s in splitter.split(doc["content"])]
        expected = [e for e in expected if e]
        expected[-1] = expected[-1] + [GPT2_EOD]
        start = ds.document_indices[d]
        got = [ds[int(start) + k].tolist() for k in range(counts[d])]
        assert got == expected


def test_null_tokenizer_int32_and_uint16(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"text": "5 3 99999"}) + "\n" + json.dumps({"text": "1"}) + "\n")
    # --vocab-size N: ids 0..N-1, the last one the end of document.
    assert preprocess(path, tmp_path / "big", "--vocab-size", "100001", "--append-eod",
                      keys=("text",), tokenizer=("NullTokenizer",)) == 0
    ds = IndexedDataset(str(tmp_path / "big_text_document"))
    assert ds.dtype == np.int32
    assert ds[0].tolist() == [5, 3, 99999, 100000] and ds[1].tolist() == [1, 100000]
    path.write_text(json.dumps({"text": "5 3 9"}) + "\n")
    assert preprocess(path, tmp_path / "small", "--vocab-size", "100", keys=("text",),
                      tokenizer=("NullTokenizer",)) == 0
    ds = IndexedDataset(str(tmp_path / "small_text_document"))
    assert ds.dtype == np.uint16 and ds[0].tolist() == [5, 3, 9]
    # The end of document appended after the data ids (the older convention), by flag.
    assert preprocess(path, tmp_path / "older", "--vocab-size", "100", "--append-eod",
                      "--null-tokenizer-eod-id", "100", keys=("text",),
                      tokenizer=("NullTokenizer",)) == 0
    assert IndexedDataset(str(tmp_path / "older_text_document"))[0].tolist() == [5, 3, 9, 100]


BAD_LINES = {
    "malformed JSON": b'{"text": "unterminated\n',
    "missing key 'text'": b'{"other": "x"}\n',
    "is a JSON int, expected a string": b'{"text": 42}\n',
    "invalid UTF-8": b'{"text": "caf\xe9"}\n',
    "expected a JSON object": b'["text"]\n',
}


@pytest.mark.parametrize("message", list(BAD_LINES))
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_errors_name_file_and_line(tmp_path, capsys, message, workers):
    good = b'{"text": "fine"}\n'
    path = tmp_path / "in.jsonl"
    path.write_bytes(good * 3 + BAD_LINES[message] + good)
    out = tmp_path / "out"
    out.mkdir()
    assert preprocess(path, out / "x", "--workers", str(workers), "--chunk-size", "2",
                      keys=("text",)) == 1
    err = capsys.readouterr().err
    assert f"{path}:4: " in err and message in err
    assert dataset_files(out) == []  # nothing that looks like (or is part of) a dataset


def test_skip_bad_lines_counts_them(tmp_path, capsys, gpt2):
    good = [b'{"text": "a"}\n', b'{"text": "b"}\n', b'{"text": "c"}\n']
    path = tmp_path / "in.jsonl"
    path.write_bytes(good[0] + b"not json\n" + good[1] + b'{"text": "\xff"}\n' + good[2])
    assert preprocess(path, tmp_path / "x", "--skip-bad-lines", "--workers", "2",
                      "--chunk-size", "1", keys=("text",)) == 0
    assert "Skipped 2 bad line(s)" in capsys.readouterr().err
    ds = IndexedDataset(str(tmp_path / "x_text_document"))
    assert ds.document_indices.tolist() == [0, 1, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == [gpt2.tokenize(t) for t in "abc"]


def test_command_line_exit_code(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": \n')
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                             "--input", str(path), "--output-prefix", str(tmp_path / "x"),
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                             "--dataset-impl", "lazy"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"{path}:2: malformed JSON" in result.stderr
    assert "--dataset-impl lazy ignored" in result.stderr
    assert dataset_files(tmp_path) == []


def test_partition_errors_keep_true_line_numbers(tmp_path, capsys):
    lines = [json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(12)]
    lines[9] = b'{"text": 7}\n'
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(lines))
    out = tmp_path / "out"
    out.mkdir()
    assert preprocess(path, out / "x", "--partitions", "3", "--workers", "3", keys=("text",)) == 1
    assert f"{path}:10: the value of 'text' is a JSON int" in capsys.readouterr().err
    assert os.listdir(out) == []  # the partitions' scratch folder is gone too


def test_progress_line_and_empty_input(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": "x " * 50}) + "\n" for _ in range(6)))
    assert preprocess(path, tmp_path / "x", "--log-interval", "2", "--chunk-size", "2",
                      keys=("text",)) == 0
    err = capsys.readouterr().err
    for count in (2, 4, 6):
        assert f"Processed {count} documents" in err
    assert "docs/s" in err and "MB/s" in err and "ETA" in err


def _one_error_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("extra", [[], ["--workers", "2", "--partitions", "2"]])
def test_input_without_documents_is_an_error_naming_the_file(tmp_path, capsys, extra):
    """Before: an empty input exited 0 with an empty dataset, which training later refused far
    from its cause; so did a file whose every line --skip-bad-lines skipped."""
    out = tmp_path / "out"
    out.mkdir()
    path = tmp_path / "in.jsonl"
    path.write_text("")
    assert preprocess(path, out / "x", *extra, keys=("text",)) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"{path}: no documents (the input is empty)" in line
    path.write_bytes(b"not json\n{\n[1]\n")
    assert preprocess(path, out / "x", "--skip-bad-lines", *extra, keys=("text",)) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"{path}: no documents: all 3 line(s) are malformed" in line
    assert os.listdir(out) == []


def test_existing_output_is_kept_without_overwrite(tmp_path, capsys):
    """Before: a second run over the same --output-prefix replaced the datasets silently."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    null = ("NullTokenizer", "--vocab-size", "10")
    assert preprocess(path, tmp_path / "x", keys=("text",), tokenizer=null) == 0
    prefix = str(tmp_path / "x_text_document")
    first = read_bytes(prefix)
    capsys.readouterr()
    path.write_text(json.dumps({"text": "4 5"}) + "\n")
    assert preprocess(path, tmp_path / "x", keys=("text",), tokenizer=null) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert f"{prefix}.bin exists already" in line and "--overwrite" in line
    assert read_bytes(prefix) == first
    os.remove(prefix + ".bin")  # half a pair is refused too: the .idx names the dataset
    assert preprocess(path, tmp_path / "x", keys=("text",), tokenizer=null) == 1
    assert f"{prefix}.idx exists already" in _one_error_line(capsys.readouterr().err)
    assert preprocess(path, tmp_path / "x", "--overwrite", keys=("text",), tokenizer=null) == 0
    assert IndexedDataset(prefix)[0].tolist() == [4, 5]


def test_malformed_json_names_file_line_and_column_once(tmp_path, capsys):
    """Before: "malformed JSON: Unterminated string starting at at column 10"."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "unterminated')  # no newline: ends the input
    assert preprocess(path, tmp_path / "x", keys=("text",)) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"error: {path}:2: malformed JSON: Unterminated string starting at column 10"
    assert preprocess(path, tmp_path / "x", "--skip-bad-lines", keys=("text",)) == 0
    capsys.readouterr()
    path.write_bytes(b'{"text": 1,}\n{"text": "tab\x09"}\n')
    assert preprocess(path, tmp_path / "y", keys=("text",)) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == (f"error: {path}:1: malformed JSON: Expecting property name enclosed in "
                    f"double quotes at column 12")
    path.write_bytes(b'{"text": "tab\x09"}\n')
    assert preprocess(path, tmp_path / "z", keys=("text",)) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"error: {path}:1: malformed JSON: Invalid control character at column 14"


def test_tiktokenizer_documents_end_in_its_end_of_document_id(tmp_path, documents, monkeypatch):
    """--tokenizer-type TikTokenizer: each document is the ids of a tiktoken encoding built
    here from the same vocabulary (regular tokens after the 10 special ids), then </s>."""
    import base64

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab, merges = gpt2_vocab_files()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")    # no cache files written
    ranks = data_gym_to_mergeable_bpe_ranks(merges, vocab)
    tokens = [bytes([b]) for b in range(256)] + sorted(
        (t for t in ranks if len(t) > 1), key=ranks.get)[:500]
    model = tmp_path / "tiktoken.json"
    model.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                  "token_str": t.decode("utf-8", "replace")}
                                 for i, t in enumerate(tokens)]))
    pattern = (r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"
               r"\s+(?!\S)|\s+")
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{k}>" for k in range(3, 10)]
    reference = tiktoken.Encoding(name="reference", pat_str=pattern,
                                  mergeable_ranks={t: 10 + i for i, t in enumerate(tokens)},
                                  special_tokens={s: i for i, s in enumerate(specials)})
    texts = [d["content"] for d in documents[:4]]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = ("TikTokenizer", "--tokenizer-model", str(model), "--tiktoken-pattern", "v1",
                 "--vocab-size", str(10 + len(tokens)), "--tiktoken-num-special-tokens", "10",
                 "--tiktoken-special-tokens", "<unk>", "<s>", "</s>")
    assert preprocess(path, tmp_path / "x", "--append-eod", keys=("text",),
                      tokenizer=tokenizer) == 0
    ds = IndexedDataset(str(tmp_path / "x_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == reference.encode(text, allowed_special="all") + [2]

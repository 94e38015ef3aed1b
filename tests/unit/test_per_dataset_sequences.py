"""--per-dataset-sequences-path: datasets opened from a hand-written file in Megatron's format
({prefix: [N, D]}) give the same samples, byte for byte, as those opened from the .idx headers;
the header is then not read; a file that does not fit the data is refused in one line."""

import json
import shutil
import struct

import numpy as np
import pytest

import pretrain_gpt
from megatron.data.dataset_utils import DataError
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from megatron.tokenizer.tokenizer import NullTokenizer
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from tests.functional.gpt_runs import VOCAB_SIZE, write_counting_corpus
from tools import build_sequences_per_dataset

MODEL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
         "--train-iters 5 --eval-interval 5 --eval-iters 2 --split 80,15,5").split()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return [write_counting_corpus(str(root / name), num_docs=40 + 10 * i, seed=i)
            for i, name in enumerate(("a_document", "b_document"))]


def _header_counts(prefix):
    """N and D as the bytes of the .idx header hold them (FORMATS.md 1: offsets 18 and 26)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read(34)
    return list(struct.unpack("<QQ", raw[18:34]))


def _datasets(flags, cache, vocab=VOCAB_SIZE):
    args = validate_args(parse_args(argv=MODEL + ["--data-cache-path", str(cache)] + flags))
    global_vars.set_global_variables(args=args, tokenizer=NullTokenizer(vocab))
    try:
        return pretrain_gpt.train_valid_test_datasets_provider([20, 12, 4])
    finally:
        global_vars.unset_global_variables()


def _bytes(datasets):
    return [None if d is None else [np.asarray(d[i]["text"]).tobytes() for i in range(len(d))]
            for d in datasets]


def _write(path, table):
    path.write_text(json.dumps(table))
    return str(path)


def test_counts_file_gives_the_same_samples(corpora, tmp_path):
    a, b = corpora
    blend = ["--data-path", "0.4", a, "0.6", b]
    path = _write(tmp_path / "seq.json", {a: _header_counts(a), b: _header_counts(b)})
    with_file = _datasets(blend + ["--per-dataset-sequences-path", path], tmp_path / "c1")
    plain = _datasets(blend, tmp_path / "c2")
    assert all(d is not None for d in plain)
    assert _bytes(with_file) == _bytes(plain)
    part = with_file[0].datasets[0].indexed_dataset
    assert part._counts == tuple(_header_counts(a))


def test_the_header_is_not_read(corpora, tmp_path):
    # Megatron's fast path trusts the counts: a file whose header is damaged still opens.
    a = corpora[0]
    copy = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, copy + ext)
    with open(copy + ".idx", "r+b") as f:
        f.write(b"XXXXXXXXX")
    with pytest.raises(IndexedDatasetError, match="not an indexed-dataset index"):
        IndexedDataset(copy)
    fast = IndexedDataset(copy, sequences_per_dataset=_header_counts(a), dtype_code=8)
    plain = IndexedDataset(a)
    assert len(fast) == len(plain)
    assert all(np.array_equal(fast[i], plain[i]) for i in range(len(plain)))


def test_tool_writes_the_hand_written_file(corpora, tmp_path):
    a, b = corpora
    out = tmp_path / "tool.json"
    build_sequences_per_dataset.main(["--data-path", "1", a, "2", b, "--test-data-path", a,
                                      "--per-dataset-sequences-path", str(out)])
    assert json.loads(out.read_text()) == {a: _header_counts(a), b: _header_counts(b)}


def _refused(corpora, tmp_path, content, vocab=VOCAB_SIZE):
    a, b = corpora
    path = tmp_path / "seq.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    flags = ["--data-path", "0.5", a, "0.5", b, "--per-dataset-sequences-path", str(path)]
    with pytest.raises((DataError, IndexedDatasetError)) as err:
        _datasets(flags, tmp_path / "c", vocab)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_malformed_json_is_refused(corpora, tmp_path):
    assert "not valid JSON" in _refused(corpora, tmp_path, "{oops")
    assert "expected a JSON object" in _refused(corpora, tmp_path, [1, 2])


def test_bad_entries_are_refused(corpora, tmp_path):
    a, b = corpora
    good = _header_counts(b)
    assert "expected [N, D]" in _refused(corpora, tmp_path, {a: [3], b: good})
    assert "expected [N, D]" in _refused(corpora, tmp_path, {a: [-1, 2], b: good})
    assert "no entry for data prefix" in _refused(corpora, tmp_path, {b: good})


def test_counts_that_are_not_the_files_are_refused(corpora, tmp_path):
    a, b = corpora
    n, d = _header_counts(a)
    for wrong in ([n + 1, d], [n, d - 1], [n + 2, d - 3]):
        message = _refused(corpora, tmp_path, {a: wrong, b: _header_counts(b)})
        assert "are not this file's" in message or "counts do not belong" in message


def test_a_vocabulary_whose_dtype_is_not_the_files_is_refused(corpora, tmp_path):
    # More than 65,536 ids means int32 tokens to Megatron; these files hold uint16.
    a, b = corpora
    message = _refused(corpora, tmp_path, {a: _header_counts(a), b: _header_counts(b)},
                       vocab=70000)
    assert "token dtype" in message

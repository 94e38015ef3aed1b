"""--data-args-path and --per-split-data-args-path: the datasets pretrain_gpt builds from the
files equal, sample for sample, the ones it builds with the same paths written out as flags."""

import json

import numpy as np
import pytest

import pretrain_gpt
from megatron.training import global_vars
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.tokenizer.tokenizer import NullTokenizer
from tests.functional.gpt_runs import VOCAB_SIZE, write_counting_corpus

MODEL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
         "--train-iters 5 --eval-interval 5 --eval-iters 2 --split 80,15,5").split()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return [write_counting_corpus(str(root / name), num_docs=60, seed=i)
            for i, name in enumerate(("a_document", "b_document"))]


def _datasets(flags, cache):
    args = validate_args(parse_args(argv=MODEL + ["--data-cache-path", str(cache)] + flags))
    global_vars.set_global_variables(args=args, tokenizer=NullTokenizer(VOCAB_SIZE))
    try:
        return args, pretrain_gpt.train_valid_test_datasets_provider([20, 12, 4])
    finally:
        global_vars.unset_global_variables()


def _samples(dataset):
    if dataset is None:
        return None
    return [np.asarray(dataset[i]["text"]).tolist() for i in range(len(dataset))]


def _assert_same(built, expected):
    for got, want in zip(built, expected):
        assert _samples(got) == _samples(want)


def test_data_args_path_equals_data_path(corpora, tmp_path):
    a, b = corpora
    file = tmp_path / "data_args.txt"
    file.write_text(f"0.3 {a}\n  0.7\t{b}\n")  # any whitespace separates, as Megatron reads it
    args, built = _datasets(["--data-args-path", str(file)], tmp_path / "c1")
    assert args.data_path == ["0.3", a, "0.7", b]
    _, expected = _datasets(["--data-path", "0.3", a, "0.7", b], tmp_path / "c2")
    assert all(d is not None for d in built)
    _assert_same(built, expected)


def test_per_split_data_args_path_equals_the_per_split_flags(corpora, tmp_path):
    a, b = corpora
    file = tmp_path / "splits.json"
    # Megatron's format: a list per split, or one whitespace-separated string.
    file.write_text(json.dumps({"train": ["0.5", a, "0.5", b], "valid": f"{b}", "test": [a]}))
    args, built = _datasets(["--per-split-data-args-path", str(file)], tmp_path / "c1")
    assert (args.train_data_path, args.valid_data_path, args.test_data_path) == (
        ["0.5", a, "0.5", b], [b], [a])
    _, expected = _datasets(["--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", b,
                             "--test-data-path", a], tmp_path / "c2")
    _assert_same(built, expected)


@pytest.mark.parametrize("content,flags,message", [
    (None, ["--data-path", "x"], "only one of --data-path and --data-args-path"),
    ("missing", [], "cannot read it"),
])
def test_data_args_path_errors(tmp_path, content, flags, message):
    path = tmp_path / "args.txt"
    if content is None:
        path.write_text("prefix")
    with pytest.raises(ArgumentsError, match=message):
        validate_args(parse_args(argv=MODEL + ["--data-args-path", str(path)] + flags))


@pytest.mark.parametrize("content,message", [
    ("{not json", "not JSON"),
    ('{"train": ["a"], "eval": ["b"]}', "keys train, valid and test"),
    ('{"train": {"a": 1}}', "'train' must be a list"),
])
def test_per_split_data_args_path_errors(tmp_path, content, message):
    path = tmp_path / "splits.json"
    path.write_text(content)
    with pytest.raises(ArgumentsError, match=message):
        validate_args(parse_args(argv=MODEL + ["--per-split-data-args-path", str(path)]))

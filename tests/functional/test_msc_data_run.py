"""A pretrain_gpt run reading its data through the Multi-Storage Client (--enable-msc, an
msc:// prefix of a POSIX profile) trains the same losses as the same files
given by their local path."""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks



def test_msc_data_prefix_trains_the_same_losses(tmp_path, monkeypatch):
    store = tmp_path / "store"
    corpus = write_counting_corpus(str(store / "corpus" / "count_document"))
    config = tmp_path / "msc.yaml"
    config.write_text(f"profiles:\n  bucket:\n    storage_provider:\n      type: file\n"
                      f"      options:\n        base_path: {store}\n")
    monkeypatch.setenv("MSC_CONFIG", str(config))  # the ranks inherit it
    cache = tmp_path / "object_cache"
    remote = run_on_ranks(run_pretrain, 1, gpt_flags(
        "msc://bucket/corpus/count_document", 4,
        extra=["--enable-msc", "--object-storage-cache-path", str(cache), "--data-cache-path",
               str(tmp_path / "data_cache"), "--no-mmap-bin-files"]))[0]
    local = run_on_ranks(run_pretrain, 1, gpt_flags(
        corpus, 4, extra=["--data-cache-path", str(tmp_path / "local_cache")]))[0]
    assert len(local["losses"]) == 4
    assert remote["losses"] == local["losses"]
    assert remote["valid"] == local["valid"]
    assert os.path.isfile(cache / "bucket" / "corpus" / "count_document.idx")
    # Nothing was written beside the data.
    assert sorted(os.listdir(store / "corpus")) == ["count_document.bin", "count_document.idx"]

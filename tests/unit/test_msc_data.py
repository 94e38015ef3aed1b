"""msc:// data prefixes (--enable-msc): the indexed dataset read through the Multi-Storage Client
from a POSIX profile equals the same files opened directly; the flags it needs are checked."""

import os
import pickle
import shutil
import sys

import numpy as np
import pytest

from megatron.data import object_storage
from megatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                           IndexedDatasetError, get_idx_path, missing_files)
from megatron.training.arguments import ArgumentsError, parse_args, validate_args



def write_config(tmp_path, monkeypatch) -> str:
    """An MSC configuration whose profile ``local`` is the folder ``tmp_path/store``.

    The client keeps each profile's storage service for the life of the process; the test
    empties that cache so the profile is read from this test's configuration.
    """
    import multistorageclient.shortcuts as shortcuts

    monkeypatch.setattr(shortcuts, "_STORAGE_CLIENT_CACHE", {})
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "msc.yaml"
    config.write_text(f"profiles:\n  local:\n    storage_provider:\n      type: file\n"
                      f"      options:\n        base_path: {store}\n")
    monkeypatch.setenv("MSC_CONFIG", str(config))
    return str(store)


def write_dataset(prefix: str, num_docs: int = 40, seed: int = 3) -> None:
    rng = np.random.RandomState(seed)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(num_docs):
        for _ in range(rng.randint(1, 4)):
            builder.add_item(rng.randint(0, 50000, size=rng.randint(1, 30)))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def test_msc_prefix_reads_the_same_tokens(tmp_path, monkeypatch):
    store = write_config(tmp_path, monkeypatch)
    local_prefix = os.path.join(store, "corpora", "text_document")
    write_dataset(local_prefix)
    cache = str(tmp_path / "idx_cache")
    url = "msc://local/corpora/text_document"
    assert missing_files(url) == []
    assert missing_files(url + "_nope") == [url + "_nope.bin", url + "_nope.idx"]

    local = IndexedDataset(local_prefix)
    remote = IndexedDataset(url, mmap=False, object_storage_cache=cache)
    # The index was copied into the cache, under the profile and path.
    copied = os.path.join(cache, "local", "corpora", "text_document.idx")
    assert open(copied, "rb").read() == open(local_prefix + ".idx", "rb").read()
    assert len(remote) == len(local)
    np.testing.assert_array_equal(remote.document_indices, local.document_indices)
    for i in range(len(local)):
        np.testing.assert_array_equal(remote[i], local[i])
        np.testing.assert_array_equal(remote.get(i, 1 if len(local[i]) > 1 else 0),
                                      local.get(i, 1 if len(local[i]) > 1 else 0))
    for a, b in zip(remote[3:9], local[3:9]):
        np.testing.assert_array_equal(a, b)
    # The .bin is read from the storage service, never from a local copy.
    assert isinstance(remote._bin_reader, object_storage.RemoteBin)
    assert not os.path.exists(os.path.join(cache, "local", "corpora", "text_document.bin"))
    # Pickled (as for a data-loader worker), it reopens by URL and reads the same.
    again = pickle.loads(pickle.dumps(remote))
    np.testing.assert_array_equal(again[len(local) - 1], local[len(local) - 1])
    # Data-loader worker processes open their own handles.
    import torch.utils.data

    loader = torch.utils.data.DataLoader(remote, batch_size=None, num_workers=2)
    read = [np.asarray(got) for got in loader]
    assert len(read) == len(local)
    for i, got in enumerate(read):
        np.testing.assert_array_equal(got, local[i])


def test_stale_cached_index_is_replaced(tmp_path, monkeypatch):
    store = write_config(tmp_path, monkeypatch)
    prefix = os.path.join(store, "d", "x")
    write_dataset(prefix, seed=1)
    cache = str(tmp_path / "cache")
    IndexedDataset("msc://local/d/x", mmap=False, object_storage_cache=cache)
    write_dataset(prefix, num_docs=55, seed=2)  # the object changes: a new index size
    fresh = IndexedDataset("msc://local/d/x", mmap=False, object_storage_cache=cache)
    local = IndexedDataset(prefix)
    assert len(fresh) == len(local)
    np.testing.assert_array_equal(fresh[len(local) - 1], local[len(local) - 1])


def test_truncated_object_is_named(tmp_path, monkeypatch):
    store = write_config(tmp_path, monkeypatch)
    prefix = os.path.join(store, "d", "x")
    write_dataset(prefix)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 4)
    with pytest.raises(IndexedDatasetError, match=r"msc://local/d/x\.bin: file is"):
        IndexedDataset("msc://local/d/x", mmap=False, object_storage_cache=str(tmp_path / "c"))
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"msc://local/d/x\.bin: data file is missing"):
        IndexedDataset("msc://local/d/x", mmap=False, object_storage_cache=str(tmp_path / "c"))
    with pytest.raises(IndexedDatasetError, match="needs --object-storage-cache-path"):
        IndexedDataset("msc://local/d/x", mmap=False)


BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 100").split()


def _validate(extra):
    return validate_args(parse_args(argv=BASE + extra))


def test_validation_names_what_an_msc_prefix_needs(tmp_path, monkeypatch):
    write_config(tmp_path, monkeypatch)
    ok = ["--enable-msc", "--data-path", "msc://local/d/x", "--object-storage-cache-path",
          str(tmp_path / "c"), "--data-cache-path", str(tmp_path / "dc"), "--no-mmap-bin-files"]
    assert _validate(ok).data_path == ["msc://local/d/x"]
    cases = [
        (["--data-path", "msc://local/d/x"], "msc:// URLs are read through the Multi-Storage "
                                             "Client; pass --enable-msc"),
        ([f for f in ok if f != "--no-mmap-bin-files"], "needs --no-mmap-bin-files"),
        (ok[:5] + ok[7:], "needs --data-cache-path"),
        (ok[:3] + ok[5:], "needs --object-storage-cache-path"),
        (["--enable-msc", "--train-data-path", "msc://local"] + ok[3:], "expected "
                                                                         "msc://PROFILE/PATH"),
        (["--data-path", "s3://bucket/x"], "s3:// paths are read here through the Multi-Storage"),
    ]
    for flags, message in cases:
        with pytest.raises(ArgumentsError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _validate(flags)


def test_enable_msc_without_the_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "multistorageclient", None)
    with pytest.raises(ArgumentsError, match="--enable-msc needs the Multi-Storage Client, which "
                                             "is not installed.*pip install multi-storage-client"):
        _validate(["--enable-msc", "--mock-data"])


def test_dataset_builder_refuses_msc_prefix_without_enable_msc(tmp_path, monkeypatch):
    from megatron.core.msc import ObjectStorageError
    from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets

    store = write_config(tmp_path, monkeypatch)
    write_dataset(os.path.join(store, "d", "x"))
    config = GPTDatasetConfig(seq_length=8, split="1,0,0", mmap_bin_files=False,
                              data_cache_path=str(tmp_path / "dc"),
                              object_storage_cache_path=str(tmp_path / "c"))
    with pytest.raises(ObjectStorageError, match="'msc://local/d/x' is a Multi-Storage Client "
                                                 "URL; pass --enable-msc"):
        build_train_valid_test_datasets(config, ["msc://local/d/x"], [4, 0, 0])
    config.enable_msc = True
    train = build_train_valid_test_datasets(config, ["msc://local/d/x"], [4, 0, 0])[0]
    assert len(train) >= 4 and train[0]["text"].shape == (9,)


def test_msc_teacher_logits_are_refused(tmp_path, monkeypatch):
    write_config(tmp_path, monkeypatch)
    with pytest.raises(ArgumentsError, match="--logits-load-dir msc://local/t: teacher logits "
                                             "are written and read in local or mounted folders "
                                             "only here, not through the Multi-Storage Client"):
        _validate(["--enable-msc", "--mock-data", "--logits-load-dir", "msc://local/t"])

"""GPT dataset: splits, samples against a brute-force token walk, the index cache (including the
rank-0 build that other ranks wait for), blends, mock data, and the batch masks."""

import math
import os
import pickle

import numpy as np
import pytest
import torch

from megatron.data import dataset_utils, index_builders
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import get_ltor_masks_and_position_ids, split_bounds
from megatron.data.gpt_dataset import (GPTDataset, GPTDatasetConfig,
                                       build_train_valid_test_datasets)
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.data.mock_dataset import MockGPTDataset
from tests.multiprocess import run_on_ranks


class FakeIndexed:
    """In-memory stand-in with the reader's interface (one sequence per document)."""

    def __init__(self, docs):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]
        self.sequence_lengths = np.array([len(d) for d in docs], dtype=np.int32)
        self.document_indices = np.arange(len(docs) + 1, dtype=np.int64)

    def __len__(self):
        return len(self.docs)

    def get(self, idx, offset=0, length=None):
        doc = self.docs[idx]
        return doc[offset:] if length is None else doc[offset:offset + length]


def random_docs(seed, n, max_len=12, empty_every=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, int(rng.integers(1, max_len))) for _ in range(n)]
    if empty_every:
        docs = [d if i % empty_every else d[:0] for i, d in enumerate(docs)]
    return docs


def expected_samples(docs, documents, num_samples, s, seed):
    """FORMATS.md 3.3-3.8 written out directly: epochs by counting, the RandomState draws in the
    documented order, and samples cut from the concatenated token stream."""
    sizes = np.array([len(d) for d in docs])
    documents = np.asarray(documents)
    t = int(sizes[documents].sum())
    e = 1
    while e * t < num_samples * s + 1:
        e += 1
    separate, sans = False, 0
    if e > 1:
        sans = ((e - 1) * t - 1) // s
        separate = num_samples - sans < int(0.8 * ((t - 1) // s))
    rng = np.random.RandomState(seed)
    if separate:
        head = np.concatenate([documents] * (e - 1))
        order = np.concatenate([head[rng.permutation(head.size)],
                                documents[rng.permutation(documents.size)]])
    else:
        body = np.concatenate([documents] * e)
        order = body[rng.permutation(body.size)]
    total = (e * t - 1) // s
    if separate:
        shuffle = np.concatenate([rng.permutation(sans), sans + rng.permutation(total - sans)])
    else:
        shuffle = rng.permutation(total)
    stream = np.concatenate([docs[d] for d in order])
    return [stream[j * s:j * s + s + 1] for j in shuffle]


def write_dataset(prefix, docs):
    """A real .bin/.idx pair; an empty document adds no sequence (as preprocessing does)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for d in docs:
        if len(d):
            builder.add_item(np.asarray(d, dtype=np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def items(dataset):
    return [dataset[i]["text"] for i in range(len(dataset))]


def assert_samples(dataset, want):
    got = items(dataset)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.int64
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------------------------ splits


def test_split_bounds_follow_cumulative_rounding():
    assert split_bounds("969, 30, 1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_bounds("969,30,1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_bounds("1,0,0", 37) == [(0, 37), None, None]
    assert split_bounds("80,20", 100) == [(0, 80), (80, 100), None]
    assert split_bounds("80, 20", 7) == [(0, 6), (6, 7), None]
    assert split_bounds("1", 5) == [(0, 5), None, None]
    assert split_bounds("80/20", 10) == [(0, 8), (8, 10), None]
    # Cumulative bounds are rounded, not each share: 3.33 / 6.67 -> 3 and 7.
    assert split_bounds("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]


@pytest.mark.parametrize("bad", ["1,2,3,4", "-1,2", "a,b", "0,0,0", ""])
def test_bad_split_names_the_flag(bad):
    with pytest.raises(ValueError, match="--split"):
        split_bounds(bad, 10)


def test_train_valid_test_num_samples():
    # 100 iterations x 8, eval every 10 iterations for 2 iterations: (10 + 1) x 2 x 8 valid.
    assert dataset_utils.get_train_valid_test_num_samples(100, 8, 10, 2) == [800, 176, 16]
    assert dataset_utils.get_train_valid_test_num_samples(100, 8, 10, 2, 1000) == [1000, 176, 16]


# ----------------------------------------------------------------------- samples, stand-in data


@pytest.mark.parametrize("num_samples", [3, 13, 40, 41])
def test_samples_equal_brute_force_walk(tmp_path, num_samples):
    docs = random_docs(0, 9)
    indexed = FakeIndexed(docs)
    documents = np.arange(2, 8)
    cfg = GPTDatasetConfig(seed=5, seq_length=4, data_cache_path=str(tmp_path))
    ds = GPTDataset("train", str(tmp_path / "data"), indexed, documents, num_samples, cfg)
    assert len(ds) >= num_samples
    assert ds.doc_idx.dtype == np.int32 and ds.sample_idx.dtype == np.int32
    assert ds.shuffle_idx.dtype == np.uint32
    assert_samples(ds, expected_samples(docs, documents, num_samples, 4, 5))


def test_dataset_pickles_by_cache_path(tmp_path):
    docs = random_docs(1, 6)
    cfg = GPTDatasetConfig(seed=2, seq_length=3, data_cache_path=str(tmp_path))
    ds = GPTDataset("train", str(tmp_path / "d"), FakeIndexed(docs), np.arange(6), 10, cfg)
    state = ds.__getstate__()
    assert "sample_idx" not in state and "doc_idx" not in state
    clone = pickle.loads(pickle.dumps(ds))
    for a, b in zip(items(ds), items(clone)):
        np.testing.assert_array_equal(a, b)


# -------------------------------------------------------------------------------- the cache


def _counting_builder(monkeypatch):
    calls = []
    real = index_builders.build_gpt_indices

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(index_builders, "build_gpt_indices", counting)
    return calls


def _npy_mtimes(folder):
    return {f: os.stat(os.path.join(folder, f)).st_mtime_ns
            for f in os.listdir(folder) if f.endswith(".npy")}


def test_cache_is_reused_and_invalidated_by_seed_and_seq_length(tmp_path, monkeypatch):
    calls = _counting_builder(monkeypatch)
    docs = random_docs(2, 8)
    cache = str(tmp_path / "cache")

    def build(seed=1, seq_length=4, n=20):
        cfg = GPTDatasetConfig(seed=seed, seq_length=seq_length, data_cache_path=cache)
        return GPTDataset("train", str(tmp_path / "d"), FakeIndexed(docs), np.arange(8), n, cfg)

    first = build()
    assert len(calls) == 1 and len(_npy_mtimes(cache)) == 3
    before = _npy_mtimes(cache)
    second = build()
    assert len(calls) == 1 and _npy_mtimes(cache) == before  # read back, not rebuilt
    assert isinstance(second.sample_idx, np.memmap)
    np.testing.assert_array_equal(first.shuffle_idx, second.shuffle_idx)
    build(seed=2)
    assert len(calls) == 2 and len(_npy_mtimes(cache)) == 6
    build(seq_length=5)
    assert len(calls) == 3 and len(_npy_mtimes(cache)) == 9
    build(n=21)
    assert len(calls) == 4
    assert_samples(build(seq_length=5), expected_samples(docs, np.arange(8), 20, 5, 1))
    assert len(calls) == 4


def test_default_cache_folder_is_beside_the_data(tmp_path):
    prefix = str(tmp_path / "corpus" / "text_document")
    os.makedirs(os.path.dirname(prefix))
    write_dataset(prefix, random_docs(3, 20))
    cfg = GPTDatasetConfig(seed=1, seq_length=4, split="1,0,0")
    train, valid, test = build_train_valid_test_datasets(cfg, prefix, [10, 0, 0])
    assert valid is None and test is None
    files = os.listdir(tmp_path / "corpus" / "cache")
    assert sum(f.endswith(".npy") for f in files) == 3
    assert sum(f.endswith(".done") for f in files) == 1
    assert not any(".tmp" in f for f in files)


def test_failed_build_leaves_error_marker_and_next_build_clears_it(tmp_path, monkeypatch):
    docs = random_docs(4, 6)
    cfg = GPTDatasetConfig(seed=1, seq_length=4, data_cache_path=str(tmp_path))

    def failing(*args, **kwargs):
        raise RuntimeError("out of disk")

    monkeypatch.setattr(index_builders, "build_gpt_indices", failing)
    with pytest.raises(RuntimeError, match="out of disk"):
        GPTDataset("train", str(tmp_path / "d"), FakeIndexed(docs), np.arange(6), 5, cfg)
    markers = [f for f in os.listdir(tmp_path) if f.endswith(".error")]
    assert len(markers) == 1
    assert "out of disk" in (tmp_path / markers[0]).read_text()
    monkeypatch.undo()
    GPTDataset("train", str(tmp_path / "d"), FakeIndexed(docs), np.arange(6), 5, cfg)
    assert not any(f.endswith(".error") for f in os.listdir(tmp_path))


def test_waiting_rank_ignores_a_stale_error_marker_but_reports_a_new_one(tmp_path, monkeypatch):
    cache = str(tmp_path)
    desc = {"what": "test"}
    build = lambda: {"a": np.arange(5)}  # noqa: E731
    error = os.path.join(cache, f"{dataset_utils.description_hash(desc)[1]}-K.error")
    with open(error, "w") as f:
        f.write("failure of an earlier run")
    monkeypatch.setattr(dataset_utils, "get_global_rank", lambda: 1)

    def rank0_builds_meanwhile(seconds):
        monkeypatch.setattr(dataset_utils, "get_global_rank", lambda: 0)
        dataset_utils.load_or_build_cached(cache, "K", desc, ["a"], build)
        monkeypatch.setattr(dataset_utils, "get_global_rank", lambda: 1)

    monkeypatch.setattr(dataset_utils, "poll_sleep", rank0_builds_meanwhile)
    loaded = dataset_utils.load_or_build_cached(cache, "K", desc, ["a"], build)
    np.testing.assert_array_equal(loaded["a"], np.arange(5))
    assert not os.path.exists(error)  # rank 0 removed the stale marker before building

    # Nothing built for another description: the waiting rank polls until rank 0's marker shows.
    other = {"what": "other"}
    other_error = os.path.join(cache, f"{dataset_utils.description_hash(other)[1]}-K.error")

    def rank0_fails_meanwhile(seconds):
        with open(other_error, "w") as f:
            f.write("new failure")

    monkeypatch.setattr(dataset_utils, "poll_sleep", rank0_fails_meanwhile)
    with pytest.raises(RuntimeError, match="(?s)rank 0 failed.*new failure"):
        dataset_utils.load_or_build_cached(cache, "K", other, ["a"], build)


# ------------------------------------------------------------------- real files, end to end


def test_real_files_single_prefix_splits_match_brute_force(tmp_path):
    prefix = str(tmp_path / "text_document")
    docs = random_docs(5, 41, empty_every=7)  # 6 empty documents: 35 sequences
    write_dataset(prefix, docs)
    sequences = [d for d in docs if len(d)]
    cfg = GPTDatasetConfig(seed=11, seq_length=6, split="80,15,5",
                           data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, prefix, [30, 12, 3])
    # 35 sequences: bounds round(0.8*35)=28, round(0.95*35)=33.
    for ds, docs_range, n in ((train, range(0, 28), 30), (valid, range(28, 33), 12),
                              (test, range(33, 35), 3)):
        assert_samples(ds, expected_samples(sequences, np.array(docs_range), n, 6, 11))


def test_weighted_blend_asks_each_dataset_for_its_share(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    docs_a, docs_b = random_docs(6, 30), random_docs(7, 50)
    write_dataset(a, docs_a)
    write_dataset(b, docs_b)
    cfg = GPTDatasetConfig(seed=3, seq_length=5, split="90,10,0",
                           data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, ["1", a, "3", b], [40, 8, 4])
    assert test is None  # test share is 0
    assert isinstance(train, BlendableDataset) and isinstance(valid, BlendableDataset)
    # ceil(ceil(40 * 0.25) * 1.005) = 11, ceil(ceil(40 * 0.75) * 1.005) = 31
    assert [d.num_samples for d in train.datasets] == [11, 31]
    assert len(train) == 10 + 30
    want = [expected_samples(docs_a, np.arange(27), 11, 5, 3),
            expected_samples(docs_b, np.arange(45), 31, 5, 3)]
    for i in range(len(train)):
        d, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train[i]["text"], want[d][k])
    assert np.bincount(train.dataset_index, minlength=2).tolist() == [10, 30]


def test_mid_level_dataset_surplus_sets_each_blended_datasets_size(tmp_path):
    """--mid-level-dataset-surplus replaces the 0.005 of ceil(ceil(N * w) * (1 + surplus)); the
    blend itself still draws sum(ceil(N * w)) samples, the same ones as with the default."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    docs_a, docs_b = random_docs(6, 30), random_docs(7, 50)
    write_dataset(a, docs_a)
    write_dataset(b, docs_b)
    built = {}
    for surplus in (0.005, 0.5, 0.0):
        cfg = GPTDatasetConfig(seed=3, seq_length=5, split="90,10,0",
                               data_cache_path=str(tmp_path / "c"),
                               mid_level_dataset_surplus=surplus)
        built[surplus] = build_train_valid_test_datasets(cfg, ["1", a, "3", b], [40, 8, 4])[0]
        want = [math.ceil(math.ceil(40 * w) * (1 + surplus)) for w in (0.25, 0.75)]
        assert [d.num_samples for d in built[surplus].datasets] == want
        assert len(built[surplus]) == 40
    assert [d.num_samples for d in built[0.5].datasets] == [15, 45]
    want = [expected_samples(docs_a, np.arange(27), 15, 5, 3),
            expected_samples(docs_b, np.arange(45), 45, 5, 3)]
    for d, dataset in enumerate(built[0.5].datasets):
        assert_samples(dataset, want[d])
    # The blend's choice of dataset is the same; only the buffers behind it grow.
    for surplus in (0.5, 0.0):
        np.testing.assert_array_equal(built[surplus].dataset_index, built[0.005].dataset_index)
        np.testing.assert_array_equal(built[surplus].dataset_sample_index,
                                      built[0.005].dataset_sample_index)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--mid-level-dataset-surplus"):
            GPTDatasetConfig(seed=3, seq_length=5, mid_level_dataset_surplus=bad)


def test_explicit_split_paths_use_whole_datasets(tmp_path):
    a = str(tmp_path / "a")
    docs = random_docs(8, 12)
    write_dataset(a, docs)
    cfg = GPTDatasetConfig(seed=4, seq_length=3, data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, None, [9, 5, 0],
                                                         train_data_path=[a], valid_data_path=a)
    assert test is None
    assert_samples(train, expected_samples(docs, np.arange(12), 9, 3, 4))
    assert_samples(valid, expected_samples(docs, np.arange(12), 5, 3, 4))


def test_bad_inputs_name_what_is_wrong(tmp_path):
    a = str(tmp_path / "a")
    write_dataset(a, random_docs(9, 5))
    cfg = GPTDatasetConfig(seed=1, seq_length=3, split="1,100,0",
                           data_cache_path=str(tmp_path / "c"))
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        build_train_valid_test_datasets(cfg, missing, [5, 0, 0])
    with pytest.raises(ValueError, match=r"--split '1,100,0'.*\(5 documents\)"):
        build_train_valid_test_datasets(cfg, a, [5, 1, 0])
    with pytest.raises(ValueError, match="--data-path.*3 entries"):
        build_train_valid_test_datasets(cfg, ["1", a, "2"], [5, 0, 0])
    with pytest.raises(ValueError, match="--data-path.*weight"):
        build_train_valid_test_datasets(cfg, [a, a], [5, 0, 0])
    with pytest.raises(ValueError, match="--train-data-path"):
        build_train_valid_test_datasets(cfg, a, [5, 0, 0], train_data_path=a)
    with pytest.raises(ValueError, match="--seq-length"):
        GPTDatasetConfig(seq_length=0)


@pytest.mark.parametrize("where", ["data-path", "blend", "train-data-path", "valid-data-path"])
def test_a_data_file_without_documents_is_named(tmp_path, where):
    """A .bin/.idx pair that holds no documents is named as such, whichever flag brings it in
    (it used to be blamed on --split, or to end in an IndexError)."""
    empty, full = str(tmp_path / "empty_text_document"), str(tmp_path / "full")
    write_dataset(empty, [])
    write_dataset(full, random_docs(10, 20))
    cfg = GPTDatasetConfig(seed=1, seq_length=3, split="90,8,2",
                           data_cache_path=str(tmp_path / "c"))
    kwargs = {"data-path": dict(data_path=empty),
              "blend": dict(data_path=["1", full, "1", empty]),
              "train-data-path": dict(data_path=None, train_data_path=empty),
              "valid-data-path": dict(data_path=None, train_data_path=full,
                                      valid_data_path=empty)}[where]
    flag = "--data-path" if where == "blend" else f"--{where}"
    with pytest.raises(dataset_utils.DataError) as err:
        build_train_valid_test_datasets(cfg, train_valid_test_num_samples=[5, 2, 0], **kwargs)
    assert str(err.value) == (f"{flag}: the data file {empty}.bin/.idx holds no documents; "
                              "preprocess a non-empty input with tools/preprocess_data.py, or "
                              "leave this prefix out")


# -------------------------------------------------------------------------------- mock data


def test_mock_data_is_deterministic_per_index():
    cfg = GPTDatasetConfig(seed=9, seq_length=7, mock=True, vocab_size=50)
    train, valid, test = build_train_valid_test_datasets(cfg, None, [6, 3, 0])
    assert len(train) == 6 and len(valid) == 3 and test is None
    again = MockGPTDataset(6, 7, 50, seed=9)
    for i in reversed(range(6)):
        x = train[i]["text"]
        assert x.dtype == np.int64 and x.shape == (8,) and 0 <= x.min() and x.max() < 50
        np.testing.assert_array_equal(x, again[i]["text"])
    assert not np.array_equal(train[0]["text"], valid[0]["text"])
    with pytest.raises(ValueError, match="--mock-data"):
        GPTDatasetConfig(mock=True)


# ------------------------------------------------------------------------------ batch masks


def naive_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """The flags' meaning as plain loops over end-of-document tokens."""
    b, s = data.shape
    allowed = np.tril(np.ones((b, s, s), dtype=bool))
    loss = np.ones((b, s))
    pos = np.tile(np.arange(s), (b, 1))
    for r in range(b):
        for i in range(s):
            if data[r, i] != eod:
                continue
            if eod_mask_loss:
                loss[r, i] = 0
            if reset_attention_mask:
                allowed[r, i + 1:, :i + 1] = False
            if reset_position_ids:
                pos[r, i + 1:] = np.arange(s - i - 1)
    mask = ~allowed[:, None]
    if not reset_attention_mask:
        mask = mask[:1]
    return mask, loss, pos


@pytest.mark.parametrize("flags", [(p, a, l) for p in (0, 1) for a in (0, 1) for l in (0, 1)])
def test_masks_and_position_ids_match_naive_loops(flags):
    rng = np.random.default_rng(sum(f << i for i, f in enumerate(flags)))
    data = rng.integers(0, 5, (3, 17))
    data[0, -1] = 0  # end-of-document as the last token
    data[1, 0] = 0   # ... and as the first
    mask, loss, pos = get_ltor_masks_and_position_ids(torch.from_numpy(data), 0, *map(bool, flags))
    ref_mask, ref_loss, ref_pos = naive_masks(data, 0, *flags)
    assert mask.dtype == torch.bool and loss.dtype == torch.float32 and pos.dtype == torch.long
    np.testing.assert_array_equal(mask.numpy(), ref_mask)
    np.testing.assert_array_equal(loss.numpy(), ref_loss)
    np.testing.assert_array_equal(pos.numpy(), ref_pos)


# ---------------------------------------------------------------- rank 0 builds, rank 1 waits


def _build_counting_calls(prefix, cache):
    calls = []
    real = index_builders.build_gpt_indices

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    index_builders.build_gpt_indices = counting
    try:
        cfg = GPTDatasetConfig(seed=3, seq_length=5, split="1,0,0", data_cache_path=cache)
        train, _, _ = build_train_valid_test_datasets(cfg, prefix, [20, 0, 0])
    finally:
        index_builders.build_gpt_indices = real
    return len(calls), [train[i]["text"].tolist() for i in range(len(train))]


def _build_while_rank0_fails(prefix, cache):
    import torch.distributed as dist

    real_build, real_sleep = index_builders.build_gpt_indices, dataset_utils.poll_sleep
    if dist.get_rank() == 0:
        def failing(*args, **kwargs):
            dist.barrier()  # released once rank 1 is polling, so it sees the failure happen
            raise RuntimeError("disk on fire")

        index_builders.build_gpt_indices = failing
    else:
        first = [True]

        def hooked(seconds):
            if first[0]:
                first[0] = False
                dist.barrier()
            real_sleep(seconds)

        dataset_utils.poll_sleep = hooked
    cfg = GPTDatasetConfig(seed=3, seq_length=5, split="1,0,0", data_cache_path=cache)
    try:
        build_train_valid_test_datasets(cfg, prefix, [20, 0, 0])
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    finally:
        index_builders.build_gpt_indices, dataset_utils.poll_sleep = real_build, real_sleep
    return "no error"


def _two_rank_body(prefix, tmp):
    ok = _build_counting_calls(prefix, os.path.join(tmp, "cache_ok"))
    failed = _build_while_rank0_fails(prefix, os.path.join(tmp, "cache_fail"))
    return ok, failed


def test_rank0_builds_other_ranks_wait_and_load_or_report_its_failure(tmp_path):
    prefix = str(tmp_path / "d")
    docs = random_docs(10, 15)
    write_dataset(prefix, docs)
    results = run_on_ranks(_two_rank_body, 2, prefix, str(tmp_path))
    (calls0, samples0), failed0 = results[0]
    (calls1, samples1), failed1 = results[1]
    # Only rank 0 built; rank 1 read rank 0's files and sees the same samples.
    assert (calls0, calls1) == (1, 0)
    want = [w.tolist() for w in expected_samples(docs, np.arange(15), 20, 5, 3)]
    assert samples0 == samples1 == want
    # Rank 0's failure reaches the waiting rank as an error carrying rank 0's message.
    assert failed0 == "RuntimeError: disk on fire"
    assert failed1.startswith("RuntimeError: global rank 0 failed")
    assert "disk on fire" in failed1

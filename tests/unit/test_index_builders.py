"""Index builders: compiled vs numpy bodies, brute-force sample walks, the documented shuffles."""

import numpy as np
import pytest

from megatron.data import index_builders as ib

needs_compiled = pytest.mark.skipif(not ib.compiled_available(),
                                    reason="megatron.data._index_helpers is not built")


def _random_case(rng, max_docs=25, max_len=15):
    """Sizes (some empty), a shuffled multi-epoch doc_idx, S, E and T of a small corpus."""
    n = int(rng.integers(1, max_docs))
    sizes = rng.integers(0, max_len, n).astype(np.int32)
    if sizes.sum() == 0:
        sizes[int(rng.integers(0, n))] = int(rng.integers(1, max_len))
    epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    seq_length = int(rng.integers(1, 3 * max_len))
    return sizes, doc_idx, seq_length, epochs, int(sizes.sum())


@needs_compiled
def test_sample_idx_compiled_equals_numpy_on_random_corpora():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes, doc_idx, s, e, t = _random_case(rng)
        compiled = ib.build_sample_idx(sizes, doc_idx, s, e, t, use_compiled=True)
        fallback = ib.build_sample_idx(sizes, doc_idx, s, e, t, use_compiled=False)
        assert compiled.dtype == fallback.dtype == np.int32
        np.testing.assert_array_equal(compiled, fallback)


@needs_compiled
def test_blending_compiled_equals_numpy_on_random_weights():
    rng = np.random.default_rng(1)
    for _ in range(200):
        w = rng.random(int(rng.integers(1, 9))) ** 2 + 1e-4
        w /= w.sum()
        size = int(rng.integers(0, 400))
        di_c, ds_c = ib.build_blending_indices(w, size, use_compiled=True)
        di_n, ds_n = ib.build_blending_indices(w, size, use_compiled=False)
        assert (di_c.dtype, ds_c.dtype) == (di_n.dtype, ds_n.dtype) == (np.uint8, np.int64)
        np.testing.assert_array_equal(di_c, di_n)
        np.testing.assert_array_equal(ds_c, ds_n)


@needs_compiled
def test_compiled_blending_rejects_output_arrays_it_would_copy():
    from megatron.data import _index_helpers

    for dataset_index, sample_index in [(np.zeros(4, np.uint8), np.zeros(4, np.int32)),
                                        (np.zeros(8, np.uint8)[::2], np.zeros(4, np.int64))]:
        with pytest.raises(TypeError):
            _index_helpers.build_blending_indices(dataset_index, sample_index,
                                                  np.array([0.5, 0.5]), 2, 4)


@pytest.mark.parametrize("use_compiled", [
    pytest.param(True, marks=needs_compiled), False])
def test_sample_idx_equals_brute_force_token_walk(use_compiled):
    """Every sample is the brute-force slice [i*S, i*S + S] of the concatenated token stream."""
    rng = np.random.default_rng(2)
    for _ in range(150):
        sizes, doc_idx, s, e, t = _random_case(rng)
        # Token values are unique ids, so equality pins down the exact position of every token.
        starts = np.concatenate([[0], np.cumsum(sizes)])
        docs = [np.arange(starts[d], starts[d + 1]) for d in range(sizes.size)]
        stream = np.concatenate([docs[d] for d in doc_idx])
        assert stream.size == e * t
        idx = ib.build_sample_idx(sizes, doc_idx, s, e, t, use_compiled=use_compiled)
        n = (e * t - 1) // s
        assert idx.shape == (n + 1, 2) and tuple(idx[0]) == (0, 0)
        pieces = []
        for i in range(n):
            (p0, o0), (p1, o1) = idx[i], idx[i + 1]
            if p0 == p1:
                text = docs[doc_idx[p0]][o0:o1 + 1]
            else:
                text = np.concatenate([docs[doc_idx[p0]][o0:]]
                                      + [docs[doc_idx[p]] for p in range(p0 + 1, p1)]
                                      + [docs[doc_idx[p1]][:o1 + 1]])
            np.testing.assert_array_equal(text, stream[i * s:i * s + s + 1])
            pieces.append(text[:-1])
            if i > 0:
                assert prev_last == text[0]  # consecutive samples share one token
            prev_last = text[-1]
        if n:
            # In order, every token of every epoch up to the last sample's end is read.
            np.testing.assert_array_equal(np.concatenate(pieces + [text[-1:]]),
                                          stream[:n * s + 1])


def test_sample_idx_errors():
    sizes = np.array([3, 4], np.int32)
    with pytest.raises(RuntimeError, match="ran past the end"):
        ib.build_sample_idx_numpy(sizes, np.array([0, 1], np.int32), 2, 1, 100)
    with pytest.raises(ValueError, match="not a sequence id"):
        ib.build_sample_idx_numpy(sizes, np.array([0, 2], np.int32), 2, 1, 7)
    with pytest.raises(ValueError, match="seq_length"):
        ib.build_sample_idx_numpy(sizes, np.array([0, 1], np.int32), 0, 1, 7)
    with pytest.raises(ValueError, match="1 to 255"):
        ib.build_blending_indices(np.ones(256) / 256, 10)


def test_num_epochs_is_the_smallest_sufficient():
    for tokens in (1, 7, 25, 100):
        for s in (1, 3, 8):
            for n in (0, 1, 5, 33, 80):
                e = ib.num_epochs(tokens, s, n)
                assert e >= 1 and e * tokens >= n * s + 1
                assert e == 1 or (e - 1) * tokens < n * s + 1
                # Equivalently: the smallest E giving (E*T - 1)//S >= n samples.
                assert (e * tokens - 1) // s >= n
    assert ib.num_epochs(25, 3, 8) == 1  # 25 >= 25: exactly one epoch
    assert ib.num_epochs(25, 3, 9) == 2
    with pytest.raises(ValueError):
        ib.num_epochs(0, 3, 1)


# Hand-worked corpus: 4 documents of 7, 5, 9, 4 tokens (T = 25), S = 3, so an epoch gives
# (25 - 1) // 3 = 8 samples and the threshold is int(0.8 * 8) = 6.
#   13 samples: E = 2 (needs 40 tokens), sans = (25 - 1) // 3 = 8, last = 5 < 6  -> separate
#   14 samples: E = 2 (needs 43 tokens), last = 6, not < 6                        -> together
#    5 samples: E = 1                                                             -> together
HAND_SIZES = np.array([7, 5, 9, 4], np.int32)


def test_separate_last_epoch_hand_worked():
    assert ib.separate_last_epoch(25, 3, 13, ib.num_epochs(25, 3, 13)) == (True, 8)
    assert ib.separate_last_epoch(25, 3, 14, ib.num_epochs(25, 3, 14)) == (False, 8)
    assert ib.separate_last_epoch(25, 3, 5, ib.num_epochs(25, 3, 5))[0] is False


def _reference_indices(sizes, documents, n, s, seed, epochs, separate, sans):
    """The documented RandomState order, written independently: x[rng.permutation(len(x))]."""
    rng = np.random.RandomState(seed)
    docs = np.asarray(documents, np.int32)
    if separate:
        body = np.concatenate([docs] * (epochs - 1))
        doc_idx = np.concatenate([body[rng.permutation(body.size)],
                                  docs[rng.permutation(docs.size)]])
    else:
        body = np.concatenate([docs] * epochs)
        doc_idx = body[rng.permutation(body.size)]
    total = (epochs * int(sizes[docs].sum()) - 1) // s
    if separate:
        shuffle = np.concatenate([rng.permutation(sans), sans + rng.permutation(total - sans)])
    else:
        shuffle = rng.permutation(total)
    return doc_idx, shuffle


@pytest.mark.parametrize("num_samples,separate", [(13, True), (14, False), (5, False)])
def test_doc_idx_and_shuffle_idx_follow_documented_random_order(num_samples, separate):
    documents = np.arange(4, dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = ib.build_gpt_indices(HAND_SIZES, documents, num_samples,
                                                            3, seed=1234)
    epochs = ib.num_epochs(25, 3, num_samples)
    ref_doc, ref_shuffle = _reference_indices(HAND_SIZES, documents, num_samples, 3, 1234,
                                              epochs, separate, 8)
    assert doc_idx.dtype == np.int32 and shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(doc_idx, ref_doc)
    np.testing.assert_array_equal(shuffle_idx, ref_shuffle)
    assert sample_idx.shape[0] - 1 == (epochs * 25 - 1) // 3 >= num_samples
    if separate:
        # The last epoch's documents are a permutation of the split on their own, and the
        # samples of the first E - 1 epochs are shuffled only among themselves.
        assert sorted(doc_idx[-4:]) == [0, 1, 2, 3]
        assert sorted(shuffle_idx[:8]) == list(range(8))
        assert sorted(shuffle_idx[8:]) == list(range(8, 16))


def test_gpt_indices_of_a_split_use_only_its_documents_and_depend_on_seed():
    sizes = np.array([4, 6, 2, 8, 5, 3], np.int32)
    docs = np.arange(2, 5, dtype=np.int32)
    a = ib.build_gpt_indices(sizes, docs, 10, 4, seed=7)
    b = ib.build_gpt_indices(sizes, docs, 10, 4, seed=7)
    c = ib.build_gpt_indices(sizes, docs, 10, 4, seed=8)
    assert set(a[0].tolist()) == {2, 3, 4}
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_shuffle_idx_permutes_its_two_parts_separately():
    small = ib.build_shuffle_idx(3, 5, np.random.RandomState(0))
    assert small.dtype == np.uint32
    assert sorted(small[:3]) == [0, 1, 2] and sorted(small[3:]) == [3, 4]


def test_missing_extension_falls_back_to_numpy_with_one_warning(monkeypatch):
    monkeypatch.setattr(ib, "_compiled", None)
    monkeypatch.setattr(ib, "_WARNED", False)
    sizes, doc_idx = np.array([4, 3], np.int32), np.array([1, 0], np.int32)
    with pytest.warns(RuntimeWarning, match="_index_helpers is not built") as record:
        a = ib.build_sample_idx(sizes, doc_idx, 2, 1, 7)
        ib.build_blending_indices([0.5, 0.5], 4)
    assert len([w for w in record if "_index_helpers" in str(w.message)]) == 1
    # Stream: document 1 (3 tokens) then document 0 (4); samples end at tokens 2, 4, 6.
    np.testing.assert_array_equal(a, [[0, 0], [0, 2], [1, 1], [1, 3]])
    with pytest.raises(ImportError):
        ib.build_sample_idx(sizes, doc_idx, 2, 1, 7, use_compiled=True)

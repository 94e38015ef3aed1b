"""BERT dataset: the compiled sample mapping against a pure-Python walk driven by a Mersenne Twister
checked on the C++ standard's known answers; sentence pairs against a brute-force search over every
split and truncation; masking statistics; determinism; a real corpus through the preprocessing and
tokenizer-training tools; and the errors for data that cannot give BERT samples."""

import json
import math
import os
import pickle

import numpy as np
import pytest

from megatron.data import bert_dataset, dataset_utils
from megatron.data.bert_dataset import (BertDataset, BertDatasetConfig, WordPieceVocab,
                                        build_samples_mapping, build_train_valid_test_datasets,
                                        get_a_and_b_segments, truncate_segments)
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import DataError
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.multiprocess import run_on_ranks

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask", "truncated")


# ------------------------------------------------------------------ Mersenne Twister reference


def mersenne_twister(seed, bits):
    """std::mt19937 (bits=32) or std::mt19937_64 (bits=64) outputs, from the published
    parameters of the two engines."""
    if bits == 32:
        n, m, a, u, d, s, b, t, c, l, f = (624, 397, 0x9908B0DF, 11, 0xFFFFFFFF, 7, 0x9D2C5680,
                                           15, 0xEFC60000, 18, 1812433253)
    else:
        n, m, a, u, d, s, b, t, c, l, f = (312, 156, 0xB5026F5AA96619E9, 29, 0x5555555555555555,
                                           17, 0x71D67FFFEDA60000, 37, 0xFFF7EEE000000000, 43,
                                           6364136223846793005)
    full = (1 << bits) - 1
    lower = (1 << 31) - 1
    upper = full & ~lower
    state = [seed & full]
    for i in range(1, n):
        state.append((f * (state[-1] ^ (state[-1] >> (bits - 2))) + i) & full)
    index = n
    while True:
        if index == n:
            for i in range(n):
                x = (state[i] & upper) | (state[(i + 1) % n] & lower)
                state[i] = state[(i + m) % n] ^ (x >> 1) ^ (a if x & 1 else 0)
            index = 0
        y = state[index]
        index += 1
        y ^= (y >> u) & d
        y ^= (y << s) & b
        y ^= (y << t) & c
        y ^= y >> l
        yield y & full


def test_reference_generators_give_the_standard_known_answers():
    # The C++ standard ([rand.predef]): the 10000th output of a default-constructed engine.
    for bits, want in ((32, 4123659995), (64, 9981545732273789042)):
        gen = mersenne_twister(5489, bits)
        for _ in range(9999):
            next(gen)
        assert next(gen) == want


def reference_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                      seed, min_num_sent):
    """The sample mapping written out plainly, one sentence at a time."""
    ratio = math.floor(1.0 / short_seq_prob + 0.5) if short_seq_prob > 0 else 0
    gen32 = mersenne_twister(seed, 32)

    def target():
        if ratio == 0:
            return max_seq_length
        r = next(gen32)
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        for first, last in zip(docs[:-1], docs[1:]):
            sentences = list(range(first, last))
            if len(sentences) < min_num_sent:
                continue
            if len(sentences) > 1 and any(sizes[s] > 512 for s in sentences):
                continue
            start, length, count, goal = first, 0, 0, target()
            for s in sentences:
                length += sizes[s]
                count += 1
                left = last - s - 1
                if (length >= goal and left > 1 and count >= min_num_sent) or left == 0:
                    rows.append((start, s + 1, goal))
                    start, length, count, goal = s + 1, 0, 0, target()
    gen64 = mersenne_twister(seed + 1, 64)
    for i in range(len(rows) - 1, 0, -1):
        j = next(gen64) % (i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return np.array(rows, dtype=np.uint32).reshape(-1, 3)


def random_corpus(seed, num_docs, max_sentences=7, max_size=60, long_every=0):
    """(document boundaries, sentence sizes), with empty documents and, optionally, long
    sentences."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_sentences + 1, num_docs)
    sizes = rng.integers(0, max_size + 1, int(counts.sum())).astype(np.int32)
    if long_every:
        sizes[::long_every] = 600
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), sizes


@pytest.mark.parametrize("min_num_sent,short_seq_prob,max_seq_length,epochs,max_samples,seed", [
    (2, 0.1, 64, 3, 10 ** 9, 1234),
    (1, 0.1, 64, 2, 10 ** 9, 7),
    (2, 0.5, 20, 4, 30, 99),         # stops after the epoch that reaches 30 samples
    (2, 0.0, 40, 2, 10 ** 9, 5),     # no short targets: the generator is never drawn
    (1, 1.0, 2, 1, 10 ** 9, 0),      # every target short, the shortest max_seq_length
    (2, 0.4, 30, 2, 10 ** 9, 2 ** 31 - 2),  # 1 / 0.4 = 2.5 rounds half away from zero
])
def test_mapping_equals_the_plain_walk(min_num_sent, short_seq_prob, max_seq_length, epochs,
                                       max_samples, seed):
    docs, sizes = random_corpus(seed % 1000, 60, long_every=37)
    for lo, hi in ((0, 60), (17, 45)):  # a split passes its slice of the boundaries
        got = build_samples_mapping(docs[lo:hi + 1], sizes, epochs, max_samples, max_seq_length,
                                    short_seq_prob, seed, min_num_sent)
        want = reference_mapping(docs[lo:hi + 1], sizes, epochs, max_samples, max_seq_length,
                                 short_seq_prob, seed, min_num_sent)
        assert got.dtype == np.uint32 and got.shape == want.shape and len(want) > 0
        np.testing.assert_array_equal(got, want)


def test_mapping_invariants():
    docs, sizes = random_corpus(3, 300, max_size=30, long_every=101)
    got = build_samples_mapping(docs, sizes, 1, 10 ** 9, 50, 0.1, 11, 2)
    doc_of = np.searchsorted(docs, got[:, 0].astype(np.int64), side="right") - 1
    # Every row lies in one document, holds at least two sentences and a target in [2, 50].
    assert (got[:, 1] <= docs[doc_of + 1]).all() and (got[:, 1] - got[:, 0] >= 2).all()
    assert ((got[:, 2] >= 2) & (got[:, 2] <= 50)).all()
    # Sorted by start, the rows tile each eligible document's sentences exactly once, in order.
    rows = got[np.argsort(got[:, 0])]
    covered = []
    for d in range(300):
        first, last = int(docs[d]), int(docs[d + 1])
        long = last - first > 1 and (sizes[first:last] > 512).any()
        if last - first >= 2 and not long:
            covered.append((first, last))
    starts = rows[:, 0].tolist()
    for first, last in covered:
        pos, at = starts.index(first), first
        while at < last:
            assert rows[pos, 0] == at
            at = int(rows[pos, 1])
            pos += 1
        assert at == last
    assert len(covered) > 100
    # The Python-side eligibility check (used for the errors) agrees with the walk.
    eligible = np.flatnonzero(bert_dataset.eligible_documents(docs, sizes, 2))
    assert [(int(docs[d]), int(docs[d + 1])) for d in eligible] == covered
    assert sorted(set(doc_of.tolist())) == eligible.tolist()
    # Same seed, same rows; another seed shuffles differently.
    np.testing.assert_array_equal(got, build_samples_mapping(docs, sizes, 1, 10 ** 9, 50, 0.1,
                                                             11, 2))
    other = build_samples_mapping(docs, sizes, 1, 10 ** 9, 50, 0.1, 12, 2)
    assert not np.array_equal(got[:, :2], other[:, :2])


def test_short_targets_follow_short_seq_prob():
    # Sentences as long as the longest target: every sentence but a document's last two ends a
    # sample whatever its target, so the targets are independent draws.
    docs = np.arange(0, 40001, 8, dtype=np.int64)
    sizes = np.full(40000, 64, dtype=np.int32)
    got = build_samples_mapping(docs, sizes, 1, 10 ** 9, 64, 0.1, 1234, 1)
    assert len(got) == 5000 * 7
    short = got[:, 2] < 64
    # A short draw is 2 + r % 63, which is 64 one time in 63.
    p = 0.1 * 62 / 63
    assert abs(short.mean() - p) < 4 * math.sqrt(p * (1 - p) / len(got))
    assert got[short, 2].min() == 2 and got[short, 2].max() == 63


def test_mapping_rejects_bad_arguments():
    from megatron.data import _index_helpers

    docs, sizes = random_corpus(0, 5)
    good = dict(docs=docs, sizes=sizes, num_epochs=1, max_num_samples=10, max_seq_length=10,
                short_seq_prob=0.1, seed=1, verbose=False, min_num_sent=2)
    bad = [(dict(max_seq_length=1), "max_seq_length"), (dict(short_seq_prob=1.5), "short_seq"),
           (dict(short_seq_prob=-0.1), "short_seq"), (dict(num_epochs=0), "num_epochs"),
           (dict(docs=docs[::-1].copy()), "must not decrease"),
           (dict(docs=np.array([0, len(sizes) + 1])), "past the"),
           (dict(seed=-1), "seed"), (dict(min_num_sent=0), "min_num_sent")]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            _index_helpers.build_mapping(**{**good, **change})


# ----------------------------------------------------------------------- a hand-made corpus


class FakeWordPiece:
    """Ids 0-4 are [PAD] [UNK] [CLS] [SEP] [MASK]; id i >= 5 is the piece "##i" when i % 4 == 0
    (it continues a word), else the word start "wi"."""

    name = "fake WordPiece"
    cls, sep, mask, pad = CLS, SEP, MASK, PAD

    def __init__(self, vocab_size=3000):
        self.inv_vocab = {0: "[PAD]", 1: "[UNK]", 2: "[CLS]", 3: "[SEP]", 4: "[MASK]"}
        for i in range(5, vocab_size):
            self.inv_vocab[i] = f"##{i}" if i % 4 == 0 else f"w{i}"
        self.vocab_size = vocab_size


def continuation(token):
    return token >= 5 and token % 4 == 0


def unique_corpus(seed, sentence_counts, min_len=1, max_len=12):
    """Documents of sentences whose ids are all different and each start a word."""
    rng = np.random.default_rng(seed)
    next_id, documents = 5, []
    for count in sentence_counts:
        doc = []
        for _ in range(count):
            if continuation(next_id):
                next_id += 1
            length = int(rng.integers(min_len, max_len + 1))
            doc.append(list(range(next_id, next_id + length)))
            next_id += length
        documents.append(doc)
    return documents


def write_sentences(prefix, documents):
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in documents:
        tokens = [t for s in doc for t in s]
        builder.add_document(np.array(tokens, dtype=np.uint16), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


def make_dataset(tmp_path, documents, num_samples=200, split="1,0,0", tokenizer=None, **config):
    prefix = str(tmp_path / "sent")
    if not os.path.exists(prefix + ".idx"):
        write_sentences(prefix, documents)
    settings = dict(seed=1234, seq_length=32, split=split, data_cache_path=str(tmp_path / "cache"))
    settings.update(config)
    cfg = BertDatasetConfig(**settings)
    return build_train_valid_test_datasets(cfg, prefix, [num_samples, 0, 0],
                                           tokenizer or FakeWordPiece())[0]


def truncated_lengths(len_a, len_b, target):
    while len_a + len_b > target:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


def is_window(part, whole):
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def check_sample_structure(sample, sentences, target, seq_length, binary_head):
    """Check one sample against every way of splitting and truncating its sentences."""
    assert set(sample) == set(KEYS)
    for key in KEYS:
        assert sample[key].dtype == np.int64
        assert sample[key].shape == (() if key in ("is_random", "truncated") else (seq_length,))
    text, labels = sample["text"], sample["labels"]
    np.testing.assert_array_equal(sample["loss_mask"], (labels != -1).astype(np.int64))
    real = int(sample["padding_mask"].sum())
    np.testing.assert_array_equal(sample["padding_mask"], np.arange(seq_length) < real)
    assert (text[real:] == PAD).all() and (labels[real:] == -1).all()
    original = np.where(labels != -1, labels, text)[:real].tolist()
    assert original[0] == CLS and original[-1] == SEP
    seps = [i for i, t in enumerate(original) if t == SEP]
    assert len(seps) == (2 if binary_head else 1)
    part_a, part_b = original[1:seps[0]], original[seps[0] + 1:-1]
    want_types = [0] * (len(part_a) + 2) + ([1] * (len(part_b) + 1) if binary_head else [])
    np.testing.assert_array_equal(sample["types"], want_types + [0] * (seq_length - real))
    found = []
    for k in (range(1, len(sentences)) if binary_head else [len(sentences)]):
        first = [t for s in sentences[:k] for t in s]
        second = [t for s in sentences[k:] for t in s]
        for swapped in ((False, True) if binary_head else (False,)):
            full_a, full_b = (second, first) if swapped else (first, second)
            if (len(part_a), len(part_b)) != truncated_lengths(len(full_a), len(full_b), target):
                continue
            if is_window(part_a, full_a) and is_window(part_b, full_b):
                found.append((int(swapped), int(len(full_a) + len(full_b) > target)))
    assert (int(sample["is_random"]), int(sample["truncated"])) in found
    return original


@pytest.mark.parametrize("binary_head", [True, False])
def test_samples_match_a_brute_force_search_of_splits_and_truncations(tmp_path, binary_head):
    documents = unique_corpus(0, [3, 2, 6, 1, 4, 9, 2, 5])
    dataset = make_dataset(tmp_path, documents, seq_length=24, binary_head=binary_head)
    sentences = [s for doc in documents for s in doc]
    assert len(dataset) >= 200
    flags = []
    for i in range(len(dataset)):
        start, end, target = (int(x) for x in dataset.samples_mapping[i])
        assert target <= 24 - 3
        sample = dataset[i]
        check_sample_structure(sample, sentences[start:end], target, 24, binary_head)
        flags.append((int(sample["is_random"]), int(sample["truncated"])))
    flags = np.array(flags)
    if binary_head:
        assert 0.35 < flags[:, 0].mean() < 0.65
    else:
        assert not flags[:, 0].any()
    assert 0 < flags[:, 1].mean() < 1


def test_pair_split_and_truncation_draws_are_uniform():
    sample = [[10], [11], [12], [13]]
    a_ends, swaps = [], []
    for seed in range(3000):
        a, b, swapped = get_a_and_b_segments(sample, np.random.RandomState(seed))
        first = b if swapped else a
        a_ends.append(len(first))
        swaps.append(swapped)
        assert sorted(a + b) == [10, 11, 12, 13]
    assert set(a_ends) == {1, 2, 3}
    for k in (1, 2, 3):
        assert abs(a_ends.count(k) / 3000 - 1 / 3) < 0.04
    assert abs(np.mean(swaps) - 0.5) < 0.04
    fronts = []
    for seed in range(2000):
        a, b, truncated = truncate_segments(list(range(10)), [], 9, np.random.RandomState(seed))
        assert truncated and b == [] and a in (list(range(1, 10)), list(range(9)))
        fronts.append(a[0] == 1)
    assert abs(np.mean(fronts) - 0.5) < 0.05


# ------------------------------------------------------------------ an independent reference


def reference_sample(sentences, target, seq_length, vocab_ids, prob, rng, binary_head,
                     max_ngrams, whole_word):
    """Megatron's draw order written out naively: split, swap, truncate, mask, pad."""
    if binary_head:
        a_end = rng.randint(1, len(sentences)) if len(sentences) >= 3 else 1
        a, b = sum(sentences[:a_end], []), sum(sentences[a_end:], [])
        swapped = rng.random() < 0.5
        if swapped:
            a, b = b, a
    else:
        a, b, swapped = sum(sentences, []), [], False
    truncated = len(a) + len(b) > target
    while len(a) + len(b) > target:
        segment = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del segment[0]
        else:
            del segment[-1]
    tokens = [CLS] + a + [SEP] + (b + [SEP] if b else [])
    types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
    words = []
    for i, token in enumerate(tokens):
        if token not in (CLS, SEP):
            if whole_word and words and continuation(token):
                words[-1].append(i)
            else:
                words.append([i])
    limit = min(prob * target, max(1, int(round(len(tokens) * prob))))
    spans = [[words[i:i + n] for n in range(1, max_ngrams + 1)] for i in range(len(words))]
    rng.shuffle(spans)
    weights = np.array([1.0 / n for n in range(1, max_ngrams + 1)])
    chosen, out = {}, list(tokens)
    for span in spans:
        if len(chosen) >= limit:
            break
        n = rng.choice(np.arange(1, max_ngrams + 1), p=weights / weights.sum())
        for m in range(n, 0, -1):
            positions = sum(span[m - 1], [])
            if len(chosen) + len(positions) <= limit:
                break
        else:
            continue
        if any(p in chosen for p in positions):
            continue
        for p in positions:
            chosen[p] = tokens[p]
            if rng.random() < 0.8:
                out[p] = MASK
            elif rng.random() >= 0.5:
                out[p] = vocab_ids[rng.randint(0, len(vocab_ids))]
    pad = seq_length - len(tokens)
    labels = [chosen.get(i, -1) for i in range(len(tokens))] + [-1] * pad
    return {"text": out + [PAD] * pad, "types": types + [0] * pad, "labels": labels,
            "is_random": int(swapped), "loss_mask": [int(x != -1) for x in labels],
            "padding_mask": [1] * len(tokens) + [0] * pad, "truncated": int(truncated)}


@pytest.mark.parametrize("binary_head,max_ngrams,whole_word,prob", [
    (True, 1, True, 0.15), (True, 3, True, 0.3), (False, 1, False, 0.15), (True, 2, False, 0.5),
])
def test_samples_equal_the_naive_reference(tmp_path, binary_head, max_ngrams, whole_word, prob):
    documents = unique_corpus(1, [4, 2, 7, 3, 5, 2, 8])
    dataset = make_dataset(tmp_path, documents, num_samples=60, seq_length=28, seed=77,
                           binary_head=binary_head, max_ngrams=max_ngrams,
                           whole_word_masking=whole_word, masked_lm_prob=prob)
    sentences = [s for doc in documents for s in doc]
    vocab_ids = list(FakeWordPiece().inv_vocab)
    for i in range(len(dataset)):
        start, end, target = (int(x) for x in dataset.samples_mapping[i])
        want = reference_sample([list(s) for s in sentences[start:end]], target, 28, vocab_ids,
                                prob, np.random.RandomState(77 + i), binary_head, max_ngrams,
                                whole_word)
        got = dataset[i]
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"sample {i} {key}")


# ------------------------------------------------------------------------------ masking


@pytest.mark.parametrize("whole_word", [False, True])
def test_masking_statistics(tmp_path, whole_word):
    documents = unique_corpus(2, [12] * 40, min_len=5, max_len=14)
    dataset = make_dataset(tmp_path, documents, num_samples=400, seq_length=64,
                           whole_word_masking=whole_word, short_seq_prob=0.0,
                           tokenizer=FakeWordPiece(8000))
    masked = kept = randomized = candidates = 0
    random_ids = []
    for i in range(400):
        start, end, target = (int(x) for x in dataset.samples_mapping[i])
        sample = dataset[i]
        text, labels = sample["text"], sample["labels"]
        real = int(sample["padding_mask"].sum())
        special = np.isin(text[:real], (CLS, SEP)) & (labels[:real] == -1)
        picked = np.flatnonzero(labels != -1)
        assert not np.isin(labels[picked], (CLS, SEP, PAD)).any()
        limit = min(0.15 * target, max(1, round(real * 0.15)))
        if whole_word:
            assert len(picked) <= limit
            # A word is a start piece and the "##" pieces after it (specials skipped).
            original = np.where(labels != -1, labels, text)[:real]
            word, words = None, {}
            for p in range(real):
                if original[p] in (CLS, SEP):
                    continue
                if not continuation(int(original[p])) or word is None:
                    word = p
                words[p] = word
            by_word = {}
            for p, w in words.items():
                by_word.setdefault(w, []).append(p)
            for group in by_word.values():
                assert len(set(group) & set(picked.tolist())) in (0, len(group))
        else:
            assert len(picked) == math.floor(limit)  # one token per candidate: exact count
        candidates += int((~special).sum())
        masked += len(picked)
        kept += int((text[picked] == labels[picked]).sum())
        replaced = picked[(text[picked] != MASK) & (text[picked] != labels[picked])]
        randomized += len(replaced)
        random_ids += text[replaced].tolist()
    assert 0.13 < masked / candidates < 0.18
    assert abs((masked - kept - randomized) / masked - 0.8) < 0.03
    assert abs(kept / masked - 0.1) < 0.025 and abs(randomized / masked - 0.1) < 0.025
    # Random replacements come from the whole vocabulary.
    assert min(random_ids) >= 0 and max(random_ids) < 8000 and len(set(random_ids)) > 100
    assert abs(np.mean(random_ids) - 4000) < 600


# ---------------------------------------------------------------------------- determinism


def test_samples_depend_only_on_seed_and_index(tmp_path):
    documents = unique_corpus(3, [5, 3, 8, 2, 6] * 4)
    dataset = make_dataset(tmp_path, documents, num_samples=50)
    forward = [dataset[i] for i in range(len(dataset))]
    backward = [dataset[i] for i in reversed(range(len(dataset)))][::-1]
    again = make_dataset(tmp_path, documents, num_samples=50)  # from the cache
    copy = pickle.loads(pickle.dumps(dataset))
    assert isinstance(copy.samples_mapping, np.memmap)
    for i, sample in enumerate(forward):
        for other in (backward[i], again[i], copy[i], dataset[i - len(dataset)]):
            for key in KEYS:
                np.testing.assert_array_equal(sample[key], other[key])
    reseeded = make_dataset(tmp_path, documents, num_samples=50, seed=4321)
    assert any(not np.array_equal(reseeded[i]["text"], forward[i]["text"]) for i in range(10))


def test_cache_is_reused_and_keyed_by_the_mapping_settings(tmp_path, monkeypatch):
    documents = unique_corpus(4, [4, 6, 3, 5])
    calls = []
    real = bert_dataset.build_samples_mapping

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(bert_dataset, "build_samples_mapping", counting)
    first = make_dataset(tmp_path, documents, num_samples=30)
    make_dataset(tmp_path, documents, num_samples=30)
    assert len(calls) == 1
    for change in (dict(seed=5), dict(seq_length=40), dict(short_seq_prob=0.3),
                   dict(binary_head=False)):
        make_dataset(tmp_path, documents, num_samples=30, **change)
    make_dataset(tmp_path, documents, num_samples=31)
    assert len(calls) == 6
    # The mapping is the compiled one over the split's documents: 3 tokens left for [CLS]/[SEP].
    prefix = str(tmp_path / "sent")
    ds = IndexedDataset(prefix)
    want = real(ds.document_indices, ds.sequence_lengths, 2 ** 31 - 2, 30, 29, 0.1, 1234, 2)
    np.testing.assert_array_equal(first.samples_mapping, want)


# --------------------------------------------------------------------- a real small corpus


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    """A few hundred lines of the json package's source as 25 JSONL documents, a WordPiece vocab
    trained on them, and the corpus preprocessed with and without --split-sentences."""
    from tools import preprocess_data, train_tokenizer

    folder = tmp_path_factory.mktemp("stdlib")
    source = os.path.dirname(json.__file__)
    lines = []
    for name in sorted(os.listdir(source)):
        if name.endswith(".py"):
            with open(os.path.join(source, name), encoding="utf-8") as f:
                lines += [line.strip() for line in f if line.strip()]
    lines = lines[:400]
    texts = [" ".join(lines[i:i + 16]) for i in range(0, len(lines), 16)]
    corpus = str(folder / "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    vocab = str(folder / "vocab.txt")
    assert train_tokenizer.main(["--input", corpus, "--tokenizer-type", "BertWordPieceLowerCase",
                                 "--vocab-size", "600", "--output", vocab]) == 0
    common = ["--input", corpus, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
              vocab, "--workers", "1"]
    assert preprocess_data.main(common + ["--output-prefix", str(folder / "s"),
                                          "--split-sentences"]) == 0
    assert preprocess_data.main(common + ["--output-prefix", str(folder / "g")]) == 0
    return {"texts": texts, "vocab": vocab, "sentences": str(folder / "s_text_sentence"),
            "documents": str(folder / "g_text_document"), "folder": folder}


def test_real_corpus_samples_are_corpus_text_and_splits_are_disjoint(stdlib_corpus, tmp_path):
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(stdlib_corpus["vocab"], lower_case=True)
    prefix = stdlib_corpus["sentences"]
    cfg = BertDatasetConfig(seed=1234, seq_length=64, split="6,2,2",
                            data_cache_path=str(tmp_path / "cache"))
    splits = build_train_valid_test_datasets(cfg, prefix, [120, 20, 20], tokenizer)
    indexed = IndexedDataset(prefix)
    bounds = indexed.document_indices
    assert len(bounds) - 1 == len(stdlib_corpus["texts"]) == 25
    squeezed = ["".join(t.lower().split()) for t in stdlib_corpus["texts"]]
    owners = []
    for split, want_docs, wanted in zip(splits, dataset_utils.split_bounds("6,2,2", 25),
                                        (120, 20, 20)):
        assert len(split) >= wanted
        docs = np.searchsorted(bounds, split.samples_mapping[:, 0].astype(np.int64), "right") - 1
        assert set(docs.tolist()) <= set(range(*want_docs))
        owners.append(set(docs.tolist()))
        for i in range(len(split)):
            start, end, target = (int(x) for x in split.samples_mapping[i])
            sentences = [s.tolist() for s in indexed[start:end]]
            original = check_sample_structure(split[i], sentences, target, 64, True)
            doc_text = squeezed[int(docs[i])]
            sep = original.index(tokenizer.sep)
            for segment in (original[1:sep], original[sep + 1:-1]):
                piece = "".join(tokenizer.detokenize(segment).split())
                # A segment cut from the front may start inside a word.
                assert piece.replace("##", "") in doc_text
    assert not (owners[0] & owners[1]) and not (owners[0] & owners[2])
    assert not (owners[1] & owners[2])


def test_non_sentence_datasets_are_rejected_with_the_file_named(stdlib_corpus, tmp_path):
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(stdlib_corpus["vocab"], lower_case=True)
    cfg = BertDatasetConfig(seed=1, seq_length=64, split="1,0,0",
                            data_cache_path=str(tmp_path / "cache"))
    gpt_style = stdlib_corpus["documents"]
    with pytest.raises(DataError, match="--split-sentences") as err:
        build_train_valid_test_datasets(cfg, gpt_style, [10, 0, 0], tokenizer)
    assert gpt_style in str(err.value) and "binary" in str(err.value)
    # Without the binary head a single-sequence document is fine, unless it is obviously a
    # whole document (longer than any sentence).
    long_docs = str(tmp_path / "long")
    write_sentences(long_docs, [[list(range(5, 700))], [list(range(5, 40))]])
    no_head = BertDatasetConfig(seed=1, seq_length=64, split="1,0,0", binary_head=False,
                                data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="without --split-sentences") as err:
        build_train_valid_test_datasets(no_head, long_docs, [10, 0, 0], FakeWordPiece())
    assert long_docs in str(err.value)
    short_docs = str(tmp_path / "short")
    write_sentences(short_docs, [[list(range(5, 30))], [list(range(30, 60))]])
    train, _, _ = build_train_valid_test_datasets(no_head, short_docs, [10, 0, 0],
                                                  FakeWordPiece())
    assert len(train) == 10 and not any(train[i]["is_random"] for i in range(10))


def test_split_without_usable_documents_is_named(tmp_path):
    # Train has a pair document; the test split's documents have one sentence or a long one.
    documents = [[[5, 6], [7, 9]], [[10, 11], [12, 13]], [[14]], [list(range(20, 620)), [15]]]
    prefix = str(tmp_path / "d")
    write_sentences(prefix, documents)
    cfg = BertDatasetConfig(seed=1, seq_length=16, split="2,0,2",
                            data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"test split of .*documents \[2, 4\)"):
        build_train_valid_test_datasets(cfg, prefix, [10, 0, 5], FakeWordPiece())


def test_bad_settings_and_tokenizers_are_named(tmp_path):
    with pytest.raises(DataError, match="--seq-length"):
        BertDatasetConfig(seed=1, seq_length=4, split="1")
    with pytest.raises(DataError, match="--mask-prob"):
        BertDatasetConfig(seed=1, seq_length=16, split="1", masked_lm_prob=1.5)
    with pytest.raises(DataError, match="--short-seq-prob"):
        BertDatasetConfig(seed=1, seq_length=16, split="1", short_seq_prob=-1)
    with pytest.raises(DataError, match="--split"):
        BertDatasetConfig(seed=1, seq_length=16, split="a,b")

    class NoMask(FakeWordPiece):
        @property
        def mask(self):
            raise NotImplementedError("the fake tokenizer has no MASK token")

    with pytest.raises(DataError, match="BertWordPieceLowerCase"):
        WordPieceVocab.from_tokenizer(NoMask())
    small = make_dataset(tmp_path, unique_corpus(5, [3, 4], min_len=8), num_samples=5,
                         tokenizer=FakeWordPiece(20))
    with pytest.raises(DataError, match="token id .* outside the tokenizer's 20 ids"):
        for i in range(len(small)):
            small[i]
    with pytest.raises(FileNotFoundError, match="missing"):
        build_train_valid_test_datasets(BertDatasetConfig(seed=1, seq_length=16, split="1"),
                                        str(tmp_path / "nothing"), [1, 0, 0], FakeWordPiece())


def test_weighted_blend_and_explicit_split_paths(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    write_sentences(first, unique_corpus(6, [3, 5, 4, 6]))
    write_sentences(second, [[[2000 + t for t in s] for s in doc]
                             for doc in unique_corpus(7, [4, 3, 5])])
    cfg = BertDatasetConfig(seed=1, seq_length=32, split="1,0,0",
                            data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, ["3", first, "1", second],
                                                         [40, 0, 0], FakeWordPiece())
    assert isinstance(train, BlendableDataset) and valid is None and test is None
    assert len(train) == 40
    assert [len(d) >= n for d, n in zip(train.datasets, (31, 11))] == [True, True]
    originals = [np.where(s["labels"] != -1, s["labels"], s["text"])
                 for s in (train[i] for i in range(40))]
    from_second = [bool((o >= 2000).any()) for o in originals]
    assert sum(from_second) == int(np.sum(train.dataset_index == 1)) == 10
    _, valid, _ = build_train_valid_test_datasets(cfg, None, [0, 7, 0], FakeWordPiece(),
                                                  valid_data_path=[second])
    assert isinstance(valid, BertDataset) and valid.documents == (0, 3) and len(valid) >= 7


# ----------------------------------------------------------- rank 0 builds, rank 1 waits


def _two_rank_build(prefix, cache):
    calls = []
    real = bert_dataset.build_samples_mapping

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    bert_dataset.build_samples_mapping = counting
    try:
        cfg = BertDatasetConfig(seed=3, seq_length=16, split="1,0,0", data_cache_path=cache)
        train, _, _ = build_train_valid_test_datasets(cfg, prefix, [20, 0, 0], FakeWordPiece())
    finally:
        bert_dataset.build_samples_mapping = real
    return len(calls), [train[i]["text"].tolist() for i in range(len(train))]


def test_rank0_builds_the_mapping_and_other_ranks_load_it(tmp_path):
    prefix = str(tmp_path / "d")
    write_sentences(prefix, unique_corpus(8, [3, 4, 2, 5]))
    (calls0, samples0), (calls1, samples1) = run_on_ranks(_two_rank_build, 2, prefix,
                                                          str(tmp_path / "cache"))
    assert (calls0, calls1) == (1, 0) and samples0 == samples1 and len(samples0) >= 20

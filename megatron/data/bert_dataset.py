"""The BERT pretraining dataset: sentence pairs with masked tokens, as Megatron-LM builds them.

The data are preprocessed with ``tools/preprocess_data.py --split-sentences``: each document of the
indexed dataset is a run of sequences, one per sentence. A split is a range of *documents* (the
``--split`` fractions apply to the number of documents). The sample mapping, built once by global
rank 0 by the compiled ``build_mapping`` (csrc/data/index_helpers.cpp) and cached as a ``.npy``
file, cuts each document into runs of whole sentences, each with a target length, and shuffles them.
Sample ``i`` is then made from row ``i`` with ``numpy.random.RandomState((seed + i) % 2**32)``, so
it depends only on the seed and the index:

1. with the sentence-order head (``binary_head``) the run is cut into A = its first k sentences and
   B = the rest (k uniform in [1, n - 1]), and A and B are swapped half the time (``is_random``);
   without it A is the whole run and B is empty;
2. the longer of A and B loses a token from its front or back (a coin each time) until both fit
   the target (``truncated``);
3. ``[CLS] A [SEP] B [SEP]`` is masked: candidate words (whole words with ``whole_word_masking``)
   are shuffled and taken until about ``masked_lm_prob`` of the tokens are chosen; each chosen
   token becomes ``[MASK]`` (80 %), stays (10 %) or becomes a random vocabulary id (10 %);
4. everything is padded to ``seq_length``.

:func:`build_train_valid_test_datasets` turns ``--data-path`` (one prefix, or weighted prefixes
blended by :class:`~megatron.data.blendable_dataset.BlendableDataset`), ``--split`` and the sample
counts into the train, valid and test datasets.
"""

import bisect
import logging
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch  # noqa: F401  (loads libc10, which the compiled extension is linked against)

from megatron.data import dataset_utils, object_storage
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import DataError
from megatron.data.indexed_dataset import IndexedDataset, missing_files

try:
    from megatron.data import _index_helpers as _compiled
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as err:  # reported when a BERT dataset is built
    _compiled = None
    _IMPORT_ERROR = err

logger = logging.getLogger(__name__)

# A document with more than one sentence gives no samples when one of them is longer than this
# (kLongSentenceLen in csrc/data/index_helpers.cpp).
LONG_SENTENCE_LEN = 512

# [CLS] and two [SEP]: the mapping's targets count the tokens of A and B only.
NUM_SPECIAL_TOKENS = 3

# Bump when the way the mapping is computed changes, so old caches are not reused.
_INDEX_FORMAT_VERSION = 1
_INDEX_NAMES = ("samples_mapping",)


@dataclass
class BertDatasetConfig:
    """What the BERT datasets need from the command line.

    Attributes:
        seed: ``--seed``; draws the mapping's targets and shuffle and every sample.
        seq_length: ``--seq-length``; every sample is padded to it.
        split: ``--split`` weights of train, valid and test over documents, e.g. ``"969, 30, 1"``.
        data_cache_path: ``--data-cache-path``; None caches in ``cache/`` beside the data.
        masked_lm_prob: ``--mask-prob``, the fraction of tokens to predict.
        short_seq_prob: ``--short-seq-prob``, how often a sample gets a short random target.
        binary_head: False with ``--bert-no-binary-head`` (no sentence pairs, no sentence order).
        whole_word_masking: mask every piece of a word together.
        max_ngrams: longest run of candidate words masked together; n is drawn with probability
            proportional to 1/n (Megatron's ``pretrain_bert.py`` uses 3).
        mmap_bin_files: False with ``--no-mmap-bin-files``: read each ``.bin`` into memory.
        mid_level_dataset_surplus: ``--mid-level-dataset-surplus``: each dataset of a weighted
            blend is built with this fraction more samples than its share.
        object_storage_cache_path: ``--object-storage-cache-path``: where the ``.idx`` files of
            ``msc://`` prefixes are copied (:mod:`megatron.data.object_storage`).
        enable_msc: ``--enable-msc``: ``msc://`` prefixes are read through the Multi-Storage
            Client; without it such a prefix is refused.
    """

    seed: int
    seq_length: int
    split: str
    data_cache_path: Optional[str] = None
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True
    whole_word_masking: bool = True
    max_ngrams: int = 1
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = dataset_utils.BLEND_SURPLUS
    object_storage_cache_path: Optional[str] = None
    enable_msc: bool = False

    def __post_init__(self) -> None:
        dataset_utils.check_blend_surplus(self.mid_level_dataset_surplus)
        if self.seq_length < NUM_SPECIAL_TOKENS + 2:
            raise DataError(f"--seq-length must be at least {NUM_SPECIAL_TOKENS + 2} for BERT "
                            f"([CLS], two [SEP] and two tokens), got {self.seq_length}")
        if not 0 <= self.seed < 2 ** 32:
            raise DataError(f"--seed must be in [0, 2**32) for the BERT dataset, got {self.seed}")
        if not 0.0 <= self.masked_lm_prob <= 1.0:
            raise DataError(f"--mask-prob must be in [0, 1], got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise DataError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.max_ngrams < 1:
            raise DataError(f"max_ngrams must be >= 1, got {self.max_ngrams}")
        dataset_utils.parse_split(self.split)  # reject a bad --split before any file is read

    @property
    def min_num_sent(self) -> int:
        """Sentences a sample needs: two for a pair with the binary head, else one."""
        return 2 if self.binary_head else 1


@dataclass(frozen=True)
class WordPieceVocab:
    """What sample building needs from the tokenizer.

    Attributes:
        ids: every vocabulary id (``list(tokenizer.inv_vocab)``), the pool of random replacements.
        continuation: ``continuation[id]`` is True for a ``##`` piece that continues a word.
        cls, sep, mask, pad: the special ids.
    """

    ids: np.ndarray
    continuation: List[bool]
    cls: int
    sep: int
    mask: int
    pad: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "WordPieceVocab":
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        try:
            inv_vocab = tokenizer.inv_vocab
            specials = [int(tokenizer.cls), int(tokenizer.sep), int(tokenizer.mask),
                        int(tokenizer.pad)]
        except (AttributeError, NotImplementedError) as err:
            raise DataError(f"BERT needs a WordPiece tokenizer with [CLS], [SEP], [MASK], [PAD] "
                            f"and an inv_vocab (--tokenizer-type BertWordPieceLowerCase or "
                            f"BertWordPieceCase); the {name} tokenizer has none: {err}") from None
        ids = np.array(list(inv_vocab.keys()), dtype=np.int64)
        if ids.size == 0 or ids.min() < 0:
            raise DataError(f"the {name} tokenizer's inv_vocab must map ids >= 0 to tokens")
        continuation = [False] * (int(ids.max()) + 1)
        for i, token in inv_vocab.items():
            continuation[int(i)] = str(token).startswith("##")
        return cls(ids, continuation, *specials)


# ------------------------------------------------------------------------------ the mapping


def build_samples_mapping(document_indices: np.ndarray, sizes: np.ndarray, num_epochs: int,
                          max_num_samples: int, max_seq_length: int, short_seq_prob: float,
                          seed: int, min_num_sent: int, verbose: bool = False) -> np.ndarray:
    """The shuffled ``[n, 3]`` rows (first sentence, end sentence, target length) of the samples.

    Args:
        document_indices: int64 document boundaries in sentence numbers (``D + 1`` entries for
            ``D`` documents; a split passes its slice, so the first need not be 0).
        sizes: int32 tokens of every sentence of the indexed dataset.
        num_epochs: most passes over the documents.
        max_num_samples: no pass starts once this many samples exist.
        max_seq_length: the longest target (tokens of A and B, without [CLS] and [SEP]).
        short_seq_prob: how often a target is drawn short, in [2, max_seq_length].
        seed: seeds the target draws (mt19937) and, plus one, the row shuffle (mt19937_64).
        min_num_sent: sentences a sample needs (documents with fewer are skipped).

    Returns:
        uint32 (uint64 beyond 2**32 sentences) array ``[n, 3]``.
    """
    if _compiled is None:
        raise ImportError(f"megatron.data._index_helpers is not built ({_IMPORT_ERROR!r}); BERT "
                          f"needs its build_mapping: run `python setup.py build_ext --inplace`")
    return _compiled.build_mapping(
        np.ascontiguousarray(document_indices, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int32), int(num_epochs), int(max_num_samples),
        int(max_seq_length), float(short_seq_prob), int(seed), bool(verbose), int(min_num_sent))


def eligible_documents(document_indices: np.ndarray, sizes: np.ndarray,
                       min_num_sent: int) -> np.ndarray:
    """bool per document: whether the mapping takes samples from it (same rules as the C++)."""
    bounds = np.asarray(document_indices, dtype=np.int64)
    counts = np.diff(bounds)
    has_long = np.zeros(counts.size, dtype=bool)
    if counts.size:
        long_sentences = np.flatnonzero(
            np.asarray(sizes[bounds[0]:bounds[-1]]) > LONG_SENTENCE_LEN) + bounds[0]
        has_long[np.searchsorted(bounds, long_sentences, side="right") - 1] = True
    return (counts >= min_num_sent) & ~(has_long & (counts > 1))


# ------------------------------------------------------------------------- sample building


def get_a_and_b_segments(sample: List[List[int]], np_rng: np.random.RandomState
                         ) -> Tuple[List[int], List[int], bool]:
    """A = the first k sentences (k uniform in [1, n - 1], no draw when n == 2), B = the rest;
    swapped when a coin (``is_next_random``) says so."""
    n = len(sample)
    a_end = 1
    if n >= 3:
        a_end = int(np_rng.randint(1, n))
    tokens_a = [t for sentence in sample[:a_end] for t in sentence]
    tokens_b = [t for sentence in sample[a_end:] for t in sentence]
    is_next_random = bool(np_rng.random() < 0.5)
    if is_next_random:
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, is_next_random


def truncate_segments(tokens_a: List[int], tokens_b: List[int], max_num_tokens: int,
                      np_rng: np.random.RandomState) -> Tuple[List[int], List[int], bool]:
    """Drop one token at a time from the longer segment (B on a tie), from its front or back by a
    coin, until both fit ``max_num_tokens``. Returns (A, B, truncated)."""
    len_a, len_b = len(tokens_a), len(tokens_b)
    excess = len_a + len_b - int(max_num_tokens)
    if excess <= 0:
        return tokens_a, tokens_b, False
    # One coin per dropped token; drawing them together gives the same stream as one at a time.
    from_front = (np_rng.random(excess) < 0.5).tolist()
    a_lo, a_hi, b_lo, b_hi = 0, len_a, 0, len_b
    for front in from_front:
        if a_hi - a_lo > b_hi - b_lo:
            if front:
                a_lo += 1
            else:
                a_hi -= 1
        elif front:
            b_lo += 1
        else:
            b_hi -= 1
    return tokens_a[a_lo:a_hi], tokens_b[b_lo:b_hi], True


def create_tokens_and_tokentypes(tokens_a: List[int], tokens_b: List[int], cls_id: int,
                                 sep_id: int) -> Tuple[List[int], List[int]]:
    """``[CLS] A [SEP]`` (type 0) then ``B [SEP]`` (type 1) when B is not empty."""
    tokens = [cls_id, *tokens_a, sep_id]
    tokentypes = [0] * len(tokens)
    if tokens_b:
        tokens += [*tokens_b, sep_id]
        tokentypes += [1] * (len(tokens_b) + 1)
    return tokens, tokentypes


def _masking_candidates(tokens: List[int], vocab: WordPieceVocab,
                        whole_word_masking: bool) -> List[List[int]]:
    """Positions grouped into maskable units: every non-special token, or whole words."""
    candidates: List[List[int]] = []
    continuation = vocab.continuation
    for i, token in enumerate(tokens):
        if token == vocab.cls or token == vocab.sep:
            continue
        if whole_word_masking and candidates and continuation[token]:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    return candidates


def _masked_token(token: int, vocab: WordPieceVocab, np_rng: np.random.RandomState) -> int:
    """[MASK] with probability 0.8, else the token itself or a random vocabulary id (0.1 each)."""
    if np_rng.random() < 0.8:
        return vocab.mask
    if np_rng.random() < 0.5:
        return token
    return int(vocab.ids[np_rng.randint(0, len(vocab.ids))])


def create_masked_lm_predictions(tokens: List[int], vocab: WordPieceVocab, masked_lm_prob: float,
                                 max_predictions_per_seq: float, np_rng: np.random.RandomState,
                                 max_ngrams: int = 1, whole_word_masking: bool = True
                                 ) -> Tuple[List[int], List[int], List[int]]:
    """Choose and replace the tokens to predict.

    ``num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))``.
    The candidates (each with its n-gram continuations) are shuffled; for each in turn n is drawn
    (probability proportional to 1/n), shortened while the n-gram would pass ``num_to_predict``,
    and the candidate is skipped if even its 1-gram would, or if it overlaps a chosen one.

    Returns:
        (tokens with the replacements, masked positions in increasing order, their original ids).
    """
    output = list(tokens)
    if masked_lm_prob == 0:
        return output, [], []
    candidates = _masking_candidates(tokens, vocab, whole_word_masking)
    num_to_predict = min(max_predictions_per_seq,
                         max(1, int(round(len(tokens) * masked_lm_prob))))
    ngrams = np.arange(1, max_ngrams + 1, dtype=np.int64)
    pvals = 1.0 / ngrams
    pvals /= pvals.sum(keepdims=True)
    # np_rng.choice(ngrams, p=pvals) draws one uniform number and finds it in the cumulative
    # probabilities; doing that here gives the same n from the same draw, much faster.
    cdf = (pvals / pvals.sum(keepdims=True)).cumsum()
    cdf = (cdf / cdf[-1]).tolist()
    ngram_indexes = [[candidates[i:i + n] for n in range(1, max_ngrams + 1)]
                     for i in range(len(candidates))]
    np_rng.shuffle(ngram_indexes)

    masked: List[Tuple[int, int]] = []
    covered = set()
    for ngram_set in ngram_indexes:
        # Once not one more token fits, the remaining candidates would only draw numbers that
        # nothing uses: stopping here gives the same sample.
        if len(masked) + 1 > num_to_predict:
            break
        n = bisect.bisect_right(cdf, np_rng.random()) + 1
        positions = [i for word in ngram_set[n - 1] for i in word]
        while len(masked) + len(positions) > num_to_predict and n > 1:
            n -= 1
            positions = [i for word in ngram_set[n - 1] for i in word]
        if len(masked) + len(positions) > num_to_predict:
            continue
        if any(i in covered for i in positions):
            continue
        for i in positions:
            covered.add(i)
            output[i] = _masked_token(tokens[i], vocab, np_rng)
            masked.append((i, tokens[i]))
    masked.sort()
    return output, [i for i, _ in masked], [label for _, label in masked]


def pad_and_convert_to_numpy(tokens: List[int], tokentypes: List[int],
                             masked_positions: List[int], masked_labels: List[int], pad_id: int,
                             max_seq_length: int) -> Dict[str, np.ndarray]:
    """``text``, ``types``, ``labels``, ``loss_mask``, ``padding_mask`` as int64 ``[s]``."""
    num_tokens = len(tokens)
    padding = max_seq_length - num_tokens
    if padding < 0:
        raise AssertionError(f"{num_tokens} tokens do not fit seq_length {max_seq_length}")
    text = np.full(max_seq_length, pad_id, dtype=np.int64)
    text[:num_tokens] = tokens
    types = np.zeros(max_seq_length, dtype=np.int64)
    types[:num_tokens] = tokentypes
    padding_mask = np.zeros(max_seq_length, dtype=np.int64)
    padding_mask[:num_tokens] = 1
    labels = np.full(max_seq_length, -1, dtype=np.int64)
    labels[masked_positions] = masked_labels
    loss_mask = np.zeros(max_seq_length, dtype=np.int64)
    loss_mask[masked_positions] = 1
    return {"text": text, "types": types, "labels": labels, "loss_mask": loss_mask,
            "padding_mask": padding_mask}


def build_training_sample(sample: List[List[int]], target_seq_length: int, max_seq_length: int,
                          vocab: WordPieceVocab, masked_lm_prob: float,
                          np_rng: np.random.RandomState, binary_head: bool, max_ngrams: int = 1,
                          whole_word_masking: bool = True) -> Dict[str, np.ndarray]:
    """One sample from a run of sentences (token id lists) and its target length.

    Args:
        sample: the sentences of one mapping row (two or more with ``binary_head``).
        target_seq_length: tokens allowed for A and B together (at most
            ``max_seq_length - 3``).
        max_seq_length: ``--seq-length``, the padded length.
        vocab: special ids, continuation pieces and the random-replacement pool.
        masked_lm_prob: fraction of tokens to predict.
        np_rng: the sample's generator; every draw below comes from it in a fixed order.
        binary_head: build a sentence pair (A, B) with the sentence-order label.
        max_ngrams / whole_word_masking: see :func:`create_masked_lm_predictions`.

    Returns:
        Megatron's keys: ``text``, ``types``, ``labels``, ``is_random``, ``loss_mask``,
        ``padding_mask``, ``truncated`` (int64 numpy arrays; ``is_random`` and ``truncated`` 0-d).
    """
    if binary_head:
        if len(sample) < 2:
            raise AssertionError(f"a sentence pair needs two sentences, got {len(sample)}")
        tokens_a, tokens_b, is_random = get_a_and_b_segments(sample, np_rng)
    else:
        tokens_a, tokens_b, is_random = [t for s in sample for t in s], [], False
    tokens_a, tokens_b, truncated = truncate_segments(tokens_a, tokens_b, target_seq_length,
                                                      np_rng)
    tokens, tokentypes = create_tokens_and_tokentypes(tokens_a, tokens_b, vocab.cls, vocab.sep)
    tokens, positions, labels = create_masked_lm_predictions(
        tokens, vocab, masked_lm_prob, masked_lm_prob * target_seq_length, np_rng, max_ngrams,
        whole_word_masking)
    out = pad_and_convert_to_numpy(tokens, tokentypes, positions, labels, vocab.pad,
                                   max_seq_length)
    out["is_random"] = np.array(int(is_random), dtype=np.int64)
    out["truncated"] = np.array(int(truncated), dtype=np.int64)
    return out


# -------------------------------------------------------------------------------- dataset


class BertDataset(torch.utils.data.Dataset):
    """One split (a range of documents) of a sentence-split indexed dataset as BERT samples.

    Args:
        name: split name (``train``, ``valid``, ``test``), part of the cache description.
        path_prefix: the data prefix; its ``.bin``/``.idx`` sizes and mtimes key the cache, and
            the default cache folder is ``cache/`` beside it.
        indexed_dataset: the reader (``document_indices``, ``sequence_lengths``, slicing).
        documents: ``(begin, end)`` document ids of the split.
        num_samples: samples wanted; whole passes over the documents are mapped until at least
            this many exist (0: one pass).
        config: seed, lengths, probabilities, cache folder.
        tokenizer: the WordPiece tokenizer the data were preprocessed with.
    """

    def __init__(self, name: str, path_prefix: str, indexed_dataset, documents: Tuple[int, int],
                 num_samples: int, config: BertDatasetConfig, tokenizer):
        self.name = name
        self.path_prefix = path_prefix
        self.indexed_dataset = indexed_dataset
        self.documents = (int(documents[0]), int(documents[1]))
        self.num_samples = int(num_samples)
        self.seed = int(config.seed)
        self.max_seq_length = int(config.seq_length)
        self.masked_lm_prob = float(config.masked_lm_prob)
        self.binary_head = bool(config.binary_head)
        self.whole_word_masking = bool(config.whole_word_masking)
        self.max_ngrams = int(config.max_ngrams)
        self.vocab = WordPieceVocab.from_tokenizer(tokenizer)
        self._check_documents(config.min_num_sent)
        self.cache_dir = config.data_cache_path or os.path.join(
            os.path.dirname(os.path.abspath(path_prefix)), "cache")
        self.description = self._description(config)
        self._load_mapping()

    def _document_bounds(self) -> np.ndarray:
        begin, end = self.documents
        return np.asarray(self.indexed_dataset.document_indices[begin:end + 1], dtype=np.int64)

    def _check_documents(self, min_num_sent: int) -> None:
        begin, end = self.documents
        if end <= begin:
            raise DataError(f"{self.name} split of {self.path_prefix} has no documents")
        eligible = eligible_documents(self._document_bounds(),
                                      self.indexed_dataset.sequence_lengths, min_num_sent)
        if not eligible.any():
            raise DataError(
                f"{self.name} split of {self.path_prefix} (documents [{begin}, {end})) has no "
                f"document with at least {min_num_sent} sentence(s) and no sentence over "
                f"{LONG_SENTENCE_LEN} tokens, so it gives no BERT samples; expected data from "
                f"tools/preprocess_data.py --split-sentences")

    def _description(self, config: BertDatasetConfig) -> dict:
        prefix = os.path.abspath(self.path_prefix)
        num_epochs, max_num_samples = self._epochs_and_samples()
        return {
            "class": "BertDataset",
            "index_format": _INDEX_FORMAT_VERSION,
            "path_prefix": prefix,
            "split": self.name,
            "documents": list(self.documents),
            "num_documents": int(len(self.indexed_dataset.document_indices) - 1),
            "num_sequences": int(len(self.indexed_dataset.sequence_lengths)),
            "num_epochs": num_epochs,
            "max_num_samples": max_num_samples,
            "max_seq_length": self.max_seq_length - NUM_SPECIAL_TOKENS,
            "short_seq_prob": float(config.short_seq_prob),
            "min_num_sent": config.min_num_sent,
            "binary_head": self.binary_head,
            "seed": self.seed,
            "bin": dataset_utils.file_signature(prefix + ".bin"),
            "idx": dataset_utils.file_signature(prefix + ".idx"),
        }

    def _epochs_and_samples(self) -> Tuple[int, int]:
        """As many passes as it takes to reach ``num_samples``; one pass when none are asked."""
        if self.num_samples > 0:
            return int(np.iinfo(np.int32).max) - 1, self.num_samples
        return 1, int(np.iinfo(np.int64).max) - 1

    def _build_mapping(self) -> Dict[str, np.ndarray]:
        d = self.description
        mapping = build_samples_mapping(
            self._document_bounds(), self.indexed_dataset.sequence_lengths, d["num_epochs"],
            d["max_num_samples"], d["max_seq_length"], d["short_seq_prob"], d["seed"],
            d["min_num_sent"])
        logger.info("%s split of %s: %d BERT samples from documents [%d, %d)", self.name,
                    self.path_prefix, mapping.shape[0], *self.documents)
        return {"samples_mapping": mapping}

    def _load_mapping(self) -> None:
        arrays = dataset_utils.load_or_build_cached(
            self.cache_dir, f"BertDataset-{self.name}", self.description, _INDEX_NAMES,
            self._build_mapping)
        self.samples_mapping = arrays["samples_mapping"]

    def __getstate__(self):
        # Workers reopen the cached file instead of receiving a copy of the mapping.
        state = dict(self.__dict__)
        state.pop("samples_mapping", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        path = dataset_utils.cached_paths(self.cache_dir, f"BertDataset-{self.name}",
                                          self.description, _INDEX_NAMES)["samples_mapping"]
        self.samples_mapping = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return int(self.samples_mapping.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for the {n} samples of {self.name}")
        idx = int(idx) % n
        start, end, target = (int(x) for x in self.samples_mapping[idx])
        sample = [s.tolist() for s in self.indexed_dataset[start:end]]
        self._check_ids(sample, start)
        np_rng = np.random.RandomState(seed=(self.seed + idx) % 2 ** 32)
        return build_training_sample(sample, target, self.max_seq_length, self.vocab,
                                     self.masked_lm_prob, np_rng, self.binary_head,
                                     self.max_ngrams, self.whole_word_masking)

    def _check_ids(self, sample: List[List[int]], start: int) -> None:
        limit = len(self.vocab.continuation)
        for k, sentence in enumerate(sample):
            if sentence and max(sentence) >= limit:
                raise DataError(
                    f"{self.path_prefix}: sequence {start + k} holds token id {max(sentence)}, "
                    f"outside the tokenizer's {limit} ids; preprocess the data with the same "
                    f"--vocab-file as training")


# ------------------------------------------------------------------------ building the splits


def _open_sentence_dataset(prefix: str, flag: str, binary_head: bool,
                           mmap: bool = True,
                           object_storage_cache: Optional[str] = None,
                           enable_msc: bool = False) -> IndexedDataset:
    """The indexed dataset of ``prefix``, rejected when it cannot hold BERT samples."""
    object_storage.check_enabled(prefix, flag, enable_msc)
    missing = missing_files(prefix)
    if missing:
        raise FileNotFoundError(f"{flag}: data prefix {prefix!r} does not exist (missing "
                                f"{', '.join(missing)}); expected PREFIX.bin and PREFIX.idx as "
                                f"written by tools/preprocess_data.py --split-sentences")
    indexed = IndexedDataset(prefix, mmap=mmap, object_storage_cache=object_storage_cache)
    counts = np.diff(np.asarray(indexed.document_indices, dtype=np.int64))
    dataset_utils.check_has_documents(prefix, counts.size, flag)
    sizes = indexed.sequence_lengths
    most = int(counts.max()) if counts.size else 0
    if most == 0:
        raise DataError(f"{flag}: {prefix} holds no sentences ({counts.size} documents)")
    if binary_head and most < 2:
        raise DataError(
            f"{flag}: no document of {prefix} has more than one sentence ({counts.size} "
            f"documents of one sequence each); BERT's sentence-order (binary) head needs "
            f"sentence pairs: preprocess with tools/preprocess_data.py --split-sentences, or "
            f"train with --bert-no-binary-head")
    longest = int(sizes.max()) if len(sizes) else 0
    if most < 2 and longest > LONG_SENTENCE_LEN:
        raise DataError(
            f"{flag}: {prefix} looks preprocessed without --split-sentences: every document is "
            f"one sequence, the longest {longest} tokens; BERT samples are built from sentences "
            f"(expected sequences of at most {LONG_SENTENCE_LEN} tokens)")
    return indexed


def _split_documents(indexed: IndexedDataset, split: str,
                     whole: bool) -> List[Optional[Tuple[int, int]]]:
    """The (begin, end) document ids of train, valid and test (all documents when ``whole``)."""
    n = len(indexed.document_indices) - 1
    if whole:
        return [(0, n)] * 3
    return [None if b is None or b[1] <= b[0] else b for b in dataset_utils.split_bounds(split, n)]


def _build_split(index: int, prefixes: List[str], weights: Optional[List[float]],
                 documents: Dict[str, List[Optional[Tuple[int, int]]]],
                 opened: Dict[str, IndexedDataset], num_samples: int,
                 config: BertDatasetConfig, tokenizer):
    """One split: a BertDataset for one unweighted prefix, else a blend of the prefixes' splits."""
    name = dataset_utils.SPLIT_NAMES[index]
    if weights is None:
        docs = documents[prefixes[0]][index]
        if docs is None:
            return None
        return BertDataset(name, prefixes[0], opened[prefixes[0]], docs, num_samples, config,
                           tokenizer)
    # As for GPT: a dataset without this split, or of weight 0, leaves the blend.
    present = [(p, w) for p, w in zip(prefixes, weights)
               if documents[p][index] is not None and w > 0]
    if not present or num_samples <= 0:
        return None
    normalized = dataset_utils.normalize_weights([w for _, w in present])
    per_dataset = dataset_utils.blend_num_samples(normalized, num_samples,
                                                  config.mid_level_dataset_surplus)
    parts = [BertDataset(name, p, opened[p], documents[p][index], n, config, tokenizer)
             for (p, _), n in zip(present, per_dataset)]
    size = sum(math.ceil(num_samples * w) for w in normalized)
    return BlendableDataset(parts, normalized, size)


def _build_from_blend(data_path, num_samples: Sequence[int], config: BertDatasetConfig,
                      tokenizer, flag: str, only: Optional[int] = None) -> List:
    prefixes, weights = dataset_utils.parse_data_path(data_path, flag)
    opened = {p: _open_sentence_dataset(p, flag, config.binary_head, config.mmap_bin_files,
                                        config.object_storage_cache_path, config.enable_msc)
              for p in prefixes}
    whole = only is not None
    documents = {p: _split_documents(opened[p], config.split, whole) for p in prefixes}
    if not whole and num_samples[0] > 0:
        for p in prefixes:
            if documents[p][0] is None:
                raise DataError(f"--split {config.split!r} leaves the train split of {p!r} empty "
                                f"({len(opened[p].document_indices) - 1} documents); give train "
                                f"a larger share")
    for p in prefixes:
        logger.info("%s: %d documents; train/valid/test document ranges %s", p,
                    len(opened[p].document_indices) - 1, documents[p])
    out: List = [None, None, None]
    for i in (range(3) if only is None else [only]):
        out[i] = _build_split(i, prefixes, weights, documents, opened, int(num_samples[i]),
                              config, tokenizer)
    return out


def build_train_valid_test_datasets(config: BertDatasetConfig,
                                    data_path: Union[str, Sequence[str], None],
                                    train_valid_test_num_samples: Sequence[int], tokenizer,
                                    train_data_path: Union[str, Sequence[str], None] = None,
                                    valid_data_path: Union[str, Sequence[str], None] = None,
                                    test_data_path: Union[str, Sequence[str], None] = None):
    """The (train, valid, test) BERT datasets, each possibly None.

    Args:
        config: seed, lengths, probabilities, ``--split``, cache folder.
        data_path: ``--data-path``: one prefix, or ``W1 PREFIX1 W2 PREFIX2 ...``; each prefix's
            documents are split by ``--split``. With weights each split blends the prefixes'
            splits, each dataset asked for ``ceil(ceil(total * w) * 1.005)`` samples.
        train_valid_test_num_samples: samples wanted per split.
        tokenizer: the WordPiece tokenizer (``cls``, ``sep``, ``mask``, ``pad``, ``inv_vocab``).
        train_data_path / valid_data_path / test_data_path: ``--train-data-path`` etc.: every
            document of these prefixes goes to that split instead of ``--data-path``/``--split``.
    """
    num_samples = [int(n) for n in train_valid_test_num_samples]
    if len(num_samples) != 3:
        raise DataError(f"need train, valid and test sample counts, got {num_samples}")
    return dataset_utils.build_splits(
        num_samples, data_path, (train_data_path, valid_data_path, test_data_path),
        lambda path, flag, only: _build_from_blend(path, num_samples, config, tokenizer, flag,
                                                   only=only))

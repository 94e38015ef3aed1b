"""Index arrays of the GPT and blended datasets (FORMATS.md sections 3 and 4).

Everything here is a pure function of its inputs, so the same data and seed give the same samples
in the same order as Megatron-LM:

* :func:`num_epochs`, :func:`separate_last_epoch`: how many passes over a split are needed.
* :func:`build_doc_idx`, :func:`build_shuffle_idx`: the two shuffles, drawn from one
  ``numpy.random.RandomState(seed)`` in the documented order.
* :func:`build_sample_idx`, :func:`build_blending_indices`: the two sequential walks. They run in
  the compiled ``megatron.data._index_helpers`` (csrc/data/index_helpers.cpp) when it is built;
  otherwise the numpy versions below, which give identical arrays, are used after one warning.
* :func:`build_gpt_indices`: all three GPT arrays for one split.
"""

import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import torch  # noqa: F401  (loads libc10, which the compiled extension is linked against)

try:
    from megatron.data import _index_helpers as _compiled
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as err:  # the extension was not built; numpy versions are used instead
    _compiled = None
    _IMPORT_ERROR = err

_WARNED = False

# The last epoch gets its own shuffle when it would contribute fewer than this fraction of an
# epoch's samples, so its few samples are spread over the whole run's tail rather than mixed in.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80

_INT32_MAX = np.iinfo(np.int32).max


def compiled_available() -> bool:
    """Whether the compiled index helpers could be imported."""
    return _compiled is not None


def _use_compiled(use_compiled: Optional[bool]) -> bool:
    global _WARNED
    if use_compiled is None:
        use_compiled = _compiled is not None
        if not use_compiled and not _WARNED:
            _WARNED = True
            warnings.warn(
                "megatron.data._index_helpers is not built (" + repr(_IMPORT_ERROR) + "); the "
                "GPT and blended dataset indices are built with slower numpy code instead. Build "
                "it with `python setup.py build_ext --inplace`.", RuntimeWarning, stacklevel=3)
    elif use_compiled and _compiled is None:
        raise ImportError(f"megatron.data._index_helpers is not built: {_IMPORT_ERROR!r}")
    return use_compiled


# ----------------------------------------------------------------------------- sample index


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, use_compiled: Optional[bool] = None) -> np.ndarray:
    """Start of every sample as (position in ``doc_idx``, token offset); FORMATS.md 3.7.

    Args:
        sizes: int32 token count of every sequence of the indexed dataset.
        doc_idx: int32 sequence ids in the order they are read (see :func:`build_doc_idx`).
        seq_length: S; each sample holds S + 1 tokens and shares its last one with the next.
        num_epochs: E, the number of times ``doc_idx`` lists each sequence of the split.
        tokens_per_epoch: T, the tokens of the split's sequences.
        use_compiled: force (True) or forbid (False) the compiled helper; None picks it when built.

    Returns:
        ``[num_samples + 1, 2]`` array, num_samples = (E*T - 1) // S; int32 unless ``doc_idx``
        is too long for int32, then int64.
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int32)
    if _use_compiled(use_compiled):
        return _compiled.build_sample_idx(sizes, doc_idx, int(seq_length), int(num_epochs),
                                          int(tokens_per_epoch))
    return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def build_sample_idx_numpy(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                           num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """The numpy body of :func:`build_sample_idx`, same result as the compiled walk.

    Sample s ends on (and sample s + 1 starts at) token ``s * S`` of the stream formed by
    concatenating the sequences of ``doc_idx``; its row holds the position in ``doc_idx`` of the
    sequence containing that token and the token's offset inside it. A token that is the last of
    its sequence stays in that sequence (offset = length - 1), and empty sequences never hold one,
    as in the walk. Row 0 is (0, 0) whatever the first sequence's length.
    """
    if seq_length <= 0:
        raise ValueError("build_sample_idx: seq_length must be > 0")
    num_samples = (int(num_epochs) * int(tokens_per_epoch) - 1) // int(seq_length)
    if num_samples < 0:
        raise ValueError("build_sample_idx: no tokens")
    if doc_idx.size and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= sizes.size):
        bad = int(np.flatnonzero((doc_idx < 0) | (doc_idx >= sizes.size))[0])
        raise ValueError(f"build_sample_idx: doc_idx[{bad}] = {int(doc_idx[bad])} is not a "
                         f"sequence id in [0, {sizes.size})")
    wide = doc_idx.size > _INT32_MAX or (sizes.size > 0 and int(sizes.max()) > _INT32_MAX)
    out_dtype = np.int64 if wide else np.int32
    # starts[k]: stream position of the first token of doc_idx[k]; starts[-1]: tokens in total.
    starts = np.zeros(doc_idx.size + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=starts[1:])
    ends = np.arange(1, num_samples + 1, dtype=np.int64) * int(seq_length)
    if num_samples > 0 and ends[-1] >= starts[-1]:
        raise RuntimeError("build_sample_idx: ran past the end of doc_idx; tokens_per_epoch does "
                           "not match the document sizes")
    doc_pos = np.searchsorted(starts, ends, side="right") - 1
    result = np.empty((num_samples + 1, 2), dtype=out_dtype)
    result[0] = 0
    result[1:, 0] = doc_pos
    result[1:, 1] = ends - starts[doc_pos]
    return result


# ------------------------------------------------------------------------------ blending


def build_blending_indices(weights: Sequence[float], size: int,
                           use_compiled: Optional[bool] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, each blended sample comes from; FORMATS.md 4.

    For sample i, with x = max(i, 1), the dataset with the largest ``w_d * x - count_d`` is
    chosen (ties: lowest index), so every prefix of the blend holds each dataset within about one
    sample of its share.

    Args:
        weights: one weight per dataset, already normalised to sum to 1.
        size: number of blended samples.
        use_compiled: force (True) or forbid (False) the compiled helper; None picks it when built.

    Returns:
        ``(dataset_index uint8 [size], dataset_sample_index int64 [size])``.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if not 1 <= weights.size <= 255:
        raise ValueError(f"blending needs 1 to 255 datasets, got {weights.size}")
    size = int(size)
    if size < 0:
        raise ValueError(f"blending size must be >= 0, got {size}")
    if _use_compiled(use_compiled):
        dataset_index = np.zeros(size, dtype=np.uint8)
        dataset_sample_index = np.zeros(size, dtype=np.int64)
        _compiled.build_blending_indices(dataset_index, dataset_sample_index, weights,
                                         int(weights.size), size)
        return dataset_index, dataset_sample_index
    return build_blending_indices_numpy(weights, size)


def build_blending_indices_numpy(weights: Sequence[float],
                                 size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The Python body of :func:`build_blending_indices` (same float64 arithmetic, same result)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    candidates = range(1, len(w))
    for i in range(size):
        x = float(max(i, 1))
        best, best_error = 0, w[0] * x - counts[0]
        for d in candidates:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


# ------------------------------------------------------------------ epochs and the shuffles


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E >= 1 with E * T >= num_samples * S + 1 (each sample reads S + 1 tokens)."""
    if tokens_per_epoch <= 0:
        raise ValueError(f"a split with {tokens_per_epoch} tokens cannot give samples")
    needed = int(num_samples) * int(seq_length) + 1
    return max(1, -(-needed // int(tokens_per_epoch)))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                        epochs: int) -> Tuple[bool, int]:
    """Whether the last epoch is shuffled on its own, and the samples of the epochs before it.

    Returns:
        ``(separate, num_samples_sans_last_epoch)``; the count is only meaningful when E > 1.
    """
    if epochs == 1:
        return False, 0
    sans = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    last = num_samples - sans
    per_epoch = (tokens_per_epoch - 1) // seq_length
    if not 0 <= last <= per_epoch + 1:
        raise AssertionError(f"last epoch would give {last} samples; an epoch gives {per_epoch}")
    return last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch), sans


def build_doc_idx(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                  separate_last: bool) -> np.ndarray:
    """The split's sequence ids repeated ``epochs`` times and shuffled (int32); FORMATS.md 3.6.

    With ``separate_last`` the first E - 1 epochs are shuffled together, then the last one alone.
    """
    if not separate_last or epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(num_samples: int, total_size: int,
                      rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``arange(total_size)`` whose first ``num_samples`` entries permute
    ``[0, num_samples)`` and whose rest permute ``[num_samples, total_size)``; FORMATS.md 3.8.

    uint32 unless ``total_size`` is too large for it, then int64.
    """
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                      seq_length: int, seed: int,
                      use_compiled: Optional[bool] = None
                      ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(doc_idx, sample_idx, shuffle_idx)`` for one split of a GPT dataset; FORMATS.md 3.3-3.8.

    Args:
        sizes: int32 token count of every sequence of the indexed dataset.
        documents: the split's sequence ids (a contiguous range for a ``--split`` split).
        num_samples: samples wanted from this split.
        seq_length: S (``--seq-length``).
        seed: ``--seed``; one ``RandomState(seed)`` draws the document shuffle(s), then the
            sample shuffle(s).
    """
    sizes = np.asarray(sizes)
    documents = np.asarray(documents, dtype=np.int32)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate, sans = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, epochs)
    rng = np.random.RandomState(seed)
    doc_idx = build_doc_idx(documents, epochs, rng, separate)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch,
                                  use_compiled=use_compiled)
    built = sample_idx.shape[0] - 1
    shuffle_idx = build_shuffle_idx(sans if separate else built, built, rng)
    return doc_idx, sample_idx, shuffle_idx

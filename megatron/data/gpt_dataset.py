"""The GPT pretraining dataset: fixed-length samples cut from shuffled documents.

A :class:`GPTDataset` views one split of an indexed dataset (``.bin``/``.idx``). Like Megatron's
GPT dataset it counts and splits *sequences*, the entries of the indexed dataset: for data
preprocessed without ``--split-sentences`` a sequence is a whole document (an empty document has
none), so "document" below means such a sequence. Sample i of a split is the S + 1 tokens
(``--seq-length`` S) starting where sample i - 1 ended, in the order given by the shuffled
document index; the samples themselves are then read in shuffled order (FORMATS.md section 3).
The three index arrays are built once by global rank 0 and cached as ``.npy`` files
(see :func:`megatron.data.dataset_utils.load_or_build_cached`).

:func:`build_train_valid_test_datasets` turns ``--data-path`` (one prefix, or weighted prefixes,
blended by :class:`~megatron.data.blendable_dataset.BlendableDataset`), ``--split`` and the sample
counts into the train, valid and test datasets.
"""

import logging
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from megatron.data import (dataset_utils, document_masks, fim_dataset, index_builders,
                           object_storage, sequences_per_dataset)
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.indexed_dataset import IndexedDataset, missing_files
from megatron.data.mock_dataset import MockGPTDataset
from megatron.data.dataset_utils import DataError

logger = logging.getLogger(__name__)

# Bump when the way the indices are computed changes, so old caches are not reused.
_INDEX_FORMAT_VERSION = 1
_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


@dataclass
class GPTDatasetConfig:
    """What the GPT datasets need from the command line.

    Attributes:
        seed: ``--seed``; draws the document and sample shuffles.
        seq_length: ``--seq-length``; a sample holds ``seq_length + 1`` tokens.
        split: ``--split`` weights of train, valid and test, e.g. ``"969, 30, 1"``.
        data_cache_path: ``--data-cache-path``; None caches in ``cache/`` beside the data.
        reset_position_ids / reset_attention_mask / eod_mask_loss: the batch-mask flags of the
            same names, used by
            :func:`~megatron.data.dataset_utils.get_ltor_masks_and_position_ids`.
        mock: ``--mock-data``; synthetic tokens instead of files.
        vocab_size: the tokenizer's vocabulary size: of the synthetic tokens with ``mock``; with
            ``per_dataset_sequences_path`` it gives the token dtype.
        mmap_bin_files: False with ``--no-mmap-bin-files``: read each ``.bin`` into memory
            instead of memory-mapping it (the same tokens).
        mid_level_dataset_surplus: ``--mid-level-dataset-surplus``: each dataset of a weighted
            blend is built with this fraction more samples than its share.
        fim: with ``--fim-data``, the resolved
            :class:`~megatron.data.fim_dataset.FIMConfig`: each split's datasets are then
            :class:`GPTFIMDataset` (same indices and cache).
        per_dataset_sequences_path: ``--per-dataset-sequences-path``: a JSON file of each
            prefix's sequence and document counts, used instead of reading the ``.idx`` headers
            (:mod:`megatron.data.sequences_per_dataset`); the samples are the same.
        inter_document_masking: ``--dataloader-inter-document-masking``: samples also carry
            ``cu_seqlens``, their document boundaries (:mod:`megatron.data.document_masks`).
        object_storage_cache_path: ``--object-storage-cache-path``: where the ``.idx`` files of
            ``msc://`` prefixes are copied (:mod:`megatron.data.object_storage`).
        enable_msc: ``--enable-msc``: ``msc://`` prefixes are read through the Multi-Storage
            Client; without it such a prefix is refused.
    """

    seed: int = 1234
    seq_length: int = 1024
    split: str = "969, 30, 1"
    data_cache_path: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    mock: bool = False
    mmap_bin_files: bool = True
    vocab_size: Optional[int] = None
    fim: Optional[fim_dataset.FIMConfig] = None
    mid_level_dataset_surplus: float = dataset_utils.BLEND_SURPLUS
    per_dataset_sequences_path: Optional[str] = None
    inter_document_masking: bool = False
    object_storage_cache_path: Optional[str] = None
    enable_msc: bool = False

    def __post_init__(self) -> None:
        dataset_utils.check_blend_surplus(self.mid_level_dataset_surplus)
        if self.seq_length <= 0:
            raise DataError(f"--seq-length must be > 0, got {self.seq_length}")
        dataset_utils.parse_split(self.split)  # reject a bad --split before any file is read
        if self.mock and (self.vocab_size is None or self.vocab_size <= 0):
            raise DataError(f"--mock-data needs a vocabulary size > 0, got {self.vocab_size}")
        if self.mock and self.fim is not None:
            raise DataError("--fim-data permutes the text of --data-path samples; --mock-data "
                            "has no text")


class GPTDataset(torch.utils.data.Dataset):
    """One split of an indexed dataset as ``{"text": int64 [seq_length + 1]}`` samples.

    Args:
        name: split name (``train``, ``valid``, ``test``), part of the cache description.
        path_prefix: the data prefix; its ``.bin``/``.idx`` sizes and mtimes key the cache, and
            the default cache folder is ``cache/`` beside it.
        indexed_dataset: the reader (``sequence_lengths`` and ``get(idx, offset, length)``).
        documents: the split's sequence ids.
        num_samples: samples wanted; the dataset holds at least this many (whole epochs).
        config: seed, sequence length and cache folder.
    """

    def __init__(self, name: str, path_prefix: str, indexed_dataset, documents: np.ndarray,
                 num_samples: int, config: GPTDatasetConfig):
        self.name = name
        self.path_prefix = path_prefix
        self.indexed_dataset = indexed_dataset
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = int(num_samples)
        self.seq_length = int(config.seq_length)
        self.inter_document_masking = bool(config.inter_document_masking)
        if self.documents.size == 0:
            raise DataError(f"{name} split of {path_prefix} has no documents")
        sizes = indexed_dataset.sequence_lengths
        if int(np.sum(sizes[self.documents], dtype=np.int64)) == 0:
            raise DataError(f"{name} split of {path_prefix} ({self.documents.size} documents) "
                             f"holds no tokens")
        self.cache_dir = config.data_cache_path or os.path.join(
            os.path.dirname(os.path.abspath(path_prefix)), "cache")
        self.description = self._description(config.seed)
        self._load_indices()

    def _description(self, seed: int) -> dict:
        prefix = os.path.abspath(self.path_prefix)
        docs = self.documents
        contiguous = bool(docs.size and np.array_equal(
            docs, np.arange(docs[0], docs[0] + docs.size, dtype=np.int32)))
        return {
            "class": "GPTDataset",
            "index_format": _INDEX_FORMAT_VERSION,
            "path_prefix": prefix,
            "split": self.name,
            "documents": ([int(docs[0]), int(docs[-1]) + 1] if contiguous else
                          dataset_utils.description_hash({"ids": docs.tolist()})[1]),
            "num_sequences": int(len(self.indexed_dataset.sequence_lengths)),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": int(seed),
            "bin": dataset_utils.file_signature(prefix + ".bin"),
            "idx": dataset_utils.file_signature(prefix + ".idx"),
        }

    def _build_indices(self) -> Dict[str, np.ndarray]:
        doc_idx, sample_idx, shuffle_idx = index_builders.build_gpt_indices(
            self.indexed_dataset.sequence_lengths, self.documents, self.num_samples,
            self.seq_length, self.description["seed"])
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def _load_indices(self) -> None:
        arrays = dataset_utils.load_or_build_cached(
            self.cache_dir, f"GPTDataset-{self.name}", self.description, _INDEX_NAMES,
            self._build_indices)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __getstate__(self):
        # Workers reopen the cached files instead of receiving copies of the arrays.
        state = dict(self.__dict__)
        for name in _INDEX_NAMES:
            state.pop(name, None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        paths = dataset_utils.cached_paths(self.cache_dir, f"GPTDataset-{self.name}",
                                           self.description, _INDEX_NAMES)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.load(paths[n], mmap_mode="r") for n in _INDEX_NAMES)

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def _parts(self, idx: int) -> List[np.ndarray]:
        """The token runs of sample ``idx``, one per document it draws from, in order."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for the {n} samples of {self.name}")
        built = int(self.shuffle_idx[idx])
        first_pos, first_offset = (int(x) for x in self.sample_idx[built])
        last_pos, last_offset = (int(x) for x in self.sample_idx[built + 1])
        read = self.indexed_dataset.get
        if first_pos == last_pos:
            return [read(int(self.doc_idx[first_pos]), offset=first_offset,
                         length=last_offset - first_offset + 1)]
        parts = [read(int(self.doc_idx[first_pos]), offset=first_offset)]
        parts += [read(int(self.doc_idx[p])) for p in range(first_pos + 1, last_pos)]
        parts.append(read(int(self.doc_idx[last_pos]), length=last_offset + 1))
        return parts

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        parts = self._parts(idx)
        text = parts[0] if len(parts) == 1 else np.concatenate(parts)
        sample = {"text": np.array(text, dtype=np.int64)}
        if self.inter_document_masking:
            sample["cu_seqlens"] = document_masks.document_cu_seqlens(
                [len(p) for p in parts], self.seq_length)
        return sample


class GPTFIMDataset(GPTDataset):
    """A :class:`GPTDataset` whose samples are rewritten for fill-in-the-middle
    (``--fim-data``, :func:`megatron.data.fim_dataset.fim_sample`); it shares the plain dataset's
    indices and cache. ``fim`` is the resolved :class:`~megatron.data.fim_dataset.FIMConfig`."""

    def __init__(self, name: str, path_prefix: str, indexed_dataset, documents: np.ndarray,
                 num_samples: int, config: GPTDatasetConfig, fim: fim_dataset.FIMConfig):
        super().__init__(name, path_prefix, indexed_dataset, documents, num_samples, config)
        self.fim = fim

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        text = super().__getitem__(idx)["text"]
        rng = fim_dataset.sample_rng(self.description["seed"], idx % len(self))
        return {"text": fim_dataset.fim_sample(text, self.fim, rng)}


# ------------------------------------------------------------------------ building the splits


def _open_indexed_dataset(prefix: str, flag: str, mmap: bool = True,
                          config: Optional[GPTDatasetConfig] = None,
                          table: Optional[dict] = None) -> IndexedDataset:
    """The indexed dataset of ``prefix``; with ``table`` (the loaded
    ``--per-dataset-sequences-path``), opened from its counts instead of its header."""
    object_storage.check_enabled(prefix, flag, config is not None and config.enable_msc)
    missing = missing_files(prefix)
    if missing:
        raise FileNotFoundError(f"{flag}: data prefix {prefix!r} does not exist (missing "
                                f"{', '.join(missing)}); expected PREFIX.bin and PREFIX.idx as "
                                f"written by tools/preprocess_data.py")
    cache = None if config is None else config.object_storage_cache_path
    if table is None:
        return IndexedDataset(prefix, mmap=mmap, object_storage_cache=cache)
    path = config.per_dataset_sequences_path
    return IndexedDataset(prefix, mmap=mmap, object_storage_cache=cache,
                          sequences_per_dataset=sequences_per_dataset.counts_for(table, path,
                                                                                 prefix),
                          dtype_code=sequences_per_dataset.token_dtype_code(config.vocab_size),
                          source=f"{sequences_per_dataset.FLAG} {path}")


def _split_documents(indexed, split: str, whole: bool) -> List[Optional[np.ndarray]]:
    """The sequence ids of train, valid and test (all of them for each when ``whole``)."""
    n = len(indexed)
    if whole:
        return [np.arange(n, dtype=np.int32)] * 3
    out = []
    for bounds in dataset_utils.split_bounds(split, n):
        if bounds is None or bounds[1] <= bounds[0]:
            out.append(None)
        else:
            out.append(np.arange(bounds[0], bounds[1], dtype=np.int32))
    return out


def _gpt_dataset(name, prefix, indexed, docs, num_samples, config: GPTDatasetConfig):
    """A GPTDataset, or its FIM form with ``config.fim``."""
    if config.fim is None:
        return GPTDataset(name, prefix, indexed, docs, num_samples, config)
    return GPTFIMDataset(name, prefix, indexed, docs, num_samples, config, config.fim)


def _build_split(index: int, prefixes: List[str], weights: Optional[List[float]],
                 documents: Dict[str, List[Optional[np.ndarray]]],
                 opened: Dict[str, IndexedDataset],
                 num_samples: int, config: GPTDatasetConfig, one_epoch: bool = False):
    """One split: a GPTDataset for one unweighted prefix, else a blend of the prefixes' splits.
    ``one_epoch`` (``--full-validation``): the split's samples of exactly one epoch."""
    name = dataset_utils.SPLIT_NAMES[index]
    if one_epoch and weights is not None:
        raise DataError(f"--full-validation reads the {name} data whole, once; a weighted blend "
                         f"({len(prefixes)} prefixes) has no such end: give one prefix, or "
                         f"unweighted --valid-data-path prefixes with --multiple-validation-sets")
    if weights is None:
        prefix = prefixes[0]
        docs = documents[prefix][index]
        if docs is None:
            return None
        return _gpt_dataset(name, prefix, opened[prefix], docs, num_samples, config)
    # A dataset too small to have this split leaves it, and the others share its weight. A
    # dataset of weight 0 is left out too: the greedy blend breaks ties towards the lowest index
    # and could otherwise draw from it.
    present = [(p, w) for p, w in zip(prefixes, weights)
               if documents[p][index] is not None and w > 0]
    if not present or num_samples <= 0:
        return None
    normalized = dataset_utils.normalize_weights([w for _, w in present])
    per_dataset = dataset_utils.blend_num_samples(normalized, num_samples,
                                                  config.mid_level_dataset_surplus)
    parts = [_gpt_dataset(name, p, opened[p], documents[p][index], n, config)
             for (p, _), n in zip(present, per_dataset)]
    # The blend's length: each dataset's share rounded up (at least the samples wanted).
    size = sum(math.ceil(num_samples * w) for w in normalized)
    return BlendableDataset(parts, normalized, size)


def _check_train_not_empty(prefixes, documents, opened, split) -> None:
    for p in prefixes:
        if documents[p][0] is None:
            raise DataError(f"--split {split!r} leaves the train split of {p!r} empty "
                             f"({len(opened[p])} documents); give train a larger share")


def _build_from_blend(data_path, num_samples: Sequence[int], config: GPTDatasetConfig,
                      flag: str, only: Optional[int] = None,
                      one_epoch: Sequence[bool] = (False, False, False)) -> List:
    prefixes, weights = dataset_utils.parse_data_path(data_path, flag)
    table = (sequences_per_dataset.load(config.per_dataset_sequences_path)
             if config.per_dataset_sequences_path else None)
    opened = {p: _open_indexed_dataset(p, flag, config.mmap_bin_files, config, table)
              for p in prefixes}
    whole = only is not None
    wanted = [n > 0 or e for n, e in zip(num_samples, one_epoch)]
    if wanted[only] if whole else any(wanted):
        for p in prefixes:
            dataset_utils.check_has_documents(p, len(opened[p]), flag)
    documents = {p: _split_documents(opened[p], config.split, whole) for p in prefixes}
    if not whole and num_samples[0] > 0:
        _check_train_not_empty(prefixes, documents, opened, config.split)
    for p in prefixes:
        logger.info("%s: %d documents; train/valid/test document ranges %s", p, len(opened[p]),
                    [None if d is None else (int(d[0]), int(d[-1]) + 1) for d in documents[p]])
    splits = range(3) if only is None else [only]
    out: List = [None, None, None]
    for i in splits:
        out[i] = _build_split(i, prefixes, weights, documents, opened, int(num_samples[i]),
                              config, one_epoch[i])
    return out


def build_train_valid_test_datasets(config: GPTDatasetConfig,
                                    data_path: Union[str, Sequence[str], None],
                                    train_valid_test_num_samples: Sequence[int],
                                    train_data_path: Union[str, Sequence[str], None] = None,
                                    valid_data_path: Union[str, Sequence[str], None] = None,
                                    test_data_path: Union[str, Sequence[str], None] = None,
                                    multiple_validation_sets: bool = False):
    """The (train, valid, test) datasets, each possibly None.

    Args:
        config: seed, sequence length, ``--split``, cache folder, mock flag.
        data_path: ``--data-path``: one prefix, or ``W1 PREFIX1 W2 PREFIX2 ...``; each prefix is
            split by ``--split``. With weights, each split blends the prefixes' splits and each
            dataset is asked for ``ceil(ceil(total * w) * (1 + surplus))`` samples
            (FORMATS.md 4; surplus: ``config.mid_level_dataset_surplus``, default 0.005).
        train_valid_test_num_samples: samples wanted per split
            (:func:`~megatron.data.dataset_utils.get_train_valid_test_num_samples`); None
            (``--full-validation``'s valid count) asks for the split's samples of one epoch.
        train_data_path / valid_data_path / test_data_path: ``--train-data-path`` etc.: used
            whole for that split instead of ``--data-path`` and ``--split``.
        multiple_validation_sets: ``--multiple-validation-sets``: the valid split is a list of
            datasets, one per (unweighted) ``--valid-data-path`` prefix, each built as if that
            prefix were the only one.
    """
    if len(train_valid_test_num_samples) != 3:
        raise DataError(f"need train, valid and test sample counts, "
                         f"got {list(train_valid_test_num_samples)}")
    one_epoch = [n is None for n in train_valid_test_num_samples]
    num_samples = [0 if n is None else int(n) for n in train_valid_test_num_samples]
    if config.mock and any(one_epoch):
        raise DataError("--full-validation reads the validation data whole, once; --mock-data "
                         "has no end: give --data-path or --valid-data-path")
    if multiple_validation_sets and valid_data_path:
        return _with_validation_sets(config, data_path, num_samples, one_epoch,
                                     (train_data_path, valid_data_path, test_data_path))
    if config.mock:
        return tuple(
            MockGPTDataset(n, config.seq_length, config.vocab_size, config.seed + i) if n > 0
            else None for i, n in enumerate(num_samples))
    return dataset_utils.build_splits(
        num_samples, data_path, (train_data_path, valid_data_path, test_data_path),
        lambda path, flag, only: _build_from_blend(path, num_samples, config, flag, only=only,
                                                   one_epoch=one_epoch),
        ", or --mock-data")


def _with_validation_sets(config: GPTDatasetConfig, data_path, num_samples: List[int],
                          one_epoch: List[bool], per_split_paths: Sequence) -> tuple:
    """Train and test as usual; valid as one dataset per ``--valid-data-path`` prefix."""
    train_path, valid_path, test_path = per_split_paths
    if data_path:
        raise DataError("--data-path cannot be combined with --train-data-path, "
                        "--valid-data-path or --test-data-path")
    train = test = None
    if train_path or test_path:
        train, _, test = dataset_utils.build_splits(
            num_samples, None, (train_path, None, test_path),
            lambda path, flag, only: _build_from_blend(path, num_samples, config, flag,
                                                       only=only))
    valid = [_build_from_blend(prefix, num_samples, config, "--valid-data-path", only=1,
                               one_epoch=one_epoch)[1]
             for prefix in dataset_utils.parse_prefix_list(valid_path, "--valid-data-path")]
    return train, valid, test

"""Token datasets on disk: ``PREFIX.bin`` + ``PREFIX.idx`` in Megatron's mmap format.

The byte layout is FORMATS.md section 1. ``.bin`` is every sequence's tokens back to back; ``.idx``
holds a 34-byte header, then the sequence lengths (int32), the byte offsets of the sequences in
``.bin`` (int64), and the document indices (int64): entry ``d`` is the number of sequences before
document ``d``, so document ``d`` is sequences ``[doc[d], doc[d + 1])``.

:class:`IndexedDatasetBuilder` writes a pair under temporary names and moves both into place only in
:meth:`IndexedDatasetBuilder.finalize`, so an interrupted run never leaves a file that looks valid.
:class:`IndexedDataset` memory-maps a pair and checks every size and offset when it opens it, so a
truncated or foreign file is reported by name instead of producing garbage tokens or a crash.
"""

import os
import shutil
import secrets
import struct
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np

from megatron.core.msc import is_msc_url
from megatron.data import object_storage

_MAGIC = b"MMIDIDX\x00\x00"
_LEGACY_MAGIC = b"TNTIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D document entries
HEADER_SIZE = _HEADER.size  # 34
assert HEADER_SIZE == 34

# Validation works on blocks of this many entries so that checking a huge index needs little memory.
_CHECK_BLOCK = 1 << 22


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, inconsistent or in an unsupported format."""


class DType:
    """The dtype codes stored in byte 17 of an ``.idx`` file (FORMATS.md section 1)."""

    _CODES = {
        1: np.uint8,
        2: np.int8,
        3: np.int16,
        4: np.int32,
        5: np.int64,
        6: np.float64,
        7: np.float32,
        8: np.uint16,
    }

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        """The code for a numpy dtype; raises for a dtype the format cannot store."""
        dtype = np.dtype(dtype)
        for code, candidate in cls._CODES.items():
            if np.dtype(candidate) == dtype:
                return code
        allowed = ", ".join(np.dtype(d).name for d in cls._CODES.values())
        raise IndexedDatasetError(f"dtype {dtype.name} cannot be stored; expected one of {allowed}")

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        """The numpy scalar type for a code; raises for an unknown code."""
        if code not in cls._CODES:
            raise IndexedDatasetError(f"unknown dtype code {code}; expected 1..8")
        return cls._CODES[code]

    @staticmethod
    def size(dtype) -> int:
        """Bytes per element."""
        return np.dtype(dtype).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """The smallest dtype Megatron uses for token ids of a vocabulary of this size.

        uint16 when the vocabulary has fewer than 65,500 entries, else int32 (also when unknown).
        """
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Module-level spelling of :meth:`DType.optimal_dtype` (uint16 below 65,500 tokens)."""
    return DType.optimal_dtype(vocab_size)


def get_bin_path(path_prefix: str) -> str:
    """``PREFIX.bin``."""
    return path_prefix + ".bin"


def get_idx_path(path_prefix: str) -> str:
    """``PREFIX.idx``."""
    return path_prefix + ".idx"


# ------------------------------------------------------------------------------------------------
# Writer
# ------------------------------------------------------------------------------------------------


class _IntColumn:
    """An append-only integer column kept as numpy chunks, so millions of entries stay compact."""

    def __init__(self, dtype):
        self._dtype = dtype
        self._chunks: List[np.ndarray] = []
        self._pending: List[int] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, value: int) -> None:
        self._pending.append(value)
        self._count += 1
        if len(self._pending) >= 65536:
            self._flush()

    def extend(self, values: np.ndarray) -> None:
        self._flush()
        self._chunks.append(np.asarray(values, dtype=self._dtype).ravel())
        self._count += len(self._chunks[-1])

    def last(self) -> int:
        if self._pending:
            return self._pending[-1]
        for chunk in reversed(self._chunks):
            if len(chunk):
                return int(chunk[-1])
        raise IndexError("empty column")

    def blocks(self, size: int = 1 << 20) -> Iterator[np.ndarray]:
        """The column in order, as non-empty views of at most ``size`` entries."""
        self._flush()
        for chunk in self._chunks:
            for start in range(0, chunk.size, size):
                yield chunk[start:start + size]

    def to_array(self) -> np.ndarray:
        self._flush()
        if not self._chunks:
            return np.zeros(0, dtype=self._dtype)
        return np.concatenate(self._chunks)

    def _flush(self) -> None:
        if self._pending:
            self._chunks.append(np.array(self._pending, dtype=self._dtype))
            self._pending = []


class IndexedDatasetBuilder:
    """Writes one ``.bin``/``.idx`` pair.

    Sequences are appended with :meth:`add_item` (one sequence; close the document with
    :meth:`end_document`), :meth:`add_document` (one document of one or more sequences),
    :meth:`add_documents` (many documents as flat arrays: the fast path of the preprocessing tool)
    or :meth:`add_index` (a whole finished dataset). Nothing is visible under the final names until
    :meth:`finalize`; :meth:`abort` (or leaving a ``with`` block by an exception) deletes the
    temporary file.

    Args:
        bin_path: where the ``.bin`` file goes once finalized.
        dtype: token dtype, one of the eight the format stores (see :class:`DType`).
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self._bin_path = bin_path
        self._dtype = np.dtype(dtype)
        DType.code_from_dtype(self._dtype)  # reject unsupported dtypes before creating anything
        self._bin_tmp = _temporary_name(bin_path)
        self._data_file = open(self._bin_tmp, "xb")
        self._lengths = _IntColumn(np.int32)
        self._document_indices = _IntColumn(np.int64)
        self._document_indices.append(0)
        self._closed = False

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add_item(self, tensor) -> None:
        """Append one sequence (a 1-D tensor, array or list of token ids)."""
        array = self._as_tokens(tensor)
        self._write(array)
        self._lengths.append(self._checked_length(array.size))

    def end_document(self) -> None:
        """Close the current document: record the number of sequences so far."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document: its sequences back to back in ``tokens``, sizes in ``lengths``."""
        array = self._as_tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64).ravel()
        if int(lengths.sum()) != array.size or (lengths < 0).any():
            raise ValueError(f"add_document: sequence lengths {lengths.tolist()} do not add up to "
                             f"the {array.size} tokens given")
        self._write(array)
        self._lengths.extend(self._checked_lengths(lengths))
        self.end_document()

    def add_documents(self, tokens, sequence_lengths, sequences_per_document) -> None:
        """Append many documents at once.

        Args:
            tokens: every sequence's tokens back to back (1-D).
            sequence_lengths: the length of each sequence; they sum to ``len(tokens)``.
            sequences_per_document: how many of those sequences each document has (0 for an
                empty document, which still gets its document-index entry).
        """
        array = self._as_tokens(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64).ravel()
        counts = np.asarray(sequences_per_document, dtype=np.int64).ravel()
        if int(lengths.sum()) != array.size or int(counts.sum()) != lengths.size:
            raise ValueError(
                f"add_documents: {array.size} tokens, sequence lengths summing to "
                f"{int(lengths.sum())} over {lengths.size} sequences, document counts summing to "
                f"{int(counts.sum())}")
        if (counts < 0).any() or (lengths < 0).any():
            raise ValueError("add_documents: negative length or count")
        self._write(array)
        first = len(self._lengths)
        self._lengths.extend(self._checked_lengths(lengths))
        self._document_indices.extend(first + np.cumsum(counts))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of the finished dataset at ``path_prefix``.

        Its lengths are appended, its document indices shifted by the sequences already present
        (its leading 0 dropped), and its ``.bin`` bytes copied as they are.
        """
        other = IndexedDataset(path_prefix)
        if np.dtype(other.dtype) != self._dtype:
            raise IndexedDatasetError(
                f"{get_idx_path(path_prefix)}: dtype {np.dtype(other.dtype).name} differs from the "
                f"dataset being built ({self._dtype.name}); merge only datasets of one dtype")
        offset = len(self._lengths)
        # Copies, so that no memory map (and its open file) outlives this call.
        self._lengths.extend(np.array(other.sequence_lengths, dtype=np.int32))
        self._document_indices.extend(offset + np.array(other.document_indices[1:], dtype=np.int64))
        other.close()
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file, 16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move ``.bin`` and ``.idx`` to their final names."""
        self._ensure_open()
        self._data_file.flush()
        os.fsync(self._data_file.fileno())
        self._data_file.close()
        self._closed = True
        idx_tmp = _temporary_name(idx_path)
        try:
            with open(idx_tmp, "xb") as index:
                index.write(_HEADER.pack(_MAGIC, _VERSION, DType.code_from_dtype(self._dtype),
                                         len(self._lengths), len(self._document_indices)))
                self._write_columns(index)
                index.flush()
                os.fsync(index.fileno())
            # An old index must never sit beside the new data, even for a moment.
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(self._bin_tmp, self._bin_path)
            os.replace(idx_tmp, idx_path)
        except BaseException:
            _remove_quietly(idx_tmp)
            _remove_quietly(self._bin_tmp)
            raise

    def _write_columns(self, index) -> None:
        """Lengths, pointers and document indices, a block of entries at a time.

        The columns are never joined or widened whole: finalizing needs no memory beyond the
        columns themselves (12 bytes per sequence) and one block.
        """
        for block in self._lengths.blocks():
            index.write(block.astype("<i4", copy=False).tobytes(order="C"))
        offset = 0
        for block in self._lengths.blocks():
            ends = offset + np.cumsum(block.astype(np.int64) * self._dtype.itemsize)
            index.write(np.concatenate(([offset], ends[:-1])).astype("<i8").tobytes(order="C"))
            offset = int(ends[-1])
        for block in self._document_indices.blocks():
            index.write(block.astype("<i8", copy=False).tobytes(order="C"))

    def abort(self) -> None:
        """Drop everything written so far (the temporary file is deleted)."""
        if not self._closed:
            self._data_file.close()
            self._closed = True
        _remove_quietly(self._bin_tmp)

    # -- helpers -----------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the builder for {self._bin_path} is already finalized or aborted")

    def _as_tokens(self, tokens) -> np.ndarray:
        self._ensure_open()
        if hasattr(tokens, "detach"):  # a torch tensor
            tokens = tokens.detach().cpu().numpy()
        source = np.asarray(tokens)
        if source.dtype == self._dtype:
            return np.ascontiguousarray(source).ravel()
        narrowing = not np.can_cast(source.dtype, self._dtype)
        if source.size and source.dtype.kind in "iub" and narrowing:
            low, high = int(source.min()), int(source.max())
            info = np.iinfo(self._dtype) if self._dtype.kind in "iu" else None
            if info is not None and (low < info.min or high > info.max):
                raise ValueError(f"token ids span [{low}, {high}], outside {self._dtype.name}'s "
                                 f"range [{info.min}, {info.max}]; choose a wider dtype")
        return np.ascontiguousarray(source, dtype=self._dtype).ravel()

    def _write(self, array: np.ndarray) -> None:
        self._data_file.write(memoryview(array).cast("B"))

    @staticmethod
    def _checked_length(length: int) -> int:
        if length > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {length} tokens does not fit the int32 length field")
        return length

    @staticmethod
    def _checked_lengths(lengths: np.ndarray) -> np.ndarray:
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit the int32 "
                             "length field")
        return lengths.astype(np.int32)


MMapIndexedDatasetBuilder = IndexedDatasetBuilder


def _temporary_name(path: str) -> str:
    """A unique name beside ``path`` that no reader mistakes for a dataset file."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------------------------------------
# Reader
# ------------------------------------------------------------------------------------------------


class IndexedDataset:
    """A memory-mapped ``.bin``/``.idx`` pair, checked when opened.

    ``dataset[i]`` is sequence ``i`` as a numpy array; ``dataset[a:b]`` the list of sequences
    ``a..b-1``; :meth:`get` reads part of a sequence. The object pickles by path, so DataLoader
    workers reopen the files instead of copying them.

    Args:
        path_prefix: the path without ``.bin``/``.idx``.
        multimodal: expect the per-sequence mode bytes after the document indices.
        mmap: memory-map ``.bin`` (default); False reads it into memory.
        sequences_per_dataset: ``(N, D)``, the sequence and document-index counts, given instead
            of reading the header (Megatron's ``--per-dataset-sequences-path`` fast path); needs
            ``dtype_code``. The index is then checked only where it costs no read of its
            columns: its file size, the first and last document index, and the byte size of
            ``.bin`` against the last sequence (a wrong count or dtype fails there).
        dtype_code: the token dtype code (FORMATS.md 1) that goes with ``sequences_per_dataset``.
        source: what gave ``sequences_per_dataset``, for error messages.
        object_storage_cache: ``--object-storage-cache-path``; needed when ``path_prefix`` is an
            ``msc://`` URL, whose ``.idx`` is copied there and whose ``.bin`` is read in ranges
            (:mod:`megatron.data.object_storage`).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True,
                 sequences_per_dataset: Optional[Sequence[int]] = None,
                 dtype_code: Optional[int] = None, source: str = "the given counts",
                 object_storage_cache: Optional[str] = None):
        self._path_prefix = path_prefix
        self._object_storage_cache = object_storage_cache
        self._multimodal = multimodal
        self._mmap = mmap
        self._counts = None if sequences_per_dataset is None else (
            int(sequences_per_dataset[0]), int(sequences_per_dataset[1]))
        self._dtype_code = dtype_code
        self._source = source
        if self._counts is not None and dtype_code is None:
            raise IndexedDatasetError(f"{path_prefix}: sequence counts from {source} need the "
                                      "token dtype code too")
        self._open()

    # -- opening and validation --------------------------------------------------------------

    def _header_counts(self, idx_path: str):
        """(dtype code, N, D, where they came from): read from the header, or as given."""
        if self._counts is None:
            header = _read_header(idx_path)
            return header["code"], header["sequences"], header["documents"], "its header"
        if not os.path.isfile(idx_path):
            raise IndexedDatasetError(f"{idx_path}: index file is missing")
        n, d = self._counts
        return self._dtype_code, n, d, self._source

    def _open(self) -> None:
        idx_path, bin_path = get_idx_path(self._path_prefix), get_bin_path(self._path_prefix)
        remote = is_msc_url(self._path_prefix)
        if remote:
            if not self._object_storage_cache:
                raise IndexedDatasetError(f"{self._path_prefix}: an msc:// data prefix needs "
                                          "--object-storage-cache-path, where its .idx is kept")
            idx_path = object_storage.fetch_index(self._path_prefix, self._object_storage_cache)
        code, n, d, origin = self._header_counts(idx_path)
        self._dtype = DType.dtype_from_code(code)
        itemsize = np.dtype(self._dtype).itemsize
        base = HEADER_SIZE + 12 * n + 8 * d
        size = os.path.getsize(idx_path)
        if size == base + n and (n > 0 or self._multimodal):
            has_modes = True
        elif size == base:
            has_modes = False
        else:
            raise IndexedDatasetError(
                f"{idx_path}: file is {size} bytes, but {origin} (N={n} sequences, D={d} "
                f"document entries) needs exactly {base} bytes ({base + n} with sequence modes); "
                "the counts do not belong to this file, or it is truncated or not an index")
        if self._multimodal and not has_modes:
            raise IndexedDatasetError(
                f"{idx_path}: opened as multimodal but holds no sequence modes")
        self._idx_mmap = np.memmap(idx_path, dtype=np.uint8, mode="r") if size else None
        buffer = memoryview(self._idx_mmap) if size else b""
        self._sequence_lengths = np.frombuffer(buffer, dtype="<i4", count=n, offset=HEADER_SIZE)
        self._sequence_pointers = np.frombuffer(buffer, dtype="<i8", count=n,
                                                offset=HEADER_SIZE + 4 * n)
        self._document_indices = np.frombuffer(buffer, dtype="<i8", count=d,
                                               offset=HEADER_SIZE + 12 * n)
        self._sequence_modes = (np.frombuffer(buffer, dtype=np.int8, count=n, offset=base)
                                if has_modes else None)
        if self._counts is None:
            _check_index(idx_path, self._sequence_lengths, self._sequence_pointers,
                         self._document_indices, itemsize)
        else:
            _check_index_ends(idx_path, self._sequence_lengths, self._sequence_pointers,
                              self._document_indices, itemsize, origin)
        if remote:
            actual = object_storage.bin_size(self._path_prefix)
            if actual is None:
                raise IndexedDatasetError(
                    f"{bin_path}: data file is missing (its index {idx_path} exists)")
        elif not os.path.exists(bin_path):
            raise IndexedDatasetError(
                f"{bin_path}: data file is missing (its index {idx_path} exists)")
        elif not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"{bin_path}: not a regular file; expected the data file")
        else:
            actual = os.path.getsize(bin_path)
        expected = int(self._sequence_pointers[-1]) + int(self._sequence_lengths[-1]) * itemsize \
            if n else 0
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: file is {actual} bytes, but {idx_path} describes {expected} bytes "
                f"({n} sequences of {np.dtype(self._dtype).name}); the pair does not belong "
                "together or one of them is truncated"
                + ("" if self._counts is None else
                   f" (or the counts and token dtype from {origin} are not this dataset's)"))
        self._bin_reader = None
        if actual == 0:
            self._bin_buffer = np.zeros(0, dtype=np.uint8)
        elif remote:  # byte ranges from the storage service, one read per access
            self._bin_buffer = None
            self._bin_reader = object_storage.RemoteBin(bin_path, actual)
        elif self._mmap:
            self._bin_buffer = np.memmap(bin_path, dtype=np.uint8, mode="r")
        else:
            self._bin_buffer = np.fromfile(bin_path, dtype=np.uint8)

    def close(self) -> None:
        """Release the memory maps (the object is unusable afterwards)."""
        if getattr(self, "_bin_reader", None) is not None:
            self._bin_reader.close()
        self._bin_reader = None
        self._bin_buffer = None
        self._idx_mmap = None
        self._sequence_lengths = self._sequence_pointers = self._document_indices = None
        self._sequence_modes = None

    def __getstate__(self):
        return {"path_prefix": self._path_prefix, "multimodal": self._multimodal,
                "mmap": self._mmap, "counts": self._counts, "dtype_code": self._dtype_code,
                "source": self._source, "object_storage_cache": self._object_storage_cache}

    def __setstate__(self, state) -> None:
        self._path_prefix = state["path_prefix"]
        self._multimodal = state["multimodal"]
        self._mmap = state["mmap"]
        self._counts = state.get("counts")
        self._dtype_code = state.get("dtype_code")
        self._source = state.get("source", "the given counts")
        self._object_storage_cache = state.get("object_storage_cache")
        self._open()

    # -- access ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sequence_lengths)

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an IndexedDataset must be contiguous, got step {step}")
            if start >= stop:
                return []
            lengths = self._sequence_lengths[start:stop]
            flat = self._read(int(self._sequence_pointers[start]), int(lengths.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64))
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end by default)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences "
                             f"in {get_idx_path(self._path_prefix)}")
        size = int(self._sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) requested from sequence {idx} "
                             f"of length {size}")
        itemsize = np.dtype(self._dtype).itemsize
        return self._read(int(self._sequence_pointers[idx]) + offset * itemsize, length)

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=self._dtype)
        if self._bin_reader is not None:
            data = self._bin_reader.read(byte_offset, count * np.dtype(self._dtype).itemsize)
            return np.frombuffer(data, dtype=self._dtype, count=count)
        return np.frombuffer(self._bin_buffer, dtype=self._dtype, count=count, offset=byte_offset)

    # -- metadata ----------------------------------------------------------------------------

    @property
    def path_prefix(self) -> str:
        return self._path_prefix

    @property
    def dtype(self) -> type:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32, one entry per sequence."""
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of each sequence in ``.bin``."""
        return self._sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64, D = documents + 1 entries; document d is sequences [doc[d], doc[d+1])."""
        return self._document_indices

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        """int8 per-sequence modes of multimodal files, else None."""
        return self._sequence_modes

    # Names used by older Megatron code.
    sizes = sequence_lengths
    doc_idx = document_indices

    def get_document_indices(self) -> np.ndarray:
        return self._document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
        return (os.path.exists(get_idx_path(path_prefix))
                and os.path.exists(get_bin_path(path_prefix)))


MMapIndexedDataset = IndexedDataset


def missing_files(path_prefix: str) -> List[str]:
    """Which of ``PREFIX.bin`` and ``PREFIX.idx`` do not exist (objects, for an msc:// URL)."""
    if is_msc_url(path_prefix):
        return object_storage.prefix_exists(path_prefix)
    return [p for p in (get_bin_path(path_prefix), get_idx_path(path_prefix))
            if not os.path.isfile(p)]


def header_counts(path_prefix: str) -> tuple:
    """``(N, D)`` of ``PREFIX.idx``: its numbers of sequences and of document-index entries, read
    from its (checked) header alone."""
    header = _read_header(get_idx_path(path_prefix))
    return header["sequences"], header["documents"]


def _read_header(idx_path: str) -> dict:
    """Parse and check the 34-byte header of ``idx_path``."""
    if not os.path.exists(idx_path):
        raise IndexedDatasetError(f"{idx_path}: index file is missing")
    if not os.path.isfile(idx_path):
        raise IndexedDatasetError(f"{idx_path}: not a regular file; expected the index file")
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if raw.startswith(_LEGACY_MAGIC):
        raise IndexedDatasetError(
            f"{idx_path}: this is Megatron's old 'lazy'/'cached' index format (magic TNTIDX), "
            "which is not supported; re-run tools/preprocess_data.py to write the mmap format")
    if len(raw) < len(_MAGIC) or raw[:len(_MAGIC)] != _MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: not an indexed-dataset index (magic {raw[:9]!r}, expected {_MAGIC!r})")
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{idx_path}: file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    _, version, code, n, d = _HEADER.unpack(raw)
    if version != _VERSION:
        raise IndexedDatasetError(f"{idx_path}: index version {version}, expected {_VERSION}")
    if code not in DType._CODES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}, expected 1..8")
    return {"code": code, "sequences": n, "documents": d}


def _check_index(idx_path: str, lengths: np.ndarray, pointers: np.ndarray,
                 document_indices: np.ndarray, itemsize: int) -> None:
    """Check lengths, pointers and document indices against each other, block by block."""
    n, d = len(lengths), len(document_indices)
    if d < 1:
        raise IndexedDatasetError(f"{idx_path}: no document indices (D=0); expected at least [0]")
    if int(document_indices[0]) != 0:
        raise IndexedDatasetError(
            f"{idx_path}: document indices start at {int(document_indices[0])}, expected 0")
    if int(document_indices[-1]) != n:
        raise IndexedDatasetError(
            f"{idx_path}: last document index is {int(document_indices[-1])}, expected N={n} "
            "(the number of sequences)")
    for start in range(0, d - 1, _CHECK_BLOCK):
        block = np.asarray(document_indices[start:start + _CHECK_BLOCK + 1])
        steps = np.diff(block)
        if (steps < 0).any():
            at = start + int(np.argmax(steps < 0)) + 1
            raise IndexedDatasetError(
                f"{idx_path}: document indices decrease at entry {at} "
                f"({int(document_indices[at - 1])} then {int(document_indices[at])})")
    expected_next = 0
    for start in range(0, n, _CHECK_BLOCK):
        block_lengths = np.asarray(lengths[start:start + _CHECK_BLOCK]).astype(np.int64)
        if (block_lengths < 0).any():
            at = start + int(np.argmax(block_lengths < 0))
            raise IndexedDatasetError(f"{idx_path}: sequence {at} has negative length "
                                      f"{int(lengths[at])}")
        ends = expected_next + np.cumsum(block_lengths * itemsize)
        starts = np.concatenate(([expected_next], ends[:-1]))
        block_pointers = np.asarray(pointers[start:start + _CHECK_BLOCK])
        wrong = block_pointers != starts
        if wrong.any():
            at = start + int(np.argmax(wrong))
            raise IndexedDatasetError(
                f"{idx_path}: sequence {at} points to byte {int(pointers[at])}, but the lengths "
                f"before it put it at byte {int(starts[at - start])}")
        expected_next = int(ends[-1])


def _check_index_ends(idx_path: str, lengths: np.ndarray, pointers: np.ndarray,
                      document_indices: np.ndarray, itemsize: int, origin: str) -> None:
    """The checks of :func:`_check_index` that read no more than a few entries: counts that
    are not the file's (or a wrong dtype) put these entries out of place."""
    n, d = len(lengths), len(document_indices)
    if d < 1 or int(document_indices[0]) != 0 or int(document_indices[-1]) != n:
        seen = [int(document_indices[0]), int(document_indices[-1])] if d else []
        raise IndexedDatasetError(
            f"{idx_path}: with N={n}, D={d} from {origin}, the first and last document "
            f"indices are {seen}, expected [0, {n}]; the counts are not this file's")
    if n > 1 and int(pointers[1]) != int(lengths[0]) * itemsize:
        raise IndexedDatasetError(
            f"{idx_path}: sequence 1 points to byte {int(pointers[1])}, but sequence 0 holds "
            f"{int(lengths[0])} tokens of {itemsize} bytes; the token dtype from {origin} is "
            "not this file's")

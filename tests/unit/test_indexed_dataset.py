"""The .bin/.idx pair: round trips, the exact bytes of FORMATS.md section 1, merging, and errors.

The byte-level reference here is written with ``struct`` straight from the table in FORMATS.md, so
the reader and writer are checked against the format, not against each other.
"""

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import (
    DType, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, MMapIndexedDataset,
    MMapIndexedDatasetBuilder, get_bin_path, get_idx_path, optimal_dtype)

DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
               np.float32: 7, np.uint16: 8}


def random_documents(rng, dtype, num_documents=12, max_sequences=3, max_length=40):
    """Documents as lists of 1-D arrays; some documents and some sequences are empty."""
    if np.dtype(dtype).kind == "f":
        draw = lambda n: rng.standard_normal(n).astype(dtype)  # noqa: E731
    else:
        info = np.iinfo(dtype)
        draw = lambda n: rng.integers(  # noqa: E731
            info.min, int(info.max) + 1, n, dtype=np.int64).astype(dtype)
    return [[draw(int(rng.integers(0, max_length)))
             for _ in range(int(rng.integers(0, max_sequences + 1)))]
            for _ in range(num_documents)]


def write_reference(prefix, dtype_code, itemsize, documents, byteorder_dtype):
    """An independent writer: the .idx table of FORMATS.md section 1, packed field by field."""
    sequences = [s for doc in documents for s in doc]
    lengths = [len(s) for s in sequences]
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=byteorder_dtype).tobytes())
    return lengths, pointers, doc_index


def parse_reference(prefix):
    """An independent reader of the .idx header and tables."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    magic = raw[:9]
    version, = struct.unpack_from("<Q", raw, 9)
    code, = struct.unpack_from("<B", raw, 17)
    n, d = struct.unpack_from("<QQ", raw, 18)
    lengths = list(struct.unpack_from(f"<{n}i", raw, 34))
    pointers = list(struct.unpack_from(f"<{n}q", raw, 34 + 4 * n))
    doc_index = list(struct.unpack_from(f"<{d}q", raw, 34 + 12 * n))
    assert len(raw) == 34 + 12 * n + 8 * d
    return magic, version, code, lengths, pointers, doc_index


def build(prefix, documents, dtype, use_items=False):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in documents:
        if use_items:
            for s in doc:
                builder.add_item(torch.from_numpy(np.array(s)) if s.dtype != np.uint16 else s)
            builder.end_document()
        else:
            tokens = np.concatenate(doc) if doc else np.zeros(0, dtype)
            builder.add_document(tokens, [len(s) for s in doc])
    builder.finalize(get_idx_path(prefix))


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
@pytest.mark.parametrize("use_items", [False, True])
def test_round_trip_every_dtype(tmp_path, dtype, use_items):
    rng = np.random.default_rng([DTYPE_CODES[dtype], int(use_items)])
    documents = random_documents(rng, dtype)
    prefix = str(tmp_path / "data")
    build(prefix, documents, dtype, use_items)
    sequences = [s for doc in documents for s in doc]
    ds = IndexedDataset(prefix)
    assert len(ds) == len(sequences)
    assert np.dtype(ds.dtype) == np.dtype(dtype)
    assert ds.sequence_lengths.dtype == np.int32 and ds.document_indices.dtype == np.int64
    np.testing.assert_array_equal(ds.sequence_lengths, [len(s) for s in sequences])
    expected_docs = np.cumsum([0] + [len(doc) for doc in documents])
    np.testing.assert_array_equal(ds.document_indices, expected_docs)
    for i, s in enumerate(sequences):
        np.testing.assert_array_equal(ds[i], s)
        if len(s) >= 3:
            np.testing.assert_array_equal(ds.get(i, offset=1, length=len(s) - 2), s[1:-1])
            np.testing.assert_array_equal(ds.get(i, offset=2), s[2:])
    if len(sequences) >= 4:
        for got, want in zip(ds[1:4], sequences[1:4]):
            np.testing.assert_array_equal(got, want)
    # The format is little-endian whatever the machine: compare with the reference parser.
    magic, version, code, lengths, pointers, doc_index = parse_reference(prefix)
    assert (magic, version, code) == (b"MMIDIDX\x00\x00", 1, DTYPE_CODES[dtype])
    assert doc_index == expected_docs.tolist()
    itemsize = np.dtype(dtype).itemsize
    assert pointers == [sum(lengths[:i]) * itemsize for i in range(len(lengths))]


def test_writer_bytes_match_format(tmp_path):
    """Our writer's files, parsed with struct, hold exactly the FORMATS.md fields and tokens."""
    documents = [[np.array([5, 6, 7], np.uint16)], [],
                 [np.array([1], np.uint16), np.array([2, 3], np.uint16)]]
    prefix = str(tmp_path / "ours")
    build(prefix, documents, np.uint16)
    magic, version, code, lengths, pointers, doc_index = parse_reference(prefix)
    assert magic == b"MMIDIDX\x00\x00" and version == 1 and code == 8
    assert lengths == [3, 1, 2]
    assert pointers == [0, 6, 8]
    assert doc_index == [0, 1, 1, 3]
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == struct.pack("<6H", 5, 6, 7, 1, 2, 3)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float32])
def test_reads_reference_written_files(tmp_path, dtype):
    rng = np.random.default_rng(7)
    documents = random_documents(rng, dtype)
    prefix = str(tmp_path / "ref")
    lengths, pointers, doc_index = write_reference(
        prefix, DTYPE_CODES[dtype], np.dtype(dtype).itemsize, documents,
        np.dtype(dtype).newbyteorder("<"))
    ds = IndexedDataset(prefix)
    assert ds.sequence_lengths.tolist() == lengths
    assert ds.sequence_pointers.tolist() == pointers
    assert ds.document_indices.tolist() == doc_index
    for i, s in enumerate(s for doc in documents for s in doc):
        np.testing.assert_array_equal(ds[i], s)


def test_merge_with_add_index(tmp_path):
    rng = np.random.default_rng(3)
    parts = [random_documents(rng, np.int32, num_documents=n) for n in (5, 0, 7)]
    prefixes = []
    for i, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"part{i}"))
        build(prefixes[-1], docs, np.int32)
    merged = str(tmp_path / "merged")
    builder = MMapIndexedDatasetBuilder(get_bin_path(merged), dtype=np.int32)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(get_idx_path(merged))
    whole = str(tmp_path / "whole")
    build(whole, [doc for docs in parts for doc in docs], np.int32)
    for suffix in (".bin", ".idx"):
        with open(merged + suffix, "rb") as a, open(whole + suffix, "rb") as b:
            assert a.read() == b.read()


def test_merge_rejects_other_dtype(tmp_path):
    build(str(tmp_path / "a"), [[np.array([1, 2], np.uint16)]], np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="uint16"):
        builder.add_index(str(tmp_path / "a"))
    builder.abort()


def test_merge_datasets_tool(tmp_path):
    from tools import merge_datasets

    rng = np.random.default_rng(11)
    folder = tmp_path / "shards"
    folder.mkdir()
    parts = [random_documents(rng, np.uint16, num_documents=4) for _ in range(3)]
    for name, docs in zip(("b", "a", "c"), parts):
        build(str(folder / name), docs, np.uint16)
    output = str(tmp_path / "merged")
    assert merge_datasets.main(["--input", str(folder), "--output-prefix", output]) == 0
    whole = str(tmp_path / "whole")
    build(whole, parts[1] + parts[0] + parts[2], np.uint16)  # sorted prefix order: a, b, c
    for suffix in (".bin", ".idx"):
        with open(output + suffix, "rb") as a, open(whole + suffix, "rb") as b:
            assert a.read() == b.read()


def test_empty_dataset_and_empty_documents(tmp_path):
    prefix = str(tmp_path / "empty")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    builder.finalize(get_idx_path(prefix))
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    prefix = str(tmp_path / "holes")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    builder.end_document()
    builder.add_item(np.array([4, 5], np.uint16))
    builder.end_document()
    builder.end_document()
    builder.finalize(get_idx_path(prefix))
    assert IndexedDataset(prefix).document_indices.tolist() == [0, 0, 1, 1]


def test_add_documents_bulk_matches_per_document(tmp_path):
    rng = np.random.default_rng(5)
    documents = random_documents(rng, np.uint16, num_documents=20)
    per_doc = str(tmp_path / "per_doc")
    build(per_doc, documents, np.uint16)
    bulk = str(tmp_path / "bulk")
    builder = IndexedDatasetBuilder(get_bin_path(bulk), dtype=np.uint16)
    sequences = [s for doc in documents for s in doc]
    builder.add_documents(np.concatenate(sequences), [len(s) for s in sequences],
                          [len(doc) for doc in documents])
    builder.finalize(get_idx_path(bulk))
    for suffix in (".bin", ".idx"):
        with open(per_doc + suffix, "rb") as a, open(bulk + suffix, "rb") as b:
            assert a.read() == b.read()


def test_out_of_range_tokens_rejected(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match="outside uint16"):
            builder.add_item(np.array([1, 70000], dtype=np.int64))
        builder.abort()
    assert os.listdir(tmp_path) == []


def test_unfinished_writer_leaves_no_dataset(tmp_path):
    prefix = str(tmp_path / "partial")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    builder.add_item(np.arange(10))
    builder.end_document()
    assert not IndexedDataset.exists(prefix)
    assert not any(name.endswith((".bin", ".idx")) for name in os.listdir(tmp_path))
    builder.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32) as b:
            b.add_item(np.arange(3))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.dtype_from_code(4) == np.int32
    with pytest.raises(IndexedDatasetError):
        DType.code_from_dtype(np.uint32)


def test_pickle_reopens_by_path(tmp_path):
    prefix = str(tmp_path / "p")
    build(prefix, [[np.array([9, 8, 7], np.int32)]], np.int32)
    ds = pickle.loads(pickle.dumps(MMapIndexedDataset(prefix)))
    np.testing.assert_array_equal(ds[0], [9, 8, 7])


def test_access_errors(tmp_path):
    prefix = str(tmp_path / "p")
    build(prefix, [[np.array([1, 2, 3], np.int32)]], np.int32)
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError, match="out of range"):
        ds[1]
    with pytest.raises(IndexError, match="length 3"):
        ds.get(0, offset=2, length=2)
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:1:2]


# -- corrupt files ------------------------------------------------------------------------------


@pytest.fixture
def valid_pair(tmp_path):
    """A small valid uint16 dataset: 3 sequences in 2 documents; returns (prefix, idx bytes)."""
    prefix = str(tmp_path / "ds")
    documents = [[np.array([1, 2, 3], np.uint16)],
                 [np.array([4], np.uint16), np.array([5, 6], np.uint16)]]
    build(prefix, documents, np.uint16)
    with open(prefix + ".idx", "rb") as f:
        return prefix, bytearray(f.read())


def rewrite_idx(prefix, data):
    with open(prefix + ".idx", "wb") as f:
        f.write(bytes(data))


N, D = 3, 3
LENGTHS_AT, POINTERS_AT, DOCS_AT = 34, 34 + 4 * N, 34 + 12 * N


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: d.__setitem__(slice(0, 9), b"XXXXXXXXX"), "not an indexed-dataset index"),
    (lambda d: d.__setitem__(slice(0, 9), b"TNTIDX\x00\x00\x00"), "old 'lazy'/'cached'"),
    (lambda d: d.__setitem__(slice(9, 17), struct.pack("<Q", 2)), "version 2, expected 1"),
    (lambda d: d.__setitem__(17, 9), "unknown dtype code 9"),
    (lambda d: d.__delitem__(slice(len(d) - 8, len(d))), "needs exactly"),
    (lambda d: d.extend(b"\x00" * 5), "needs exactly"),
    (lambda d: d.__delitem__(slice(20, len(d))), "shorter than the 34-byte header"),
    (lambda d: d.__setitem__(slice(POINTERS_AT + 8, POINTERS_AT + 16), struct.pack("<q", 4)),
     "sequence 1 points to byte 4"),
    (lambda d: d.__setitem__(slice(LENGTHS_AT, LENGTHS_AT + 4), struct.pack("<i", -1)),
     "negative length"),
    (lambda d: d.__setitem__(slice(DOCS_AT, DOCS_AT + 8), struct.pack("<q", 1)),
     "start at 1, expected 0"),
    (lambda d: d.__setitem__(slice(DOCS_AT + 16, DOCS_AT + 24), struct.pack("<q", 2)),
     "last document index is 2, expected N=3"),
    (lambda d: d.__setitem__(slice(DOCS_AT + 8, DOCS_AT + 16), struct.pack("<q", 4)),
     "decrease at entry 2"),
])
def test_corrupt_index_errors(valid_pair, corrupt, message):
    prefix, data = valid_pair
    corrupt(data)
    rewrite_idx(prefix, data)
    with pytest.raises(IndexedDatasetError) as error:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(error.value)
    assert message in str(error.value)


def test_truncated_or_missing_bin(valid_pair):
    prefix, _ = valid_pair
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(IndexedDatasetError) as error:
        IndexedDataset(prefix)
    assert prefix + ".bin" in str(error.value) and "10 bytes" in str(error.value)
    assert "describes 12 bytes" in str(error.value)
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match="data file is missing"):
        IndexedDataset(prefix)
    os.remove(prefix + ".idx")
    with pytest.raises(IndexedDatasetError, match="index file is missing"):
        IndexedDataset(prefix)

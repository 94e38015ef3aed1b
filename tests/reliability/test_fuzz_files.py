"""Hostile and broken files: every reader ends in one of the project's errors or a counted skip.

Never a crash, a hang, a read outside a file, or silently wrong data. Four inputs users hand us:

* ``.bin``/``.idx`` pairs: a valid pair written field by field from FORMATS.md section 1, then
  mutated (header fields, array entries, raw bytes, sizes of either file). The reader must raise
  IndexedDatasetError exactly when an independent parser of the format says the pair is invalid,
  and when it accepts a pair, every sequence it returns must be the bytes that parser finds.
* JSONL input of tools/preprocess_data.py: valid, malformed, non-UTF-8, deeply nested and
  oversized lines. The tool must write exactly the documents a line-by-line reference derives
  (``json`` + the tokenizer), count skipped lines, or fail naming the file and the first bad line.
* ``latest_checkpointed_iteration.txt``: CheckpointError or the number written in it.
* checkpoint files: mutated bytes of a real ``torch.save`` file give CheckpointError or a dict;
  a pickle that would run code is refused and provably never runs.

The readers built on compiled code (numpy memory maps, tiktoken, torch's zip reader) are fuzzed in
a child process with faulthandler on, so a segfault or a hang fails the test with the input that
caused it instead of killing pytest. Examples are derandomized (CI sees the same cases every run);
the ``slow`` variants run many more.
"""

import argparse
import collections
import contextlib
import faulthandler
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_EXAMPLES = 60
SLOW_EXAMPLES = 1500
CHILD_TIMEOUT_S = 300

MAGIC = b"MMIDIDX\x00\x00"
ITEM_FORMAT = {1: "<u1", 2: "<i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
NULL_VOCAB = 100  # --vocab-size: ids 0..99 for data, 100 for end-of-document


def fuzz_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------------ the child process

def run_target(name: str, max_examples: int, workdir: str) -> None:
    """Entry point of the child: fuzz one reader, print the outcome counts as JSON."""
    import warnings

    faulthandler.enable()
    # torch warns about the odd pickle protocol numbers that mutated files claim; not a result.
    warnings.simplefilter("ignore", UserWarning)
    outcomes = collections.Counter()  # how examples ended: a branch never reached is caught
    {"indexed_dataset": fuzz_indexed_dataset, "jsonl": fuzz_jsonl,
     "checkpoint": fuzz_checkpoint}[name](max_examples, workdir, outcomes)
    print("OUTCOMES " + json.dumps(outcomes), flush=True)


def _record_case(workdir: str, case) -> str:
    """A fresh folder for one example; the case is written first, so a crash can name it."""
    with open(os.path.join(workdir, "last_case.txt"), "w") as f:
        f.write(repr(case))
    folder = os.path.join(workdir, "case")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def run_in_child(target: str, max_examples: int, workdir) -> dict:
    """Run ``target`` in a fresh interpreter; fail on a crash, a hang or a failing example."""
    code = ("import sys; from tests.reliability.test_fuzz_files import run_target; "
            "run_target(sys.argv[1], int(sys.argv[2]), sys.argv[3])")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               HYPOTHESIS_STORAGE_DIRECTORY=os.path.join(str(workdir), ".hypothesis"))
    last_case = os.path.join(str(workdir), "last_case.txt")
    try:
        proc = subprocess.run([sys.executable, "-c", code, target, str(max_examples),
                               str(workdir)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        case = open(last_case).read() if os.path.exists(last_case) else "?"
        pytest.fail(f"{target}: no result after {CHILD_TIMEOUT_S} s (a hang?); last case: {case}")
    if proc.returncode != 0:
        case = open(last_case).read() if os.path.exists(last_case) else "?"
        kind = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else "failed"
        pytest.fail(f"{target}: child {kind}; last case: {case}\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-6000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("OUTCOMES ")][-1]
    return json.loads(line[len("OUTCOMES "):])


# ---------------------------------------------------------------- indexed dataset (.bin/.idx)

def pack_index(code: int, lengths, document_indices) -> bytes:
    """An ``.idx`` written field by field from the table in FORMATS.md section 1."""
    itemsize = np.dtype(ITEM_FORMAT[code]).itemsize
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    n, d = len(lengths), len(document_indices)
    return (MAGIC + struct.pack("<QBQQ", 1, code, n, d) + struct.pack(f"<{n}i", *lengths)
            + struct.pack(f"<{n}q", *pointers) + struct.pack(f"<{d}q", *document_indices))


def reference_parse(idx: bytes, bin_size: int, multimodal: bool):
    """The pair as FORMATS.md defines it: ``(code, lengths, pointers, documents)`` or None."""
    if len(idx) < 34 or idx[:9] != MAGIC:
        return None
    version, code, n, d = struct.unpack_from("<QBQQ", idx, 9)
    if version != 1 or code not in ITEM_FORMAT:
        return None
    base = 34 + 12 * n + 8 * d
    allowed = {base + n} if multimodal else {base, base + n}
    if len(idx) not in allowed:
        return None
    lengths = list(struct.unpack_from(f"<{n}i", idx, 34))
    pointers = list(struct.unpack_from(f"<{n}q", idx, 34 + 4 * n))
    documents = list(struct.unpack_from(f"<{d}q", idx, 34 + 12 * n))
    itemsize = np.dtype(ITEM_FORMAT[code]).itemsize
    offset = 0
    for length, pointer in zip(lengths, pointers):
        if length < 0 or pointer != offset:
            return None
        offset += length * itemsize
    if offset != bin_size or not documents or documents[0] != 0 or documents[-1] != n:
        return None
    if any(b < a for a, b in zip(documents, documents[1:])):
        return None
    return code, lengths, pointers, documents


U64 = st.one_of(st.integers(0, 12), st.sampled_from([2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]),
                st.integers(0, 2 ** 64 - 1))
I32 = st.one_of(st.integers(-3, 12), st.integers(-2 ** 31, 2 ** 31 - 1))
I64 = st.one_of(st.integers(-3, 64), st.sampled_from([2 ** 62, -2 ** 63, 2 ** 63 - 1]),
                st.integers(-2 ** 63, 2 ** 63 - 1))
IDX_MUTATION = st.one_of(
    st.tuples(st.just("version"), U64), st.tuples(st.just("code"), st.integers(0, 255)),
    st.tuples(st.just("sequences"), U64), st.tuples(st.just("documents"), U64),
    st.tuples(st.just("length"), st.integers(0, 99), I32),
    st.tuples(st.just("pointer"), st.integers(0, 99), I64),
    st.tuples(st.just("document"), st.integers(0, 99), I64),
    st.tuples(st.just("extra_document"), I64),
    st.tuples(st.just("idx_bytes"), st.integers(0, 10 ** 4), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("idx_truncate"), st.integers(1, 60)),
    st.tuples(st.just("idx_append"), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("bin_truncate"), st.integers(1, 16)),
    st.tuples(st.just("bin_append"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("modes"), st.binary(max_size=1)),
)
HEADER_FIELDS = {"version": (9, "<Q"), "code": (17, "<B"), "sequences": (18, "<Q"),
                 "documents": (26, "<Q")}


@st.composite
def indexed_cases(draw):
    code = draw(st.sampled_from(sorted(ITEM_FORMAT)))
    documents = draw(st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=5))
    mutations = draw(st.lists(IDX_MUTATION, max_size=3))
    return {"code": code, "documents": documents, "mutations": mutations,
            "multimodal": draw(st.booleans()), "mmap": draw(st.booleans()),
            "seed": draw(st.integers(0, 2 ** 16)),
            "reads": draw(st.lists(st.tuples(st.integers(-8, 20), st.integers(-2, 8),
                                             st.none() | st.integers(-2, 8)), max_size=4))}


def _apply_idx_mutation(idx: bytearray, data: bytearray, mutation, n: int, d: int) -> None:
    kind = mutation[0]
    if kind in HEADER_FIELDS:
        offset, fmt = HEADER_FIELDS[kind]
        if len(idx) >= offset + struct.calcsize(fmt):
            struct.pack_into(fmt, idx, offset, mutation[1])
    elif kind in ("length", "pointer", "document"):
        count = d if kind == "document" else n
        if count == 0 or len(idx) < 34 + 12 * n + 8 * d:
            return
        start, fmt = {"length": (34, "<i"), "pointer": (34 + 4 * n, "<q"),
                      "document": (34 + 12 * n, "<q")}[kind]
        struct.pack_into(fmt, idx, start + struct.calcsize(fmt) * (mutation[1] % count),
                         mutation[2])
    elif kind == "extra_document" and len(idx) >= 34:  # D + 1 and one more 8-byte entry
        struct.pack_into("<Q", idx, 26, d + 1)
        idx[34 + 12 * n + 8 * d:34 + 12 * n + 8 * d] = struct.pack("<q", mutation[1])
    elif kind == "idx_bytes" and idx:
        at = mutation[1] % len(idx)
        idx[at:at + len(mutation[2])] = mutation[2]
    elif kind == "idx_truncate":
        del idx[max(0, len(idx) - mutation[1]):]
    elif kind == "idx_append":
        idx.extend(mutation[1])
    elif kind == "bin_truncate":
        del data[max(0, len(data) - mutation[1]):]
    elif kind == "bin_append":
        data.extend(mutation[1])
    elif kind == "modes":  # the multimodal tail: one mode byte per sequence
        idx.extend((mutation[1] or b"\x01") * n)


def _write_indexed_case(case, folder: str):
    lengths = [n for doc in case["documents"] for n in doc]
    counts = [0]
    for doc in case["documents"]:
        counts.append(counts[-1] + len(doc))
    idx = bytearray(pack_index(case["code"], lengths, counts))
    itemsize = np.dtype(ITEM_FORMAT[case["code"]]).itemsize
    data = bytearray(random.Random(case["seed"]).randbytes(sum(lengths) * itemsize))
    for mutation in case["mutations"]:
        _apply_idx_mutation(idx, data, mutation, len(lengths), len(counts))
    prefix = os.path.join(folder, "data")
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(data)
    return prefix, bytes(idx), bytes(data)


def check_indexed_case(case, folder: str, outcomes: collections.Counter) -> None:
    from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError

    prefix, idx, data = _write_indexed_case(case, folder)
    expected = reference_parse(idx, len(data), case["multimodal"])
    try:
        ds = IndexedDataset(prefix, multimodal=case["multimodal"], mmap=case["mmap"])
    except IndexedDatasetError as err:
        assert expected is None, f"a valid pair was refused: {err}"
        assert prefix in str(err), f"the error does not name the file: {err}"
        outcomes["refused"] += 1
        return
    assert expected is not None, "an invalid pair was accepted"
    code, lengths, pointers, documents = expected
    dtype = np.dtype(ITEM_FORMAT[code])
    assert np.dtype(ds.dtype).newbyteorder("<") == dtype
    assert ds.sequence_lengths.tolist() == lengths and ds.sequence_pointers.tolist() == pointers
    assert ds.document_indices.tolist() == documents and len(ds) == len(lengths)
    for i, (length, pointer) in enumerate(zip(lengths, pointers)):
        assert ds[i].tobytes() == data[pointer:pointer + length * dtype.itemsize]
    if lengths:
        assert [a.tobytes() for a in ds[0:len(lengths)]] == [ds[i].tobytes()
                                                             for i in range(len(lengths))]
    for i, offset, length in case["reads"]:
        _check_partial_read(ds, data, lengths, pointers, dtype, i, offset, length)
    ds.close()
    outcomes["read"] += 1


def _check_partial_read(ds, data, lengths, pointers, dtype, i, offset, length) -> None:
    n = len(lengths)
    if not -n <= i < n:
        with pytest.raises(IndexError):
            ds.get(i, offset, length)
        return
    size = lengths[i]
    stop = size if length is None else offset + length
    if offset < 0 or stop < offset or stop > size:
        with pytest.raises(IndexError):
            ds.get(i, offset, length)
        return
    start = pointers[i] + offset * dtype.itemsize
    assert ds.get(i, offset, length).tobytes() == data[start:start + (stop - offset)
                                                       * dtype.itemsize]


def fuzz_indexed_dataset(max_examples: int, workdir: str, outcomes: collections.Counter) -> None:
    @fuzz_settings(max_examples)
    @given(indexed_cases())
    def check(case):
        check_indexed_case(case, _record_case(workdir, case), outcomes)

    check()


# ------------------------------------------------------------- JSONL of tools/preprocess_data.py

def _json_line(value, ensure_ascii: bool) -> bytes:
    # Lone surrogates written raw (ensure_ascii=False) become invalid UTF-8 on purpose.
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def _overwrite(line: bytes, at: int, patch: bytes) -> bytes:
    at = at % (len(line) + 1)
    return (line[:at] + patch + line[at + len(patch):]).replace(b"\n", b" ")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                  max_size=3), max_leaves=5)
ANY_TEXT = st.text(st.characters(codec=None), max_size=20)
NULL_TEXT = st.one_of(
    st.lists(st.integers(-3, NULL_VOCAB + 3), max_size=6).map(lambda v: " ".join(map(str, v))),
    st.lists(st.integers(-2 ** 70, 2 ** 70), max_size=2).map(lambda v: " ".join(map(str, v))),
    st.sampled_from(["1_0", "\u0663", "+7", "-0", " 4\t5 ", "", "12 abc"]))
TEXT_OBJECTS = st.builds(lambda text, extra: {**extra, "text": text},
                         st.one_of(ANY_TEXT, NULL_TEXT),
                         st.dictionaries(st.sampled_from(["id", "Text", "meta"]), JSON_VALUES,
                                         max_size=2))
GOOD_LINE = st.builds(_json_line, TEXT_OBJECTS, st.booleans())
JSONL_LINE = st.one_of(
    GOOD_LINE, GOOD_LINE, GOOD_LINE,
    st.builds(_json_line, JSON_VALUES, st.booleans()),
    st.builds(_json_line, st.dictionaries(st.sampled_from(["text", "other"]), JSON_VALUES,
                                          max_size=2), st.booleans()),
    st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"")),
    st.builds(_overwrite, GOOD_LINE, st.integers(0, 60), st.binary(min_size=1, max_size=3)),
    st.integers(1, 4000).map(lambda k: b'{"text": ' + b"[" * k),
    st.integers(4400, 5000).map(lambda k: b'{"text": "x", "n": ' + b"7" * k + b"}"),
)


@st.composite
def jsonl_cases(draw):
    return {"lines": draw(st.lists(JSONL_LINE, max_size=6)),
            "final_newline": draw(st.booleans()),
            "tokenizer": draw(st.sampled_from(["GPT2BPETokenizer", "NullTokenizer"])),
            "skip_bad_lines": draw(st.booleans()), "append_eod": draw(st.booleans()),
            "chunk_size": draw(st.sampled_from([None, 1, 2]))}


def _parse_line(raw: bytes):
    """The text of a line, or None when it is not a JSON object with a string under "text"."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001 - anything a JSON parser rejects is a bad line
        return None
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    return None


def reference_preprocess(lines, tokenizer, vocab_size: int, case):
    """``("error", line number)``, ``("empty", bad lines)`` or ``("ok", documents, bad lines)``,
    line by line."""
    per_batch = case["chunk_size"] or max(1, len(lines))
    documents, bad = [], 0
    for first in range(0, len(lines), per_batch):
        batch = list(enumerate(lines[first:first + per_batch], first + 1))
        texts = []
        for number, raw in batch:  # the tool parses a whole batch before tokenizing it
            text = _parse_line(raw)
            if text is None and not case["skip_bad_lines"]:
                return ("error", number)
            if text is None:
                bad += 1
            else:
                texts.append((number, text))
        for number, text in texts:
            try:
                ids = tokenizer.tokenize(text)
            except ValueError:
                return ("error", number)
            if any(not 0 <= t < vocab_size for t in ids):
                return ("error", number)
            if ids and case["append_eod"]:
                ids = ids + [tokenizer.eod]
            documents.append(ids)
    if not documents:  # nothing to write is an error naming the file, not an empty dataset
        return ("empty", bad)
    return ("ok", documents, bad)


def _tokenizer_flags(name: str):
    if name == "NullTokenizer":
        return ["--vocab-size", str(NULL_VOCAB)]
    from megatron.tokenizer import gpt2_vocab_files

    vocab, merges = gpt2_vocab_files()
    return ["--vocab-file", vocab, "--merge-file", merges]


def _cached_tokenizers():
    """Build each tokenizer once per process (GPT-2's takes a second to build)."""
    from tools import preprocess_data

    build, cache = preprocess_data._quiet_build_tokenizer, {}

    def cached(args):
        if args.tokenizer_type not in cache:
            cache[args.tokenizer_type] = build(args)
        return cache[args.tokenizer_type]

    preprocess_data._quiet_build_tokenizer = cached
    return cached


def check_jsonl_case(case, folder: str, tokenizers, outcomes: collections.Counter) -> None:
    from megatron.data.indexed_dataset import IndexedDataset
    from tools import preprocess_data

    data = b"\n".join(case["lines"]) + (b"\n" if case["final_newline"] else b"")
    path = os.path.join(folder, "in.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    lines = data.split(b"\n")  # as a binary file iterates: on b"\n" only
    if lines[-1] == b"":
        lines.pop()
    argv = ["--input", path, "--output-prefix", os.path.join(folder, "out"), "--tokenizer-type",
            case["tokenizer"], *_tokenizer_flags(case["tokenizer"])]
    argv += ["--skip-bad-lines"] * case["skip_bad_lines"] + ["--append-eod"] * case["append_eod"]
    argv += ["--chunk-size", str(case["chunk_size"])] if case["chunk_size"] else []
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = preprocess_data.main(argv)
        tokenizer = tokenizers(preprocess_data.get_args(argv))
    expected = reference_preprocess(lines, tokenizer, tokenizer.vocab_size, case)
    outputs = sorted(n for n in os.listdir(folder) if n != "in.jsonl")
    if expected[0] == "error":
        assert rc == 1, (expected, stderr.getvalue())
        assert f"{path}:{expected[1]}: " in stderr.getvalue(), (expected, stderr.getvalue())
        assert outputs == [], outputs
        outcomes["error"] += 1
        return
    if expected[0] == "empty":
        assert rc == 1, (expected, stderr.getvalue())
        assert f"{path}: no documents" in stderr.getvalue(), stderr.getvalue()
        assert outputs == [], outputs
        outcomes["empty"] += 1
        return
    assert rc == 0, stderr.getvalue()
    _, documents, bad = expected
    ds = IndexedDataset(os.path.join(folder, "out_text_document"))
    counts = np.cumsum([0] + [1 if doc else 0 for doc in documents]).tolist()
    assert ds.document_indices.tolist() == counts
    assert [ds[i].tolist() for i in range(len(ds))] == [doc for doc in documents if doc]
    if case["skip_bad_lines"]:
        assert f"Skipped {bad} bad line(s)" in stderr.getvalue()
    ds.close()
    outcomes["skipped" if bad else "written"] += 1


def fuzz_jsonl(max_examples: int, workdir: str, outcomes: collections.Counter) -> None:
    tokenizers = _cached_tokenizers()

    @fuzz_settings(max_examples)
    @given(jsonl_cases())
    def check(case):
        check_jsonl_case(case, _record_case(workdir, case), tokenizers, outcomes)

    check()


# -------------------------------------------------------------------------- checkpoint files

def sample_checkpoint() -> dict:
    """A small ``model_optim_rng.pt`` state with the kinds of values real ones hold."""
    import torch

    return {"args": argparse.Namespace(num_layers=2, hidden_size=8, lr=0.5, tokenizer_type="x"),
            "checkpoint_version": 3.0, "iteration": 7,
            "model": {"language_model": {"embedding": {"word_embeddings": {
                "weight": torch.arange(24, dtype=torch.float32).reshape(6, 4)}},
                "encoder": {"final_layernorm": {"bias": torch.ones(4, dtype=torch.bfloat16)}}}},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [
                {"lr": 0.5, "params": [0]}]},
            "rng_state": [{"random_rng_state": (3, tuple(range(5)), None),
                           "np_rng_state": ("MT19937", torch.arange(4), 2, 0, 0.0)}]}


def same_values(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_values(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same_values(x, y) for x, y in zip(a, b)))
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and same_values(vars(a), vars(b))
    return type(a) is type(b) and a == b


def zip_checksums_pass(path: str) -> bool:
    """Whether every member of the file is intact by its CRC-32 (zipfile reads it all)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except Exception:  # noqa: BLE001 - not a readable archive at all
        return False


CKPT_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10 ** 5), st.integers(1, 255)),
    st.tuples(st.just("overwrite"), st.integers(0, 10 ** 5), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.integers(0, 10 ** 5), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10 ** 5), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 10 ** 5)),
)


@st.composite
def checkpoint_cases(draw):
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "legacy", "random"]))
    if kind == "random":
        return {"kind": kind, "bytes": draw(st.one_of(
            st.binary(max_size=200), st.binary(max_size=200).map(lambda b: b"PK\x03\x04" + b)))}
    return {"kind": kind, "mutations": draw(st.lists(CKPT_MUTATION, min_size=1, max_size=3))}


def _mutate(data: bytearray, mutation) -> None:
    kind, at = mutation[0], mutation[1] % (len(data) + 1)
    if kind == "flip" and at < len(data):
        data[at] ^= mutation[2]
    elif kind == "overwrite":
        data[at:at + len(mutation[2])] = mutation[2]
    elif kind == "insert":
        data[at:at] = mutation[2]
    elif kind == "delete":
        del data[at:at + mutation[2]]
    elif kind == "truncate":
        del data[at:]


def check_checkpoint_case(case, folder: str, originals: dict,
                          outcomes: collections.Counter) -> None:
    from megatron.training.checkpointing import CheckpointError, load_state_file

    if case["kind"] == "random":
        data = bytearray(case["bytes"])
    else:
        data = bytearray(originals[case["kind"]])
        for mutation in case["mutations"]:
            _mutate(data, mutation)
    path = os.path.join(folder, "model_optim_rng.pt")
    with open(path, "wb") as f:
        f.write(data)
    try:
        state = load_state_file(path)
    except CheckpointError as err:
        assert path in str(err), f"the error does not name the file: {err}"
        outcomes["refused"] += 1
        return
    assert isinstance(state, dict) and "iteration" in state
    if case["kind"] != "random" and zip_checksums_pass(path):
        # Every member intact: the bytes that changed were framing, the values must not have.
        assert same_values(sample_checkpoint(), state), "intact members loaded as other values"
        outcomes["loaded intact"] += 1
    else:
        outcomes["loaded unverified"] += 1


def fuzz_checkpoint(max_examples: int, workdir: str, outcomes: collections.Counter) -> None:
    import torch

    originals = {}
    for kind, zipped in (("mutated", True), ("legacy", False)):
        buffer = io.BytesIO()
        torch.save(sample_checkpoint(), buffer, _use_new_zipfile_serialization=zipped)
        originals[kind] = buffer.getvalue()

    @fuzz_settings(max_examples)
    @given(checkpoint_cases())
    def check(case):
        check_checkpoint_case(case, _record_case(workdir, case), originals, outcomes)

    check()


# ------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("target", ["indexed_dataset", "jsonl", "checkpoint"])
def test_fuzzed_files_end_in_project_errors(target, tmp_path):
    outcomes = run_in_child(target, DEFAULT_EXAMPLES, tmp_path)
    # Both branches must have been reached, or the run checked less than it claims.
    expected = {"indexed_dataset": ["refused", "read"], "jsonl": ["error", "written"],
                "checkpoint": ["refused", "loaded intact"]}[target]
    for name in expected:
        assert outcomes.get(name, 0) > 0, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("target", ["indexed_dataset", "jsonl", "checkpoint"])
def test_fuzzed_files_many_examples(target, tmp_path):
    run_in_child(target, SLOW_EXAMPLES, tmp_path)


# -------------------------------------------------------------------- the tracker file

def reference_tracker(content: bytes):
    """What ``latest_checkpointed_iteration.txt`` says: (iteration, release) or None if garbage."""
    text = content.decode("utf-8").strip()
    if text == "release":
        return 0, True
    if text.isdecimal():
        return int(text), False
    return None


TRACKER_TEXT = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"\s*[0-9]{1,40}\s*", fullmatch=True),
    st.from_regex(r"\s*(release|RELEASE|releas|release1|-?[0-9]+\.?[0-9]*)\s*", fullmatch=True),
    st.sampled_from(["", "\n", "0", "00000000000000001000", "1e3", "0x10", "\u0661\u0662",
                     "12 13", "iter_0000100"]))


@fuzz_settings(DEFAULT_EXAMPLES * 3)
@given(TRACKER_TEXT)
def test_fuzzed_tracker_gives_iteration_or_checkpoint_error(text):
    from megatron.training.checkpointing import CheckpointError, read_tracker

    content = text.encode("utf-8")
    expected = reference_tracker(content)
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "wb") as f:
            f.write(content)
        if expected is None:
            with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
                read_tracker(folder)
        else:
            assert read_tracker(folder) == expected


@pytest.mark.parametrize("content", [
    pytest.param(b"\xff\xfe1\x000\x00", id="not-utf8"),
    pytest.param(b"9" * 5000, id="5000-digits"),
    pytest.param(None, id="folder"),
])
def test_broken_tracker_is_a_checkpoint_error(tmp_path, content):
    from megatron.training.checkpointing import CheckpointError, read_tracker

    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.mkdir() if content is None else tracker.write_bytes(content)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        read_tracker(str(tmp_path))


# ------------------------------------------------------------- checkpoints that run code

class _CodePayload:
    """Unpickles to a call that creates ``marker``: what a hostile checkpoint would hold."""

    def __init__(self, marker: str, how: str):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "exec":
            return exec, (f"open({self.marker!r}, 'w').close()",)
        return os.mkdir, (self.marker,)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("how", ["exec", "mkdir"])
def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, zipped, how):
    import torch

    from megatron.training.checkpointing import CheckpointError, load_state_file

    marker = str(tmp_path / "code_ran")
    state = sample_checkpoint()
    state["args"] = argparse.Namespace(num_layers=2, hook=_CodePayload(marker, how))
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save(state, path, _use_new_zipfile_serialization=zipped,
               pickle_protocol=pickle.HIGHEST_PROTOCOL)
    # The payload is live: an unrestricted load runs it.
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)
    (os.rmdir if how == "mkdir" else os.remove)(marker)

    with pytest.raises(CheckpointError, match="refusing to load"):
        load_state_file(path)
    assert not os.path.exists(marker)


# ---------------------------------------------------- checkpoint defects (checkpointing.py)

def _flip_tensor_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    weights = np.arange(24, dtype=np.float32).tobytes()
    at = data.find(weights)
    assert at > 0
    data[at + 9] ^= 0x40  # inside word_embeddings.weight: 2.0 becomes another float
    with open(path, "wb") as f:
        f.write(data)


def test_zip_checksums_catch_a_flipped_tensor_byte(tmp_path):
    """The proposed check works: torch writes CRC-32s that zipfile verifies."""
    import torch

    path = str(tmp_path / "model_optim_rng.pt")
    torch.save(sample_checkpoint(), path)
    assert zip_checksums_pass(path)
    _flip_tensor_byte(path)
    assert not zip_checksums_pass(path)


def test_flipped_tensor_byte_is_a_checkpoint_error(tmp_path):
    import torch

    from megatron.training.checkpointing import CheckpointError, load_state_file

    path = str(tmp_path / "model_optim_rng.pt")
    torch.save(sample_checkpoint(), path)
    _flip_tensor_byte(path)
    with pytest.raises(CheckpointError, match="model_optim_rng.pt"):
        load_state_file(path)


class _Chunk:
    """The two methods checkpoint loading asks of a model chunk."""

    def __init__(self):
        import torch

        self.weight = torch.zeros(3)

    def state_dict_for_save_checkpoint(self):
        return {"language_model": {"weight": self.weight}}

    def load_state_dict(self, tree, strict=True):
        self.weight.copy_(tree["language_model"]["weight"])


def test_checkpoint_whose_model_is_not_a_dict_is_a_checkpoint_error(tmp_path):
    import torch
    import torch.distributed as dist

    from megatron.training.checkpointing import CheckpointError, load_model_weights

    rank_dir = tmp_path / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"iteration": 1, "model": 5}, str(rank_dir / "model_optim_rng.pt"))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=None, exit_on_missing_checkpoint=True)
    pstate = argparse.Namespace(tp_rank=0, pp_rank=0, tp_size=1, pp_size=1, dp_cp_rank=0)
    with pytest.raises(CheckpointError, match="model_optim_rng.pt"):
        load_model_weights([_Chunk()], args, pstate)


# ------------------------------------------------ regressions: bugs the fuzzing found (fixed)

def _preprocess(tmp_path, lines, *extra):
    """tools/preprocess_data.py with NullTokenizer (--vocab-size 100); (exit code, stderr)."""
    from tools import preprocess_data

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / "out"),
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                   str(NULL_VOCAB), *extra])
    return rc, stderr.getvalue().replace(str(path), "IN")


HOSTILE_JSON = {
    "nested too deeply": b'{"text": ' + b"[" * 100000,
    "Exceeds the limit (4300 digits)": b'{"text": "1", "n": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("message", list(HOSTILE_JSON))
def test_hostile_json_is_a_bad_line_not_a_crash(tmp_path, message):
    """Once a RecursionError / ValueError escaped json.loads and ended the tool with a traceback,
    --skip-bad-lines or not."""
    good = b'{"text": "1 2"}'
    rc, err = _preprocess(tmp_path, [good, HOSTILE_JSON[message], good])
    assert rc == 1 and "IN:2: malformed JSON" in err and message in err, err
    rc, err = _preprocess(tmp_path, [good, HOSTILE_JSON[message], good], "--skip-bad-lines")
    assert rc == 0 and "Skipped 1 bad line(s)" in err, err
    from megatron.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [1, 2]]


NULL_TOKENIZER_TEXTS = {
    "101": "token id 101 is outside the vocabulary [0, 100)",
    "-3": "token id -3 is outside the vocabulary [0, 100)",
    "1_0": "got '1_0'",
    "\u0663": "got '\u0663'",
    "99999999999999999999": "got '99999999999999999999'",
}


@pytest.mark.parametrize("text", list(NULL_TOKENIZER_TEXTS))
def test_ids_outside_the_vocabulary_name_the_line(tmp_path, text):
    """Line 3 is the first bad one, line 4 a second. Before: an id >= the vocabulary was written
    (training would fail on it much later), '1_0' and non-ASCII digits were read by int() as
    10 and 3, a 20-digit id ended in an OverflowError traceback, a negative id was reported as
    the batch's largest id without a line, and the batch was blamed as a range of lines."""
    lines = [json.dumps({"text": t}).encode() for t in ("1 7", "3", "7 " + text, "5 x")]
    rc, err = _preprocess(tmp_path, lines, "--chunk-size", "4")
    assert rc == 1, err
    assert "IN:3: key 'text': " in err and NULL_TOKENIZER_TEXTS[text] in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_index_path_that_is_not_a_file_is_refused_quickly(tmp_path):
    """A FIFO named PREFIX.idx once blocked the reader in open() forever; a folder raised
    IsADirectoryError."""
    from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError

    (tmp_path / "dir.idx").mkdir()
    (tmp_path / "dir.bin").write_bytes(b"")
    with pytest.raises(IndexedDatasetError, match="dir.idx: not a regular file"):
        IndexedDataset(str(tmp_path / "dir"))
    os.mkfifo(tmp_path / "fifo.idx")
    (tmp_path / "fifo.bin").write_bytes(b"")
    code = ("import sys; from megatron.data.indexed_dataset import IndexedDataset, "
            "IndexedDatasetError\ntry:\n    IndexedDataset(sys.argv[1])\n"
            "except IndexedDatasetError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fifo")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert "fifo.idx: not a regular file" in proc.stdout, proc.stderr
    (tmp_path / "data.bin").mkdir()
    (tmp_path / "data.idx").write_bytes(pack_index(8, [], [0]))
    with pytest.raises(IndexedDatasetError, match="data.bin: not a regular file"):
        IndexedDataset(str(tmp_path / "data"))

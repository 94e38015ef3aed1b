"""Tokenize JSONL documents into ``.bin``/``.idx`` datasets (Megatron's preprocess_data.py).

Each line of ``--input`` is a JSON object; the text under each ``--json-keys`` key becomes a
document of the dataset ``{output_prefix}_{key}_document`` (``_sentence`` with
``--split-sentences``, where each sentence is its own sequence). Documents are written in input
order whatever ``--workers`` and ``--partitions`` are, so every setting gives the same bytes.

Speed: the main process reads lines in batches and writes arrays; ``--workers`` processes parse
JSON and tokenize a whole batch at once (tiktoken straight into numpy for GPT-2), so the tokenizer
is the limit. At most a few batches per worker are in flight, so memory stays bounded for any input
size. Outputs are written under temporary names and appear only when complete.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2
"""

import argparse
import contextlib
import glob
import gzip
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import numpy as np  # noqa: E402

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder, get_bin_path, get_idx_path, optimal_dtype)
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.tokenizer.flags import add_tokenizer_option_args  # noqa: E402
from megatron.tokenizer.gigatoken_backend import gigatoken_refusal  # noqa: E402

# A batch sent to a worker holds about this much input, or --chunk-size lines when given.
BATCH_BYTES = 256 * 1024
BATCH_MAX_LINES = 4096
# Batches in flight per worker: enough to keep workers busy, few enough to bound memory.
IN_FLIGHT_PER_WORKER = 4


class InputError(Exception):
    """Bad input or settings; the message names the flag, file or line. Exit code 1."""


class _Stopped(Exception):
    """Raised in a partition's process when the parent asks every partition to stop."""


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="JSONL file (.gz allowed), or a glob of them read in sorted order")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys whose text to tokenize; each gets its own dataset")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (one sequence each)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep the newlines between sentences")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece model, or tokenizer.json / its folder for HuggingFace")
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--vocab-size", type=int, default=None,
                       help="for NullTokenizer, and TikTokenizer (default 2**17)")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="NullTokenizer: the end-of-document id (default --vocab-size - 1)")
    group.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                       help="for TikTokenizer: the pre-tokenization regex")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="for TikTokenizer: ids 0..N-1 are special tokens")
    group.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", type=str,
                       nargs="+", default=None, dest="special_tokens",
                       help="for TikTokenizer: the first special tokens, in id order; for the "
                       "SentencePiece types with --tokenizer-sentencepiece-legacy: tokens split "
                       "out of the text")
    add_tokenizer_option_args(group)
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document")
    group.add_argument("--lang", type=str, default="english",
                       help="language of the Punkt model used by --split-sentences")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="path prefix of the outputs, without _{key}_document.bin")
    group.add_argument("--overwrite", action="store_true",
                       help="replace output datasets that exist already (default: refuse, "
                            "naming the file)")
    group.add_argument("--dataset-impl", type=str, default=None, choices=["lazy", "cached", "mmap"],
                       help="accepted for old scripts; only the mmap format is written")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing worker processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many parts processed in parallel, "
                            "then merged")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="print progress every this many documents")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted for old scripts; documents always keep their input order")
    group.add_argument("--chunk-size", type=int, default=None,
                       help="lines per worker batch (default: about 256 KiB of input per batch)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip malformed lines (bad JSON or UTF-8, missing or non-string key) "
                            "and report how many, instead of stopping at the first")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1:
        parser.error("--workers, --partitions and --log-interval must be >= 1")
    refusal = gigatoken_refusal(args.tokenizer_type) if args.use_gigatoken else None
    if refusal:
        parser.error(refusal)
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.keep_newlines and not args.split_sentences:
        print("note: --keep-newlines only matters with --split-sentences", file=sys.stderr)
    if args.dataset_impl is not None and args.dataset_impl != "mmap":
        print(f"note: --dataset-impl {args.dataset_impl} ignored; only the mmap format is written",
              file=sys.stderr)
    if args.chunk_size is not None:
        print(f"note: --chunk-size {args.chunk_size} sets the lines per worker batch; it changes "
              "speed only, never the output", file=sys.stderr)
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        print("note: BERT data is usually prepared with --split-sentences", file=sys.stderr)
    # Tokenizer settings preprocessing needs no say in (Megatron uses the same values).
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    return args


# ------------------------------------------------------------------------------------------------
# Reading input
# ------------------------------------------------------------------------------------------------


@dataclass
class Segment:
    """A run of whole lines of one file: bytes [start, end) (end None = to the end)."""

    path: str
    start: int = 0
    end: Optional[int] = None
    first_line: int = 1

    @property
    def compressed(self) -> bool:
        return self.path.endswith(".gz")

    def input_bytes(self) -> int:
        """Bytes of the file this segment covers (compressed bytes for .gz)."""
        end = os.path.getsize(self.path) if self.end is None else self.end
        return end - self.start


@dataclass
class Batch:
    path: str
    first_line: int
    lines: List[bytes]
    consumed: int  # input-file bytes read since the previous batch (compressed for .gz)


def read_batches(segments: List[Segment], chunk_lines: Optional[int]) -> Iterator[Batch]:
    """Lines of the segments, in order, grouped into batches that never span two files."""
    max_lines = chunk_lines or BATCH_MAX_LINES
    max_bytes = None if chunk_lines else BATCH_BYTES
    for segment in segments:
        try:
            yield from _read_segment(segment, max_lines, max_bytes)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"{segment.path}: cannot read input: {e}") from None


def _read_segment(segment: Segment, max_lines: int, max_bytes: Optional[int]) -> Iterator[Batch]:
    with open(segment.path, "rb") as raw:
        raw.seek(segment.start)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if segment.compressed else raw
        position, reported = segment.start, segment.start
        lines: List[bytes] = []
        size, line_number = 0, segment.first_line
        for line in stream:
            lines.append(line)
            size += len(line)
            position += len(line)
            if len(lines) >= max_lines or (max_bytes and size >= max_bytes) \
                    or (segment.end is not None and position >= segment.end):
                consumed = (raw.tell() if segment.compressed else position) - reported
                reported += consumed
                yield Batch(segment.path, line_number, lines, consumed)
                line_number += len(lines)
                lines, size = [], 0
                if segment.end is not None and position >= segment.end:
                    return
        if lines:
            end = raw.tell() if segment.compressed else position
            yield Batch(segment.path, line_number, lines, end - reported)


def input_files(pattern: str) -> List[str]:
    """The files ``--input`` names: the path itself, or the sorted matches of a glob."""
    if os.path.isfile(pattern):
        return [pattern]
    matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not matches:
        raise InputError(f"--input {pattern!r}: no such file (and no file matches it as a glob)")
    return matches


def plan_partitions(files: List[str], partitions: int) -> List[List[Segment]]:
    """Split the input into up to ``partitions`` contiguous runs of lines, in input order."""
    if partitions == 1:
        return [[Segment(f) for f in files]]
    if len(files) >= partitions:
        # Whole files, grouped contiguously by where each starts in the total size.
        sizes = [os.path.getsize(f) for f in files]
        total, before = max(sum(sizes), 1), 0
        groups: List[List[Segment]] = [[] for _ in range(partitions)]
        for f, size in zip(files, sizes):
            groups[min(before * partitions // total, partitions - 1)].append(Segment(f))
            before += size
        return [g for g in groups if g]
    if len(files) == 1 and not files[0].endswith(".gz"):
        return [[s] for s in _split_file(files[0], partitions)]
    print(f"note: --partitions {partitions} with {len(files)} input file(s); compressed files are "
          f"not split, so {len(files)} partition(s) are used", file=sys.stderr)
    return [[Segment(f)] for f in files]


def _split_file(path: str, parts: int) -> List[Segment]:
    """Byte ranges of ``path`` starting at line starts, with the line number of each start."""
    size = os.path.getsize(path)
    starts = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            f.seek(max(size * k // parts - 1, starts[-1]))
            f.readline()  # move to the start of the next line
            if f.tell() < size and f.tell() > starts[-1]:
                starts.append(f.tell())
        line_numbers = [1]
        f.seek(0)
        position, newlines = 0, 0
        for boundary in starts[1:]:
            while position < boundary:
                block = f.read(min(16 << 20, boundary - position))
                newlines += block.count(b"\n")
                position += len(block)
            line_numbers.append(newlines + 1)
    ends = starts[1:] + [None]
    return [Segment(path, s, e, n) for s, e, n in zip(starts, ends, line_numbers)]


# ------------------------------------------------------------------------------------------------
# Encoding (runs in the worker processes)
# ------------------------------------------------------------------------------------------------


class BadLine(Exception):
    """One input line cannot be used; the caller adds the file and line number."""


@dataclass
class BatchResult:
    datasets: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    documents: int = 0
    bad_lines: int = 0
    text_bytes: int = 0
    consumed: int = 0
    error: Optional[str] = None


class Encoder:
    """Turns a batch of JSONL lines into, per key: tokens, sequence lengths, sequences per document.
    """

    def __init__(self, args: argparse.Namespace, tokenizer=None):
        self.keys = list(args.json_keys)
        self.skip_bad_lines = args.skip_bad_lines
        self.tokenizer = tokenizer if tokenizer is not None else _quiet_build_tokenizer(args)
        self.dtype = np.dtype(optimal_dtype(self.tokenizer.vocab_size))
        self.eod = None
        if args.append_eod:
            try:
                self.eod = self.tokenizer.eod
            except NotImplementedError as e:
                raise InputError(f"--append-eod: {e}") from None
        self.splitter = None
        if args.split_sentences:
            from megatron.tokenizer.sentence_splitter import SentenceSplitter

            try:
                self.splitter = SentenceSplitter(args.lang, keep_newlines=args.keep_newlines)
            except ValueError as e:
                raise InputError(str(e)) from None

    def encode(self, batch: Batch) -> BatchResult:
        texts: Dict[str, List[str]] = {key: [] for key in self.keys}
        line_numbers: List[int] = []  # the input line of each kept document
        result = BatchResult(consumed=batch.consumed)
        for offset, raw in enumerate(batch.lines):
            try:
                document = self._parse(raw)
            except BadLine as e:
                if not self.skip_bad_lines:
                    result.error = f"{batch.path}:{batch.first_line + offset}: {e}"
                    return result
                result.bad_lines += 1
                continue
            result.text_bytes += len(raw)
            line_numbers.append(batch.first_line + offset)
            for key in self.keys:
                texts[key].append(document[key])
        result.documents = len(texts[self.keys[0]])
        for key in self.keys:
            try:
                result.datasets[key] = self._encode_documents(texts[key])
            except _DocumentError as e:
                result.error = f"{batch.path}:{line_numbers[e.document]}: key {key!r}: {e}"
                return result
            except ValueError as e:  # the batch failed though no single document does
                last = batch.first_line + len(batch.lines) - 1
                result.error = f"{batch.path}:{batch.first_line}-{last}: key {key!r}: {e}"
                return result
        return result

    def _parse(self, raw: bytes) -> dict:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = raw[e.start:e.start + 1]
            raise BadLine(f"invalid UTF-8 (byte {e.start} of the line: {bad!r})") from None
        try:
            document = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadLine(f"malformed JSON: {_json_error_at(e)}") from None
        except RecursionError:
            raise BadLine("malformed JSON: nested too deeply to parse") from None
        except ValueError as e:  # e.g. an integer literal longer than Python converts
            raise BadLine(f"malformed JSON: {str(e)[:120]}") from None
        if not isinstance(document, dict):
            raise BadLine(f"expected a JSON object, got {type(document).__name__}")
        for key in self.keys:
            if key not in document:
                raise BadLine(f"missing key {key!r} (--json-keys); the line has "
                              f"{sorted(document)[:10]}")
            if not isinstance(document[key], str):
                raise BadLine(f"the value of {key!r} is a JSON {type(document[key]).__name__}, "
                              "expected a string")
        return document

    def _encode_documents(self, texts: List[str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, sequence lengths, sequences per document) for one key's documents.

        Raises:
            _DocumentError: naming the first document the tokenizer rejects or that yields an id
                outside the vocabulary (which would fail only later, inside training).
        """
        if self.splitter is not None:
            pieces = [self.splitter.split(text) for text in texts]
            flat_texts = [sentence for sentences in pieces for sentence in sentences]
            counts = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        else:
            flat_texts, counts = texts, np.ones(len(texts), dtype=np.int64)
        owner = np.repeat(np.arange(len(texts)), counts)  # the document of each text piece
        try:
            tokens, lengths = self.tokenizer.tokenize_batch_flat(flat_texts)
        except ValueError:  # e.g. NullTokenizer given text that is not integers
            self._raise_for_first_failing(flat_texts, owner)
            raise
        self._check_vocabulary(tokens, lengths, owner)
        kept = lengths > 0  # empty documents and sentences add no sequence
        lengths, owner = lengths[kept], owner[kept]
        per_document = np.bincount(owner, minlength=len(texts))
        if self.eod is not None and lengths.size:
            last = np.flatnonzero(np.r_[owner[1:] != owner[:-1], True])  # each document's last
            tokens = np.insert(tokens, np.cumsum(lengths)[last], self.eod)
            lengths = lengths.copy()
            lengths[last] += 1
        return self._narrow(tokens), lengths.astype(np.int32), per_document

    def _raise_for_first_failing(self, flat_texts: List[str], owner: np.ndarray) -> None:
        """Tokenize piece by piece to name the first document that fails, for either reason."""
        for piece, text in enumerate(flat_texts):
            try:
                ids = np.asarray(self.tokenizer.tokenize(text), dtype=np.int64)
            except ValueError as e:
                raise _DocumentError(int(owner[piece]), str(e)) from None
            self._check_vocabulary(ids, np.array([ids.size]), owner[piece:piece + 1])

    def _check_vocabulary(self, tokens: np.ndarray, lengths: np.ndarray,
                          owner: np.ndarray) -> None:
        vocab_size = self.tokenizer.vocab_size
        if not tokens.size or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
            return
        at = int(np.argmax((tokens < 0) | (tokens >= vocab_size)))
        piece = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        raise _DocumentError(int(owner[piece]),
                             f"token id {int(tokens[at])} is outside the vocabulary "
                             f"[0, {vocab_size}) of the tokenizer")

    def _narrow(self, tokens: np.ndarray) -> np.ndarray:
        if tokens.size and tokens.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            low, high = int(tokens.min()), int(tokens.max())
            if high > info.max or low < info.min:
                bad = high if high > info.max else low
                raise InputError(f"token id {bad} does not fit {self.dtype.name}, chosen for a "
                                 f"vocabulary of {self.tokenizer.vocab_size}")
        return tokens.astype(self.dtype, copy=False)


def _json_error_at(error: json.JSONDecodeError) -> str:
    """``json``'s reason with its column, said once: some reasons end in "at" (``Unterminated
    string starting at``) and take the column directly, the others get "at column N"."""
    reason = error.msg
    if reason.endswith(" at"):
        return f"{reason} column {error.colno}"
    return f"{reason} at column {error.colno}"


class _DocumentError(ValueError):
    """The tokenizer cannot encode document ``document`` of a batch (its index there)."""

    def __init__(self, document: int, message: str):
        super().__init__(message)
        self.document = document

    def __reduce__(self):
        return type(self), (self.document, str(self))


def _quiet_build_tokenizer(args: argparse.Namespace):
    args = argparse.Namespace(**vars(args))
    args.rank, args.padded_vocab_size = 1, None
    try:
        return build_tokenizer(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        raise InputError(str(e)) from None


_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER_ENCODER
    if _WORKER_ENCODER is None:  # a forked worker already inherits the parent's encoder
        _WORKER_ENCODER = Encoder(args)


def _encode_in_worker(batch: Batch) -> BatchResult:
    return _WORKER_ENCODER.encode(batch)


@contextlib.contextmanager
def _default_sigterm():
    """Fork pool workers with SIGTERM's default action, so ``Pool.terminate()`` always ends them.

    A Python-level handler inherited through fork can lose a SIGTERM that arrives before the new
    worker has finished starting, leaving a worker that the pool then waits for forever.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _BoundedFeed:
    """Hands batches to ``Pool.imap`` only while fewer than ``limit`` results await the writer.

    ``imap`` otherwise reads its whole input ahead; here the pool's feeding thread waits for a free
    slot, which the writer returns after consuming each result.
    """

    def __init__(self, batches: Iterator[Batch], limit: int):
        self._batches = batches
        self._slots = threading.Semaphore(limit)
        self._stopped = False

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._batches:
            self._slots.acquire()
            if self._stopped:
                return
            yield batch

    def consumed_one(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stopped = True
        self._slots.release()


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


class Progress:
    """The periodic progress line: documents, MB, docs/s, MB/s and, when the size is known, ETA."""

    def __init__(self, interval: int, total_input_bytes: Optional[int], label: str = ""):
        self.interval, self.total, self.label = interval, total_input_bytes, label
        self.start = time.monotonic()
        self.documents = self.bad_lines = self.text_bytes = self.consumed = 0
        self._next_report = interval

    def update(self, result: BatchResult) -> None:
        self.documents += result.documents
        self.bad_lines += result.bad_lines
        self.text_bytes += result.text_bytes
        self.consumed += result.consumed
        if self.documents >= self._next_report:
            self._next_report = (self.documents // self.interval + 1) * self.interval
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        mb = self.text_bytes / 1e6
        text = (f"{self.label}Processed {self.documents} documents, {mb:.2f} MB "
                f"({self.documents / elapsed:.1f} docs/s, {mb / elapsed:.2f} MB/s)")
        if self.total and self.consumed:
            remaining = max(self.total - self.consumed, 0) * elapsed / self.consumed
            text += f", ETA {remaining:.0f} s"
        return text


def output_prefixes(output_prefix: str, keys: List[str], split_sentences: bool) -> Dict[str, str]:
    level = "sentence" if split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in keys}


def encode_segments(args: argparse.Namespace, segments: List[Segment], prefixes: Dict[str, str],
                    workers: int, label: str = "", stop=None,
                    require_documents: bool = True) -> Progress:
    """Tokenize ``segments`` into one dataset per key at ``prefixes``; all or nothing.

    ``stop`` (an Event) is checked after every batch; once set, the work is dropped. With
    ``require_documents``, input without a single document is an :class:`InputError` and
    nothing is written (a partition may be empty; the whole input may not).
    """
    encoder = Encoder(args)
    total = sum(s.input_bytes() for s in segments)
    progress = Progress(args.log_interval, total, label)
    builders: Dict[str, IndexedDatasetBuilder] = {}
    pool, feed = None, None
    try:
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(get_bin_path(prefix), encoder.dtype)
        batches = read_batches(segments, args.chunk_size)
        if workers == 1:
            results = map(encoder.encode, batches)
        else:
            global _WORKER_ENCODER
            _WORKER_ENCODER = encoder
            with _default_sigterm():
                pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(args,))
            feed = _BoundedFeed(batches, workers * IN_FLIGHT_PER_WORKER)
            results = pool.imap(_encode_in_worker, feed)
        for result in results:
            if feed is not None:
                feed.consumed_one()
            if stop is not None and stop.is_set():
                raise _Stopped()
            if result.error is not None:
                raise InputError(result.error)
            for key, (tokens, lengths, per_document) in result.datasets.items():
                builders[key].add_documents(tokens, lengths, per_document)
            progress.update(result)
        if require_documents and progress.documents == 0:
            paths = list(dict.fromkeys(s.path for s in segments))
            raise InputError(no_documents_message(args.input, paths, progress.bad_lines))
        for key, prefix in prefixes.items():
            builders[key].finalize(get_idx_path(prefix))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if feed is not None:
            feed.stop()
        if pool is not None:
            pool.terminate()
            pool.join()
    return progress


def _partition_main(index: int, args, segments, prefixes, workers: int, report, stop) -> None:
    """Body of one partition's process: encode, then send (error or None, stats) to the parent.

    Each partition has its own pipe to the parent: a partition that dies mid-message can garble
    only its own report, never block another's (as a shared queue's lock could).
    """
    # Its own process group, so that a last-resort kill also reaches this partition's pool.
    os.setpgrp()
    try:
        progress = encode_segments(args, segments, prefixes, workers, f"[partition {index}] ",
                                   stop=stop, require_documents=False)
        message = (None, (progress.documents, progress.bad_lines, progress.text_bytes))
    except _Stopped:
        message = ("stopped", None)
    except InputError as e:
        message = (str(e), None)
    except BaseException:
        message = (f"partition {index} failed:\n{traceback.format_exc()}", None)
    report.send(message)
    report.close()


def _wait_for_partitions(processes, reports) -> Dict[int, Tuple[int, int, int]]:
    """Collect every partition's stats; the first failure ends the wait with its message."""
    stats: Dict[int, Tuple[int, int, int]] = {}
    pending = dict(enumerate(reports))
    while pending:
        for connection in multiprocessing.connection.wait(list(pending.values())):
            index = next(i for i, c in pending.items() if c is connection)
            del pending[index]
            try:
                error, result = connection.recv()
            except (EOFError, OSError):
                processes[index].join()
                raise InputError(f"partition {index} exited with code "
                                 f"{processes[index].exitcode} without a report") from None
            if error is not None:
                raise InputError(error)
            stats[index] = result
    return stats


def _stop_partitions(processes, stop, grace_s: float = 60.0) -> None:
    """Ask every partition to stop (they check between batches and clean up after themselves),
    wait, and kill the process group of any partition that is still running after ``grace_s``."""
    stop.set()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
            process.join()


def run_partitions(args: argparse.Namespace, plan: List[List[Segment]],
                   prefixes: Dict[str, str]) -> Tuple[int, int, int]:
    """Encode each partition in its own process into a scratch folder, then merge in order."""
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    scratch = tempfile.mkdtemp(dir=directory, prefix=".preprocess_partitions.")
    context = multiprocessing.get_context()
    stop = context.Event()
    processes, reports = [], []
    try:
        workers = max(1, args.workers // len(plan))
        part_prefixes = [{key: os.path.join(scratch, f"part{i:04d}_{key}") for key in prefixes}
                         for i in range(len(plan))]
        for i, segments in enumerate(plan):
            reader, writer = context.Pipe(duplex=False)
            processes.append(context.Process(target=_partition_main, args=(
                i, args, segments, part_prefixes[i], workers, writer, stop)))
            processes[-1].start()
            writer.close()  # the child holds the only write end: its exit reads as end-of-file
            reports.append(reader)
        stats = _wait_for_partitions(processes, reports)
        documents, bad_lines, text_bytes = (int(sum(column)) for column in zip(*stats.values()))
        if documents == 0:
            paths = list(dict.fromkeys(s.path for segments in plan for s in segments))
            raise InputError(no_documents_message(args.input, paths, bad_lines))
        dtype = Encoder(args).dtype
        for key, prefix in prefixes.items():
            with IndexedDatasetBuilder(get_bin_path(prefix), dtype) as builder:
                for part in part_prefixes:
                    builder.add_index(part[key])
                builder.finalize(get_idx_path(prefix))
        return documents, bad_lines, text_bytes
    finally:
        _stop_partitions(processes, stop)
        for reader in reports:
            reader.close()
        shutil.rmtree(scratch, ignore_errors=True)


def no_documents_message(pattern: str, paths: List[str], bad_lines: int) -> str:
    """The one-line error for input without a single document, naming the file(s)."""
    where = paths[0] if len(paths) == 1 else f"--input {pattern!r} ({len(paths)} files)"
    if bad_lines:
        return (f"{where}: no documents: all {bad_lines} line(s) are malformed and "
                f"--skip-bad-lines skipped them; nothing written")
    return f"{where}: no documents (the input is empty); nothing written"


def check_outputs_absent(prefixes: Dict[str, str], overwrite: bool) -> None:
    """Refuse to replace an existing dataset file unless ``--overwrite`` says so."""
    if overwrite:
        return
    for prefix in prefixes.values():
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.lexists(path):
                raise InputError(f"{path} exists already (--output-prefix); pass --overwrite "
                                 f"to replace it")


def main(argv=None) -> int:
    args = get_args(argv)
    start = time.monotonic()
    try:
        files = input_files(args.input)
        if all(os.path.getsize(f) == 0 for f in files):
            raise InputError(no_documents_message(args.input, files, 0))
        prefixes = output_prefixes(args.output_prefix, args.json_keys, args.split_sentences)
        check_outputs_absent(prefixes, args.overwrite)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        plan = plan_partitions(files, args.partitions)
        if len(plan) == 1:
            progress = encode_segments(args, plan[0], prefixes, args.workers)
            documents, bad_lines, text_bytes = (progress.documents, progress.bad_lines,
                                                progress.text_bytes)
        else:
            documents, bad_lines, text_bytes = run_partitions(args, plan, prefixes)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - start
    print(f"Done: {documents} documents, {text_bytes / 1e6:.2f} MB in {elapsed:.1f} s "
          f"({text_bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)", file=sys.stderr)
    if args.skip_bad_lines:
        print(f"Skipped {bad_lines} bad line(s)", file=sys.stderr)
    for prefix in prefixes.values():
        print(f"Wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

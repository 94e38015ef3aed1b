"""Preprocessing speed against its floor, the tokenizer; and the cost of building sample indices.

Part 1 tokenizes the Python standard library (tools/build_stdlib_corpus.py, ``--max-bytes``) twice:
(a) the raw tiktoken GPT-2 encoder on the same document texts, in one process and in ``--workers``
processes (as the tool uses them), and (b) the whole ``tools/preprocess_data.py
--tokenizer-type GPT2BPETokenizer --append-eod --workers N`` run as a separate program, timed from
launch to exit. Each is repeated ``--repeats`` times, interleaved, and the fastest run counts (the
machine may be shared). The ratio tool / encoder is the preprocessing overhead (target: <= 1.2).

Part 2 times ``megatron.data._index_helpers.build_sample_idx`` on synthetic document lengths
totalling ``--tokens`` tokens and reports its peak memory.

Run::

    python benchmarks/bench_preprocess.py [--max-bytes 8000000] [--tokens 1e9] [--workers 2]
"""

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

from megatron.tokenizer import gpt2_vocab_files  # noqa: E402
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer  # noqa: E402

_TOKENIZER = None


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-bytes", type=float, default=8e6, help="corpus size in bytes")
    parser.add_argument("--include-tests", action="store_true",
                        help="also take the standard library's test folders (about 31 MB)")
    parser.add_argument("--workers", type=int, default=2, help="processes for the tool and encoder")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each timing; the fastest counts")
    parser.add_argument("--tokens", type=float, default=1e9, help="tokens for the index benchmark")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--skip-preprocess", action="store_true")
    parser.add_argument("--skip-index", action="store_true")
    return parser.parse_args(argv)


def _encode_share(texts):
    return sum(_TOKENIZER._encode_array(t).size for t in texts)


def time_encoder(texts, workers: int, pool) -> float:
    """Seconds for the raw encoder over ``texts``: one process, or ``workers`` forked processes."""
    start = time.perf_counter()
    if pool is None:
        cpu = time.process_time()
        _encode_share(texts)
        return time.perf_counter() - start, time.process_time() - cpu
    else:
        # Largest documents first, dealt out round-robin: shares of about equal bytes.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        shares = [[texts[i] for i in order[w::workers]] for w in range(workers)]
        pool.map(_encode_share, shares)
    return time.perf_counter() - start, None


def time_tool(corpus: str, prefix: str, workers: int):
    """(wall seconds, CPU seconds of the tool and its workers) for one whole run of the tool."""
    vocab, merges = gpt2_vocab_files()
    command = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
               "--output-prefix", prefix, "--json-keys", "content", "--tokenizer-type",
               "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
               "--workers", str(workers), "--log-interval", "1000000", "--overwrite"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_preprocess(args, scratch: str) -> None:
    global _TOKENIZER
    corpus = os.path.join(scratch, "stdlib.jsonl")
    builder = os.path.join(ROOT, "tools", "build_stdlib_corpus.py")
    subprocess.run([sys.executable, builder, "--output", corpus, "--max-bytes",
                    str(int(args.max_bytes))] + (["--include-tests"] if args.include_tests else []),
                   check=True, stderr=subprocess.DEVNULL)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    megabytes = os.path.getsize(corpus) / 1e6
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    start = time.perf_counter()
    _TOKENIZER = GPT2BPETokenizer(*gpt2_vocab_files())
    build_s = time.perf_counter() - start
    # Start-up only: one empty document (an input without any is refused).
    empty = os.path.join(scratch, "empty.jsonl")
    with open(empty, "w") as f:
        f.write('{"content": ""}\n')
    pool = multiprocessing.get_context("fork").Pool(args.workers) if args.workers > 1 else None
    one, many, tool, fixed = [], [], [], []
    try:
        for _ in range(args.repeats):
            one.append(time_encoder(texts, 1, None))
            if pool is not None:
                many.append(time_encoder(texts, args.workers, pool)[0])
            tool.append(time_tool(corpus, os.path.join(scratch, "out"), args.workers))
            fixed.append(time_tool(empty, os.path.join(scratch, "empty"), args.workers))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    one_wall, one_cpu = min(w for w, _ in one), min(c for _, c in one)
    tool_wall, tool_cpu = min(w for w, _ in tool), min(c for _, c in tool)
    fixed_wall, fixed_cpu = min(w for w, _ in fixed), min(c for _, c in fixed)
    encoder_s = min(many) if many else one_wall
    print(f"corpus: {len(texts)} stdlib files, {text_mb:.2f} MB of text "
          f"({megabytes:.2f} MB JSONL); {os.cpu_count()} CPUs; fastest of {args.repeats}")
    print(f"tokenizer construction (GPT-2, tiktoken):            {build_s:7.3f} s")
    print(f"(a) raw tiktoken encoder, 1 process:                 {one_wall:7.3f} s "
          f"{text_mb / one_wall:7.2f} MB/s   CPU {one_cpu:.3f} s")
    if many:
        label = f"(a) raw tiktoken encoder, {args.workers} processes:"
        print(f"{label:53s}{min(many):7.3f} s {text_mb / min(many):7.2f} MB/s")
    print(f"(b) preprocess_data.py --workers {args.workers}, whole run:      {tool_wall:7.3f} s "
          f"{text_mb / tool_wall:7.2f} MB/s   CPU {tool_cpu:.3f} s")
    print(f"(b0) the same on one empty document (start-up):      {fixed_wall:7.3f} s"
          f"                CPU {fixed_cpu:.3f} s")
    print(f"ratio tool / encoder, wall, whole run:               {tool_wall / encoder_s:.2f}x")
    print(f"ratio tool / encoder, wall, start-up subtracted:     "
          f"{(tool_wall - fixed_wall) / encoder_s:.2f}x")
    print(f"ratio tool / encoder, CPU seconds, whole run:        {tool_cpu / one_cpu:.2f}x")
    print(f"ratio tool / encoder, CPU seconds, start-up subtr.:  "
          f"{(tool_cpu - fixed_cpu) / one_cpu:.2f}x")


def bench_index(args) -> None:
    import torch  # noqa: F401  (the compiled helpers link against torch's libraries)

    from megatron.data import _index_helpers

    rng = np.random.RandomState(1234)
    mean_length = 1000.0
    num_docs = max(1, int(args.tokens / mean_length))
    sizes = np.maximum(1, rng.exponential(mean_length, num_docs)).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    doc_idx = np.arange(num_docs, dtype=np.int32)
    rng.shuffle(doc_idx)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    start = time.perf_counter()
    sample_idx = _index_helpers.build_sample_idx(sizes, doc_idx, args.seq_length, 1, tokens)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"build_sample_idx: {num_docs} documents, {tokens / 1e9:.3f}e9 tokens, "
          f"seq {args.seq_length} -> {sample_idx.shape[0] - 1} samples ({sample_idx.dtype}): "
          f"{elapsed:.3f} s; "
          f"traced peak {peak / 2**20:.1f} MiB (output {sample_idx.nbytes / 2**20:.1f} MiB, inputs "
          f"{(sizes.nbytes + doc_idx.nbytes) / 2**20:.1f} MiB); process max RSS "
          f"{after_rss / 1024:.0f} MiB (grew {(after_rss - before_rss) / 1024:.1f} MiB during "
          "the call)")


def main(argv=None) -> int:
    args = get_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_preprocess.") as scratch:
        if not args.skip_preprocess:
            bench_preprocess(args, scratch)
    if not args.skip_index:
        bench_index(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

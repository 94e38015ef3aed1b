"""Resource limits: predict memory before a run, and keep data preparation within bounded memory.

* tools/estimate_memory.py: for every pipeline stage, the parameters checked against counts worked
  out by hand and every byte figure against megatron/training/memory_accounting.py for the same
  flags; it
  warns exactly for the stages above a limit (``--memory-budget-gb``, MemTotal / ranks per node on
  CPU); it handles a 175-billion-parameter model without building a module, forming a process
  group or starting a process.
* tools/preprocess_data.py streams: its peak resident memory does not grow with the input (two
  input sizes), and it finishes under an address-space cap (RLIMIT_AS) that leaves less headroom
  above its own start-up footprint than a third of the input's size.
* The GPT dataset's indices are built over a ``.bin`` larger than this machine's RAM (a sparse
  file) with resident memory that stays a small multiple of the index arrays.
"""

import json
import os
import random
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1024 ** 2
GB = 1024 ** 3

# TP 2 x PP 2 x DP 2, h 64, 4 layers, bf16 with the distributed optimizer; NullTokenizer with
# --vocab-size 100 gives 101 ids, padded to 256 (a multiple of 128 x TP).
TINY = """--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4
--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 10
--tokenizer-type NullTokenizer --vocab-size 100 --bf16 --use-distributed-optimizer""".split()
# GPT-3 175B (Brown et al.), one rank: far beyond any machine's memory.
GPT3 = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --lr 1e-4
--train-iters 10 --tokenizer-type NullTokenizer --vocab-size 50000 --bf16""".split()


def _estimate(argv, capsys):
    from tools import estimate_memory

    assert estimate_memory.main(argv) == 0
    out = capsys.readouterr()
    rows = {}
    for line in out.out.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 6 and fields[0].isdigit():
            rows[int(fields[0])] = (int(fields[1]), *map(float, fields[2:]))
    return rows, out.err


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_estimate_per_stage_matches_hand_counts_and_accounting(capsys, monkeypatch):
    from megatron.training import memory_accounting
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rows, _ = _estimate(TINY + ["--nproc-per-node", "8"], capsys)
    # One layer on a TP-2 rank: norms 4h + QKV (3h x h + 3h)/2 + dense h x h/2 + h
    # + h->4h (4h x h + 4h)/2 + 4h->h 4h x h/2 + h = 256 + 6240 + 2112 + 8320 + 8256.
    layer = 25184
    assert rows[0][0] == 2 * layer + 256 // 2 * 64 + 32 * 64   # + word/2 + position embeddings
    assert rows[1][0] == 2 * layer + 2 * 64 + 256 // 2 * 64    # + final norm + head copy
    # bf16 weights 2 + fp32 grads 4 + (fp32 master 4 + Adam 8) / DP 2.
    assert rows[0][1] == rows[1][1] == 12.0
    args = parse_args(argv=list(TINY))
    args.world_size = 8
    validate_args(args)
    args.padded_vocab_size = 256
    for stage in (0, 1):
        est = memory_accounting.estimate_memory(args, stage, 16 // (2 * 2))
        assert rows[stage][2] == pytest.approx(est.weight_and_optimizer_bytes / MB, abs=0.006)
        assert rows[stage][3] == pytest.approx(est.activation_bytes / MB, abs=0.006)
        assert rows[stage][4] == pytest.approx(est.total_bytes / MB, abs=0.006)
        assert rows[stage][2] == pytest.approx(rows[stage][0] * 12 / MB, abs=0.006)


def test_budget_warning_names_exactly_the_stages_above_it(capsys):
    rows, _ = _estimate(TINY + ["--world-size", "8"], capsys)
    between = (rows[0][4] + rows[1][4]) / 2  # stage 0 needs more than stage 1
    assert rows[0][4] > between > rows[1][4]
    _, err = _estimate(TINY + ["--world-size", "8", "--memory-budget-gb", str(between / 1024)],
                       capsys)
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "pipeline stage 0 needs" in warnings[0], err
    assert f"--memory-budget-gb {between / 1024:g}" in warnings[0]
    _, err = _estimate(TINY + ["--world-size", "8", "--memory-budget-gb", "1"], capsys)
    assert "WARNING" not in err


def test_huge_model_warns_without_building_anything(capsys, monkeypatch):
    import multiprocessing
    import torch.distributed as dist

    from megatron.model import GPTModel

    def forbidden(*args, **kwargs):
        raise AssertionError("the estimator must not build models or start processes")

    monkeypatch.setattr(GPTModel, "__init__", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    monkeypatch.setattr(multiprocessing.Process, "start", forbidden)
    rows, err = _estimate(GPT3 + ["--nproc-per-node", "2", "--world-size", "1",
                                  "--memory-budget-gb", "80", "--device", "cpu"], capsys)
    # 96 layers of 12h^2 + 13h, embeddings (50048 padded ids + 2048 positions) x h, final norm.
    h = 12288
    params = 96 * (12 * h * h + 13 * h) + (50048 + 2048) * h + 2 * h
    assert rows[0][0] == params
    assert rows[0][1] == 18.0  # bf16 + fp32 grads + fp32 master + Adam, no sharding
    per_rank = _meminfo_total() / 2
    assert f"MemTotal {_meminfo_total() / GB:.1f} GB / 2 ranks per node = " \
           f"{per_rank / GB:.2f} GB" in err, err
    assert "more than --memory-budget-gb 80" in err
    assert not dist.is_initialized()


def test_command_line_prints_table_and_one_line_errors(capsys):
    from tools import estimate_memory

    ok = subprocess.run([sys.executable, "tools/estimate_memory.py", *TINY, "--world-size", "8",
                         "--memory-budget-gb", "1e-9"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ok.returncode == 0, ok.stderr
    assert "world size 8 = tensor-model-parallel 2 x pipeline-model-parallel 2 x " \
           "data-parallel 2" in ok.stdout
    assert ok.stderr.count("WARNING: pipeline stage") == 2
    with pytest.raises(SystemExit) as exit_info:
        estimate_memory.main(TINY + ["--world-size", "6"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "estimate_memory.py: error: world size (6) is not divisible by "
        "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2) = 4")


@pytest.mark.gpu
def test_cuda_limit_is_the_device_memory(monkeypatch):
    from tools import estimate_memory

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = estimate_memory.parse(TINY + ["--world-size", "8", "--device", "cuda"])
    limits = estimate_memory.rank_limits(args)
    assert limits[0][0] == torch.cuda.get_device_properties(0).total_memory


# ------------------------------------------------------------------ bounded-memory preparation

# Peaks come from /proc/self/status: VmHWM (resident) and VmPeak (address space) belong to this
# program's image alone, while ru_maxrss would keep the peak of the forked pytest process.
PEAKS = """
def peaks():
    status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    return [int(status[k].split()[0]) * 1024 for k in ("VmHWM", "VmPeak")]
"""
MEASURE = PEAKS + """
import sys
from tools import preprocess_data
rc = preprocess_data.main(sys.argv[1:])
print("PEAK", rc, *peaks(), flush=True)
"""


def _write_corpus(path, size_bytes: int, seed: int = 0):
    """JSONL of ~0.9 KB documents of integer ids; returns (documents, tokens)."""
    rng = random.Random(seed)
    documents = tokens = written = 0
    with open(path, "w") as f:
        while written < size_bytes:
            ids = [rng.randrange(100) for _ in range(rng.randrange(200, 400))]
            line = json.dumps({"text": " ".join(map(str, ids))}) + "\n"
            f.write(line)
            written += len(line)
            documents += 1
            tokens += len(ids)
    return documents, tokens


def _preprocess(path, prefix, address_limit=None):
    """(exit code, peak RSS, peak address space) of the tool run alone in a fresh process."""
    def cap():
        if address_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_limit, address_limit))

    proc = subprocess.run([sys.executable, "-c", MEASURE, "--input", str(path), "--output-prefix",
                           str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                           "--workers", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=cap,
                          env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    peak = [line.split() for line in proc.stdout.splitlines() if line.startswith("PEAK")]
    assert peak, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    return int(peak[0][1]), int(peak[0][2]), int(peak[0][3])


def test_preprocessing_memory_does_not_grow_with_the_input(tmp_path):
    from megatron.data.indexed_dataset import IndexedDataset

    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    _write_corpus(small, 2 * MB)
    documents, tokens = _write_corpus(large, 18 * MB, seed=1)
    rc, rss_small, vm_small = _preprocess(small, tmp_path / "small")
    assert rc == 0
    # Headroom above the small run's whole address space: a third of the large input.
    headroom = os.path.getsize(large) // 3
    rc, rss_large, vm_large = _preprocess(large, tmp_path / "large",
                                          address_limit=vm_small + headroom)
    assert rc == 0, "the tool did not finish under the address-space cap"
    print(f"peak RSS {rss_small / MB:.1f} MB for 2 MB of input, {rss_large / MB:.1f} MB for 18 MB "
          f"under an address-space cap of {(vm_small + headroom) / MB:.1f} MB")
    # Allowed: the index columns, 12 bytes per document (~0.9 KB each here), and allocator noise.
    assert rss_large - rss_small < 0.15 * (os.path.getsize(large) - os.path.getsize(small)), \
        (rss_small, rss_large)
    assert vm_large <= vm_small + headroom
    ds = IndexedDataset(str(tmp_path / "large_text_document"))
    assert len(ds) == documents and int(ds.sequence_lengths.sum()) == tokens


INDEX_BUILD = PEAKS + """
import sys
from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets
before = peaks()[0]
config = GPTDatasetConfig(seed=1234, seq_length=int(sys.argv[2]), split="1",
                          data_cache_path=sys.argv[3])
train, _, _ = build_train_valid_test_datasets(config, sys.argv[1], [1000, 0, 0])
samples = [train[i]["text"] for i in (0, 1, len(train) - 1)]
assert all(s.shape == (config.seq_length + 1,) for s in samples)
index_bytes = sum(a.nbytes for a in (train.doc_idx, train.sample_idx, train.shuffle_idx))
after = peaks()[0]
print("INDEX", len(train), index_bytes, after - before, flush=True)
"""


def test_gpt_indices_over_data_larger_than_ram(tmp_path):
    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    ram = _meminfo_total()
    per_sequence = 1 << 30  # uint16 tokens: 2 GiB of .bin each
    count = int(1.25 * ram) // (2 * per_sequence) + 1
    prefix = str(tmp_path / "huge")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    builder.add_item(np.arange(1000, dtype=np.uint16))
    builder.end_document()
    builder.finalize(get_idx_path(prefix))
    # Rewrite the pair as ``count`` sequences of 2^30 tokens over a sparse .bin.
    from tests.reliability.test_fuzz_files import pack_index

    with open(get_idx_path(prefix), "wb") as f:
        f.write(pack_index(8, [per_sequence] * count, list(range(count + 1))))
    with open(get_bin_path(prefix), "r+b") as f:
        f.truncate(count * per_sequence * 2)
    size = os.path.getsize(get_bin_path(prefix))
    if os.stat(get_bin_path(prefix)).st_blocks * 512 > 64 * MB:
        pytest.skip("this file system does not keep sparse files sparse")
    assert size > ram
    seq_length = 8192
    proc = subprocess.run([sys.executable, "-c", INDEX_BUILD, prefix, str(seq_length),
                           str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = [x for x in proc.stdout.splitlines() if x.startswith("INDEX")]
    assert line, proc.stderr[-3000:]
    samples, index_bytes, growth = map(int, line[0].split()[1:])
    assert samples == (count * per_sequence - 1) // seq_length  # one epoch covers 1000
    # The arrays (built, saved, then memory-mapped back) and the pages of three samples.
    print(f"{size / GB:.0f} GB .bin, {samples} samples: index arrays {index_bytes / MB:.1f} MB, "
          f"peak RSS growth {growth / MB:.1f} MB")
    assert growth < 3 * index_bytes + 64 * MB, (growth, index_bytes)
    assert growth < size / 100

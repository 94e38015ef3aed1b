"""Memory reports and snapshots (--log-memory-interval, --log-device-memory-used,
--record-memory-history, --memory-snapshot-path) and NVTX ranges (--nvtx-ranges): the numbers
against what /proc/self/status says (another file than the one read), the CUDA-only parts
through recording stand-ins for torch's CUDA calls, and the flags' checks."""

import argparse
import os
import pickle

import pytest
import torch

from megatron.training import hooks
from megatron.training.timers import Timers


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024           # kB
    raise AssertionError(field)


def test_cpu_memory_numbers_are_the_resident_set_and_its_peak():
    ballast = torch.ones(64 * 2 ** 20 // 4)                   # 64 MiB touched
    numbers = hooks.memory_numbers(include_device_used=False)
    rss, hwm = _status_mb("VmRSS"), _status_mb("VmHWM")
    assert numbers["allocated"] == numbers["reserved"]
    assert numbers["allocated"] == pytest.approx(rss, abs=8)
    assert numbers["max allocated"] == numbers["max reserved"]
    assert numbers["max allocated"] == pytest.approx(max(hwm, rss), abs=8)
    assert numbers["allocated"] > 64 and "total device memory used" not in numbers
    del ballast


def test_host_memory_used_is_total_minus_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:         1000000 kB\n"
                       "MemAvailable:    6144000 kB\nBuffers:           1000 kB\n")
    assert hooks._host_memory_used_mb(str(meminfo)) == pytest.approx(10240000 / 1024)


def _args(**kw):
    base = dict(log_memory_interval=2, log_device_memory_used=True, record_memory_history=False,
                memory_snapshot_path="snapshot.pickle", rank=0, world_size=1, log_interval=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_report_line_is_megatrons(capsys):
    tools = hooks.MemoryTools(_args(), dp_rank=0)
    for iteration in (1, 2, 3, 4):
        tools.after_iteration(iteration)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" memory (MB)")[0] for ln in lines] == [
        "[Rank 0] (after 2 iterations)", "[Rank 0] (after 4 iterations)"]
    fields = [part.split(":")[0].strip() for part in lines[0].split(" | ")[1:]]
    assert fields == ["allocated", "max allocated", "reserved", "max reserved",
                      "total device memory used"]
    hooks.MemoryTools(_args(), dp_rank=1).after_iteration(2)   # not data-parallel rank 0
    assert capsys.readouterr().out == ""


def test_memory_history_and_snapshots_call_torch_cuda_as_megatron_does(tmp_path, monkeypatch):
    """--record-memory-history: history on (100,000 events with stacks) before the model, an
    OOM observer that writes oom_rank-<R>_<name>, and the last rank's snapshot at iteration 1
    and every --log-interval."""
    calls, observers = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append,
                        raising=False)
    snapshots = iter(range(100))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"n": next(snapshots)})
    path = str(tmp_path / "snap.pickle")
    args = _args(record_memory_history=True, memory_snapshot_path=path, rank=3, world_size=4,
                 log_interval=5, log_memory_interval=None)
    hooks.start_memory_history(args)
    assert calls == [dict(enabled="all", context="all", stacks="python", max_entries=100000)]
    observers[0](0, 1, 2, 3)
    with open(tmp_path / "oom_rank-3_snap.pickle", "rb") as f:
        assert pickle.load(f) == {"n": 0}
    tools = hooks.MemoryTools(args, dp_rank=0)
    written = []
    for iteration in range(1, 12):
        tools.after_iteration(iteration)
        with open(path, "rb") as f:
            written.append(pickle.load(f)["n"])
    # Written after iterations 1, 5 and 10 (snapshots 1, 2, 3), unchanged in between.
    assert written == [1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3]
    os.remove(path)
    hooks.MemoryTools(_args(record_memory_history=True, memory_snapshot_path=path, rank=0,
                            world_size=4), dp_rank=0).after_iteration(1)
    assert not os.path.exists(path)                              # only the last rank writes


def test_timers_become_nvtx_ranges_while_profiling(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: events.append(("+", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(("-",)))
    timers = Timers(1)
    timers("forward-backward", log_level=1).start()
    timers("forward-backward", log_level=1).stop()
    assert events == []
    timers.nvtx = True
    timers("forward-backward", log_level=1).start()
    timers("optimizer", log_level=1).start()
    timers("optimizer", log_level=1).stop()
    timers.nvtx = False                      # a range opened while profiling still closes
    timers("forward-backward", log_level=1).stop()
    assert events == [("+", "forward-backward"), ("+", "optimizer"), ("-",), ("-",)]


def _validate(*flags):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=["--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "16",
                            "--max-position-embeddings", "16", "--micro-batch-size", "1",
                            "--device", "cpu", *flags])
    args.world_size = 1
    return validate_args(args) or args


def test_memory_flags_are_checked_in_one_line(capsys):
    from megatron.training.arguments import ArgumentsError

    with pytest.raises(ArgumentsError, match=r"--log-memory-interval \(3\) must be a positive "
                                             r"multiple of --log-interval \(2\)"):
        _validate("--log-memory-interval", "3", "--log-interval", "2")
    with pytest.raises(ArgumentsError, match="--record-memory-history records the CUDA"):
        _validate("--record-memory-history")
    capsys.readouterr()
    _validate("--log-memory-interval", "4", "--log-interval", "2", "--nvtx-ranges",
              "--pytorch-profiler-collect-chakra")
    notes = capsys.readouterr().out
    assert "--nvtx-ranges" in notes and "without --profile it has no effect" in notes
    assert "--pytorch-profiler-collect-chakra records with --profile" in notes

"""Run ``pretrain_gpt.py`` with every torch.distributed call timed (launched by bench_scaling.py).

``torchrun ... benchmarks/scaling_probe.py <pretrain_gpt flags>`` behaves like
``torchrun ... pretrain_gpt.py <flags>``, with three additions made at run time in this process
only (no project file changes):

1. Every communication entry point of ``torch.distributed`` that training reaches (collectives,
   broadcasts, point-to-point sends and receives, barriers) is replaced by a wrapper that records
   ``(op, group ranks, t_enter, t_exit)`` with ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux:
   one clock for all processes of the machine, so the ranks' records can be lined up). An
   asynchronous call (``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``) records
   its launch, and the ``wait()`` of each returned request is recorded as a second entry
   ``<op>.wait`` with the same sequence number. Calls made from inside another wrapped call
   (``batch_isend_irecv`` posting ``isend``) are not counted twice.
2. ``megatron.training.training.train_step`` is wrapped to record each iteration's start and end; calls
   are recorded only while an iteration runs.
3. Optionally (``SCALING_PROBE_PROFILE_STEP=n``) iteration ``n`` runs under ``torch.profiler``
   and the per-op self CPU times are saved; that iteration's communication records are marked
   so the analysis can leave them out (the profiler slows every op a little).

Each rank writes ``$SCALING_PROBE_DIR/rank<r>.json`` when training ends.
"""

import functools
import json
import os
import runpy
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

# Entry points that move data or synchronise ranks. Each is replaced both on
# ``torch.distributed`` and on ``distributed_c10d`` (P2POp checks ``op in [isend, irecv]``
# against the latter's names, so the two must stay the same objects).
TIMED_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
             "reduce", "gather", "scatter", "all_to_all_single", "barrier", "send", "recv",
             "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list")


class _Recorder:
    """Collects the records of this rank."""

    def __init__(self):
        self.in_step = False
        self.step = 0
        self.profiled_step = int(os.environ.get("SCALING_PROBE_PROFILE_STEP", "0"))
        self.steps = []        # [step, t_start, t_end]
        self.calls = []        # [op, group ranks, seq, t_enter, t_exit, step, caller]
        self.seq = 0
        self.depth = threading.local()
        self.op_table = None

    def group_ranks(self, group):
        if group is None or group is dist.GroupMember.WORLD:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))


REC = _Recorder()


class _TimedWork:
    """A request whose ``wait()`` is recorded; everything else goes to the real request."""

    def __init__(self, work, op, ranks, seq):
        self._work, self._op, self._ranks, self._seq = work, op, ranks, seq

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        if REC.in_step:
            REC.calls.append([self._op + ".wait", self._ranks, self._seq, start,
                              time.perf_counter(), REC.step, _site()])
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _site() -> str:
    """``file.py:function`` of the first caller outside torch, this file and the project's
    backend-neutral wrappers (megatron/core/collectives.py)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (f"{os.sep}torch{os.sep}" not in name and not name.endswith("scaling_probe.py")
                and not name.endswith("collectives.py")):
            return f"{os.path.basename(name)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _group_of(op, args, kwargs):
    if op == "batch_isend_irecv":
        return args[0][0].group if args and args[0] else None
    if "group" in kwargs:
        return kwargs["group"]
    # Positional group: broadcast(tensor, src, group), all_reduce(tensor, op, group), ...
    position = {"broadcast": 2, "all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2,
                "all_gather_single": 2, "reduce_scatter_tensor": 3, "reduce_scatter_single": 3,
                "reduce_scatter": 3, "isend": 2, "irecv": 2, "send": 2, "recv": 2,
                "barrier": 0}.get(op)
    if position is not None and len(args) > position:
        return args[position]
    return None


def _wrap(op, real):
    @functools.wraps(real)
    def timed(*args, **kwargs):
        if getattr(REC.depth, "n", 0) or not REC.in_step:
            return real(*args, **kwargs)
        REC.depth.n = 1
        try:
            start = time.perf_counter()
            result = real(*args, **kwargs)
            end = time.perf_counter()
        finally:
            REC.depth.n = 0
        ranks = REC.group_ranks(_group_of(op, args, kwargs))
        REC.seq += 1
        asynchronous = (op in ("isend", "irecv", "batch_isend_irecv")
                        or kwargs.get("async_op", False))
        REC.calls.append([op + (".launch" if asynchronous else ""), ranks, REC.seq, start, end,
                          REC.step, _site()])
        if isinstance(result, list):
            return [_TimedWork(w, op, ranks, REC.seq) for w in result]
        if result is not None and hasattr(result, "wait"):
            return _TimedWork(result, op, ranks, REC.seq)
        return result

    return timed


def install_timers() -> None:
    """Replace the communication entry points of torch.distributed with timed wrappers."""
    for op in TIMED_OPS:
        real = getattr(c10d, op, None)
        if real is None:
            continue
        timed = _wrap(op, real)
        setattr(c10d, op, timed)
        if getattr(dist, op, None) is real:
            setattr(dist, op, timed)


def _profiled_call(fn, *args, **kwargs):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn(*args, **kwargs)
    REC.op_table = [
        {"name": e.key, "count": e.count, "self_ms": e.self_cpu_time_total / 1000.0,
         "total_ms": e.cpu_time_total / 1000.0}
        for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return result


def install_step_hook() -> None:
    """Wrap megatron.training.training.train_step to mark iterations (and profile one of them)."""
    from megatron.training import training

    real = training.train_step

    @functools.wraps(real)
    def step(*args, **kwargs):
        REC.step += 1
        REC.in_step = True
        start = time.perf_counter()
        try:
            if REC.step == REC.profiled_step:
                return _profiled_call(real, *args, **kwargs)
            return real(*args, **kwargs)
        finally:
            REC.in_step = False
            REC.steps.append([REC.step, start, time.perf_counter()])

    training.train_step = step


def write_records() -> None:
    out_dir = os.environ["SCALING_PROBE_DIR"]
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
              "threads": torch.get_num_threads(), "profiled_step": REC.profiled_step,
              "steps": REC.steps, "calls": REC.calls, "op_table": REC.op_table}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    if "SCALING_PROBE_DIR" not in os.environ:
        raise SystemExit("scaling_probe.py: set SCALING_PROBE_DIR to the folder for the records "
                         "(bench_scaling.py does this)")
    sys.path.insert(0, ROOT)
    install_timers()
    install_step_hook()
    script = os.path.join(ROOT, "pretrain_gpt.py")
    sys.argv = [script] + sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        write_records()


if __name__ == "__main__":
    main()

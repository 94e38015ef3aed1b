"""Real training processes for the reliability tests, started cheaply and watched without sleeps.

A fault test needs real processes: one is killed with SIGKILL, one gets SIGTERM, one stops with an
error. A fresh Python process spends seconds importing torch, so every rank here is forked from the
multiprocessing *forkserver* of tests/multiprocess.py, which imported torch, megatron and
pretrain_gpt once (the first test that starts ranks pays for it). Each rank joins a gloo group over
a file store in its own folder (no ports), sends its console output to ``LOG_DIR/rank{r}.log`` and,
after each training run, rewrites ``LOG_DIR/result_rank{r}.pt`` with the results so far.

:func:`start` returns a :class:`RankGroup`. Its ``wait`` blocks on the processes' sentinels
until every rank has exited and, as torchrun does, kills the remaining ranks with SIGKILL as
soon as one rank fails or dies (unless told not to, to prove that they stop by themselves).

:func:`train_runs` is the body the tests run on each rank: ``pretrain()`` of pretrain_gpt, once
per run, with per-run environment (``MEGATRON_TEST_CRASH_AT``), a pause for a real signal after
a given iteration, a fake clock, and a test's own patch (fault injection, probes).
"""

import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import types
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import pretrain_gpt  # noqa: F401 - imported once in the forkserver, inherited by every rank
from megatron.training import global_vars
from megatron.training import training
from megatron.core import device, parallel_state
from tests import multiprocess

_RESULT_PATH: Optional[str] = None


def _context():
    # The shared forkserver (tests/multiprocess.py): this module is imported by each rank when
    # it unpickles the body, cheaply, since everything it imports is preloaded there.
    return multiprocess.forkserver_context()


def _rank_main(body: Callable, rank: int, world_size: int, log_dir: str, args: tuple) -> None:
    """One rank: console to its log, a gloo group over a file store, then ``body(*args)``."""
    global _RESULT_PATH
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    _RESULT_PATH = os.path.join(log_dir, f"result_rank{rank}.pt")
    torch.set_num_threads(1)
    device.configure("cpu")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(log_dir, 'store')}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        body(*args)
    except BaseException:  # noqa: BLE001 - the log shows it; the exit code says it
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no teardown: the other ranks may be gone or stuck
    dist.barrier()
    dist.destroy_process_group()


class RankGroup:
    """The processes of one multi-rank job and what they leave in ``log_dir``."""

    def __init__(self, procs, log_dir: str, events):
        self.procs = procs
        self.log_dir = log_dir
        self.events = events
        self.killed_by_launcher: List[int] = []

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def next_event(self, timeout: float = 120.0):
        """The next ``(run name, rank, pid)`` a rank posted when it paused for a signal."""
        return self.events.get(timeout=timeout)

    def wait(self, timeout: float = 120.0, kill_on_failure: bool = True) -> List[int]:
        """Exit codes (negative: killed by that signal) once every rank has exited.

        Raises:
            AssertionError: a rank still runs after ``timeout`` seconds (it hung); all are
                killed first.
        """
        deadline = time.monotonic() + timeout
        while any(p.exitcode is None for p in self.procs):
            alive = [p for p in self.procs if p.exitcode is None]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise AssertionError(f"ranks {[self.procs.index(p) for p in alive]} still ran "
                                     f"after {timeout} s (hung); logs in {self.log_dir}")
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=remaining)
            for p in alive:
                p.join(0)
            failed = any(p.exitcode not in (None, 0) for p in self.procs)
            if failed and kill_on_failure:
                for rank, p in enumerate(self.procs):
                    if p.exitcode is None:
                        self.killed_by_launcher.append(rank)
                self.kill()
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()

    def log(self, rank: int) -> str:
        path = os.path.join(self.log_dir, f"rank{rank}.log")
        with open(path, errors="replace") as f:
            return f.read()

    def results(self, rank: int) -> Dict[str, dict]:
        """Run name -> what :func:`train_runs` recorded for it on ``rank`` (finished runs)."""
        path = os.path.join(self.log_dir, f"result_rank{rank}.pt")
        if not os.path.exists(path):
            return {}
        return {r["name"]: r for r in torch.load(path, weights_only=False)}


def start(body: Callable, world_size: int, *args, log_dir: str,
          with_events: bool = False) -> RankGroup:
    """Start ``body(*args)`` on ``world_size`` forked gloo ranks; ``log_dir`` must be new.

    With ``with_events`` a queue is appended to ``args``: ranks post to it when they pause.
    """
    os.makedirs(log_dir)
    ctx = _context()
    events = ctx.Queue() if with_events else None
    full_args = args + ((events,) if with_events else ())
    procs = [ctx.Process(target=_rank_main, args=(body, r, world_size, log_dir, full_args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return RankGroup(procs, log_dir, events)


# -- the body the tests run on each rank ----------------------------------------------------------

def _pause_for_signal(events, name: str, rank: int) -> None:
    """Tell the test this rank is paused, then block until a signal arrives.

    The signal module writes a byte to the wakeup pipe whenever a signal with a Python handler
    arrives, even before this read starts, so no signal can slip past.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end)
    try:
        events.put((name, rank, os.getpid()))
        os.read(read_end, 1)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)


def _instrument(run: dict, rank: int, events) -> Callable[[], None]:
    """Wrap ``training.train_step`` for the run's pause and fake clock; returns the undo."""
    real_step, real_time = training.train_step, training.time
    steps = [0]
    pause = run.get("pause_after")  # (n-th iteration of this run, ranks that pause)

    def train_step(*a, **k):
        out = real_step(*a, **k)
        steps[0] += 1
        if pause and steps[0] == pause[0] and rank in pause[1]:
            _pause_for_signal(events, run["name"], rank)
        return out

    training.train_step = train_step
    minutes = run.get("minutes_per_iteration", {}).get(rank)
    if minutes is not None:
        training.time = types.SimpleNamespace(time=lambda: 60.0 * minutes * steps[0])

    def undo():
        training.train_step, training.time = real_step, real_time

    return undo


def _save_results(results: List[dict]) -> None:
    torch.save(results, _RESULT_PATH + ".tmp")
    os.replace(_RESULT_PATH + ".tmp", _RESULT_PATH)


def _one_run(run: dict, rank: int, events) -> dict:
    import pretrain_gpt as entry

    old_env = {key: os.environ.get(key) for key in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    # The handlers this process had before the run (inherited from whoever forked it), which a
    # run must put back.
    handlers_before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    undo = [_instrument(run, rank, events)]
    probe = {}
    try:
        if run.get("patch") is not None:
            patch_undo, probe = run["patch"](rank)
            undo.append(patch_undo)
        try:
            state = training.pretrain(entry.train_valid_test_datasets_provider,
                                      entry.model_provider, None, entry.forward_step,
                                      argv=run["argv"])
            out = {"losses": state.train_loss_history, "iteration": state.iteration,
                   "exit_requested": state.exit_requested}
        except Exception as err:  # noqa: BLE001 - a run that expects an error records it
            if not run.get("catch"):
                raise
            out = {"error": f"{type(err).__name__}: {err}"}
    finally:
        for u in reversed(undo):
            u()
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    out.update(name=run["name"], probe=probe,
               handlers_restored=(signal.getsignal(signal.SIGTERM),
                                  signal.getsignal(signal.SIGINT)) == handlers_before)
    return out


def train_runs(runs: List[dict], events=None) -> None:
    """Run ``pretrain()`` once per entry of ``runs``, in order, on this rank.

    Each run is a dict: ``name``, ``argv`` (pretrain_gpt's flags), and optionally ``env``
    (environment for this run only), ``pause_after`` (``(n, ranks)``: after the n-th iteration
    of this run, those ranks pause until a signal arrives), ``minutes_per_iteration``
    (``{rank: minutes}``: that rank's training clock), ``patch`` (``patch(rank) -> (undo,
    probe dict)``, a module-level function) and ``catch`` (record an exception and go on).
    """
    rank = dist.get_rank()
    results = []
    for run in runs:
        print(f"=== run {run['name']} ===", flush=True)
        results.append(_one_run(run, rank, events))
        _save_results(results)


def run_log(text: str, name: str) -> str:
    """The part of a rank's log written during run ``name``."""
    marker = f"=== run {name} ===\n"
    if marker not in text:
        return ""
    return text.split(marker, 1)[1].split("=== run ", 1)[0]

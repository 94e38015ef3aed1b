"""One failing rank ends the whole torchrun job within a bound and the failed rank is named.

Each test launches ``torchrun --standalone --nproc_per_node 4 pretrain_gpt.py`` on gloo with
tensor-parallel 2 x pipeline-parallel 2, so every rank has a tensor-parallel and a pipeline peer
blocked on it once it stops, then breaks rank 2 in the middle of training:

* SIGKILL (a crashed or OOM-killed process): torchrun's monitor sees the exit and stops the rest.
* a Python exception (a bug, a bad batch): the rank exits, torchrun stops the rest; torch prefixes
  the rank's traceback with ``[rank2]:``.
* a hang (slow): the rank stays alive but stops taking part. Only the collective timeout ends
  the job: ``--distributed-timeout-seconds-after-init``, which every process group takes after
  the first iteration (the hang comes later; ``--distributed-timeout-minutes``, which the groups
  are created with, has a one-minute minimum and would add 45 s of waiting; that every group is
  created with it is checked in tests/functional/test_run_control_run.py).

The checks: every process of the job is gone within the bound, torchrun exits non-zero, and its
summary lists rank 2 with the exit code of what happened to it.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD_SIZE = 4
FAILING_RANK = 2
START_TIMEOUT_S = 180   # four ranks importing torch on a busy two-core machine
DEATH_BOUND_S = 30      # torchrun's monitor polls every 0.1 s; SIGTERM ends the others at once
HANG_TIMEOUT_S = 15        # --distributed-timeout-seconds-after-init of the hang test
HANG_BOUND_S = HANG_TIMEOUT_S + 60
# Printed by rank 0 once the process group exists, so every worker is running.
INITIALIZED = r"^> initialized on "

# Wraps pretrain_gpt.py: the forward step of rank FAILING_RANK fails on its 5th call (iteration 3
# with two micro-batches), then the real script runs as ``python pretrain_gpt.py`` would.
FAULT_SCRIPT = """
import os, runpy, sys, threading, time
sys.path.insert(0, {root!r})
import megatron.training.training as training

real_pretrain = training.pretrain


def pretrain(datasets, model_provider, model_type, forward_step, *args, **kwargs):
    calls = [0]

    def faulty_forward_step(data_iterator, model):
        calls[0] += 1
        if os.environ["RANK"] == "{rank}" and calls[0] == 5:
            print(f"FAULT rank {rank} at {{time.time()!r}}", flush=True)
            if {mode!r} == "raise":
                raise RuntimeError("injected failure on rank {rank}")
            threading.Event().wait()  # alive, never answers again
        return forward_step(data_iterator, model)

    return real_pretrain(datasets, model_provider, model_type, faulty_forward_step, *args,
                         **kwargs)


training.pretrain = pretrain
sys.argv[0] = os.path.join({root!r}, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Job:
    """A torchrun job (in a session of its own); its merged output is collected line by line."""

    def __init__(self, script: str, flags):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(WORLD_SIZE), script] + list(flags)
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines, self._queue, self.workers = [], queue.Queue(), {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"no line matching {pattern!r}:\n{self.output()[-4000:]}")
            if re.search(pattern, line):
                return line

    def output(self) -> str:
        return "".join(self.lines)

    def find_workers(self) -> dict:
        """``{rank: pid}`` of the workers torchrun started (each in a session of its own)."""
        self._collect_workers()
        assert len(self.workers) == WORLD_SIZE, self.workers
        return self.workers

    def _collect_workers(self) -> None:
        for pid in _children(self.proc.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                self.workers[int(env[b"RANK"])] = pid
            except (OSError, KeyError, ValueError):
                continue

    def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for torchrun to exit."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def alive(self) -> list:
        """torchrun and workers of this job that are still running."""
        return [pid for pid in [self.proc.pid, *self.workers.values()] if _running(pid)]

    def kill(self):
        """Remove whatever is left of this job (its own processes only).

        Workers live in sessions of their own: they are looked up before torchrun goes, since
        killing torchrun alone would leave them running.
        """
        if _running(self.proc.pid):
            self._collect_workers()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._reader.join(timeout=10)
        self.proc.stdout.close()


def _stat(pid: int):
    """(state, ppid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _children(parent: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == parent:
                out.append(int(entry))
    return out


def _flags(corpus, *extra):
    return gpt_flags(corpus, 10000, tp=2, dropout=0.0, extra=[
        "--pipeline-model-parallel-size", "2", "--eval-interval", "10000", *extra])


def _summary_entry(output: str, rank: int) -> str:
    """The exit code torchrun's failure summary gives for ``rank``."""
    match = re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*: (-?\d+)",
                      output)
    assert match, f"torchrun's summary does not list rank {rank}:\n{output[-4000:]}"
    return match.group(1)


def _assert_job_gone(job: Job, elapsed: float, bound: float) -> None:
    left = job.alive()
    assert not left, f"processes {left} still running {elapsed:.0f} s after the failure"
    assert elapsed < bound
    assert job.proc.returncode != 0


@pytest.mark.slow  # about 8 s each: four torchrun ranks
@pytest.mark.parametrize("extra", [[], ["--exit-signal-handler"]],
                         ids=["plain", "exit-signal-handler"])
def test_killed_rank_ends_the_job_and_is_named(corpus, extra):
    """With --exit-signal-handler the survivors catch torchrun's SIGTERM and try to finish the
    iteration; the collective with the dead rank must still end them."""
    job = Job("pretrain_gpt.py", _flags(corpus, *extra))
    try:
        job.wait_for_line(INITIALIZED, START_TIMEOUT_S)
        job.find_workers()
        job.wait_for_line(r"^ iteration +3/", START_TIMEOUT_S)
        os.kill(job.workers[FAILING_RANK], signal.SIGKILL)
        killed_at = time.monotonic()
        job.finish(DEATH_BOUND_S)
        _assert_job_gone(job, time.monotonic() - killed_at, DEATH_BOUND_S)
    finally:
        job.kill()
    output = job.output()
    assert "pretrain_gpt.py FAILED" in output
    assert _summary_entry(output, FAILING_RANK) == str(-signal.SIGKILL), output[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in output


@pytest.mark.slow  # about 8 s: four torchrun ranks
def test_rank_that_raises_ends_the_job_and_is_named(corpus, tmp_path):
    script = tmp_path / "faulty_pretrain_gpt.py"
    script.write_text(FAULT_SCRIPT.format(root=REPO_ROOT, rank=FAILING_RANK, mode="raise"))
    job = Job(str(script), _flags(corpus))
    try:
        job.wait_for_line(INITIALIZED, START_TIMEOUT_S)
        job.find_workers()
        line = job.wait_for_line(r"^FAULT rank", START_TIMEOUT_S)
        raised_at = float(line.split(" at ")[1])
        job.finish(DEATH_BOUND_S)
        _assert_job_gone(job, time.time() - raised_at, DEATH_BOUND_S)
    finally:
        job.kill()
    output = job.output()
    # The rank's own traceback, prefixed with its rank by torch.distributed's excepthook.
    assert f"[rank{FAILING_RANK}]: RuntimeError: injected failure on rank {FAILING_RANK}" \
        in output, output[-4000:]
    assert _summary_entry(output, FAILING_RANK) == "1", output[-3000:]


class StillRunning(AssertionError):
    """The job outlived the bound that the collective timeout should set."""


@pytest.mark.slow
def test_hung_rank_ends_the_job_within_the_distributed_timeout(corpus, tmp_path):
    script = tmp_path / "hanging_pretrain_gpt.py"
    script.write_text(FAULT_SCRIPT.format(root=REPO_ROOT, rank=FAILING_RANK, mode="hang"))
    # --distributed-timeout-minutes keeps its default (10): only the shorter timeout can end
    # the job within HANG_BOUND_S.
    job = Job(str(script), _flags(corpus, "--distributed-timeout-seconds-after-init",
                                  str(HANG_TIMEOUT_S)))
    try:
        job.wait_for_line(INITIALIZED, START_TIMEOUT_S)
        job.find_workers()
        line = job.wait_for_line(r"^FAULT rank", START_TIMEOUT_S)
        hung_at = float(line.split(" at ")[1])
        job.finish(HANG_BOUND_S)
        elapsed = time.time() - hung_at
        if job.proc.returncode is None:
            raise StillRunning(f"job still running {elapsed:.0f} s after rank {FAILING_RANK} "
                               f"hung (--distributed-timeout-seconds-after-init "
                               f"{HANG_TIMEOUT_S})")
        _assert_job_gone(job, elapsed, HANG_BOUND_S)
    finally:
        job.kill()
    assert "Timed out" in job.output()

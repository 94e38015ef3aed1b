"""One run per --save folder (issue 28): two runs saving into one folder used to both report
success while overwriting each other's checkpoints.

The run that starts second stops at start-up, exit status 2, with one line naming the first run
(host, pid) and the folder, before it writes anything; the first run goes on and its checkpoints
are intact. A lock left by a killed run on this host is taken over with one NOTE line; one from
another host, or one naming no run, is refused with the file to remove. The lock is gone after a
run ends, normally or with an error.

The first run is a real training process (launch.py) that pauses after its first iteration until
the test sends it SIGUSR1, so the second run starts while the first one certainly holds the lock;
the second is the real entry point, ``python pretrain_gpt.py``.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron.checkpoint import save_lock
from megatron.errors import exit_on_user_error
from megatron.training.checkpointing import (LOCK_FILENAME, TRACKER_FILENAME,
                                             clean_interrupted_saves, read_tracker)
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks
from tests.reliability import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, save, iters=4, tp=1, extra=()):
    return gpt_flags(corpus, iters, tp=tp, extra=["--save", save, "--save-interval", "2",
                                                 "--eval-iters", "0", *extra])


def wake_on_sigusr1(rank):
    """launch.py patch: a Python handler for SIGUSR1, so the paused rank wakes on it."""
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    return (lambda: signal.signal(signal.SIGUSR1, previous)), {}


def _dead_pid():
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_lock(save, text):
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, LOCK_FILENAME)
    with open(path, "w") as f:
        f.write(text)
    return path


def test_second_run_into_the_same_folder_stops_and_the_first_is_unaffected(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    first = launch.start(launch.train_runs, 1, [{
        "name": "first", "argv": _flags(corpus, save), "pause_after": (1, [0]),
        "patch": wake_on_sigusr1}], log_dir=str(tmp_path / "first"), with_events=True)
    try:
        _, _, pid = first.next_event()                 # paused after iteration 1, holding --save
        assert os.listdir(save) == [LOCK_FILENAME]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        second = subprocess.run(
            [sys.executable, "pretrain_gpt.py"] + _flags(corpus, save), cwd=ROOT,
            env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
        assert os.listdir(save) == [LOCK_FILENAME]     # the second run wrote nothing
        os.kill(pid, signal.SIGUSR1)
        assert first.wait() == [0], first.log(0)[-3000:]
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr == (
        f"pretrain_gpt.py: error: --save {save} is in use by another run (host "
        f"{socket.gethostname()}, pid {pid}; lock {os.path.join(save, LOCK_FILENAME)}): two "
        "runs saving into one folder overwrite each other's checkpoints; stop that run or choose "
        "another --save\n")
    assert " iteration " not in second.stdout          # stopped before training
    assert [i for i, _ in first.results(0)["first"]["losses"]] == [1, 2, 3, 4]
    assert read_tracker(save) == (4, False)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]


def test_every_rank_stops_when_the_folder_is_locked(tmp_path, corpus):
    """Two tensor-parallel ranks: rank 0 finds the lock of a live run (this test process) and
    both ranks raise its error before building anything; the lock is left as it was."""
    save = str(tmp_path / "ckpt")
    lock, _ = save_lock.acquire(save)
    try:
        with pytest.raises(AssertionError) as failure:
            run_on_ranks(run_pretrain, 2, _flags(corpus, save, tp=2))
        report = str(failure.value)
        for rank in (0, 1):
            assert f"--- rank {rank} of 2 failed" in report, report[-3000:]
        assert report.count(f"SaveDirLockedError: --save {save} is in use by another run (host "
                            f"{socket.gethostname()}, pid {os.getpid()};") == 2, report[-3000:]
        assert os.listdir(save) == [LOCK_FILENAME]
    finally:
        lock.release()
    assert os.listdir(save) == []


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path, corpus, capfd):
    save = str(tmp_path / "ckpt")
    dead = _dead_pid()
    _write_lock(save, json.dumps({"host": socket.gethostname(), "pid": dead,
                                  "started": "2026-12-01 10:00:00"}))
    out = run_on_ranks(run_pretrain, 1, _flags(corpus, save, iters=2))[0]
    assert [i for i, _ in out["losses"]] == [1, 2]
    notes = [line for line in capfd.readouterr().out.splitlines()
             if line.startswith("NOTE: --save")]
    assert notes == [f"NOTE: --save {save}: took over {LOCK_FILENAME}, left by a run that is "
                     f"gone (host {socket.gethostname()}, pid {dead}, started 2026-12-01 10:00:00; "
                     "killed, or its node lost)"]
    assert sorted(os.listdir(save)) == ["iter_0000002", TRACKER_FILENAME]


def fail_after_setup(rank):
    """launch.py patch: building the data fails (an error, or Ctrl-C's KeyboardInterrupt, as
    the run's env says) after recording in a file whether --save was locked then."""
    from megatron.data.dataset_utils import DataError
    from megatron.training import training

    real = training.build_chunk_data_iterators

    def failing(provider, args, *rest, **kwargs):
        with open(os.environ["LOCK_PROBE"], "w") as f:
            f.write(str(os.path.exists(os.path.join(args.save, LOCK_FILENAME))))
        if os.environ["FAILURE"] == "interrupt":
            raise KeyboardInterrupt
        raise DataError("--data-path: injected failure")

    training.build_chunk_data_iterators = failing
    return (lambda: setattr(training, "build_chunk_data_iterators", real)), {}


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_lock_is_gone_after_a_failing_run(tmp_path, corpus, failure):
    """The run holds the lock while it builds its data; that fails (an error, or Ctrl-C), and
    the lock goes with the run."""
    save, probe = str(tmp_path / "ckpt"), str(tmp_path / "probe")
    run = launch.start(launch.train_runs, 1, [{
        "name": "fail", "argv": _flags(corpus, save), "patch": fail_after_setup,
        "env": {"LOCK_PROBE": probe, "FAILURE": failure}, "catch": True}],
        log_dir=str(tmp_path / "logs"))
    assert run.wait() == [0 if failure == "error" else 1]
    with open(probe) as f:
        assert f.read() == "True"
    if failure == "error":
        assert run.results(0)["fail"]["error"] == "DataError: --data-path: injected failure"
    else:
        assert "KeyboardInterrupt" in run.log(0)
    assert os.listdir(save) == []


# -- the lock alone, without training -------------------------------------------------------------

def test_lock_from_another_host_is_refused(tmp_path):
    save = str(tmp_path)
    path = _write_lock(save, json.dumps({"host": "node-17.cluster", "pid": os.getpid()}))
    with pytest.raises(save_lock.SaveDirLockedError) as err:
        save_lock.acquire(save)
    assert str(err.value) == (
        f"--save {save} is locked by a run on host node-17.cluster (pid {os.getpid()}), which "
        f"this host ({socket.gethostname()}) cannot check: if that run is gone, remove {path} "
        "and start again; else choose another --save")
    assert err.value.exit_code == 2


def test_lock_naming_no_run_is_refused(tmp_path):
    path = _write_lock(str(tmp_path), "garbage")
    with pytest.raises(save_lock.SaveDirLockedError, match=rf"is locked by {path}, which names "
                       rf"no run \(it holds 'garbage'\); if no run is saving into .*, remove "):
        save_lock.acquire(str(tmp_path))


def test_live_lock_is_refused_and_release_removes_only_its_own(tmp_path):
    save = str(tmp_path)
    _write_lock(save, json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))
    with pytest.raises(save_lock.SaveDirLockedError, match=f"pid {os.getppid()}; lock"):
        save_lock.acquire(save)
    os.remove(os.path.join(save, LOCK_FILENAME))
    lock, notes = save_lock.acquire(save)
    assert notes == []
    with pytest.raises(save_lock.SaveDirLockedError, match=f"pid {os.getpid()}; lock"):
        save_lock.acquire(save)                        # a second run in this very process
    assert clean_interrupted_saves(save) == []          # start-up tidying keeps the lock
    _write_lock(save, "another run's lock now")
    lock.release()
    assert os.listdir(save) == [LOCK_FILENAME]        # not ours any more: left alone


def test_every_rank_error_is_printed_once(capsys, monkeypatch):
    """A verdict every rank raises is printed by rank 0 alone, with its own exit status."""
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        err = save_lock.SaveDirLockedError("--save x is in use")
        err.every_rank_raises = True
        with pytest.raises(SystemExit) as exit_info:
            with exit_on_user_error(prog="pretrain_gpt.py"):
                raise err
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == ("pretrain_gpt.py: error: --save x is in use\n"
                                           if printed else "")

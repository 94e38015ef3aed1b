"""Graceful stops: real SIGTERM / SIGINT with --exit-signal-handler, --exit-duration-in-mins and
--exit-interval save a checkpoint on every rank and exit with status 0, and the pieces resume
into exactly the run that never stopped.

The signals are real: the test sends them with ``os.kill`` to the rank processes. To make the
iteration they land in deterministic, a rank pauses after a chosen iteration until a signal
arrives (launch.py's wakeup-pipe pause, which no signal can slip past); the run must then stop at
that iteration's boundary. The last test runs the real entry point under torchrun.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_file, read_tracker
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.reliability import launch
from tests.reliability.test_crash_during_save import _assert_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _same_state(root_a, root_b, iteration, tp_size=2):
    for tp_rank in range(tp_size):
        a = torch.load(checkpoint_file(root_a, iteration, tp_rank, 0, 1), weights_only=False)
        b = torch.load(checkpoint_file(root_b, iteration, tp_rank, 0, 1), weights_only=False)
        for key in ("iteration", "model", "optimizer", "opt_param_scheduler", "rng_state"):
            _assert_equal(a[key], b[key], f"{root_a} vs {root_b}: iteration {iteration} {key}")


def test_signals_and_exit_flags_stop_save_and_resume_exactly(tmp_path, corpus):
    """Two tensor-parallel ranks (each writes its own file), six iterations, in one pair of
    processes, runs in order:

    * ``ref``: never stops.
    * ``sigterm``: SIGTERM reaches rank 1 alone while it pauses after iteration 2: both ranks
      save iteration 2 and stop there.
    * ``sigint``: SIGINT (Ctrl-C) reaches both ranks after iteration 2, with --async-save and a
      save every iteration: the exit waits for the background save of 2 and publishes it.
    * ``timed``: resumes the ``sigterm`` folder; only rank 1's clock passes
      --exit-duration-in-mins 1 (45 s per iteration), after iteration 4: both stop there.
    * ``interval``: resumes; --exit-interval 5 stops after iteration 5.
    * ``rest``: resumes and finishes iteration 6.

    The pieces' losses are the reference's, bit for bit, and so is the final checkpoint; the
    signalled runs skip the final evaluation and put the signal handlers back.
    """
    base = gpt_flags(corpus, 6, tp=2, extra=["--ckpt-format", "torch"])   # files compared
    ref, stop, ctrl_c = (str(tmp_path / n) for n in ("ref", "stop", "ctrl_c"))
    resume = ["--load", stop, "--save", stop]
    runs = [
        {"name": "ref", "argv": base + ["--save", ref]},
        {"name": "sigterm", "argv": base + ["--save", stop, "--exit-signal-handler"],
         "pause_after": (2, [1])},
        {"name": "sigint", "argv": base + ["--save", ctrl_c, "--exit-signal-handler",
                                           "--async-save", "--save-interval", "1"],
         "pause_after": (2, [0, 1])},
        {"name": "timed", "argv": base + resume + ["--exit-duration-in-mins", "1"],
         "minutes_per_iteration": {1: 0.75}},
        {"name": "interval", "argv": base + resume + ["--exit-interval", "5"]},
        {"name": "rest", "argv": base + resume},
    ]
    group = launch.start(launch.train_runs, 2, runs, log_dir=str(tmp_path / "logs"),
                         with_events=True)
    try:
        name, rank, pid = group.next_event()
        assert (name, rank, pid) == ("sigterm", 1, group.pids[1])
        os.kill(pid, signal.SIGTERM)
        for _ in range(2):
            name, rank, pid = group.next_event()
            assert name == "sigint" and pid == group.pids[rank]
            os.kill(pid, signal.SIGINT)
    finally:
        codes = group.wait()
    assert codes == [0, 0], group.log(0)[-3000:]

    results = group.results(1)
    losses = results["ref"]["losses"]
    assert [i for i, _ in losses] == [1, 2, 3, 4, 5, 6]
    pieces = [results[n]["losses"] for n in ("sigterm", "timed", "interval", "rest")]
    assert [[i for i, _ in p] for p in pieces] == [[1, 2], [3, 4], [5], [6]]
    assert sum(pieces, []) == losses
    assert results["sigint"]["losses"] == losses[:2]

    log = group.log(0)
    for name, why in (("sigterm", "exiting at iteration 2: received SIGTERM"),
                      ("sigint", "exiting at iteration 2: received SIGINT"),
                      ("timed", "exiting at iteration 4: exceeded --exit-duration-in-mins 1"),
                      ("interval", "exiting at iteration 5: reached --exit-interval 5")):
        assert why in launch.run_log(log, name), name
        assert "validation loss at the end of training" not in launch.run_log(log, name)
        for rank in range(2):
            out = group.results(rank)[name]
            assert out["exit_requested"] and out["handlers_restored"], (name, rank)
    assert "validation loss at the end of training" in launch.run_log(log, "rest")

    for folder, iterations in ((stop, [2, 4, 5, 6]), (ctrl_c, [1, 2])):
        assert sorted(os.listdir(folder)) == [f"iter_{i:07d}" for i in iterations] + [
            TRACKER_FILENAME]
        assert read_tracker(folder) == (iterations[-1], False)
        for i in iterations:
            assert os.listdir(os.path.join(folder, f"iter_{i:07d}")) in (
                ["mp_rank_00", "mp_rank_01"], ["mp_rank_01", "mp_rank_00"])
    _same_state(stop, ref, 6)
    _same_state(ctrl_c, stop, 2)  # the background save wrote what the synchronous one did


def _children(pid):
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.slow  # three fresh processes import torch: about 30 s on two busy cores
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers in /proc")
def test_torchrun_sigterm_saves_every_rank_and_exits_0(tmp_path, corpus):
    """The real entry point under torchrun, two tensor-parallel ranks, 1000 iterations planned:
    once iteration 2 is logged, every worker gets SIGTERM (as a cluster scheduler sends it).
    They stop at the same iteration boundary, both write their file of it, the tracker names it,
    and torchrun exits with 0 because every worker did."""
    save = str(tmp_path / "ckpt")
    flags = gpt_flags(corpus, 1000, tp=2, extra=["--save", save, "--exit-signal-handler",
                                                 "--ckpt-format", "torch"])   # files read
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "pretrain_gpt.py"] + flags, cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if re.match(r"^ iteration +2/ +1000 \|", line):
                break
        workers = _children(proc.pid)
        assert len(workers) == 2, "".join(seen)[-3000:]
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        out = "".join(seen) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    stopped = re.findall(r"exiting at iteration (\d+): received SIGTERM", out)
    assert len(stopped) == 1, out[-3000:]
    iteration = int(stopped[0])
    assert 2 <= iteration < 1000
    assert read_tracker(save) == (iteration, False)
    assert sorted(os.listdir(save)) == [f"iter_{iteration:07d}", TRACKER_FILENAME]
    for tp_rank in range(2):
        state = torch.load(checkpoint_file(save, iteration, tp_rank, 0, 1), weights_only=False)
        assert state["iteration"] == iteration
        assert state["args"].consumed_train_samples == 4 * iteration

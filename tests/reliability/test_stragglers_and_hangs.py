"""Three data-parallel gloo ranks, one of them made slow or stuck on purpose.

* --log-straggler: rank 1 sleeps in every forward step; the report rank 0 prints at every
  --log-interval must name rank 1 as the slowest (MxRtt, MnEtpt), the TensorBoard scalars
  written by rank 2 likewise, and the losses must equal those of a run without the flag. With
  --disable-straggler-on-startup the report stays silent until rank 0's control port is asked
  to turn it on, then lists --straggler-minmax-count ranks.
* --hang-dump-timeout-s: rank 1 stops inside its third forward step while ranks 0 and 2 wait
  for it in the loss all-reduce; within the timeout and a margin every rank has written its
  stacks and exited with the watchdog's code, and the verdict names rank 1. Then the same
  under torchrun with tensor and pipeline peers.
"""

import os
import re
import socket
import time
import urllib.request

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.reliability import launch

WORLD_SIZE = 3
SLOW_RANK = 1          # neither the rank that prints (0) nor the one with TensorBoard (2)
SLEEP_S = 0.4          # per forward step: far above a tiny model's step time, even on a busy CPU
HANG_TIMEOUT_S = 4.0
HANG_MARGIN_S = 25.0   # a loaded two-core machine: polling, writing, waiting for the others


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, *extra):
    return gpt_flags(corpus, iters, micro_batch=1, global_batch=3, dropout=0.0,
                     extra=["--eval-interval", "10000", "--eval-iters", "0", *extra])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slow_forward(rank, hang_at=None):
    """On SLOW_RANK: every forward step sleeps SLEEP_S, or, from call ``hang_at`` on, stays
    stuck. Returns the undo."""
    import pretrain_gpt

    real = pretrain_gpt.forward_step
    calls = [0]

    def sleepy_forward_step(data_iterator, model):
        calls[0] += 1
        if hang_at is not None and calls[0] == hang_at:
            print(f"HANG rank {rank} at {time.time()!r}", flush=True)
            time.sleep(600)
        if hang_at is None:
            time.sleep(SLEEP_S)
        return real(data_iterator, model)

    if rank == SLOW_RANK:
        pretrain_gpt.forward_step = sleepy_forward_step
    return lambda: setattr(pretrain_gpt, "forward_step", real)


def _slow_rank(rank):
    return _slow_forward(rank), {}


def _slow_rank_and_toggle(rank):
    """Also: rank 0 asks its control port to turn the report on after its second step."""
    from megatron.training import training

    undo_slow = _slow_forward(rank)
    real_step, steps, answers = training.train_step, [0], []

    def train_step(*a, **k):
        out = real_step(*a, **k)
        steps[0] += 1
        if rank == 0 and steps[0] == 2:
            port = os.environ["TEST_STRAGGLER_PORT"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=30) as response:
                answers.append(response.read().decode())
        return out

    training.train_step = train_step

    def undo():
        training.train_step = real_step
        undo_slow()

    return undo, {"answers": answers}


def _hang_rank(rank):
    return _slow_forward(rank, hang_at=3), {}


def _report_lines(log: str):
    return [line for line in log.splitlines() if "MnRtt/Rnk" in line]


def _named(line: str, field: str) -> int:
    return int(re.search(rf"{field}/Rnk: [0-9.]+(?:ms|TF)/(\d+)", line).group(1))


def _tensorboard_ranks(folder: str, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {int(e.step): int(e.value) for e in acc.Scalars(tag)}


@pytest.mark.slow
def test_straggler_report_names_the_slowed_rank(tmp_path, corpus):
    tb, port = str(tmp_path / "tb"), _free_port()
    runs = [
        {"name": "plain", "argv": _flags(corpus, 6, "--log-interval", "3")},
        {"name": "report", "argv": _flags(corpus, 6, "--log-interval", "3", "--log-straggler",
                                          "--tensorboard-dir", tb, "--straggler-ctrlr-port",
                                          str(_free_port()), "--timing-log-level", "1"),
         "patch": _slow_rank},
        {"name": "toggled", "argv": _flags(corpus, 6, "--log-interval", "3", "--log-straggler",
                                           "--disable-straggler-on-startup",
                                           "--straggler-minmax-count", "2",
                                           "--straggler-ctrlr-port", str(port)),
         "patch": _slow_rank_and_toggle, "env": {"TEST_STRAGGLER_PORT": str(port)}},
    ]
    group = launch.start(launch.train_runs, WORLD_SIZE, runs, log_dir=str(tmp_path / "logs"))
    assert group.wait(timeout=600) == [0] * WORLD_SIZE, group.log(0)[-3000:]
    log0 = group.log(0)
    results = group.results(WORLD_SIZE - 1)
    assert results["report"]["losses"] == results["plain"]["losses"]   # bit for bit

    assert _report_lines(launch.run_log(log0, "plain")) == []
    report = _report_lines(launch.run_log(log0, "report"))
    assert len(report) == 2, log0[-3000:]                # iterations 3 and 6
    for line in report:
        assert _named(line, "MxRtt") == SLOW_RANK and _named(line, "MnEtpt") == SLOW_RANK
        assert _named(line, "MnRtt") != SLOW_RANK and _named(line, "MxEtpt") != SLOW_RANK
        # --timing-log-level 1 adds the timers' sections (which include waiting for peers).
        assert "| MnFwdBwd/Rnk: " in line and "| MxOptim/Rnk: " in line
    assert all(_report_lines(group.log(r)) == [] for r in range(1, WORLD_SIZE))  # rank 0 only
    assert _tensorboard_ranks(tb, "straggler/MaxRoundTripTime-rank") == {3: SLOW_RANK,
                                                                         6: SLOW_RANK}

    toggled = launch.run_log(log0, "toggled")
    answers = group.results(0)["toggled"]["probe"]["answers"]
    assert answers == ["Will turn StragglerDetector ON at next logging interval"]
    lines = _report_lines(toggled)
    assert len(lines) == 1, toggled[-3000:]             # off at 3, switched on there, 6 reported
    bottom = re.search(r"\^\^\^\^ Bottom 2 Ranks with lowest  Etpt\(TF\):(.*)", toggled)
    top = re.search(r"\^\^\^\^ Top    2 Ranks with highest Etpt\(TF\):(.*)", toggled)
    bottom_ranks = [int(r) for r in re.findall(r"/(\d+),", bottom.group(1))]
    top_ranks = [int(r) for r in re.findall(r"/(\d+),", top.group(1))]
    assert bottom_ranks[0] == SLOW_RANK and len(bottom_ranks) == 2
    assert SLOW_RANK not in top_ranks and len(top_ranks) == 2


@pytest.mark.slow
def test_hang_watchdog_dumps_every_rank_and_names_the_missing_one(tmp_path, corpus):
    dumps = tmp_path / "dumps"
    runs = [{"name": "hang", "patch": _hang_rank,
             "argv": _flags(corpus, 10, "--hang-dump-timeout-s", str(HANG_TIMEOUT_S),
                            "--hang-dump-dir", str(dumps), "--distributed-timeout-minutes",
                            "1")}]
    group = launch.start(launch.train_runs, WORLD_SIZE, runs, log_dir=str(tmp_path / "logs"))
    codes = group.wait(timeout=300, kill_on_failure=False)
    ended = time.time()
    from megatron.training.watchdog import HANG_EXIT_CODE

    assert codes == [HANG_EXIT_CODE] * WORLD_SIZE, group.log(0)[-3000:]
    hung_at = float(re.search(r"HANG rank 1 at ([0-9.]+)", group.log(SLOW_RANK)).group(1))
    assert ended - hung_at < HANG_TIMEOUT_S + HANG_MARGIN_S
    for rank in range(WORLD_SIZE):
        text = (dumps / f"hang_rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank} of {WORLD_SIZE} on ")
        assert "iteration 3 train-step" in text.splitlines()[0]
        if rank == SLOW_RANK:
            assert "in sleepy_forward_step" in text
        else:
            assert "in all_reduce" in text and "in loss_func" in text, text
    log0 = group.log(0)
    assert "hang watchdog: rank(s) 1 did not arrive where the others wait" in log0, log0[-3000:]
    assert re.search(r"rank 0: iteration 3 train-step, waiting in torch\.distributed\."
                     r"all_reduce called at \S+pretrain_gpt\.py:\d+ in loss_func", log0)
    assert re.search(r"rank 1: iteration 3 train-step, not in a collective, at \S+:\d+ in "
                     r"sleepy_forward_step", log0)


@pytest.mark.slow
def test_hang_watchdog_under_torchrun_with_tensor_and_pipeline_peers(tmp_path, corpus):
    """torchrun, TP=2 x PP=2 over 4 ranks, rank 2 stuck in its forward step: its tensor peer
    waits in a tensor-parallel collective and the first stage in a pipeline receive (a
    ``.wait()`` on a handle); only rank 2 is named, every rank leaves its stacks, and the job
    ends."""
    from tests.reliability import test_failing_rank as failing

    script = tmp_path / "hanging_pretrain_gpt.py"
    script.write_text(failing.FAULT_SCRIPT.format(root=failing.REPO_ROOT,
                                                  rank=failing.FAILING_RANK, mode="hang"))
    dumps = tmp_path / "dumps"
    timeout_s = 8.0
    job = failing.Job(str(script), failing._flags(
        corpus, "--hang-dump-timeout-s", str(timeout_s), "--hang-dump-dir", str(dumps),
        "--distributed-timeout-minutes", "1"))
    try:
        job.wait_for_line(failing.INITIALIZED, failing.START_TIMEOUT_S)
        job.find_workers()
        line = job.wait_for_line(r"^FAULT rank", failing.START_TIMEOUT_S)
        hung_at = float(line.split(" at ")[1])
        job.finish(timeout_s + HANG_MARGIN_S + 15)
        elapsed = time.time() - hung_at
        assert not job.alive(), f"still running {elapsed:.0f} s after the hang"
        assert elapsed < timeout_s + HANG_MARGIN_S + 15
        assert job.proc.returncode != 0
    finally:
        job.kill()
    output = job.output()
    assert "hang watchdog: rank(s) 2 did not arrive where the others wait" in output, \
        output[-4000:]
    assert re.search(r"rank 3: iteration \d+ train-step, waiting in torch\.distributed\.", output)
    assert re.search(r"rank 0: iteration \d+ train-step, waiting for an asynchronous "
                     r"communication", output), output[-4000:]
    for rank in range(failing.WORLD_SIZE):
        text = (dumps / f"hang_rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank} of {failing.WORLD_SIZE} on ")
    assert "in faulty_forward_step" in (dumps / "hang_rank2.txt").read_text()

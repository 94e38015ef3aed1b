"""--step-batch-size-schedule and --decrease-batch-size-if-needed in real runs: batches, consumed
samples and the LR schedule against Megatron's rules, and a resume from a checkpoint saved in
the middle of the schedule reproduces the uninterrupted run."""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags
from tests.functional.test_training_options import (_log_lines, _run_named, _without, corpus,
                                                     megatron_cosine_lr)
from tests.multiprocess import run_on_ranks

__all__ = ["corpus"]  # the shared corpus fixture
pytestmark = pytest.mark.slow  # one spawned process, five short runs


def _schedule_flags(corpus, extra=()):
    flags = gpt_flags(corpus, 1, micro_batch=2, global_batch=4, dropout=0.0)
    flags = _without(_without(flags, "--train-iters"), "--lr-warmup-iters")
    # --seq-length 16: thresholds 64 and 320 tokens are 4 and 20 samples.
    return flags + ["--train-samples", "40", "--lr-warmup-samples", "4",
                    "--step-batch-size-schedule", "0:2 64:4 320:8"] + list(extra)


def _decrease_flags(corpus, global_batch):
    flags = gpt_flags(corpus, 1, micro_batch=2, global_batch=global_batch, dropout=0.0)
    flags = _without(_without(flags, "--train-iters"), "--lr-warmup-iters")
    return flags + ["--train-samples", "20", "--lr-warmup-samples", "4"]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("schedule"))
    save = os.path.join(root, "ckpt")
    scenarios = [
        ("straight", {"argv": _schedule_flags(corpus)}),
        ("stopped", {"argv": _schedule_flags(corpus, ["--save", save, "--exit-interval", "3"])}),
        ("resumed", {"argv": _schedule_flags(corpus, ["--save", save, "--load", save])}),
        ("decrease", {"argv": _decrease_flags(corpus, 5) + ["--decrease-batch-size-if-needed"]}),
        ("batch4", {"argv": _decrease_flags(corpus, 4)}),
    ]
    return run_on_ranks(_run_named, 1, scenarios, timeout=240)[0]


def test_step_schedule_batches_consumed_and_lr(runs):
    """Batches 2, 2 (to 4 samples), 4 x 4 (to 20), then 8s: 36 + 8 > 40, so 8 iterations; the
    LR (cosine over 40 samples, warmup 4) is stepped by each iteration's batch."""
    out = runs["straight"]
    batches = [2, 2, 4, 4, 4, 4, 8, 8]
    consumed = [sum(batches[:i + 1]) for i in range(len(batches))]
    lines = _log_lines(out["stdout"])
    assert [int(m[1]) for m in lines] == list(range(1, 9))
    assert {int(m[2]) for m in lines} == {8}
    assert [int(m[5]) for m in lines] == batches
    assert [int(m[3]) for m in lines] == consumed
    assert out["consumed"] == 36
    for m, step in zip(lines, consumed):
        want = megatron_cosine_lr(step, 4, 40, 5e-3, 1e-4)
        assert float(m[4]) == pytest.approx(want, rel=1e-5), (m[0], want)


def test_step_schedule_resume_matches_the_uninterrupted_run(runs):
    """Saved after iteration 3 (8 samples, inside the batch-4 segment); the resumed run starts
    there and its losses, batches and consumed samples are the straight run's, bit for bit."""
    straight, stopped, resumed = runs["straight"], runs["stopped"], runs["resumed"]
    assert stopped["iteration"] == 3 and stopped["consumed"] == 8
    assert resumed["start"]["iteration"] == 3 and resumed["start"]["consumed"] == 8
    assert resumed["start"]["scheduler_steps"] == 8
    assert resumed["losses"] == straight["losses"][3:]
    assert stopped["losses"] == straight["losses"][:3]
    assert resumed["scalars"] == straight["scalars"][3:]
    assert resumed["consumed"] == 36


def test_decrease_batch_size_runs_whole_micro_batches(runs):
    """Global batch 5 with micro batch 2 on one rank runs 4 samples a step: the iterations
    count the nominal 5 (20 // 5 = 4, as Megatron), consumed samples and the LR count the 4
    run, so the steps are those of a global-batch-4 run, bit for bit."""
    decrease, batch4 = runs["decrease"], runs["batch4"]
    lines = _log_lines(decrease["stdout"])
    assert [int(m[5]) for m in lines] == [4] * 4
    assert [int(m[3]) for m in lines] == [4, 8, 12, 16]
    assert decrease["iteration"] == 4 and batch4["iteration"] == 5
    assert decrease["losses"] == batch4["losses"][:4]
    assert decrease["scalars"] == batch4["scalars"][:4]

"""--iterations-to-skip from a tracker file, --start-eval-at-iter's schedule and
--no-manual-gc-eval, each against its rule written out."""

import argparse
import gc

import pytest

from megatron.training import hooks
from megatron.training.configs import TrainingConfig
from megatron.training.rerun import tracker_iterations_to_skip
from megatron.training.training import _eval_due


def _line(rank, iteration, status):
    return (f"ts=2026-01-01 00:00:00.000000 node=n1 device=0 jobID=77 rank={rank} "
            f"iteration={iteration} status={status} result=[nan] message='m'\n")


def test_tracker_file_rule(tmp_path):
    """Megatron's rule: reproduced on the second re-run -> skip; rejected with re-runs disabled
    -> skip only when seen twice on the same rank and iteration. Both spellings of a status
    (value, or enum name as newer Pythons format it) count."""
    path = tmp_path / "tracker.txt"
    path.write_text(
        _line(0, 5, "second_rerun_reproducible")
        + _line(1, 7, "rerun_disabled") + _line(0, 7, "rerun_disabled")   # two ranks: once each
        + _line(2, 9, "RerunValidationStatus.RERUN_DISABLED") + _line(2, 9, "rerun_disabled")
        + _line(0, 11, "first_rerun_reproducible") + _line(0, 11, "initial_run")
        + "not a tracker line\n"
        + _line(3, 13, "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE"))
    assert tracker_iterations_to_skip(str(path)) == [5, 9, 13]
    assert tracker_iterations_to_skip(str(tmp_path / "missing.txt")) == []
    assert tracker_iterations_to_skip(None) == []


def test_this_projects_tracker_lines_are_read(tmp_path, monkeypatch):
    """A line as the rerun machine here writes it is one the reader understands."""
    from megatron.training import rerun

    class _Machine:
        tracker_filename = str(tmp_path / "t.txt")
        rank, current_iteration = 0, 42

    machine = _Machine()
    monkeypatch.setattr(rerun, "_message", lambda self: "same result")
    rerun.RerunStateMachine._track(machine, "second_rerun_reproducible", [float("nan")])
    assert tracker_iterations_to_skip(machine.tracker_filename) == [42]


def test_iterations_to_skip_config_merges_the_tracker(tmp_path):
    from megatron.training.configs import _iterations_to_skip

    path = tmp_path / "tracker.txt"
    path.write_text(_line(0, 8, "second_rerun_reproducible"))
    assert _iterations_to_skip([3, 8, 1], str(path)) == (1, 3, 8)


@pytest.mark.parametrize("interval,start,eval_iters", [(2, None, 1), (2, 3, 1), (3, 7, 2),
                                                       (0, None, 1), (2, 4, 0)])
def test_eval_due_follows_megatron(interval, start, eval_iters):
    config = TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=20,
                            eval_interval=interval, eval_iters=eval_iters,
                            start_eval_at_iter=start)
    for iteration in range(1, 21):
        want = bool(interval and iteration % interval == 0 and eval_iters > 0
                    and (start is None or iteration >= start))
        assert _eval_due(config, iteration, True) == want, iteration
        assert not _eval_due(config, iteration, False)


@pytest.mark.parametrize("manual_gc,manual_gc_eval,want", [
    (True, True, [(), {"generation": 0}]), (True, False, []), (False, True, [])])
def test_manual_gc_around_evaluation(monkeypatch, manual_gc, manual_gc_eval, want):
    calls = []
    was_enabled = gc.isenabled()
    collector = hooks.ManualGC(argparse.Namespace(manual_gc=manual_gc, manual_gc_interval=0,
                                                  manual_gc_eval=manual_gc_eval))
    try:
        monkeypatch.setattr(hooks.gc, "collect", lambda *a, **k: calls.append(k or a))
        collector.before_eval()
        collector.after_eval()
    finally:
        collector.close()
    assert calls == want
    assert gc.isenabled() == was_enabled


def test_num_samples_counts_megatrons_evaluations():
    """Megatron sizes the validation split for train_iters // eval_interval + 1 evaluations,
    less start_eval_at_iter // eval_interval."""
    from megatron.training.training import _num_samples

    args = argparse.Namespace(train_samples=None, train_iters=20, global_batch_size=4,
                              eval_interval=5, eval_iters=3, eval_global_batch_size=None,
                              start_eval_at_iter=None, full_validation=False)
    assert _num_samples(args) == [80, 5 * 3 * 4, 12]
    args.start_eval_at_iter = 11
    assert _num_samples(args) == [80, (5 - 2) * 3 * 4, 12]
    # --full-validation asks for the validation data's one epoch (Megatron's None).
    args.full_validation = True
    assert _num_samples(args) == [80, None, 12]


def _validated(extra):
    from megatron.training.arguments import parse_args, validate_args

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "4"] + extra
    return validate_args(parse_args(argv=flags))


@pytest.mark.parametrize("extra,message", [
    (["--eval-micro-batch-size", "3"],
     r"--global-batch-size \(evaluation's\) \(8\) must be divisible by --eval-micro-batch-size "
     r"\(3\)"),
    (["--eval-micro-batch-size", "4", "--eval-global-batch-size", "6"],
     r"--eval-global-batch-size \(6\) must be divisible by --eval-micro-batch-size \(4\)"),
    (["--eval-global-batch-size", "3"],
     r"--eval-global-batch-size \(3\) must be divisible by --micro-batch-size \(2\)"),
    (["--eval-micro-batch-size", "0"], "--eval-micro-batch-size"),
])
def test_eval_batch_checks(extra, message):
    from megatron.training.arguments import ArgumentsError

    with pytest.raises(ArgumentsError, match=message):
        _validated(extra)


def test_eval_micro_batch_accepted():
    args = _validated(["--eval-micro-batch-size", "4", "--eval-global-batch-size", "12"])
    assert args.eval_micro_batch_size == 4

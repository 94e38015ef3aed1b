"""Numerical faults injected into real training runs: an inf or nan in a loss or a gradient, and a
loss spike.

* --check-for-nan-in-loss-and-grad stops every rank before the optimizer step with one message
  naming the iteration, the rank that produced the value and the tensor; no rank hangs and the
  checkpoints saved before are intact.
* With --fp16 an inf gradient is an overflow: the step is skipped on every rank (weights,
  optimizer and LR schedule unchanged), counted in the log line, and the loss scale backs off
  after the hysteresis, as Megatron's dynamic scaler does.
* --skip-iterations-with-loss-spike skips the step of an iteration whose loss is far above the
  recent mean or not finite, counts it, and decides the same way after a resume.

The faults are injected by patching the run inside the rank processes (launch.py): a tensor hook
poisons one parameter's gradient, or the per-token losses are scaled or made nan, on one rank at
chosen iterations. Each run records the weights after every iteration.
"""

import functools
import math
import os
import re

import pytest
import torch

from megatron.training.checkpointing import (TRACKER_FILENAME, checkpoint_file, load_state_file,
                                             read_tracker)
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.reliability import launch

LOG_LINE = re.compile(r"^ iteration +(\d+)/ +\d+ \|.*\| learning rate: ([-+.\dE]+) \|.*"
                      r"\| loss scale: ([\d.]+) \|.*number of skipped iterations: +(\d+) \| "
                      r"number of nan iterations: +(\d+) \|$", re.M)
# A weight whose gradient goes through autograd: under --gradient-accumulation-fusion the linear
# layers add theirs straight into main_grad, where a tensor hook cannot reach it.
PARAM = "language_model.encoder.layers.1.post_attention_layernorm.weight"  # [32]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _poison_all_inf(grad):
    return torch.full_like(grad, math.inf)


def _poison_one_nan(grad):
    grad = grad.clone()
    grad.view(-1)[7] = math.nan
    return grad


def inject(rank, *, on_rank, faults):
    """Patch for train_runs. ``faults``: {n-th iteration of the run: kind}, on ``on_rank`` only.

    Kinds: ``grad_inf`` (every value of PARAM's gradient), ``grad_nan`` (one value of it),
    ``loss_nan`` (the per-token losses), ``loss_x10``. Probe: ``weights``, the flattened
    parameters after every iteration.
    """
    import pretrain_gpt
    from megatron.training import training

    real_step, real_loss = training.train_step, pretrain_gpt.loss_func
    probe = {"weights": []}
    now = {"kind": None, "step": 0}

    def loss_func(loss_mask, output_tensor):  # [b, s] per-token losses
        if now["kind"] == "loss_nan":
            output_tensor = output_tensor * math.nan  # the nan flows back into the gradients
        elif now["kind"] == "loss_x10":
            output_tensor = output_tensor * 10.0
        return real_loss(loss_mask, output_tensor)

    def train_step(*a, **k):
        model = a[2]
        now["step"] += 1
        now["kind"] = faults.get(now["step"]) if rank == on_rank else None
        hook = None
        if now["kind"] in ("grad_inf", "grad_nan"):
            param = dict(model[0].module.named_parameters())[PARAM]
            hook = param.register_hook(_poison_all_inf if now["kind"] == "grad_inf"
                                       else _poison_one_nan)
        try:
            return real_step(*a, **k)
        finally:
            now["kind"] = None
            if hook is not None:
                hook.remove()
            probe["weights"].append(torch.cat([p.detach().float().flatten()
                                               for p in model[0].parameters()]))

    training.train_step, pretrain_gpt.loss_func = train_step, loss_func

    def undo():
        training.train_step, pretrain_gpt.loss_func = real_step, real_loss

    return undo, probe


def _log_lines(text):
    """(iteration, learning rate, loss scale, skipped, nan) of every log line."""
    return [(int(m[1]), float(m[2]), float(m[3]), int(m[4]), int(m[5]))
            for m in LOG_LINE.finditer(text)]


def test_two_ranks_fp16_overflow_skips_then_nan_loss_stops_every_rank(tmp_path, corpus):
    """Two data-parallel ranks, one pair of processes, two runs.

    ``overflow`` (--fp16, loss scale 128, no natural overflow): rank 1's gradient of one weight
    is made inf at iterations 3 and 4. Both ranks skip both steps: their weights after 3 and 4
    are those after 2, the LR schedule does not advance, the log line counts one skipped
    iteration each time, and the scale halves at the second overflow (hysteresis 2).

    ``nan_loss`` (--check-for-nan-in-loss-and-grad, --save-interval 2): rank 1's per-token
    losses turn nan at iteration 3. Both ranks raise before the optimizer step, each naming
    iteration 3, rank 1, its loss and the gradients that went nan with it (rank 0's own values
    were finite: the check runs before the data-parallel reduction), and both processes exit
    by themselves; the checkpoint of iteration 2 is intact and tracked.
    """
    save = str(tmp_path / "ckpt")
    runs = [
        {"name": "overflow", "argv": gpt_flags(corpus, 6, extra=[
            "--fp16", "--initial-loss-scale", "128"]),
         "patch": functools.partial(inject, on_rank=1, faults={3: "grad_inf", 4: "grad_inf"})},
        {"name": "nan_loss", "argv": gpt_flags(corpus, 6, extra=[
            "--check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled",
            "--save", save, "--save-interval", "2",
            "--ckpt-format", "torch"]),   # its file is read below
         "patch": functools.partial(inject, on_rank=1, faults={3: "loss_nan"})},
    ]
    group = launch.start(launch.train_runs, 2, runs, log_dir=str(tmp_path / "logs"))
    assert group.wait(kill_on_failure=False) == [1, 1]  # neither rank hung nor was killed

    lines = _log_lines(launch.run_log(group.log(1), "overflow"))
    assert [line[0] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [line[3] for line in lines] == [0, 0, 1, 1, 0, 0]
    assert [line[4] for line in lines] == [0] * 6
    assert [line[2] for line in lines] == [128.0, 128.0, 128.0, 64.0, 64.0, 64.0]
    lrs = [line[1] for line in lines]
    assert lrs[2] == lrs[3] == lrs[1] and lrs[4] != lrs[3]
    weights = [group.results(r)["overflow"]["probe"]["weights"] for r in range(2)]
    for w in weights:
        assert torch.equal(w[2], w[1]) and torch.equal(w[3], w[1])
        assert not torch.equal(w[4], w[3]) and torch.isfinite(w[5]).all()
    assert all(torch.equal(a, b) for a, b in zip(*weights))

    pattern = (r"NumericalFaultError: iteration 3: inf or nan found "
               r"\(--check-for-nan-in-loss-and-grad\): rank 1 \(tensor-parallel rank 0, "
               r"pipeline-parallel rank 0, data-parallel rank 1\): loss of micro-batch 0 is nan; "
               r"gradient of \S+ has \d+ nan and \d+ inf of \d+ values.*\. Every rank stops "
               r"before the optimizer step of iteration 3; the checkpoints saved so far are "
               r"untouched\.")
    for rank in range(2):
        text = launch.run_log(group.log(rank), "nan_loss")
        assert re.search(pattern, text), text[-2000:]
        assert "rank 0 (" not in text
        assert "nan_loss" not in group.results(rank)
    assert read_tracker(save) == (2, False)
    assert sorted(os.listdir(save)) == ["iter_0000002", TRACKER_FILENAME]
    assert load_state_file(checkpoint_file(save, 2, 0, 0, 1))["iteration"] == 2


def test_one_rank_nan_gradient_and_loss_spikes(tmp_path, corpus):
    """One rank, one process, runs in order:

    * ``nan_grad``: one value of one weight's gradient turns nan at iteration 2: the run stops
      with the iteration, the rank and that weight, counting exactly the one nan.
    * ``nan_grad_default``: the same at iteration 1 with Megatron's default checks.
    * ``spike``: --skip-iterations-with-loss-spike (window 2, factor 1.5); the losses are x10 at
      iteration 4 and nan at 5. Both steps are skipped and counted (5 also as a nan iteration),
      each with a message; training goes on at 6.
    * ``no_skip``: the same faults without the flag change the weights: the injection is real.
    * ``stopped`` + ``resumed``: the spike run stopped after 3 (--exit-interval) and resumed:
      the recent losses travel in the checkpoint, so the resumed run skips the same steps and
      ends with the same weights.
    """
    save = str(tmp_path / "ckpt")
    spike = ["--skip-iterations-with-loss-spike", "--loss-spike-window", "2",
             "--loss-spike-factor", "1.5"]
    faults = {4: "loss_x10", 5: "loss_nan"}
    patch = functools.partial(inject, on_rank=0, faults=faults)
    runs = [
        {"name": "nan_grad", "catch": True,
         "argv": gpt_flags(corpus, 6, extra=["--check-for-nan-in-loss-and-grad",
                                             "--rerun-mode", "disabled"]),
         "patch": functools.partial(inject, on_rank=0, faults={2: "grad_nan"})},
        {"name": "nan_grad_default", "catch": True, "argv": gpt_flags(corpus, 6),
         "patch": functools.partial(inject, on_rank=0, faults={1: "grad_nan"})},
        {"name": "spike", "argv": gpt_flags(corpus, 6, extra=spike), "patch": patch},
        {"name": "no_skip", "argv": gpt_flags(corpus, 6, extra=[
            "--no-check-for-nan-in-loss-and-grad"]), "patch": patch},
        {"name": "stopped", "argv": gpt_flags(corpus, 6, extra=spike + [
            "--save", save, "--exit-interval", "3"])},
        {"name": "resumed", "argv": gpt_flags(corpus, 6, extra=spike + ["--load", save]),
         "patch": functools.partial(inject, on_rank=0, faults={1: "loss_x10", 2: "loss_nan"})},
    ]
    group = launch.start(launch.train_runs, 1, runs, log_dir=str(tmp_path / "logs"))
    assert group.wait() == [0]
    results, log = group.results(0), group.log(0)

    assert results["nan_grad"]["error"] == (
        "NumericalFaultError: iteration 2: inf or nan found (--check-for-nan-in-loss-and-grad): "
        "rank 0 (tensor-parallel rank 0, pipeline-parallel rank 0, data-parallel rank 0): "
        f"gradient of {PARAM} has 1 nan and 0 inf of 32 values. Every rank stops before the "
        "optimizer step of iteration 2; the checkpoints saved so far are untouched.")
    assert len(results["nan_grad"]["probe"]["weights"]) == 2  # it stopped inside iteration 2
    # Megatron's defaults (the check on, --rerun-mode validate_results): found through the
    # re-run machine's gradient sum of squares; in a process's first iteration it stops plainly.
    assert results["nan_grad_default"]["error"] == (
        "NumericalFaultError: iteration 1: inf or nan found (--check-for-nan-in-loss-and-grad): "
        "rank 0 (tensor-parallel rank 0, pipeline-parallel rank 0, data-parallel rank 0): "
        f"gradient of {PARAM} has 1 nan and 0 inf of 32 values. Every rank stops before the "
        "optimizer step of iteration 1; the checkpoints saved so far are untouched.")

    lines = _log_lines(launch.run_log(log, "spike"))
    assert [line[3] for line in lines] == [0, 0, 0, 1, 1, 0]
    assert [line[4] for line in lines] == [0, 0, 0, 0, 1, 0]
    text = launch.run_log(log, "spike")
    assert re.search(r"skipping the optimizer step of iteration 4: the loss 5\.\d{6}E\+01 is "
                     r"above 1\.5 x 5\.\d{6}E\+00, the mean of the last 2 iterations "
                     r"\(--skip-iterations-with-loss-spike\)", text), text
    assert ("skipping the optimizer step of iteration 5: the loss is not finite "
            "(--skip-iterations-with-loss-spike)") in text
    w = results["spike"]["probe"]["weights"]
    assert torch.equal(w[3], w[2]) and torch.equal(w[4], w[2]) and not torch.equal(w[5], w[4])
    unguarded = results["no_skip"]["probe"]["weights"]
    assert torch.equal(unguarded[2], w[2]) and not torch.equal(unguarded[3], w[3])
    assert not torch.isfinite(unguarded[4]).all()  # the nan step ruined the weights

    assert results["stopped"]["iteration"] == 3
    # repr: exact for floats, and equal for the two nan losses of iteration 5
    assert repr(results["resumed"]["losses"]) == repr(results["spike"]["losses"][3:])
    assert torch.equal(results["resumed"]["probe"]["weights"][-1], w[-1])

"""--override-ckpt-iteration N: a run that loads a checkpoint goes on as from iteration N - the
iteration counter, the consumed samples (N x global batch) and the learning-rate schedule's
position - whatever iteration the checkpoint recorded, in either checkpoint format."""

import math
import os

import pytest

from megatron.checkpoint.layout import load_state_file
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned training runs

GLOBAL_BATCH = 4
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS = 5e-3, 1e-4, 1, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra):
    return gpt_flags(corpus, iters, extra=["--lr-decay-iters", str(DECAY_ITERS),
                                           "--use-checkpoint-opt_param-scheduler"] + extra)


def _final(save, iteration):
    return load_state_file(os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00",
                                        "model_optim_rng.pt"))


def _cosine_lr(samples):
    """Megatron's cosine schedule in float64, from its formula (warmup, then decay)."""
    warmup, decay = WARMUP_ITERS * GLOBAL_BATCH, DECAY_ITERS * GLOBAL_BATCH
    if samples <= warmup:
        return LR * samples / warmup
    ratio = (samples - warmup) / (decay - warmup)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_run_continues_from_the_given_iteration(corpus, tmp_path, fmt):
    start = str(tmp_path / "start")
    run_on_ranks(run_pretrain, 1, _flags(corpus, 2, ["--save", start, "--ckpt-format", fmt]))
    resumed = str(tmp_path / "resumed")
    out = run_on_ranks(run_pretrain, 1, _flags(corpus, 7, [
        "--load", start, "--override-ckpt-iteration", "5", "--save", resumed,
        "--ckpt-format", "torch"]))[0]   # read back below as one file
    assert [it for it, _ in out["losses"]] == [6, 7]
    state = _final(resumed, 7)
    assert state["iteration"] == 7
    assert state["args"].consumed_train_samples == 7 * GLOBAL_BATCH
    assert state["opt_param_scheduler"]["num_steps"] == 7 * GLOBAL_BATCH
    # The rate the next step would use: the schedule's value after 7 iterations.
    lr = state["optimizer"]["param_groups"][0]["lr"]
    assert lr == pytest.approx(_cosine_lr(7 * GLOBAL_BATCH), rel=1e-12)


def test_without_the_flag_the_checkpoint_iteration_holds(corpus, tmp_path):
    start = str(tmp_path / "start")
    run_on_ranks(run_pretrain, 1, _flags(corpus, 2, ["--save", start]))
    out = run_on_ranks(run_pretrain, 1, _flags(corpus, 4, ["--load", start]))[0]
    assert [it for it, _ in out["losses"]] == [3, 4]

"""--freeze-all-layers: every step runs forward only; no parameter changes (bit for bit) while
the loss is still computed and logged, and a step's loss equals the loss the unfrozen run
computes for the same weights and batch."""

import os

import pytest
import torch

from megatron.checkpoint.layout import load_state_file
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned training runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra):
    # --ckpt-format torch: _weights reads each save's one model_optim_rng.pt
    return gpt_flags(corpus, iters, extra=["--use-checkpoint-opt_param-scheduler",
                                           "--ckpt-format", "torch"] + extra)


def _weights(save, iteration):
    state = load_state_file(os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00",
                                         "model_optim_rng.pt"))
    return {k: v for k, v in flatten_state_dict(state["model"]).items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_frozen_run_keeps_every_weight(corpus, tmp_path):
    start = str(tmp_path / "start")
    run_on_ranks(run_pretrain, 1, _flags(corpus, 2, ["--save", start]))
    frozen, free = str(tmp_path / "frozen"), str(tmp_path / "free")
    got = run_on_ranks(run_pretrain, 1, _flags(corpus, 4, [
        "--load", start, "--save", frozen, "--freeze-all-layers"]))[0]
    ref = run_on_ranks(run_pretrain, 1, _flags(corpus, 4, ["--load", start, "--save", free]))[0]
    before, after, trained = _weights(start, 2), _weights(frozen, 4), _weights(free, 4)
    assert before.keys() == after.keys() and len(before) > 5
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(before[n], trained[n]) for n in before)  # the test can fail
    # Same weights, batch and dropout stream at iteration 3: the same loss, forward only.
    (it3, loss3), (it4, loss4) = got["losses"]
    (ref3, ref_loss3), (_, ref_loss4) = ref["losses"]
    assert (it3, it4, ref3) == (3, 4, 3)
    assert loss3 == ref_loss3
    assert loss4 != ref_loss4  # the unfrozen run has taken a step by then


def test_frozen_pipeline_run_matches_one_process(corpus):
    """Two pipeline stages, frozen: the forward-only schedule gives the single process's losses
    (float tolerance: the stages split the same computation), and every iteration's loss is
    the initial weights' loss on its batch, so the first equals the unfrozen run's first."""
    flags = gpt_flags(corpus, 3, dropout=0.0, extra=["--freeze-all-layers"])
    one = run_on_ranks(run_pretrain, 1, flags)[0]["losses"]
    two = run_on_ranks(run_pretrain, 2, flags + ["--pipeline-model-parallel-size", "2"])
    last = two[1]["losses"]
    assert [i for i, _ in last] == [1, 2, 3]
    for (_, a), (_, b) in zip(one, last):
        assert a == pytest.approx(b, rel=1e-5)
    free = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 3, dropout=0.0))[0]["losses"]
    assert one[0][1] == free[0][1]


@pytest.mark.parametrize("ranks, extra", [(1, []), (2, ["--use-distributed-optimizer"])],
                         ids=["replicated", "distributed-dp2"])
def test_frozen_run_resumes_from_torch_dist(corpus, tmp_path, ranks, extra):
    """A frozen run's torch_dist save holds no optimizer state for its never-stepped
    parameters (the distributed optimizer: its zero state); resuming from it continues with
    the losses of the run that never stopped."""
    save = str(tmp_path / "frozen")
    flags = ["--freeze-all-layers", "--ckpt-format", "torch_dist"] + extra
    straight = run_on_ranks(run_pretrain, ranks, gpt_flags(corpus, 4, extra=flags))[-1]["losses"]
    run_on_ranks(run_pretrain, ranks, gpt_flags(corpus, 4, extra=flags + [
        "--save", save, "--save-interval", "2", "--exit-interval", "2"]))
    resumed = run_on_ranks(run_pretrain, ranks, gpt_flags(corpus, 4, extra=flags + [
        "--load", save]))[-1]["losses"]
    assert resumed == straight[2:]

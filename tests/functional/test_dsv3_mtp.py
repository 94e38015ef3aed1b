"""DeepSeek-V3's router and multi-token prediction end to end, against Megatron-LM's own file
(``mcore_dist_dsv3_mtp``: 8 experts in 4 groups, best 2 groups, sigmoid top-2 with expert
bias, scaling 2.5, one MTP layer): ``pretrain_gpt.py --load`` gives its logits; training on
from it keeps the loss finite, logs ``mtp_1 loss``, moves the expert biases by the update rate,
writes Megatron-Core's keys, shapes and dtypes; and a run resumed from its own checkpoint gives
the losses of the run that never stopped, bit for bit.
"""

import os

import pytest
import torch

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    fixture_dir, megatron_argv, reference)
from tests.functional.test_moe_model import _tensor_summary
from tests.multiprocess import run_on_ranks

DSV3 = "mcore_dist_dsv3_mtp"
RATE = 0.1  # --moe-router-bias-update-rate of the file's run


# A fusion switch that does not change the numbers; parsed only once Megatron's whole flag
# table is (it is not read here).
UNREAD = ("--no-rope-fusion",)


def _argv(load, *extra):
    argv = [a for a in megatron_argv(DSV3) if a not in UNREAD]
    return argv + ["--load", load, "--device", "cpu", *extra]


def _train(load, save, iters, *extra):
    argv = _argv(load, "--train-iters", str(iters), "--mock-data", "--eval-iters", "0",
                 "--num-workers", "0", "--log-interval", "1", *extra)
    if save:
        argv += ["--save", save]
    return run_on_ranks(run_pretrain, 1, argv)[0]


def test_load_of_megatrons_dsv3_file_gives_its_logits():
    logits, iteration, _ = run_on_ranks(_logits_after_load, 1, _argv(fixture_dir(DSV3)))[0]
    assert iteration == 10
    torch.testing.assert_close(logits.float(), reference(DSV3)["logits"], atol=LOGITS_ATOL,
                               rtol=0)


def test_trained_on_it_writes_megatrons_keys_and_moves_the_expert_biases(tmp_path):
    save = str(tmp_path / "saved")
    _train(fixture_dir(DSV3), save, 11, "--no-load-optim", "--no-save-optim")
    iter_dir = os.path.join(save, "iter_0000011")
    assert _tensor_summary(iter_dir) == _tensor_summary(
        os.path.join(fixture_dir(DSV3), "iter_0000010"))
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(iter_dir)
    for key in ("decoder.layers.mlp.router.expert_bias",
                "mtp.layers.0.transformer_layer.mlp.router.expert_bias"):
        bias = reader.read(key)
        # One update from zero: every expert moved by exactly +-rate (or not at all when it
        # took exactly the mean load), and not all of them stayed.
        steps = bias / RATE
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-6)
        assert steps.abs().max() == 1 and bool((steps != 0).any()), key
        assert bool((steps.sum(-1).abs() < steps.size(-1)).all()), key


@pytest.mark.parametrize("optimizer", [
    (), pytest.param(("--use-distributed-optimizer",), marks=pytest.mark.slow)],
    ids=["adam", "distributed"])
def test_resumed_run_matches_the_run_that_never_stopped(tmp_path, capfd, optimizer):
    straight = _train(fixture_dir(DSV3), None, 13, "--no-load-optim", *optimizer)
    out = capfd.readouterr().out
    assert "mtp_1 loss" in out, out[-2000:]
    first = str(tmp_path / "first")
    stopped = _train(fixture_dir(DSV3), first, 13, "--no-load-optim", "--exit-interval", "11",
                     *optimizer)
    assert stopped["iteration"] == 11
    resumed = _train(first, None, 13, *optimizer)
    assert resumed["iteration"] == straight["iteration"] == 13
    tail = straight["losses"][-2:]
    assert bool(torch.isfinite(torch.tensor(tail, dtype=torch.float64)).all())
    assert resumed["losses"][-2:] == tail


# --------------------------------------------------------------------------------------------
# Parity: the expert-bias update counts every data-parallel rank's tokens, so DP 2 and EP 2
# give the single process's biases and losses.

PARITY = ["--num-layers", "2", "--num-experts", "8", "--moe-router-topk", "2",
          "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "0.05", "--moe-router-num-groups", "4",
          "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
          "--moe-aux-loss-coeff", "1e-3", "--mtp-num-layers", "1", "--no-bias-gelu-fusion",
          "--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng"]


def _parity_run(tmp_path, name, world, *extra):
    from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    save = str(tmp_path / name)
    argv = gpt_flags(corpus, 5, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=PARITY + ["--save", save, *extra])
    result = run_on_ranks(run_pretrain, world, argv)[-1]
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(os.path.join(save, "iter_0000005"))
    biases = [reader.read("decoder.layers.mlp.router.expert_bias"),
              reader.read("mtp.layers.0.transformer_layer.mlp.router.expert_bias")]
    return [loss for _, loss in result["losses"]], biases


@pytest.mark.slow
def test_expert_bias_and_losses_at_dp2_and_ep2_are_the_single_process(tmp_path):
    """Tolerance: as in the MoE parity tests (1e-4 relative on the losses: reductions in
    another order). The biases move by exact multiples of the rate, so they must be equal:
    a DP rank updating from its own counts only would move some by another step."""
    base_losses, base_bias = _parity_run(tmp_path, "one", 1)
    assert all(bool((b != 0).any()) for b in base_bias), base_bias
    for name, world, extra in (("dp2", 2, ()), ("ep2", 2, ("--expert-model-parallel-size",
                                                          "2"))):
        losses, bias = _parity_run(tmp_path, name, world, *extra)
        for x, y in zip(base_losses, losses):
            assert abs(x - y) <= 1e-4 * abs(x), (name, base_losses, losses)
        for want, got in zip(base_bias, bias):
            assert torch.equal(want, got), (name, want, got)


@pytest.mark.slow
@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_mtp_at_tp2_gives_the_single_process_losses(tmp_path, untie):
    """A dense GPT with one MTP depth (its projection split over TP, its output gathered):
    TP 2 trains as TP 1 does. Tolerance as in the parity suite (reductions in another order)."""
    from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    extra = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    extra += ["--untie-embeddings-and-output-weights"] if untie else []
    losses = {}
    for tp in (1, 2):
        argv = gpt_flags(corpus, 4, tp=tp, dropout=0.0, extra=extra)
        losses[tp] = [loss for _, loss in run_on_ranks(run_pretrain, tp, argv)[-1]["losses"]]
    for x, y in zip(losses[1], losses[2]):
        assert abs(x - y) <= 1e-5 * abs(x), losses

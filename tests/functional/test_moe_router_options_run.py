"""Training with the router options that follow Megatron-Core's current ones: several balancing
losses at once (each with its coefficient, each logged under Megatron's name), the
``sqrtsoftplus`` score function, ``--moe-router-force-load-balancing`` and
``--moe-router-force-biased``.

The model and the tolerances are test_moe_training.py's. ``aux_loss`` and ``seq_aux_loss`` are
layout-invariant, so EP 2 and TP 2 runs must give the one-process losses; ``global_aux_loss``
is invariant over context parallelism only (see test_moe_global_aux_loss_run.py), so its
combination is checked at CP 2. Forced balancing draws its logits from the seeded default
generator: the same seed gives the same losses, and a resumed run continues bit for bit. So do
the biased logits, kept (negative std) or drawn again each forward (positive std), and a run that
recomputes its layers draws them again the same: the same losses as without recomputation.
"""

import re

import pytest

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import (_check_parity, _flags, _losses, _run_logged,
                                                _train_logged, corpus)  # noqa: F401
from tests.multiprocess import run_on_ranks

LISTED = ("--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
          "--moe-aux-loss-coeff", "0.01", "0.02", "--moe-router-score-function", "sqrtsoftplus")
WITH_GLOBAL = ("--moe-router-load-balancing-type", "aux_loss", "global_aux_loss",
               "--moe-aux-loss-coeff", "0.01", "0.05")
NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


def _logged(corpus, tmp_path, world, extra, iters=3):
    """Per logged iteration: {name: value} of the lm loss and the balancing losses."""
    log = str(tmp_path / f"log-{world}.txt")
    run_on_ranks(_run_logged, world, _flags(corpus, iters=iters, extra=list(extra)), log)
    path = log if world == 1 else f"{log}.{world - 1}"      # the last rank logs
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if "| lm loss: " in l]
    return [{name: float(value) for name, value in
             re.findall(r"\| ((?:seq_|global_)?load_balancing_loss|lm loss|z_loss): (\S+)", l)}
            for l in lines]


@pytest.mark.slow
def test_each_listed_loss_is_logged_under_its_own_name(corpus, tmp_path):
    steps = _logged(corpus, tmp_path, 1, ("--moe-router-load-balancing-type", "aux_loss",
                                          "seq_aux_loss", "global_aux_loss",
                                          "--moe-aux-loss-coeff", "0.01", "0.02", "0.03"),
                    iters=2)
    assert len(steps) == 2
    for step in steps:
        assert set(step) == {"lm loss", "z_loss", *NAMES}, step
        for name in NAMES:
            assert 0.9 < step[name] < 2.0, step     # E sum f P is ~1 when balanced


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp,extra", [
    pytest.param(1, 2, ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "alltoall"), id="ep2-alltoall"),
    pytest.param(2, 1, (), id="tp2-sp"),
])
def test_listed_losses_and_sqrtsoftplus_match_one_process(corpus, tmp_path, tp, dp, extra):
    base = _train_logged(corpus, str(tmp_path / "one"), extra=LISTED)
    _check_parity(base, _train_logged(corpus, str(tmp_path / "many"), tp, 1, dp,
                                      extra=LISTED + extra))


@pytest.mark.slow
def test_listed_global_loss_under_context_parallelism_follows_one_process(corpus, tmp_path):
    one = _logged(corpus, tmp_path, 1, WITH_GLOBAL, iters=4)
    two = _logged(corpus, tmp_path, 2, WITH_GLOBAL + ("--context-parallel-size", "2"), iters=4)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert set(a) == set(b) == {"lm loss", "z_loss", NAMES[0], NAMES[2]}, (a, b)
        for name in a:      # printed with 7 significant digits
            assert b[name] == pytest.approx(a[name], rel=1e-4), (name, one, two)


@pytest.mark.slow
def test_forced_balancing_same_seed_same_losses(corpus):
    forced = ["--moe-router-force-load-balancing"]
    first = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=forced))[-1])
    again = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=forced))[-1])
    plain = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus))[-1])
    assert first == again
    assert first != plain


@pytest.mark.slow
@pytest.mark.parametrize("std", ["-2", "2"])
def test_force_biased_same_seed_same_losses(corpus, std):
    biased = ["--moe-router-force-biased", std]
    first = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=biased))[-1])
    again = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=biased))[-1])
    forced = _losses(run_on_ranks(run_pretrain, 1, _flags(
        corpus, extra=["--moe-router-force-load-balancing"]))[-1])
    plain = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus))[-1])
    assert first == again
    assert first != forced and first != plain


@pytest.mark.slow
@pytest.mark.parametrize("std", ["-2", "2"])
def test_force_biased_recomputation_draws_the_same_logits(corpus, std):
    biased = ["--moe-router-force-biased", std]
    plain = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=biased))[-1])
    recomputed = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=biased + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]))[-1])
    assert recomputed == plain


@pytest.mark.slow
@pytest.mark.parametrize("extra", [pytest.param(LISTED, id="listed-sqrtsoftplus"),
                                   pytest.param(WITH_GLOBAL + ("--moe-router-force-load-"
                                                               "balancing",),
                                                id="global-forced"),
                                   pytest.param(("--moe-router-force-biased", "-2"),
                                                id="biased-kept"),
                                   pytest.param(("--moe-router-force-biased", "2"),
                                                id="biased-redrawn")])
def test_resume_is_bit_exact(corpus, tmp_path, extra):
    """6 iterations straight == 3, save, new processes load and run 3 more (PP 2)."""
    n, kw = 3, dict(pp=2, iters=6)
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=list(extra)))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=list(extra) + ["--save", save, "--exit-interval", str(n)]))[-1]
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=list(extra) + ["--load", save]))[-1]
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)

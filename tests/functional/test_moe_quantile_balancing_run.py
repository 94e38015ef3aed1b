"""Training with ``--moe-router-load-balancing-type quantile_balancing``: the per-expert bias
``qb_beta`` is set after each step from the micro-batches' token-choice quantiles, averaged
over the data x context-parallel ranks, so EP 2 (two data-parallel ranks, each one of the
one-process run's micro-batches at a time) and CP 2 (the logits gathered over the sequence)
give the one-process losses; the bias is saved with the model, so a resumed run continues
bit for bit. The model and the tolerances are test_moe_training.py's.
"""

import glob

import pytest
import torch

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import (_check_parity, _flags, _losses,  # noqa: F401
                                                _train_logged, corpus)
from tests.multiprocess import run_on_ranks

QB = ("--moe-router-load-balancing-type", "quantile_balancing", "--moe-aux-loss-coeff", "0",
      "--moe-router-quantile-balancing-ema", "0.5")


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp,extra", [
    pytest.param(1, 2, ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "alltoall"), id="ep2-alltoall"),
    pytest.param(1, 2, ("--context-parallel-size", "2"), id="cp2"),
    pytest.param(2, 1, (), id="tp2-sp"),
    # Recomputation routes each layer again, with the same bias: the same losses.
    pytest.param(1, 1, ("--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"), id="recompute"),
])
def test_quantile_balancing_matches_one_process(corpus, tmp_path, tp, dp, extra):
    base = _train_logged(corpus, str(tmp_path / "one"), extra=QB)
    out = _train_logged(corpus, str(tmp_path / "many"), tp, 1, dp, extra=QB + extra)
    _check_parity(base, out)


@pytest.mark.slow
def test_same_seed_same_losses_and_not_the_aux_loss_run(corpus):
    first = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=list(QB)))[-1])
    again = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra=list(QB)))[-1])
    plain = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus))[-1])
    assert first == again
    assert first != plain


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _saved_biases(path):
    """``...mlp.router.qb_beta`` of every rank's file of the checkpoint in ``path``."""
    biases = {}
    for name in glob.glob(f"{path}/iter_*/*/*.pt"):
        model = torch.load(name, map_location="cpu", weights_only=False)["model"]
        biases.update({f"{name}:{k}": v for k, v in _flat(model)
                       if k.endswith("mlp.router.qb_beta")})
    return biases


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bit_exact_with_the_saved_bias(corpus, tmp_path, fmt):
    """6 iterations straight == 3, save, new processes load and run 3 more (PP 2)."""
    n, kw = 3, dict(pp=2, iters=6)
    qb = list(QB) + ["--ckpt-format", fmt]
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=qb))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=qb + ["--save", save, "--exit-interval", str(n)]))[-1]
    if fmt == "torch":
        biases = _saved_biases(save)
        assert len(biases) == 4, sorted(biases)          # one per MoE layer, both stages
        for value in biases.values():
            assert value.dtype == torch.float32 and value.abs().sum() > 0
            assert abs(value.sum().item()) < 1e-5        # centred after each update
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=qb + ["--load", save]))[-1]
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)

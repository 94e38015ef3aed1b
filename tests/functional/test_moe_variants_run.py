"""Training with the MoE variants (``--moe-latent-size``, GLU-interleaved experts and shared
expert, ``--mlp-chunks-for-training``, ``--moe-enable-routing-replay`` present but unused): the
model learns, EP 2 gives the one-process losses, and a resumed run (PP 2, either checkpoint
format) continues bit for bit. The model and tolerances are test_moe_training.py's.
"""

import pytest

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import (_check_parity, _flags, _losses,  # noqa: F401
                                                _train_logged, corpus)
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow
VARIANTS = ("--swiglu", "--disable-bias-linear", "--moe-latent-size", "16",
            "--moe-mlp-glu-interleave-size", "4", "--moe-shared-expert-intermediate-size", "32",
            "--moe-shared-expert-glu-interleave-size", "8", "--moe-enable-routing-replay")


def test_ep2_matches_one_process(corpus, tmp_path):
    base = _train_logged(corpus, str(tmp_path / "one"), extra=VARIANTS)
    out = _train_logged(corpus, str(tmp_path / "ep2"), 1, 1, 2, extra=VARIANTS + (
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"))
    _check_parity(base, out)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bit_exact(corpus, tmp_path, fmt):
    """6 iterations straight == 3, save, new processes load and run 3 more (PP 2)."""
    n, kw = 3, dict(pp=2, iters=6)
    flags = list(VARIANTS) + ["--mlp-chunks-for-training", "2", "--ckpt-format", fmt]
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=flags))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=flags + ["--save", save, "--exit-interval", str(n)]))[-1]
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=flags + ["--load", save]))[-1]
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)

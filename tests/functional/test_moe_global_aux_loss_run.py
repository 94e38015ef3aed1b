"""Training with ``--moe-router-load-balancing-type global_aux_loss``.

Where Megatron-Core's definition is layout-invariant (context parallelism: the ranks of a
sequence count its token choices together, and the loss's terms add up to the one-rank loss)
a CP 2 run must follow the single-process run: same losses within the MoE parity tolerance
(see test_moe_training.py), same logged ``global_load_balancing_loss``. Over data-parallel
ranks it is not invariant by definition (see tests/unit/test_moe_global_aux_loss.py, which
checks DP 2 against Megatron-Core's formula instead).
"""

import re

import pytest

from tests.functional.test_moe_training import _flags, _run_logged, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks

GLOBAL = ("--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.1")


def _logged(corpus, tmp_path, world, extra):
    log = str(tmp_path / f"log-{world}.txt")
    run_on_ranks(_run_logged, world, _flags(corpus, iters=4, extra=list(GLOBAL + extra)), log)
    path = log if world == 1 else f"{log}.{world - 1}"      # the last rank logs
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if "| lm loss: " in l]
    return [(float(re.search(r"\| lm loss: (\S+) \|", l).group(1)),
             float(re.search(r"\| global_load_balancing_loss: (\S+) \|", l).group(1)))
            for l in lines]


@pytest.mark.slow
def test_context_parallel_follows_one_process(corpus, tmp_path):
    one = _logged(corpus, tmp_path, 1, ())
    two = _logged(corpus, tmp_path, 2, ("--context-parallel-size", "2"))
    assert len(one) == len(two) == 4
    for (loss, balance), (loss_cp, balance_cp) in zip(one, two):
        assert 0.9 < balance < 2.0, one     # E sum f P is ~1 when balanced
        # Printed with 7 significant digits; the layouts sum the same terms in another order.
        assert loss_cp == pytest.approx(loss, rel=1e-4)
        assert balance_cp == pytest.approx(balance, rel=1e-4)


@pytest.mark.slow
def test_data_parallel_run_counts_over_both_ranks(corpus, tmp_path):
    """DP 2 trains and logs the loss of the global micro-batches (~1 when balanced); its value
    against Megatron-Core's formula is the unit test's."""
    two = _logged(corpus, tmp_path, 2, ())
    assert len(two) == 4 and all(0.9 < balance < 2.0 for _, balance in two), two
    assert two[-1][0] < two[0][0], two

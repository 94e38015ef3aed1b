"""--eval-micro-batch-size: evaluation reads its batch in micro-batches of that size; the
validation loss is the one evaluation in micro-batches of --micro-batch-size gives (same
samples, same model), training is untouched, and pipeline stages pass evaluation's shapes."""

import pytest

from tests.functional.gpt_runs import gpt_flags
from tests.functional.test_training_options import EVAL_VALUE, _run_named, corpus
from tests.multiprocess import run_on_ranks

__all__ = ["corpus"]  # the shared corpus fixture
pytestmark = pytest.mark.slow  # spawned processes

EVAL = ["--eval-interval", "2", "--eval-iters", "2", "--eval-global-batch-size", "4"]


@pytest.fixture(scope="module")
def one_rank(corpus):
    base = gpt_flags(corpus, 4, dropout=0.0, extra=EVAL)
    scenarios = [("plain", {"argv": base}),
                 ("eval_micro_1", {"argv": base + ["--eval-micro-batch-size", "1"]}),
                 ("eval_micro_4", {"argv": base + ["--eval-micro-batch-size", "4"]})]
    return run_on_ranks(_run_named, 1, scenarios, timeout=240)[0]


def _validation(stdout):
    return [(m[1], float(m[2])) for m in EVAL_VALUE.finditer(stdout)]


@pytest.mark.parametrize("name", ["eval_micro_1", "eval_micro_4"])
def test_same_validation_loss_in_other_micro_batches(one_rank, name):
    plain, other = one_rank["plain"], one_rank[name]
    assert other["losses"] == plain["losses"]
    want, got = _validation(plain["stdout"]), _validation(other["stdout"])
    assert [w[0] for w in want] == [g[0] for g in got] and len(want) == 4
    for (_, a), (_, b) in zip(want, got):
        assert b == pytest.approx(a, rel=1e-6)  # sums in another order only


def test_pipeline_stages_pass_the_evaluation_shape(corpus, one_rank):
    """PP=2 with --eval-micro-batch-size 1: the stages exchange [s, 1, h] activations and the
    validation losses are the single process's."""
    argv = gpt_flags(corpus, 4, dropout=0.0, extra=EVAL + [
        "--pipeline-model-parallel-size", "2", "--eval-micro-batch-size", "1"])
    ranks = run_on_ranks(_run_named, 2, [("pp", {"argv": argv})], timeout=240)
    got = _validation(ranks[-1]["pp"]["stdout"])
    want = _validation(one_rank["plain"]["stdout"])
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(want, got):
        assert b == pytest.approx(a, rel=1e-5)

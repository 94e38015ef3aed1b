"""Context parallelism in half precision: a CP = 2 run with ``--bf16``, or with ``--fp16`` and its
dynamic loss scaler, gives the losses of the CP = 1 run with the same flags.

Same tiny GPT, data and batch as ``test_context_parallel_parity`` (2 layers, hidden 32, 4 heads,
sequence 16, dropout 0, 8 samples in micro-batches of 2); only the precision flags are added.

Tolerances. Half precision rounds differently at CP = 2: its attention runs in fp32 blocks
merged by log-sum-exp and rounds only the output to the model's dtype, while the one-process
attention rounds its scores, probabilities and output to it. The runs differ from the first
forward on, and Adam carries the difference.

* bf16 (8 mantissa bits, unit roundoff 2^-9 = 2.0e-3): measured at most 2.0e-4 over 6 steps;
  ``ATOL_BF16 = 1e-3``. That catches a broken precision path (an overflow skip pattern, the loss
  averaged over the wrong ranks: 0.7 and more), not the subtle wiring errors that the fp32
  parity test pins to 2e-5: dropping the cp factor of the backward loss moves a bf16 run by
  4.6e-4 only.
* fp16 (11 bits, 4.9e-4): measured at most 4e-5; ``ATOL_FP16 = 2e-4``, which still catches
  dropping the cp factor of the backward loss (4.4e-4 by step 4).

The loss scaler must make the same decisions at both sizes: the scale after every step and
which steps were skipped are compared exactly. One difference is inherent, and the flags below
stay clear of it: the backward loss of a CP rank is cp x its share of the loss (gradients are
averaged over data x context ranks, as in Megatron), so its activation gradients are cp x those
of one process and fp16 overflows at a loss scale up to cp x lower. A scale right at the edge
(2^18 here after a few steps with ``--loss-scale-window 2``) can skip a step at CP = 2 that
CP = 1 takes.
"""

import math

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 6
ATOL_BF16 = 1e-3
ATOL_FP16 = 2e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _train_recording_scaler(argv):
    """run_pretrain, with ``(skipped, loss scale after the step)`` of every iteration."""
    from megatron.training import training

    steps = []
    real = training.train_step

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        steps.append((bool(out[1]), float(out[3])))
        return out

    training.train_step = recording
    try:
        return run_pretrain(argv), steps
    finally:
        training.train_step = real


def _train(corpus, cp, precision, extra=()):
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--context-parallel-size", str(cp), *precision, *extra])
    return run_on_ranks(_train_recording_scaler, cp, flags)[-1]


def _check(corpus, precision, atol, extra=()):
    """CP = 2 against CP = 1 with the same flags; returns the scaler's steps."""
    (want, want_steps), (got, got_steps) = (_train(corpus, cp, precision, extra)
                                            for cp in (1, 2))
    assert got_steps == want_steps
    a, b = [loss for _, loss in want["losses"]], [loss for _, loss in got["losses"]]
    assert len(a) == len(b) == ITERS
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert abs(x - y) <= atol, (precision, step, a, b)
    x, y = want["valid"]["lm loss"], got["valid"]["lm loss"]
    assert abs(x - y) <= atol, (precision, x, y)
    return a, want_steps


def test_cp2_bf16(corpus):
    losses, steps = _check(corpus, ["--bf16"], ATOL_BF16)
    assert losses[-1] < losses[0] - 0.3, losses
    assert not any(skipped for skipped, _ in steps)


def test_cp2_fp16_scaler_grows(corpus):
    # From 2^12 the scale doubles after every 2 good steps and never overflows.
    losses, steps = _check(corpus, ["--fp16", "--initial-loss-scale", str(2 ** 12),
                                    "--loss-scale-window", "2"], ATOL_FP16)
    assert losses[-1] < losses[0] - 0.3, losses
    assert [math.log2(scale) for _, scale in steps] == [12, 13, 13, 14, 14, 15]


@pytest.mark.slow
def test_cp2_fp16_scaler_skips_overflows_distributed_optimizer(corpus):
    # From 2^20 the first two steps overflow and are skipped on every rank, the scale halves
    # to 2^18 and training goes on; at step 6 both sizes overflow again. The distributed
    # optimizer shards over data x context ranks, so each rank finds an overflow only in its
    # shard and all must agree to skip.
    losses, steps = _check(corpus, ["--fp16", "--initial-loss-scale", str(2 ** 20),
                                    "--hysteresis", "1"], ATOL_FP16,
                           extra=["--use-distributed-optimizer"])
    assert [skipped for skipped, _ in steps] == [True, True, False, False, False, True]
    assert [math.log2(scale) for _, scale in steps] == [19, 18, 18, 18, 18, 17]
    assert losses[-1] < losses[0] - 0.1, losses

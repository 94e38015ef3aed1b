"""--rampup-batch-size: the global batch and micro-batch count against Megatron's rule."""

import pytest

from megatron.training.arguments import ArgumentsError
from megatron.training.microbatches import NumMicroBatchesCalculator


def megatron_global_batch(consumed, start, incr, ramp_samples, global_batch):
    """Megatron's ramp-up rule, written out: constant after ``ramp_samples``."""
    if consumed > ramp_samples:
        return global_batch
    size = start + int(consumed / (ramp_samples / ((global_batch - start) / incr))) * incr
    return min(size, global_batch)


def naive_iterations(train_samples, batch_at):
    """Whole iterations that fit in ``train_samples``, walking one iteration at a time."""
    consumed = iterations = 0
    while consumed + batch_at(consumed) <= train_samples:
        consumed += batch_at(consumed)
        iterations += 1
    return iterations


RAMPS = [  # (start, increment, ramp samples, global batch, micro batch, data-parallel size)
    (2, 2, 10, 8, 1, 2),
    (16, 16, 5000, 256, 4, 4),
    (32, 32, 3000, 1024, 2, 8),
    (4, 2, 7, 10, 2, 1),
    (8, 8, 0, 64, 8, 1),
]


@pytest.mark.parametrize("start,incr,ramp,gbs,mbs,dp", RAMPS)
def test_global_batch_follows_megatron_rule(start, incr, ramp, gbs, mbs, dp):
    calc = NumMicroBatchesCalculator(gbs, mbs, dp, [start, incr, ramp])
    for consumed in list(range(0, ramp + 3 * gbs + 1)) + [ramp, ramp + 1, 10 * ramp + 7]:
        calc.update(consumed)
        want = megatron_global_batch(consumed, start, incr, ramp, gbs) if ramp else gbs
        assert calc.current_global_batch_size == want, consumed
        assert calc.num_micro_batches == want // (mbs * dp)
        assert calc.num_micro_batches * mbs * dp == want


def test_ramp_worked_by_hand():
    """start 2, +2 every 10 / 3 samples, up to 8 (micro 1 x DP 2: a micro-batch is 2)."""
    calc = NumMicroBatchesCalculator(8, 1, 2, [2, 2, 10])
    seen = {}
    for consumed in (0, 3, 4, 6, 7, 10, 11, 1000):
        calc.update(consumed)
        seen[consumed] = (calc.current_global_batch_size, calc.num_micro_batches)
    assert seen == {0: (2, 1), 3: (2, 1), 4: (4, 2), 6: (4, 2), 7: (6, 3), 10: (8, 4),
                    11: (8, 4), 1000: (8, 4)}


def test_ramp_keeps_megatrons_float_division():
    """9 / (9 / 7) is 6.999999999999999 in binary floating point: at exactly ``ramp_samples``
    Megatron's int() gives 6 increments (batch 7), and only past it does the batch reach 8."""
    calc = NumMicroBatchesCalculator(8, 1, 1, [1, 1, 9])
    calc.update(9)
    assert calc.current_global_batch_size == 7
    calc.update(10)
    assert calc.current_global_batch_size == 8


def test_constant_without_rampup():
    calc = NumMicroBatchesCalculator(48, 2, 3)
    for consumed in (0, 47, 48, 10 ** 9):
        calc.update(consumed)
        assert (calc.current_global_batch_size, calc.num_micro_batches) == (48, 8)
    assert calc.iterations_for_samples(1000) == 1000 // 48
    assert calc.iterations_for_samples(47) == 0


def test_iterations_for_samples_worked_by_hand():
    """Batches 2, 2, 4, 6, then 8s: 2+2+4+6+8+8 = 30 samples in 6 iterations."""
    calc = NumMicroBatchesCalculator(8, 1, 2, [2, 2, 10])
    assert [calc.iterations_for_samples(t) for t in (1, 2, 4, 7, 8, 13, 14, 21, 22, 29, 30)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    # The calculator is left at the start of the ramp.
    assert calc.current_global_batch_size == 2


@pytest.mark.parametrize("start,incr,ramp,gbs,mbs,dp", RAMPS)
def test_iterations_for_samples_matches_naive_and_megatron(start, incr, ramp, gbs, mbs, dp):
    calc = NumMicroBatchesCalculator(gbs, mbs, dp, [start, incr, ramp])

    def batch_at(c):
        return megatron_global_batch(c, start, incr, ramp, gbs) if ramp else gbs

    # Megatron's update_train_iters: walk the ramp while consumed <= ramp samples, then whole
    # global batches. It agrees with "whole iterations that fit" once the ramp fits.
    ramp_iters = ramp_consumed = 0
    while ramp_consumed <= ramp:
        ramp_consumed += batch_at(ramp_consumed)
        ramp_iters += 1
    for train_samples in [0, 1, start, ramp, ramp_consumed, ramp_consumed + 1,
                          ramp_consumed + 5 * gbs - 1, 3 * ramp + 17, 10 * ramp + 5 * gbs]:
        got = calc.iterations_for_samples(train_samples)
        assert got == naive_iterations(train_samples, batch_at), train_samples
        if train_samples >= ramp_consumed:
            assert got == ramp_iters + (train_samples - ramp_consumed) // gbs


@pytest.mark.parametrize("rampup,gbs,mbs,dp,message", [
    ([0, 2, 10], 8, 1, 1, r"--rampup-batch-size 0 2 10: start and increment must be > 0"),
    ([2, 0, 10], 8, 1, 1, r"--rampup-batch-size 2 0 10: start and increment must be > 0"),
    ([2, 2, -1], 8, 1, 1, r"ramp-up samples >= 0"),
    ([16, 16, 100], 8, 1, 1, r"--global-batch-size \(8\) minus the --rampup-batch-size start "
                             r"\(16\) must be a non-negative multiple of the increment \(16\)"),
    ([2, 4, 100], 8, 1, 1, r"--global-batch-size \(8\) minus .* start \(2\) .* increment \(4\)"),
    ([2, 2, 100], 8, 2, 2, r"batch size 2 of the ramp is not divisible by --micro-batch-size x "
                           r"data-parallel size \(4\)"),
])
def test_impossible_rampup_names_flags(rampup, gbs, mbs, dp, message):
    with pytest.raises(ArgumentsError, match=message):
        NumMicroBatchesCalculator(gbs, mbs, dp, rampup)


def test_impossible_rampup_is_one_line_before_start(capsys):
    """pretrain's flag check reports a bad ramp as one line and exit code 2, like other flags."""
    from megatron.training.training import parse_entry_flags

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-samples", "100", "--lr", "1e-3",
             "--rampup-batch-size", "3", "1", "50"]
    with pytest.raises(SystemExit) as exc:
        parse_entry_flags(flags, None, None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch size 3 of the ramp is not divisible" in err[0], err

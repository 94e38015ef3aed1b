"""--step-batch-size-schedule and --decrease-batch-size-if-needed: the calculator against a
naive walk of Megatron's rules, and the flag checks."""

import pytest

from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.microbatches import (NumMicroBatchesCalculator,
                                            parse_step_batch_size_schedule)


def reference_batch(schedule_text, seq_length, consumed):
    """Megatron's rule written out from the flag text: the batch of the last entry whose
    threshold (tokens // seq_length, or samples) is <= consumed."""
    best = None
    for entry in schedule_text.replace(",", " ").split():
        threshold, batch = entry.split(":")
        scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(threshold[-1].upper(), 1)
        number = float(threshold[:-1] if scale != 1 else threshold)
        samples = int(number * scale)
        if seq_length:
            samples //= seq_length
        if samples <= consumed and (best is None or samples >= best[0]):
            best = (samples, int(batch))
    return best[1]


def naive_iterations(train_samples, batch_at):
    consumed = iterations = 0
    while consumed + batch_at(consumed) <= train_samples:
        consumed += batch_at(consumed)
        iterations += 1
    return iterations


def test_parse_megatron_example_in_tokens():
    """Megatron's documented example at --seq-length 4096: 250B tokens is 61035156 samples."""
    got = parse_step_batch_size_schedule("0:768 250B:1536 500B:3072 750B:6144", 4096)
    assert got == [(0, 768), (250 * 10 ** 9 // 4096, 1536), (500 * 10 ** 9 // 4096, 3072),
                   (750 * 10 ** 9 // 4096, 6144)]


def test_parse_suffixes_commas_order_and_samples():
    assert parse_step_batch_size_schedule("2k:8, 0:4 1.5M:16 1t:32", None) == \
        [(0, 4), (2000, 8), (1_500_000, 16), (10 ** 12, 32)]


@pytest.mark.parametrize("text,message", [
    ("", "is empty"),
    ("0:4 100", "entry '100' is not THRESHOLD:BATCH"),
    ("0:4 1x:8", "cannot read '1x'"),
    ("16:4 32:8", "first threshold must be 0, got 1 samples"),
    ("0:4 32:8 40:16", "thresholds must increase strictly, got 2 then 2 samples"),
    ("0:0", "batch size of '0:0' must be > 0"),
])
def test_bad_schedules_name_the_flag(text, message):
    with pytest.raises(ArgumentsError, match="--step-batch-size-schedule") as err:
        parse_step_batch_size_schedule(text, 16)
    assert message in str(err.value)


SCHEDULES = [  # (text, seq_length, micro batch, data-parallel size)
    ("0:4 64:8 320:16", 16, 2, 2),
    ("0:2 3:6 4:4 30:12", None, 2, 1),
    ("0:8 1K:24 2.5K:8", 10, 4, 2),
    ("0:6", None, 3, 2),
]


@pytest.mark.parametrize("text,seq,mbs,dp", SCHEDULES)
def test_batch_follows_the_schedule(text, seq, mbs, dp):
    calc = NumMicroBatchesCalculator(None, mbs, dp,
                                     step_schedule=parse_step_batch_size_schedule(text, seq))
    for consumed in list(range(0, 400)) + [10 ** 6]:
        calc.update(consumed)
        want = reference_batch(text, seq, consumed)
        assert calc.current_global_batch_size == want, consumed
        assert calc.current_running_global_batch_size == want
        assert calc.num_micro_batches * mbs * dp == want


@pytest.mark.parametrize("text,seq,mbs,dp", SCHEDULES)
def test_iterations_for_samples_matches_a_naive_walk(text, seq, mbs, dp):
    calc = NumMicroBatchesCalculator(None, mbs, dp,
                                     step_schedule=parse_step_batch_size_schedule(text, seq))
    for train_samples in list(range(0, 200)) + [397, 1000, 4321]:
        want = naive_iterations(train_samples, lambda c: reference_batch(text, seq, c))
        assert calc.iterations_for_samples(train_samples) == want, train_samples


def test_iterations_worked_by_hand():
    """Batches 2, 2 (to 4), 6 steps over the threshold at 4 to 10 > 6, then 4s: with 30 samples
    2+2+6+4+4+4+4 = 26 and one more 4 fits: 30."""
    calc = NumMicroBatchesCalculator(None, 2, 1,
                                     step_schedule=parse_step_batch_size_schedule(
                                         "0:2 3:6 6:4 30:12", None))
    assert calc.iterations_for_samples(30) == 8
    assert calc.iterations_for_samples(29) == 7


def test_schedule_batch_not_divisible_is_refused_when_reached():
    """As in Megatron, an entry is checked when the run reaches it (an earlier one may have been
    run on fewer ranks before a resume)."""
    calc = NumMicroBatchesCalculator(None, 2, 2,
                                     step_schedule=parse_step_batch_size_schedule(
                                         "0:6 40:8", None))
    calc.update(40)
    assert calc.num_micro_batches == 2
    calc.check_reachable(40, 100)
    with pytest.raises(ArgumentsError, match=r"batch size 6 \(from 0 consumed samples on\) is "
                                             r"not divisible by --micro-batch-size x "
                                             r"data-parallel size \(4\)"):
        calc.check_reachable(0, 100)
    with pytest.raises(ArgumentsError, match="batch size 6"):
        calc.update(39)


@pytest.mark.parametrize("gbs,mbs,dp", [(10, 2, 2), (7, 3, 1), (8, 2, 2), (5, 1, 5)])
def test_decrease_batch_size_rounds_down_as_megatron(gbs, mbs, dp):
    calc = NumMicroBatchesCalculator(gbs, mbs, dp, decrease_batch_size_if_needed=True)
    running = (gbs // (mbs * dp)) * (mbs * dp)
    assert calc.current_global_batch_size == gbs
    assert calc.current_running_global_batch_size == running
    assert calc.num_micro_batches == running // (mbs * dp)
    # Megatron derives the iterations from the nominal batch.
    assert calc.iterations_for_samples(100) == 100 // gbs


def _validated(extra):
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--lr", "1e-3"] + extra
    args = parse_args(argv=flags)
    validate_args(args)
    return args


def test_validate_sets_the_global_batch_from_the_schedule(capsys):
    args = _validated(["--train-samples", "100", "--global-batch-size", "4",
                       "--step-batch-size-schedule", "0:2 64:4 320:8"])
    assert args.step_batch_size_samples == [(0, 2), (4, 4), (20, 8)]
    assert args.global_batch_size == 8
    assert "--global-batch-size (4) is replaced" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--train-iters", "10", "--step-batch-size-schedule", "0:2"],
     "--step-batch-size-schedule needs --train-samples"),
    (["--train-samples", "10", "--step-batch-size-schedule", "0:2",
      "--rampup-batch-size", "2", "2", "4"],
     "only one of --step-batch-size-schedule and --rampup-batch-size"),
    (["--train-samples", "10", "--step-batch-size-schedule", "0:2",
      "--decrease-batch-size-if-needed"],
     "--decrease-batch-size-if-needed cannot be combined"),
    (["--train-samples", "10", "--global-batch-size", "1", "--decrease-batch-size-if-needed"],
     r"--global-batch-size \(1\) is smaller than --micro-batch-size \(2\)"),
    (["--train-samples", "10", "--global-batch-size", "5"],
     r"--global-batch-size \(5\) must be divisible"),
])
def test_flag_combinations_refused(extra, message):
    with pytest.raises(ArgumentsError, match=message):
        _validated(extra)


def test_decrease_accepts_a_global_batch_that_does_not_divide():
    args = _validated(["--train-samples", "10", "--global-batch-size", "5",
                       "--decrease-batch-size-if-needed"])
    assert args.num_micro_batches == 2

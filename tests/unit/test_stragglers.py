"""--log-straggler's report lines, TensorBoard scalars, control port and flag checks.

The multi-rank run that slows one rank down and expects it named is in
tests/reliability/test_stragglers_and_hangs.py.
"""

import argparse
import datetime
import threading
import urllib.request

import pytest
import torch.distributed as dist

from megatron.training import stragglers, watchdog
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

NAN = float("nan")
NOW = datetime.datetime(2026, 12, 5, 8, 30, 0)
MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1").split()


def _row(forward_ms, etpt, sections=(NAN, NAN, NAN)):
    return [forward_ms, *sections, etpt]


def _fields(line):
    """``{"MxRtt": ("210.50ms", 2), ...}`` from a report line."""
    out = {}
    for part in line.split(" | ")[1:]:
        name, value = part.split(": ")
        shown, rank = value.rsplit("/", 1)
        out[name.replace("/Rnk", "")] = (shown, int(rank))
    return out


def test_report_names_the_slowest_and_fastest_rank():
    rows = [_row(3.0, 0.30), _row(2.5, 0.36), _row(210.5, 0.004), _row(4.0, 0.22)]
    lines = stragglers.format_report(rows, count=1, now=NOW)
    assert len(lines) == 1
    assert lines[0].startswith("[2026-12-05 08:30:00] | MnRtt/Rnk: 2.50ms/1 | ")
    fields = _fields(lines[0])
    assert fields == {"MnRtt": ("2.50ms", 1), "MxRtt": ("210.50ms", 2),
                      "MnEtpt": ("0.00TF", 2), "MxEtpt": ("0.36TF", 1)}


def test_measured_sections_are_reported_with_their_ranks():
    rows = [_row(3.0, 0.3, (30.0, 2.0, NAN)), _row(2.0, 0.4, (31.0, 9.0, NAN))]
    fields = _fields(stragglers.format_report(rows, count=1, now=NOW)[0])
    assert fields["MnFwdBwd"] == ("30.00ms", 0) and fields["MxFwdBwd"] == ("31.00ms", 1)
    assert fields["MnOptim"] == ("2.00ms", 0) and fields["MxOptim"] == ("9.00ms", 1)
    assert "MnDRtt" not in fields   # the batch generator is not timed at this level


def test_minmax_count_lists_that_many_ranks_at_each_end():
    etpt = [0.5, 0.1, 0.9, 0.3, 0.7]
    rows = [_row(1.0 / e, e) for e in etpt]
    lines = stragglers.format_report(rows, count=2, now=NOW)
    assert lines[1] == "^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 0.10/1, 0.30/3,"
    assert lines[2] == "^^^^ Top    2 Ranks with highest Etpt(TF): 0.70/4, 0.90/2,"
    # As in Megatron: no ranked lines when the count covers every rank.
    assert len(stragglers.format_report(rows, count=5, now=NOW)) == 1


def test_tensorboard_scalars_carry_value_and_rank():
    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, name, value, step):
            self.scalars[name] = (value, step)

    writer = Writer()
    rows = [_row(3.0, 0.3), _row(9.0, 0.1), _row(1.0, 0.9)]
    stragglers.write_scalars(writer, rows, iteration=7)
    assert writer.scalars["straggler/MaxRoundTripTime"] == (9.0, 7)
    assert writer.scalars["straggler/MaxRoundTripTime-rank"] == (1, 7)
    assert writer.scalars["straggler/MinRoundTripTime-rank"] == (2, 7)
    assert writer.scalars["straggler/MinThroughput-rank"] == (1, 7)
    assert not any("ForwardBackward" in name for name in writer.scalars)


def _args(**overrides):
    values = dict(rank=0, world_size=1, straggler_minmax_count=1, log_interval=2,
                  disable_straggler_on_startup=True, straggler_ctrlr_port=0,
                  log_straggler=True, hang_dump_timeout_s=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_control_port_toggles_the_report_at_the_next_log_interval(capsys):
    """An HTTP request to rank 0's port turns the report on; it takes effect at the next
    --log-interval, and only then does the report time and print anything."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    detector = stragglers.StragglerDetector(_args(), None, lambda batch: 1e9)
    try:
        forward = detector.timed(lambda: 42)
        assert forward() == 42 and detector._forward_s == 0.0     # off: nothing timed
        with urllib.request.urlopen(f"http://127.0.0.1:{detector.server.port}",
                                    timeout=10) as response:
            assert response.read().decode().split()[3] == "ON"
        detector.after_iteration(1, batch_size=4)
        assert not detector.enabled                              # not at a log interval yet
        detector.after_iteration(2, batch_size=4)
        assert detector.enabled
        assert "MnRtt" not in capsys.readouterr().out            # it was off at iteration 2
        forward()
        detector.after_iteration(3, batch_size=4)
        detector.after_iteration(4, batch_size=4)
        lines = [line for line in capsys.readouterr().out.splitlines() if "MnRtt" in line]
        assert len(lines) == 1 and _fields(lines[0])["MxRtt"][1] == 0
    finally:
        detector.close()
    assert not any(t.name == "straggler-ctrlr" for t in threading.enumerate())


def test_without_the_flags_nothing_starts():
    before = threading.active_count()
    args = _args(log_straggler=False)
    assert isinstance(stragglers.build(args, None, lambda batch: 0.0), stragglers._Off)
    assert isinstance(watchdog.build(args), watchdog._Off)
    assert threading.active_count() == before


@pytest.mark.parametrize("flags, message", [
    (["--straggler-minmax-count", "0"], "--straggler-minmax-count must be >= 1, got 0"),
    (["--straggler-ctrlr-port", "70000"], "--straggler-ctrlr-port must be a TCP port"),
    (["--hang-dump-timeout-s", "0"], "--hang-dump-timeout-s must be > 0 seconds, got 0"),
    (["--hang-dump-timeout-s", "600", "--distributed-timeout-minutes", "10"],
     "--hang-dump-timeout-s 600 must be below --distributed-timeout-minutes 10"),
])
def test_bad_values_are_refused_naming_the_flag(flags, message):
    args = parse_args(argv=MINIMAL + flags)
    with pytest.raises(ArgumentsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(args)


def test_defaults_follow_megatron():
    args = parse_args(argv=MINIMAL)
    assert (args.log_straggler, args.straggler_minmax_count, args.straggler_ctrlr_port,
            args.disable_straggler_on_startup) == (False, 1, 65535, False)
    assert args.hang_dump_timeout_s is None and args.hang_dump_dir is None


def test_sections_come_from_the_timers_without_resetting_them():
    """At --timing-log-level 1 the forward-backward and optimizer timers feed the row (per
    iteration, in ms) and keep their values for the console's timing line; the batch
    generator (level 2) is not measured and shows as nan."""
    from megatron.training.timers import Timers

    timers = Timers(log_level=1)
    for name in ("forward-backward", "optimizer"):
        timer = timers(name, log_level=1)
        timer.start()
        timer.stop()
        timer.elapsed_s = {"forward-backward": 0.5, "optimizer": 0.1}[name]
    assert timers.seconds("batch-generator") is None
    detector = stragglers.StragglerDetector(_args(rank=1, world_size=2,
                                                  disable_straggler_on_startup=False),
                                            timers, lambda batch: 6e12)
    detector._iterations, detector._forward_s = 2, 0.2
    forward_ms, fwd_bwd, optim, batch, etpt = detector._row(batch_size=4)
    assert (forward_ms, fwd_bwd, optim) == pytest.approx((100.0, 250.0, 50.0))
    assert batch != batch
    assert etpt == pytest.approx(6e12 / 2 / (3 * 0.1) / 1e12)   # 10 TFLOP/s
    assert timers.seconds("forward-backward") == 0.5

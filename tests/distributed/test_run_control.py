"""Run controls over several gloo ranks: the device self-test names a rank whose measurements
were deliberately corrupted (each timing it takes made fifty times longer: CPU timings on a
shared machine vary by a factor of two or more, far less than that), and the timeout after
start-up reaches every process group of every rank."""

import contextlib
import datetime
import io
import types

import pytest

from tests.multiprocess import run_on_ranks


def _sniff_body(slow_rank):
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training import sniff_test

    pstate = parallel_state.initialize_model_parallel(1, 1)
    if dist.get_rank() == slow_rank:
        plain = sniff_test._seconds_per_call
        sniff_test._seconds_per_call = lambda *a: 50 * plain(*a)
    args = types.SimpleNamespace(hidden_size=None, ffn_hidden_size=None,
                                 gpu_sniff_test_interval=5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert sniff_test.sniff_test_if_due(args, pstate, iteration=4) is None
        found = sniff_test.sniff_test_if_due(args, pstate, iteration=10)
    return found, out.getvalue()


@pytest.mark.slow
def test_sniff_test_names_the_rank_with_a_corrupted_measurement():
    results = run_on_ranks(_sniff_body, 4, 2)
    assert all(found for found, _ in results)
    report = results[0][1]
    assert "GPU sniff test -- iteration       10" in report
    lines = report.split("\n")
    measured = [i for i, line in enumerate(lines) if "[TFLOP/s]" in line or "[GB/s]" in line]
    assert len(measured) == 2 + 2 + 2 * 2  # GEMMs, all-reduce, send/recv at strides 1 and 2
    for i in measured:
        flagged = []
        for line in lines[i + 1:]:
            if not line.strip().startswith("OUTLIER"):
                break
            flagged.append(line.split()[2])
        assert "2" in flagged, report
    assert "Result: OUTLIERS DETECTED" in report
    assert all(text == "" for _, text in results[1:])  # only rank 0 reports


def _timeout_body():
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training import distributed_controls

    parallel_state.initialize_model_parallel(1, 2)
    groups = distributed_controls.process_groups()
    before = {distributed_controls.group_timeout(g) for g in groups}
    args = types.SimpleNamespace(distributed_timeout_seconds_after_init=321)
    distributed_controls.timeout_after_init(args, iteration=4, start_iteration=3)
    after = {distributed_controls.group_timeout(g) for g in groups}
    dist.barrier()  # the groups still work
    return len(groups), before, after


@pytest.mark.slow
def test_timeout_after_init_reaches_every_group_of_every_rank():
    for count, before, after in run_on_ranks(_timeout_body, 2):
        assert count >= 4  # world, tp, pp, dp, ...
        assert datetime.timedelta(seconds=321) not in before
        assert after == {datetime.timedelta(seconds=321)}

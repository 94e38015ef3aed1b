"""Start-up and run-time controls: the NCCL flight recorder's environment, the process groups'
timeout after the first iteration, the periodic device self-test's outlier rule, and the map of
parameters to optimizer groups. Multi-rank checks are in tests/distributed/test_run_control.py."""

import argparse
import datetime
import math
import statistics

import pytest
import torch.distributed as dist

from megatron.training import distributed_controls, initialize, sniff_test
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

BASE = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
        "--train-iters 2").split()


def _args(*extra):
    return parse_args(argv=BASE + list(extra))


# ------------------------------------------------------------------------- flight recorder

def test_flags_parse_with_megatrons_defaults():
    args = _args()
    assert args.flight_recorder_trace_buffer_size == 2000
    assert args.flight_recorder_dump_on_timeout and args.flight_recorder_include_only_active
    assert args.flight_recorder_extra_dump_on_exec and not args.flight_recorder_include_stack_trace
    assert args.flight_recorder_dump_path is None and args.gpu_sniff_test_interval is None
    assert args.distributed_timeout_seconds_after_init is None
    assert args.dump_param_to_param_group_map is None
    assert args.microbatch_group_size_per_vp_stage is None


def test_flight_recorder_environment_from_the_flags(tmp_path):
    args = _args("--flight-recorder-dump-path", str(tmp_path / "fr_"),
                 "--flight-recorder-trace-buffer-size", "512",
                 "--no-flight-recorder-dump-on-timeout",
                 "--flight-recorder-include-stack-trace",
                 "--disable-flight-recorder-include-only-active")
    env = {"UNRELATED": "1"}
    distributed_controls.apply_flight_recorder_environment(args, env)
    prefix = str(tmp_path / "fr_")
    assert env == {"UNRELATED": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                   "TORCH_NCCL_TRACE_BUFFER_SIZE": "512", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                   "TORCH_INCLUDE_STACK_TRACE": "1", "TORCH_INCLUDE_ONLY_ACTIVE": "0",
                   "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "1"}


def test_flight_recorder_folder_gets_a_prefix_and_users_variables_win(tmp_path):
    args = _args("--flight-recorder-dump-path", str(tmp_path))
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "77"}
    with pytest.warns(UserWarning) as caught:
        distributed_controls.apply_flight_recorder_environment(args, env)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "_dump_")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "77"
    assert any("TORCH_NCCL_TRACE_BUFFER_SIZE is already set to '77'" in str(w.message)
               for w in caught)
    # No path anywhere: nothing is set; a path only in the environment brings the rest.
    assert distributed_controls.apply_flight_recorder_environment(_args(), {}) == {}
    env = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/trace_"}
    distributed_controls.apply_flight_recorder_environment(_args(), env)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/x/trace_"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_flight_recorder_environment_is_set_before_the_process_group(monkeypatch, tmp_path):
    for name in distributed_controls.flight_recorder_environment(
            _args("--flight-recorder-dump-path", "p"), {}):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(*a, **k):
        seen.update({k: v for k, v in __import__("os").environ.items() if "TORCH_" in k})
        raise Stop

    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", fake_init)
    args = validate_args(_args("--flight-recorder-dump-path", str(tmp_path / "fr_"),
                               "--flight-recorder-trace-buffer-size", "64"))
    with pytest.raises(Stop):
        initialize._init_process_group(args)
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr_")
    assert seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"


# ------------------------------------------------------------------------- timeout after init

def _one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))
    return dist.new_group([0], timeout=datetime.timedelta(minutes=10))


def test_timeout_after_init_changes_every_group_after_the_first_iteration():
    sub = _one_rank_group()
    args = argparse.Namespace(distributed_timeout_seconds_after_init=42)
    ten_minutes = datetime.timedelta(minutes=10)
    assert distributed_controls.group_timeout(dist.group.WORLD) == ten_minutes
    distributed_controls.timeout_after_init(args, iteration=7, start_iteration=5)  # not first
    assert distributed_controls.group_timeout(sub) == ten_minutes
    distributed_controls.timeout_after_init(args, iteration=6, start_iteration=5)
    for group in (dist.group.WORLD, sub):
        assert distributed_controls.group_timeout(group) == datetime.timedelta(seconds=42)
    args.distributed_timeout_seconds_after_init = None
    distributed_controls.update_pg_timeout(ten_minutes)
    distributed_controls.timeout_after_init(args, iteration=6, start_iteration=5)
    assert distributed_controls.group_timeout(sub) == ten_minutes


@pytest.mark.parametrize("flag,value", [("--distributed-timeout-seconds-after-init", "0"),
                                        ("--gpu-sniff-test-interval", "0"),
                                        ("--flight-recorder-trace-buffer-size", "-1")])
def test_bad_values_are_refused_naming_the_flag(flag, value):
    with pytest.raises(ArgumentsError, match=flag):
        validate_args(_args(flag, value))


def test_group_size_below_the_pipeline_size_is_refused():
    argv = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--microbatch-group-size-per-virtual-pipeline-stage", "1"]
    args = _args(*argv)
    args.world_size = 2
    with pytest.raises(ArgumentsError, match=r"per-virtual-pipeline-stage \(1\) must be at "
                                             r"least --pipeline-model-parallel-size \(2\)"):
        validate_args(args)


# ------------------------------------------------------------------------- sniff test

def _naive_outliers(values):
    vals = [v for v in values if not math.isnan(v)]
    med = statistics.median(vals)
    mad = statistics.median([abs(v - med) for v in vals])
    return [i for i, v in enumerate(values)
            if not math.isnan(v) and abs(v - med) > max(mad, 0.1 * abs(med))]


@pytest.mark.parametrize("values", [[10.0, 10.2, 9.9, 3.0], [5.0, 5.0, 5.0], [1.0, 2.0],
                                    [100.0, float("nan"), 97.0, 180.0, 99.0],
                                    [7.0, 7.5, 6.8, 7.1, 7.2, 0.5, 14.0]])
def test_outlier_rule_matches_a_naive_median_and_mad(values):
    assert sniff_test.find_outliers(values) == _naive_outliers(values)


def test_a_corrupted_measurement_is_flagged_and_a_clean_one_is_not():
    healthy = [312.0, 309.5, 315.2, 310.8, 311.1, 313.4, 308.9, 312.6]
    assert sniff_test.find_outliers(healthy) == []
    corrupted = list(healthy)
    corrupted[5] = healthy[5] / 3  # a rank three times slower
    assert sniff_test.find_outliers(corrupted) == [5]

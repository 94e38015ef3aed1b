"""Result validation (--rerun-mode, megatron/training/rerun.py) and the weight-hash check.

The re-run must be invisible on a clean run: the losses with validation on are bit-identical
to those with it off (and report_stats, which re-runs every step, finds every re-run
identical). Injected errors (--error-injection-rate) and a real nan loss take the documented
paths: a transient fault exits with Megatron's code 17 naming the injected rank, and the run
resumed from the checkpoint it saved continues exactly as a run that never failed; a
reproducible result exits with 16 and its state in the checkpoint, and the resumed run
re-runs the step and exits with 17 saying "persistent" or "real numerical problem". A
corrupted weight on one data-parallel replica is named by the hash check.
"""

import contextlib
import functools
import io
import math
import os
import re

import pytest
import torch

from megatron.training import rerun
from megatron.training.rerun import (ErrorInjector, ReplayIterator, RerunState,
                                     RerunStateMachine, relative_difference, same_values)
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


# ---- pieces, no process group ----------------------------------------------------------------

def test_replay_iterator_replays_the_step_and_reads_the_source_once():
    source = iter(range(100))
    it = ReplayIterator(source)
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(RuntimeError, match="more micro-batches"):
        next(it)
    it.advance()
    assert next(it) == 2 and next(source) == 3  # nothing read ahead


def test_comparisons_against_naive_definitions():
    nan = math.nan
    assert same_values([1.0, nan], [1.0, nan]) and not same_values([1.0], [1.0 + 1e-16 * 4])
    assert not same_values([1.0, 2.0], [1.0])
    assert relative_difference([2.0, 3.0], [2.0, 3.0]) == 0.0
    # |a-b| / ((a+b)/2), largest over the pairs
    assert relative_difference([2.0, 4.0], [2.0, 5.0]) == pytest.approx(1.0 / 4.5, rel=1e-15)
    assert relative_difference([1.0], [nan]) == math.inf


def test_error_injector_semantics_and_rank_offset():
    def outcomes(kind):
        inj = ErrorInjector(1, kind, seed=3, rank=0)
        assert inj.maybe_inject() and not inj.maybe_inject()  # once per pending error
        in_place = inj.rerun_matches(RerunState.RERUNNING_IN_PLACE, True)
        if not in_place:
            return in_place, None
        return in_place, inj.rerun_matches(RerunState.RERUNNING_FROM_CHECKPOINT, True)

    assert outcomes("transient_error") == (False, None)
    assert outcomes("persistent_error") == (True, False)
    assert outcomes("correct_result") == (True, True)
    # Rate 2 on two ranks drawing alike: exactly one rank is hit per draw.
    ranks = [ErrorInjector(2, "transient_error", seed=7, rank=r) for r in range(2)]
    hits = []
    for _ in range(40):
        hit = [inj.maybe_inject() for inj in ranks]
        hits.append(hit)
        for inj in ranks:
            inj.injected = None
    assert all(sum(h) == 1 for h in hits) and 5 < sum(h[0] for h in hits) < 35
    assert not ErrorInjector(0, "transient_error", 1, 0).maybe_inject()


def test_spiky_values_are_judged_against_the_first_hundred():
    machine = RerunStateMachine("validate_results", ErrorInjector(0, "transient_error", 1, 0), 0,
                                check_nan=True, check_spiky_loss=True, check_large_grads=False)
    seen = [machine._unexpectedly_large(1.0 + i / 100, "loss") for i in range(100)]
    assert not any(seen) and machine.max_values["loss"] == pytest.approx(1.99)
    assert not machine._unexpectedly_large(19.8, "loss")
    assert machine._unexpectedly_large(19.9, "loss")
    assert not machine._unexpectedly_large(math.inf, "loss")  # the nan check's business


def _state_round_trip_body(path):
    from megatron.checkpoint.safe_unpickle import torch_load

    machine = RerunStateMachine("validate_results",
                                ErrorInjector(5, "persistent_error", 1, 0), 0,
                                check_nan=True, check_spiky_loss=False, check_large_grads=False)
    assert machine.state_dict() is None  # nothing pending: no entry, as Megatron saves None
    machine.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.current_iteration, machine.rerun_requested = 7, True
    machine.initial_result, machine.suspicious_node = [math.nan, 2.5], "node-a"
    machine.suspicious_device = 3
    machine.injector.injected = "persistent_error"
    machine.max_values, machine.large_value_counts = {"loss": 3.0}, {"loss": 100}
    torch.save({"rerun_state_machine": machine.state_dict()}, path)
    entry = torch_load(path)["rerun_state_machine"]
    assert entry["state"] == 3 and entry["mode"] == "validate_results"
    assert set(entry["sharded"]) >= {"rerun_requested", "checkpoint_requested",
                                     "error_injector_checkpoint", "initial_result",
                                     "suspicious_node", "large_value_counts", "max_values"}
    fresh = RerunStateMachine("validate_results", ErrorInjector(0, "transient_error", 1, 0), 0,
                              check_nan=True, check_spiky_loss=False, check_large_grads=False)
    fresh.load_state_dict(entry)
    disabled = RerunStateMachine("disabled", ErrorInjector(0, "transient_error", 1, 0), 0,
                                 check_nan=True, check_spiky_loss=False, check_large_grads=False)
    disabled.load_state_dict(entry)
    return {"state": fresh.state, "iteration": fresh.current_iteration,
            "requested": fresh.rerun_requested, "initial": repr(fresh.initial_result),
            "node": (fresh.suspicious_node, fresh.suspicious_device),
            "injector": fresh.injector.state_dict(),
            "max": fresh.max_values, "disabled_state": disabled.state}


def test_state_round_trips_through_a_checkpoint_file(tmp_path):
    out = run_on_ranks(_state_round_trip_body, 1, str(tmp_path / "state.pt"))[0]
    assert out["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT and out["iteration"] == 7
    assert out["requested"] and out["initial"] == "[nan, 2.5]" and out["node"] == ("node-a", 3)
    assert out["injector"] == {"error_injection_rate": 5, "error_injection_type":
                               "persistent_error", "injected_error_type": "persistent_error"}
    assert out["max"] == {"loss": 3.0}
    assert out["disabled_state"] == RerunState.NOT_RUNNING_YET


def test_megatron_written_entry_with_enum_stand_ins_loads():
    from megatron.checkpoint.safe_unpickle import StandIn

    class _State(StandIn):
        qualname = "megatron.core.rerun_state_machine.RerunState"

    class _Kind(StandIn):
        qualname = "megatron.core.rerun_state_machine.RerunDiagnostic"

    sharded = {"rerun_requested": True, "checkpoint_requested": True,
               "restart_again_requested": False, "continue_requested": False,
               "error_injector_checkpoint": {"error_injection_rate": 0,
                                             "error_injection_type": _Kind("transient_error"),
                                             "injected_error_type": None},
               "failed_validation_call": None, "initial_result": [1.5],
               "suspicious_node": "n1", "suspicious_device": 0,
               "data_iterator_checkpoints": None, "large_value_counts": {}, "max_values": {}}
    machine = RerunStateMachine("validate_results", ErrorInjector(0, "transient_error", 1, 0), 0,
                                check_nan=True, check_spiky_loss=False, check_large_grads=False)
    machine.load_state_dict({"mode": "validate_results", "state": _State(3),
                             "current_iteration": 4, "sharded": sharded})
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert machine.initial_result == [1.5] and machine.injector.kind == "transient_error"


# ---- training runs -------------------------------------------------------------------------

def _runs_body(runs):
    """Rank body: pretrain once per ``(name, argv, patch)``; records each run's losses or its
    exit code, and its printed output."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import global_vars, training

    results = {}
    for name, argv, patch in runs:
        out, err = io.StringIO(), io.StringIO()
        undo = patch() if patch is not None else None
        record = {}
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                state = training.pretrain(
                    pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                    None, pretrain_gpt.forward_step, argv=argv + ["--eval-iters", "0"])
            record["losses"] = [loss for _, loss in state.train_loss_history]
        except SystemExit as stop:
            record["code"] = stop.code
        except Exception as error:  # noqa: BLE001 - recorded for the test to check
            record["error"] = f"{type(error).__name__}: {error}"
        finally:
            if undo is not None:
                undo()
            global_vars.unset_global_variables()
            parallel_state.destroy_model_parallel()
        record["out"], record["err"] = out.getvalue(), err.getvalue()
        results[name] = record
    return results


def _flags(corpus, iters, extra=()):
    return gpt_flags(corpus, iters, extra=list(extra))


VALIDATE = ["--rerun-mode", "validate_results", "--check-for-nan-in-loss-and-grad",
            "--check-for-spiky-loss", "--check-for-large-grads"]


def test_clean_run_is_bit_identical_with_validation_and_report_stats(corpus):
    """One rank: off, validate_results (every check on) and report_stats (every step re-run)
    give the same losses bit for bit; report_stats prints its statistics, every re-run
    identical."""
    runs = [("off", _flags(corpus, 4), None),
            ("validate", _flags(corpus, 4, VALIDATE), None),
            ("stats", _flags(corpus, 4, ["--rerun-mode", "report_stats",
                                         "--check-for-nan-in-loss-and-grad"]), None)]
    res = run_on_ranks(_runs_body, 1, runs)[0]
    assert len(res["off"]["losses"]) == 4 and all(map(math.isfinite, res["off"]["losses"]))
    assert repr(res["validate"]["losses"]) == repr(res["off"]["losses"])
    assert repr(res["stats"]["losses"]) == repr(res["off"]["losses"])
    stats = re.findall(r"iteration (\d+): rerun statistics \(--rerun-mode report_stats\), "
                       r"loss and gradient re-run vs first run: (\d+)/(\d+) total/identical",
                       res["stats"]["out"])
    assert stats == [("2", "2", "2"), ("4", "4", "4")], res["stats"]["out"][-2000:]


def _nan_loss_at(step):
    """A patch: the per-token losses turn nan in the ``step``-th training step (both runs of
    it: a reproducible result)."""
    return functools.partial(_nan_loss_patch, step)


def _nan_loss_patch(step):
    import pretrain_gpt
    from megatron.training import training

    real_loss, real_step = pretrain_gpt.loss_func, training.train_step
    now = {"step": 0}

    def loss_func(loss_mask, output_tensor):
        if now["step"] == step:
            output_tensor = output_tensor * math.nan
        return real_loss(loss_mask, output_tensor)

    def train_step(*a, **k):
        now["step"] += 1
        return real_step(*a, **k)

    pretrain_gpt.loss_func, training.train_step = loss_func, train_step

    def undo():
        pretrain_gpt.loss_func, training.train_step = real_loss, real_step
    return undo


def _elsewhere(then=None):
    """A patch: this process runs on another node and device than the one that saved (the
    scheduler moved the job), with ``then`` (another patch) applied too."""
    return functools.partial(_elsewhere_patch, then)


def _elsewhere_patch(then):
    real = rerun.node_and_device
    rerun.node_and_device = lambda: ("another-node", 7)
    undo_then = then() if then is not None else None

    def undo():
        rerun.node_and_device = real
        if undo_then is not None:
            undo_then()
    return undo


def test_reproducible_results_exit_16_then_resume_tells_persistent_from_real(tmp_path, corpus):
    """One rank. Each case: a run exits with 16 at iteration 2 (saving iteration 1 with the
    machine's state), then resumed from it on another node exits with 17 and the
    diagnosis."""
    runs = []
    for name, extra, patch in (
            ("persistent", ["--error-injection-rate", "1", "--error-injection-type",
                            "persistent_error"], None),
            ("correct", ["--error-injection-rate", "1", "--error-injection-type",
                         "correct_result"], None),
            ("nan", [], _nan_loss_at(2))):
        save = str(tmp_path / name)
        tracker = str(tmp_path / f"{name}.tracker")
        argv = _flags(corpus, 4, VALIDATE + extra + [
            "--save", save, "--result-rejected-tracker-filename", tracker,
            "--ckpt-format", "torch"])   # its file is read below
        runs.append((name, argv, patch))
        runs.append((name + "_resumed", argv + ["--load", save],
                     _elsewhere(_nan_loss_at(1) if patch else None)))
    res = run_on_ranks(_runs_body, 1, runs)[0]
    for name in ("persistent", "correct", "nan"):
        first, resumed = res[name], res[name + "_resumed"]
        assert first.get("code") == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE, first
        assert re.search(r"iteration 2: result validation \(--rerun-mode validate_results\): "
                         r"the rejected result was reproduced in place: rank 0 \(node \S+\): "
                         r"\[.*\], re-run \[.*\]\. .*exiting with code 16", first["err"])
        entry = torch.load(os.path.join(str(tmp_path / name), "iter_0000001", "mp_rank_00",
                                        "model_optim_rng.pt"), weights_only=False)
        assert entry["rerun_state_machine"]["state"] == 3
        assert entry["rerun_state_machine"]["current_iteration"] == 2
        assert not hasattr(entry["args"], "rerun_state_machine")
        assert resumed.get("code") == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION, resumed
        tracker = open(str(tmp_path / f"{name}.tracker")).read()
        statuses = re.findall(r"rank=0 iteration=2 status=(\w+) result=", tracker)
        assert statuses[:2] == ["initial_run", "first_rerun_reproducible"]
        assert statuses[2] == ("second_rerun_not_reproducible" if name == "persistent"
                               else "second_rerun_reproducible")
    assert "a persistent fault of that node's device" in res["persistent_resumed"]["err"]
    assert "a real numerical problem" in res["correct_resumed"]["err"]
    assert re.search(r"the result \[nan, nan, nan\] is reproduced on this run: a "
                     r"real numerical problem", res["nan_resumed"]["err"]), res["nan_resumed"]
    assert "reproduced in place: rank 0 (node" in res["nan"]["err"] and "nan" in res["nan"]["err"]


def _transient_body(corpus, save, extra=()):
    runs = [("clean", _flags(corpus, 4), None),
            ("injected", _flags(corpus, 4, VALIDATE + [
                "--error-injection-rate", "2", "--save", save, *extra]), None),
            ("resumed", _flags(corpus, 4, VALIDATE + ["--load", save, *extra]), None)]
    return _runs_body(runs)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_two_ranks_transient_error_names_the_injected_rank_and_resumes_exactly(tmp_path,
                                                                                corpus,
                                                                                ckpt_format):
    """Two data-parallel ranks, rate 2: at iteration 2 exactly one rank injects a transient
    error. Both ranks exit with 17; the message names that rank (and only it) as suspect; the
    checkpoint of iteration 1 (in either format) resumes to the clean run's losses bit for
    bit."""
    save, tracker = str(tmp_path / "ckpt"), str(tmp_path / "tracker")
    res = run_on_ranks(_transient_body, 2, corpus, save, [
        "--ckpt-format", ckpt_format, "--result-rejected-tracker-filename", tracker])
    injected = [r for r in range(2) if "injecting a transient_error" in res[r]["injected"]["out"]]
    assert len(injected) == 1, [res[r]["injected"]["out"][-500:] for r in range(2)]
    suspect = injected[0]
    assert [res[r]["injected"].get("code") for r in range(2)] == [17, 17]
    message = res[0]["injected"]["err"]
    assert re.search(rf"iteration 2: .*not reproducible on the same rank: a transient fault; "
                     rf"suspect rank\(s\) \[{suspect}\]: rank {suspect} \(node \S+\): first run",
                     message), message
    assert f"rank {1 - suspect} (" not in message
    assert "(saved: iteration 1 in" in message
    # What the scheduler reads to leave the suspect out: its node and device, in Megatron's
    # tracker format (the device is the local rank on CPU).
    lines = re.findall(r"node=(\S+) device=(\S+) jobID=\S+ rank=(\d) iteration=2 "
                       r"status=(\w+)", open(tracker).read())
    assert lines == [(os.uname()[1], str(suspect), str(suspect), "initial_run"),
                     (os.uname()[1], str(suspect), str(suspect),
                      "first_rerun_not_reproducible")]
    for r in range(2):
        assert len(res[r]["clean"]["losses"]) == 4
        assert repr(res[r]["resumed"]["losses"]) == repr(res[r]["clean"]["losses"][1:])


def _corrupt_rank1_after(step):
    """A patch: rank 1 changes one weight after its ``step``-th training step."""
    return functools.partial(_corrupt_patch, step)


def _corrupt_patch(step):
    import torch.distributed as dist
    from megatron.training import training

    real_step = training.train_step
    now = {"step": 0}

    def train_step(*a, **k):
        result = real_step(*a, **k)
        now["step"] += 1
        if now["step"] == step and dist.get_rank() == 1:
            with torch.no_grad():
                param = dict(a[2][0].module.named_parameters())[
                    "language_model.encoder.final_layernorm.weight"]
                param.view(-1)[3] += 1e-3
        return result

    training.train_step = train_step

    def undo():
        training.train_step = real_step
    return undo


@pytest.mark.slow
def test_weight_hash_check_names_the_corrupted_replica(corpus):
    """Two data-parallel ranks, check every 2 iterations: a clean run passes; a weight changed
    on rank 1 after iteration 3 stops both ranks at iteration 4, naming the weight and both
    ranks' hashes."""
    hashed = ["--check-weight-hash-across-dp-replicas-interval", "2"]
    runs = [("clean", _flags(corpus, 4, hashed), None),
            ("corrupt", _flags(corpus, 4, hashed), _corrupt_rank1_after(3)),
            ("unchecked", _flags(corpus, 4), _corrupt_rank1_after(3))]
    res = run_on_ranks(_runs_body, 2, runs)
    assert len(res[0]["clean"]["losses"]) == 4
    assert len(res[0]["unchecked"]["losses"]) == 4  # without the check nothing notices
    for r in range(2):
        error = res[r]["corrupt"].get("error", "")
        assert re.fullmatch(
            r"WeightHashMismatchError: iteration 4: weights differ across data-parallel "
            r"replicas \(--check-weight-hash-across-dp-replicas-interval\): "
            r"language_model\.encoder\.final_layernorm\.weight: rank 0 [0-9a-f]{12}, "
            r"rank 1 [0-9a-f]{12}", error), error


@pytest.mark.slow
def test_torch_dist_keeps_a_pending_rerun_in_megatron_cores_layout(tmp_path, corpus):
    """One rank, --ckpt-format torch_dist: the exit-16 checkpoint holds the machine's state as
    Megatron-Core writes it (``common_state``'s ``rerun_state_machine`` with its ``mode``,
    ``state`` and ``current_iteration``, this rank's part in ``rerun_state_machine_state/
    shard_0_1``, Megatron-Core's enum types), not inside ``args``; resumed, the step runs again
    bit for bit (the tracker's first and re-run results are the same numbers) and the run ends
    with the diagnosis."""
    from megatron.checkpoint.dist.reader import DistCheckpointReader

    save, tracker = str(tmp_path / "ckpt"), str(tmp_path / "tracker")
    argv = _flags(corpus, 4, VALIDATE + [
        "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
        "--ckpt-format", "torch_dist", "--save", save,
        "--result-rejected-tracker-filename", tracker])
    runs = [("first", argv, None), ("resumed", argv + ["--load", save], _elsewhere())]
    res = run_on_ranks(_runs_body, 1, runs)[0]
    assert res["first"].get("code") == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE, res["first"]
    reader = DistCheckpointReader(os.path.join(save, "iter_0000001"))
    common = reader.common_state()
    entry = common["rerun_state_machine"]
    assert type(entry["state"]).qualname == "megatron.core.rerun_state_machine.RerunState"
    assert entry["state"].value == 3 and entry["current_iteration"] == 2
    assert type(entry["mode"]).qualname == "megatron.core.rerun_state_machine.RerunMode"
    assert entry["mode"].value == "validate_results"
    assert not hasattr(common["args"], "rerun_state_machine")
    assert [k for k in reader.byte_keys() if k.startswith("rerun_state_machine_state/")] == [
        "rerun_state_machine_state/shard_0_1"]
    mine = reader.read_single_object("rerun_state_machine_state/shard_0_1")
    assert mine["rerun_requested"] and mine["checkpoint_requested"]
    assert len(mine["initial_result"]) == 3
    assert (mine["suspicious_node"], mine["suspicious_device"]) == rerun.node_and_device()
    injected = mine["error_injector_checkpoint"]["injected_error_type"]
    assert type(injected).qualname == "megatron.core.rerun_state_machine.RerunDiagnostic"
    assert injected.value == "persistent_error"
    assert res["resumed"].get("code") == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert "a persistent fault of that node's device" in res["resumed"]["err"]
    results = dict(re.findall(r"iteration=2 status=(\w+) result=(\[.*\]) message", open(
        tracker).read()))
    assert results["initial_run"] == results["second_rerun_not_reproducible"]
    assert results["initial_run"] == repr(mine["initial_result"])


MEGATRON_DIST = ("mcore_dist_tp1", "mcore_dist_tp1_trained", "mcore_dist_moe_ep1",
                 "mcore_dist_dsv3_mtp")


@pytest.mark.parametrize("name", MEGATRON_DIST)
def test_megatron_written_rerun_entries_read_as_nothing_pending(name):
    """Megatron-Core's files carry its machine's entry (``state`` NOT_RUNNING_YET, a fresh
    ``rerun_state_machine_state/shard_0_1``): read through the safe reader, nothing is
    pending, so a resumed run starts with a fresh machine."""
    from megatron.checkpoint import torch_dist
    from megatron.checkpoint.dist.reader import DistCheckpointReader
    from tests.functional.test_megatron_written import fixture_dir

    folder = fixture_dir(name)
    iteration = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    reader = DistCheckpointReader(os.path.join(folder, f"iter_{int(iteration):07d}"))
    common = reader.common_state()
    assert common["rerun_state_machine"]["state"].value == 0
    assert "rerun_state_machine_state/shard_0_1" in reader.byte_keys()
    assert torch_dist._rerun_entry(reader, common, common["args"], folder, 0, 1) is None


@pytest.mark.slow
def test_megatron_written_file_resumes_with_validation_on(tmp_path):
    """Megatron-Core's trained file resumed with --rerun-mode validate_results (every check
    on): its rerun entry loads and the run trains on from iteration 3 with the same losses,
    bit for bit, as with validation off."""
    from tests.functional.test_megatron_written import megatron_argv, writable_copy

    name = "mcore_dist_tp1_trained"
    base = megatron_argv(name) + [
        "--device", "cpu", "--mock-data", "--exit-interval", "5", "--log-interval", "1",
        "--num-workers", "0"]
    runs = [("off", base + ["--load", writable_copy(name, tmp_path / "a")], None),
            ("on", base + ["--load", writable_copy(name, tmp_path / "b")] + VALIDATE, None)]
    res = run_on_ranks(_runs_body, 1, runs)[0]
    assert len(res["off"]["losses"]) == 2, res["off"]
    assert all(map(math.isfinite, res["off"]["losses"]))
    assert repr(res["on"]["losses"]) == repr(res["off"]["losses"]), res["on"]


@pytest.mark.slow
def test_resumed_on_the_suspect_node_and_device_exits_16_again(tmp_path, corpus):
    """Megatron's rescheduling rule. The exit-16 checkpoint names the node and device whose
    result is to be re-checked (``suspicious_node``, ``suspicious_device``), and the tracker
    file names them for the scheduler. Resumed on that same node and device, the run saves
    nothing and exits with 16 again (the checkpoint and its pending state stay as they were);
    resumed elsewhere, it gives the diagnosis (17)."""
    save, tracker = str(tmp_path / "ckpt"), str(tmp_path / "tracker")
    argv = _flags(corpus, 4, VALIDATE + [
        "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
        "--save", save, "--result-rejected-tracker-filename", tracker,
        "--ckpt-format", "torch"])   # its file is read below
    runs = [("first", argv, None), ("same_place", argv + ["--load", save], None),
            ("elsewhere", argv + ["--load", save], _elsewhere())]
    res = run_on_ranks(_runs_body, 1, runs)[0]
    node, device = rerun.node_and_device()
    assert res["first"].get("code") == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE, res["first"]
    entry = torch.load(os.path.join(save, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)["rerun_state_machine"]
    assert (entry["sharded"]["suspicious_node"], entry["sharded"]["suspicious_device"]) == (
        node, device)
    assert res["same_place"].get("code") == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert re.search(rf"iteration 2: .*rescheduled on the node and device whose result it "
                     rf"re-checks: rank 0 \(node {re.escape(node)}, device {device}\)\. "
                     rf"Nothing saved; exiting with code 16", res["same_place"]["err"]), res[
                         "same_place"]["err"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    assert res["elsewhere"].get("code") == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert "a persistent fault of that node's device" in res["elsewhere"]["err"]
    lines = re.findall(r"node=(\S+) device=(\S+) jobID=\S+ rank=0 iteration=2 status=(\w+)",
                       open(tracker).read())
    assert lines == [(node, str(device), "initial_run"),
                     (node, str(device), "first_rerun_reproducible"),
                     ("another-node", "7", "second_rerun_not_reproducible")]


@pytest.mark.slow
def test_torch_dist_pending_rerun_on_two_ranks_and_at_another_world_size(tmp_path, corpus):
    """Two data-parallel ranks, rate 2 (one rank injects a persistent error at iteration 2):
    each rank writes its own part (``shard_<rank>_2``), only the injecting rank's with the
    re-run requested. Resumed on two ranks elsewhere, the diagnosis names that rank; resumed
    on one rank, the pending state is ignored with a note (as Megatron does) and training goes
    on from iteration 1."""
    from megatron.checkpoint.dist.reader import DistCheckpointReader

    save = str(tmp_path / "ckpt")
    argv = _flags(corpus, 4, VALIDATE + [
        "--error-injection-rate", "2", "--error-injection-type", "persistent_error",
        "--ckpt-format", "torch_dist", "--save", save])
    res = run_on_ranks(_runs_body, 2, [("first", argv, None),
                                       ("resumed", argv + ["--load", save], _elsewhere())])
    injected = [r for r in range(2) if "injecting a persistent_error" in res[r]["first"]["out"]]
    assert len(injected) == 1 and [res[r]["first"].get("code") for r in range(2)] == [16, 16]
    reader = DistCheckpointReader(os.path.join(save, "iter_0000001"))
    keys = sorted(k for k in reader.byte_keys() if k.startswith("rerun_state_machine_state/"))
    assert keys == ["rerun_state_machine_state/shard_0_2", "rerun_state_machine_state/shard_1_2"]
    requested = [reader.read_single_object(k)["rerun_requested"] for k in keys]
    assert requested == [r == injected[0] for r in range(2)]
    assert [res[r]["resumed"].get("code") for r in range(2)] == [17, 17]
    assert f"rank {injected[0]}: the result first seen on node" in res[0]["resumed"]["err"]
    assert f"rank {1 - injected[0]}:" not in res[0]["resumed"]["err"]
    one = run_on_ranks(_runs_body, 1, [("one", _flags(corpus, 4, VALIDATE + [
        "--ckpt-format", "torch_dist", "--load", save]), None)])[0]["one"]
    assert "holds a pending re-run (rerun_state_machine) saved at another world" in one["out"]
    assert len(one["losses"]) == 3 and all(map(math.isfinite, one["losses"])), one


class _Reader:
    """A torch_dist reader holding only rank 0's part of a one-rank pending re-run."""

    def byte_keys(self):
        return ["rerun_state_machine_state/shard_0_1"]

    def read_single_object(self, key):
        assert key == "rerun_state_machine_state/shard_0_1"
        return {"rerun_requested": True, "initial_result": [1.0]}


def test_torch_dist_rerun_entry_is_read_only_at_the_saved_layout(capsys):
    """The pending state is this rank's part with the common fields, at the saved world, TP
    and PP sizes; at another world, TP or PP size it is ignored with a note (Megatron's
    rule)."""
    import argparse

    from megatron.checkpoint import torch_dist
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    def sizes(tp, pp):
        return argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)

    common = {"args": sizes(1, 1), "rerun_state_machine": {
        "mode": RerunMode.VALIDATE_RESULTS, "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
        "current_iteration": 5}}
    same = torch_dist._rerun_entry(_Reader(), common, sizes(1, 1), "ckpt", 0, 1)
    assert same["mode"] == "validate_results" and same["current_iteration"] == 5
    assert same["state"].value == 3 and same["sharded"]["initial_result"] == [1.0]
    capsys.readouterr()
    for args, world in ((sizes(2, 1), 1), (sizes(1, 2), 1), (sizes(1, 1), 2)):
        assert torch_dist._rerun_entry(_Reader(), common, args, "ckpt", 0, world) is None
    printed = capsys.readouterr().out
    assert printed.count("holds a pending re-run (rerun_state_machine) saved at another") == 3

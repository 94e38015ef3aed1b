"""Result validation (--rerun-mode) with mixture of experts and with FSDP2.

A re-run must start where the first run started: besides the data and the RNG states, a step's
passes change the routers' token counts (the expert-bias update after the step reads them) and
the auxiliary-loss sums that are logged; FSDP2 reduce-scatters each run's gradients into the
shards. So, against the same run with validation off: the losses, the logged auxiliary losses
and the expert biases after training are bit-identical with validate_results and with
report_stats (which re-runs every step: a count kept twice would double the logged
load_balancing_loss), and an injected transient error is caught and names the injected rank.
"""

import re

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks
from tests.reliability.test_rerun import VALIDATE

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "1e-3", "--no-bias-gelu-fusion", "--moe-router-score-function",
       "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]
FSDP = ["--use-torch-fsdp2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra):
    return gpt_flags(corpus, 4, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=list(extra) + ["--eval-iters", "0"])


def _body(runs):
    """Rank body: pretrain once per ``(name, argv)``; records the losses, the logged auxiliary
    losses, the expert biases after training, or the exit code, and the printed output."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import global_vars, training

    results = {}
    for name, argv in runs:
        out, err, record = io.StringIO(), io.StringIO(), {}
        biases = []
        real_step = training.train_step

        def train_step(*a, **k):
            result = real_step(*a, **k)
            biases[:] = [b.detach().clone() for n, b in a[2][0].named_buffers()
                         if n.endswith("expert_bias")]
            return result

        training.train_step = train_step
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                state = training.pretrain(
                    pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                    None, pretrain_gpt.forward_step, argv=argv)
            record["losses"] = [loss for _, loss in state.train_loss_history]
            record["biases"] = biases
        except SystemExit as stop:
            record["code"] = stop.code
        finally:
            training.train_step = real_step
            global_vars.unset_global_variables()
            parallel_state.destroy_model_parallel()
        record["out"], record["err"] = out.getvalue(), err.getvalue()
        record["aux"] = re.findall(r"(load_balancing_loss|z_loss|mtp_1 loss): (\S+)",
                                   record["out"])
        results[name] = record
    return results


def _clean_and_injected(corpus, extra):
    return [("off", _flags(corpus, extra)),
            ("validate", _flags(corpus, extra + VALIDATE)),
            ("stats", _flags(corpus, extra + ["--rerun-mode", "report_stats",
                                              "--check-for-nan-in-loss-and-grad"])),
            ("injected", _flags(corpus, extra + VALIDATE + ["--error-injection-rate", "2"]))]


def _check(res, world, with_moe):
    for r in range(world):
        off = res[r]["off"]
        assert len(off["losses"]) == 4, off["err"][-2000:]
        for name in ("validate", "stats"):
            run = res[r][name]
            assert repr(run["losses"]) == repr(off["losses"]), (name, run["err"][-2000:])
            assert run["aux"] == off["aux"], name
            assert len(run["biases"]) == len(off["biases"])
            for a, b in zip(run["biases"], off["biases"]):
                assert a.equal(b), name
    if with_moe:
        assert len(res[-1]["off"]["aux"]) >= 8 and res[-1]["off"]["biases"]
        assert any(b.abs().sum() > 0 for b in res[-1]["off"]["biases"])
    injected = [r for r in range(world) if "injecting a transient_error" in
                res[r]["injected"]["out"]]
    assert len(injected) == 1
    assert [res[r]["injected"].get("code") for r in range(world)] == [17] * world
    assert re.search(rf"iteration 2: .*a transient fault; suspect rank\(s\) \[{injected[0]}\]",
                     res[0]["injected"]["err"]), res[0]["injected"]["err"][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("ep, mtp", [(1, False), (2, False), (1, True)])
def test_moe_rerun_replays_the_step_exactly(corpus, ep, mtp):
    """Two data-parallel ranks, MoE with aux-loss and z-loss logging and expert-bias
    balancing; with ``ep`` 2 each rank holds half the experts and the tokens travel by
    all-to-all; with ``mtp`` a multi-token-prediction layer logs its loss too."""
    extra = MOE + ["--expert-model-parallel-size", str(ep)]
    if ep > 1:
        extra += ["--moe-token-dispatcher-type", "alltoall"]
    if mtp:
        extra += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    res = run_on_ranks(_body, 2, _clean_and_injected(corpus, extra))
    _check(res, 2, True)
    assert ("mtp_1 loss" in dict(res[-1]["off"]["aux"])) == mtp


@pytest.mark.slow
def test_torch_fsdp2_rerun_replays_the_step_exactly(corpus):
    """Two ranks sharding a dense model with FSDP2."""
    _check(run_on_ranks(_body, 2, _clean_and_injected(corpus, FSDP)), 2, False)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [MOE, FSDP], ids=["moe", "torch_fsdp2"])
def test_transient_error_checkpoint_resumes_exactly(tmp_path, corpus, extra):
    """The checkpoint an injected transient error saves (torch_dist: the weights, sharded
    optimizer state and RNG before the step's optimizer step) resumes to the clean run's
    losses bit for bit."""
    save = str(tmp_path / "ckpt")
    common = list(extra) + ["--ckpt-format", "torch_dist"]
    runs = [("off", _flags(corpus, common)),
            ("injected", _flags(corpus, common + VALIDATE + ["--error-injection-rate", "2",
                                                            "--save", save])),
            ("resumed", _flags(corpus, common + VALIDATE + ["--load", save]))]
    res = run_on_ranks(_body, 2, runs)
    for r in range(2):
        assert res[r]["injected"].get("code") == 17, res[r]["injected"]["err"][-2000:]
        assert "(saved: iteration 1 in" in res[0]["injected"]["err"]
        assert repr(res[r]["resumed"]["losses"]) == repr(res[r]["off"]["losses"][1:]), r
        assert res[r]["resumed"]["aux"] == res[r]["off"]["aux"][len(res[r]["off"]["aux"]) // 4:]
        assert len(res[r]["resumed"]["biases"]) == len(res[r]["off"]["biases"])
        assert all(a.equal(b) for a, b in zip(res[r]["resumed"]["biases"],
                                              res[r]["off"]["biases"]))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [MOE, FSDP], ids=["moe", "torch_fsdp2"])
def test_reproduced_error_reruns_from_the_checkpoint_bit_for_bit(tmp_path, corpus, extra):
    """An injected persistent error (exit 16, torch_dist checkpoint with the pending state),
    resumed on another node: the step's re-run from the checkpoint gives the first run's
    losses and gradient norm bit for bit (the tracker's two result lines), and the diagnosis
    names the injecting rank."""
    save, tracker = str(tmp_path / "ckpt"), str(tmp_path / "tracker")
    argv = _flags(corpus, list(extra) + VALIDATE + [
        "--ckpt-format", "torch_dist", "--error-injection-rate", "2", "--error-injection-type",
        "persistent_error", "--save", save, "--result-rejected-tracker-filename", tracker])
    first = run_on_ranks(_body, 2, [("first", argv)])
    assert [first[r]["first"].get("code") for r in range(2)] == [16, 16]
    resumed = run_on_ranks(_resumed_elsewhere, 2, argv + ["--load", save])
    assert [resumed[r]["resumed"].get("code") for r in range(2)] == [17, 17]
    lines = re.findall(r"rank=(\d) iteration=2 status=(\w+) result=(\[.*\]) message",
                       open(tracker).read())
    ranks = {rank for rank, _, _ in lines}
    assert len(ranks) == 1
    results = {status: result for _, status, result in lines}
    assert results["initial_run"] == results["second_rerun_not_reproducible"], lines
    assert f"rank {ranks.pop()}: the result first seen on node" in resumed[0]["resumed"]["err"]


def _resumed_elsewhere(argv):
    from tests.reliability.test_rerun import _elsewhere_patch

    undo = _elsewhere_patch(None)
    try:
        return _body([("resumed", argv)])
    finally:
        undo()

"""Multi-token prediction through pretrain_gpt under sequence parallelism (TP 2, alone and with
PP 2, where the last stage embeds the shifted tokens on its own copy of the table) and context
parallelism (CP 2): the losses, gradient norms and logged ``mtp_K loss`` values are the
single-process run's; a TP 2 + SP run repeats itself bit for bit, and resumed from its
checkpoint repeats the losses of the run that never stopped; Megatron's own DeepSeek-V3 file
(MLA, MoE in the MTP layer) trains on at TP 2 + SP as at TP 1."""

import pytest

from tests.functional.gpt_runs import write_counting_corpus
from tests.functional.test_mtp_pipeline import ITERS, _assert_parity, _run

TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
UNTIE = ["--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [
    (2, TP2_SP), (2, TP2_SP + UNTIE), (2, ["--context-parallel-size", "2"]),
    (4, TP2_SP + ["--pipeline-model-parallel-size", "2"])],
    ids=["tp2-sp", "tp2-sp-untied", "cp2", "tp2-sp-pp2"])
def test_mtp_with_sp_or_cp_gives_the_single_process_losses_and_grad_norms(corpus, ranks,
                                                                           layout):
    untie = UNTIE if "--untie-embeddings-and-output-weights" in layout else []
    _assert_parity(_run(corpus, ranks, layout), _run(corpus, 1, untie))


@pytest.mark.slow
def test_sp_run_repeats_itself_and_resumes_bit_for_bit(corpus, tmp_path):
    straight = _run(corpus, 2, TP2_SP)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, 2, TP2_SP + ["--save", save, "--exit-interval", "2"])
    assert first["iteration"] == 2
    assert first["losses"] == straight["losses"][:2]
    assert first["mtp"] == straight["mtp"][:2]
    resumed = _run(corpus, 2, TP2_SP + ["--load", save])
    assert resumed["iteration"] == ITERS
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]


def _dsv3_losses(load, ranks, *layout):
    """Losses and logged ``mtp_1 loss`` of 3 steps trained on from Megatron's DeepSeek-V3
    file (MLA, grouped sigmoid routing, MoE in the MTP layer) at ``layout``."""
    from tests.functional.test_dsv3_mtp import _argv
    from tests.functional.test_mtp_pipeline import run_recording_mtp_losses
    from tests.multiprocess import run_on_ranks

    argv = _argv(load, "--train-iters", "13", "--mock-data", "--eval-iters", "0",
                 "--num-workers", "0", "--log-interval", "1", "--no-load-optim", *layout)
    result = run_on_ranks(run_recording_mtp_losses, ranks, argv)[-1]
    return [loss for _, loss in result["losses"]], result["mtp"]


@pytest.mark.slow
def test_megatrons_dsv3_file_trains_on_at_tp2_sp_as_at_tp1():
    """Tolerance 1e-4 relative: float32 sums in another order."""
    from tests.functional.test_megatron_written import fixture_dir

    load = fixture_dir("mcore_dist_dsv3_mtp")
    want_losses, want_mtp = _dsv3_losses(load, 1)
    losses, mtp = _dsv3_losses(load, 2, "--tensor-model-parallel-size", "2",
                               "--sequence-parallel")
    assert len(losses) == len(want_losses) == 3
    assert losses == pytest.approx(want_losses, rel=1e-4)
    assert [sorted(m) for m in mtp] == [["mtp_1 loss"]] * 3
    assert [m["mtp_1 loss"] for m in mtp] == pytest.approx(
        [m["mtp_1 loss"] for m in want_mtp], rel=1e-4)

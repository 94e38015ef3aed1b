"""Multi-token prediction through pretrain_gpt under sequence parallelism (TP 2, alone and with
PP 2, where the last stage embeds the shifted tokens on its own copy of the table) and context
parallelism (CP 2): the losses, gradient norms and logged ``mtp_K loss`` values are the
single-process run's; a TP 2 + SP run repeats itself bit for bit, and resumed from its
checkpoint repeats the losses of the run that never stopped."""

import pytest

from tests.functional.test_mtp_pipeline import ITERS, _assert_parity, _run, corpus  # noqa: F401

TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
UNTIE = ["--untie-embeddings-and-output-weights"]


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

"""pretrain_gpt.py --sft --hybrid-context-parallel end to end on CPU: four data-parallel ranks cut
their packed conversations into sequences and run each over 1, 2 or 4 ranks
(--max-seqlen-per-dp-cp-rank 12, conversations of about 10 to 30 tokens). With per-token loss and
learned positions (each conversation's own position ids) the losses, training and validation,
equal one process running the plain --sft packs: the same tokens attend to the same keys, only
the order of float sums differs. A run resumed from its checkpoint continues bit for bit, the
same seed gives the same losses, and the layouts Megatron refuses are refused in one line."""

import pytest

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_sft_run import _losses, _one_line_error, flags, setup  # noqa: F401
from tests.multiprocess import run_on_ranks

HYBRID = ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "12"]
PER_TOKEN = ["--calculate-per-token-loss", "--global-batch-size", "8"]
N = 2


@pytest.mark.slow
def test_hybrid_cp_on_four_ranks_gives_the_one_process_losses(setup):
    one = run_on_ranks(run_pretrain, 1, flags(setup, iters=3, extra=PER_TOKEN))[0]
    four = run_on_ranks(run_pretrain, 4, flags(setup, iters=3, extra=PER_TOKEN + HYBRID))
    assert _losses(four[0]) == pytest.approx(_losses(one), rel=1e-5, abs=1e-6)
    assert four[0]["valid"]["lm loss"] == pytest.approx(one["valid"]["lm loss"], rel=1e-5)
    again = run_on_ranks(run_pretrain, 4, flags(setup, iters=3, extra=PER_TOKEN + HYBRID))
    assert _losses(again[0]) == _losses(four[0])


@pytest.mark.slow
def test_distributed_optimizer_overlap_and_all_to_all_give_the_one_process_losses(setup):
    """The gradient reduction starts during the last sequence's backward (which exchanges over
    its block) and is a reduce-scatter; attention trades sequence for heads over each block."""
    one = run_on_ranks(run_pretrain, 1, flags(setup, iters=3, extra=PER_TOKEN))[0]
    four = run_on_ranks(run_pretrain, 4, flags(setup, iters=3, extra=PER_TOKEN + HYBRID + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--cp-comm-type", "a2a"]))
    assert _losses(four[0]) == pytest.approx(_losses(one), rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_hybrid_cp_resumes_bit_for_bit(setup, tmp_path):
    save = str(tmp_path / "ckpt")
    extra = PER_TOKEN + HYBRID
    straight = run_on_ranks(run_pretrain, 4, flags(setup, iters=2 * N, extra=extra + [
        "--save", save, "--save-interval", str(N)]))[0]
    resumed = run_on_ranks(run_pretrain, 4, flags(setup, iters=2 * N, extra=extra + [
        "--load", save, "--ckpt-step", str(N)]))[0]
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == _losses(straight)[N:]


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ([], "--hybrid-context-parallel must be used with --calculate-per-token-loss"),
    (["--calculate-per-token-loss", "--micro-batch-size", "2"], "needs --micro-batch-size 1"),
    (["--calculate-per-token-loss", "--dataloader-type", "cyclic"],
     "needs --dataloader-type single"),
])
def test_megatrons_requirements_are_refused_in_one_line(setup, extra, message):
    argv = flags(setup, iters=1, extra=HYBRID + extra)
    assert message in _one_line_error(argv)

"""pretrain_gpt end to end with ``--use-precision-aware-optimizer``: the narrow moments change
the run, a run resumed from a checkpoint (``--ckpt-format`` torch and torch_dist) continues bit
for bit with bf16 moments and bf16 main grads, and two data-parallel ranks give one process's
losses.

Dropout is off. Tolerances: bf16 moments are read back exactly from the fp32 values a
checkpoint holds, so resume is compared with ``==``. Across DP sizes the bf16 model sums its
gradients in another order (ranks vs a larger micro-batch), and a moment that such a difference
tips to the neighbouring bf16 value moves its element by one bf16 ulp: measured 1.1e-5 relative
in the loss at most, 1e-4 allowed, while losing the optimizer state at the checkpoint moves it by
3e-3. fp16 and fp8 moments get their per-tensor scale recomputed from the saved values on load
(as TransformerEngine does), which can move a moment by one fp32 ulp: those resumes are compared
to 1e-6 (measured: identical), not asserted bit for bit.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
BF16_STATE = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
              "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
              "--main-grads-dtype", "bf16"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, dp, extra):
    argv = gpt_flags(corpus, 2 * N, dropout=0.0, lr=2e-3, micro_batch=4 // dp, global_batch=4,
                     extra=list(extra))
    return run_on_ranks(run_pretrain, dp, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_state_learns_and_resumes_bit_for_bit(corpus, tmp_path, fmt):
    save = str(tmp_path / "ckpt")
    straight = _run(corpus, 1, BF16_STATE + ["--save", save, "--save-interval", str(N),
                                             "--ckpt-format", fmt])
    losses = _losses(straight)
    assert len(losses) == 2 * N and sum(losses[N:]) / N < sum(losses[:N]) / N - 0.1, losses
    load = ["--load", save, "--ckpt-step", str(N), "--ckpt-format", fmt]
    resumed = _run(corpus, 1, BF16_STATE + load)
    assert _losses(resumed) == losses[N:]
    fresh = _run(corpus, 1, BF16_STATE + load + ["--no-load-optim"])
    assert _losses(fresh)[1:] != losses[N + 1:]


@pytest.mark.slow
def test_narrow_state_changes_the_run(corpus):
    """The same run with fp32 optimizer state (the default) gives other losses: the flags act."""
    narrow = _losses(_run(corpus, 1, BF16_STATE))
    wide = _losses(_run(corpus, 1, ["--bf16", "--use-distributed-optimizer"]))
    assert narrow[0] == wide[0] and narrow[1:] != wide[1:]
    assert narrow == pytest.approx(wide, rel=1e-2)


@pytest.mark.slow
def test_two_data_parallel_ranks_match_one_process_and_reshard(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    one = _losses(_run(corpus, 1, BF16_STATE))
    two = _run(corpus, 2, BF16_STATE + ["--save", save, "--save-interval", str(N)])
    assert _losses(two) == pytest.approx(one, rel=1e-4)
    resumed = _run(corpus, 1, BF16_STATE + ["--load", save, "--ckpt-step", str(N)])
    assert _losses(resumed) == pytest.approx(_losses(two)[N:], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("moments", [("fp16", "fp16"), ("fp8", "fp16"), ("bf16", "fp8")],
                         ids=["fp16", "fp8-fp16", "bf16-fp8"])
def test_scaled_moments_and_fp16_master_resume(corpus, tmp_path, moments):
    flags = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
             "--exp-avg-dtype", moments[0], "--exp-avg-sq-dtype", moments[1],
             "--main-params-dtype", "fp16"]
    save = str(tmp_path / "ckpt")
    straight = _losses(_run(corpus, 1, flags + ["--save", save, "--save-interval", str(N)]))
    assert sum(straight[N:]) / N < sum(straight[:N]) / N - 0.1, straight
    resumed = _losses(_run(corpus, 1, flags + ["--load", save, "--ckpt-step", str(N)]))
    assert resumed == pytest.approx(straight[N:], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_fp32_state_is_the_default_optimizer_bit_for_bit(corpus, precision):
    """Every dtype fp32: the same fp32 AdamW arithmetic as the default (fused) optimizer, so the
    same losses, bit for bit (measured: identical, fp32 and bf16 models)."""
    default = _losses(_run(corpus, 1, precision + ["--use-distributed-optimizer"]))
    aware = _losses(_run(corpus, 1, precision + ["--use-distributed-optimizer",
                                                 "--use-precision-aware-optimizer"]))
    assert aware == default

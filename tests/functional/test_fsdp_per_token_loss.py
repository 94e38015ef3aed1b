"""--calculate-per-token-loss under fully sharded data parallelism (--use-torch-fsdp2, and
--use-megatron-fsdp's FSDP2 strategies): every unit's reduce-scatter sums the gradients (no
division by the data-parallel size) and the sums are divided by the global batch's token count,
as the grad-buffer wrapper does.

Reference: one process and two ranks with the grad-buffer wrapper, both with the flag, on
short documents with --eod-mask-loss (micro-batches count different numbers of tokens). The
losses, the logged gradient norms and the final validation loss must agree to ``RTOL = 1e-5``
(test_torch_fsdp2's tolerance: sums in another order, torch's AdamW on the shards). Averaged
gradients divided by the token count again would be half the size: the norms then differ by
2x. The run without the flag is a different number (checked), so the comparison sees the flag.
Also at four ranks (hybrid sharding over two replicas; two pipeline stages) against one process,
and with experts (EP 2 x DP 2, auxiliary and z losses) against both references.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags
from tests.functional.test_per_token_loss import corpus  # noqa: F401 (fixture)
from tests.functional.test_torch_fsdp2 import run_recording_grad_norms
from tests.multiprocess import run_on_ranks

ITERS = 3
RTOL = 1e-5
PER_TOKEN = ["--calculate-per-token-loss", "--eod-mask-loss"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion", "--data-parallel-sharding-strategy"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--no-bias-gelu-fusion",
       "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
       "--moe-aux-loss-coeff", "0.1", "0.2", "--moe-z-loss-coeff", "0.05"]


def _run(corpus, ranks, extra=()):  # noqa: F811
    """Losses, gradient norms and the final validation loss of the last rank (one list)."""
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--untie-embeddings-and-output-weights", "--eval-iters", "1",
                             *extra])
    result = run_on_ranks(run_recording_grad_norms, ranks, flags)[-1]
    return ([loss for _, loss in result["losses"]] + result["grad_norms"]
            + [result["valid"]["lm loss"]])


def _close(got, want):
    assert len(got) == len(want) == 2 * ITERS + 1
    assert got == pytest.approx(want, rel=RTOL), (got, want)


@pytest.fixture(scope="module")
def single(corpus):  # noqa: F811
    return _run(corpus, 1, PER_TOKEN)


@pytest.fixture(scope="module")
def ddp(corpus):  # noqa: F811
    return _run(corpus, 2, PER_TOKEN)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--use-torch-fsdp2"],
    MEGATRON_FSDP + ["optim_grads"],
    MEGATRON_FSDP + ["optim_grads_params"],
], ids=["torch-fsdp2", "megatron-fsdp-optim-grads", "megatron-fsdp-optim-grads-params"])
def test_per_token_loss_under_fsdp_at_dp2_matches_one_process_and_ddp(  # noqa: F811
        corpus, single, ddp, layout):
    got = _run(corpus, 2, PER_TOKEN + layout)
    _close(got, single)
    _close(got, ddp)
    assert single[ITERS - 1] < single[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    MEGATRON_FSDP + ["optim_grads_params", "--num-distributed-optimizer-instances", "2"],
    ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"],
], ids=["hybrid-sharding-dp4", "pp2-dp2"])
def test_per_token_loss_under_fsdp_at_four_ranks_matches_one_process(  # noqa: F811
        corpus, single, layout):
    """Hybrid sharding: summed within each replica and across them; pipeline stages: the
    token count comes from the last stage to every stage's shards."""
    _close(_run(corpus, 4, PER_TOKEN + layout), single)


@pytest.mark.slow
def test_without_the_flag_the_run_differs(corpus, single):  # noqa: F811
    """The mean of micro-batch means moves the gradient norm by about 1% here."""
    averaged = _run(corpus, 1, ["--eod-mask-loss"])
    assert max(abs(a - b) / abs(b) for a, b in zip(averaged, single)) > 100 * RTOL


@pytest.mark.slow
def test_per_token_auxiliary_losses_under_fsdp2_match_ddp(corpus):  # noqa: F811
    """Experts as FSDP2 units of their own over the expert-data-parallel group (EP 2 x DP 2):
    their gradients are summed there too, and the routers' auxiliary losses (attached times
    their token counts, started at the loss scale alone) are divided by the same count. The
    ranks' micro-batches are the single process's, so one process is a reference too."""
    layout = PER_TOKEN + MOE + ["--expert-model-parallel-size", "2"]
    fsdp = _run(corpus, 2, layout + ["--use-torch-fsdp2"])
    _close(fsdp, _run(corpus, 2, layout))
    _close(fsdp, _run(corpus, 1, PER_TOKEN + MOE))

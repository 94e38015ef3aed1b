"""--use-megatron-fsdp: every --data-parallel-sharding-strategy at two data-parallel ranks gives
the losses, logged gradient norms and final validation loss of one process and of two ranks
with the grad-buffer wrapper, the same numbers twice, and resumes from its own checkpoint bit
for bit.

The strategies run on layouts that are built and tested on their own (no_shard: the grad-buffer
wrapper; optim: the distributed optimizer; optim_grads and optim_grads_params: FSDP2 without
and with resharding after forward), so the tolerance is ``test_torch_fsdp2``'s: sums in another
order and torch's AdamW on the shards move fp32 losses by a few ulps, ``RTOL = 1e-5`` is far
below what a dropped micro-batch or an unaveraged gradient does (1e-3 within two steps; the
gradient norm, doubled by an unaveraged sum, is compared too).
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_torch_fsdp2 import run_recording_grad_norms
from tests.multiprocess import run_on_ranks

ITERS = 4
N = 3  # iterations before the checkpoint in the resume test, and after it
RTOL = 1e-5
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# What Megatron-FSDP's user guide asks a launch script to pass with each strategy.
GUIDE = ["--use-megatron-fsdp", "--use-distributed-optimizer",
         "--no-gradient-accumulation-fusion"]


def _strategy(name):
    return GUIDE + ["--data-parallel-sharding-strategy", name]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, ranks, extra=()):
    """Losses, gradient norms and the final validation loss of the last rank (one list)."""
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--untie-embeddings-and-output-weights", *extra])
    result = run_on_ranks(run_recording_grad_norms, ranks, flags)[-1]
    return ([loss for _, loss in result["losses"]] + result["grad_norms"]
            + [result["valid"]["lm loss"]])


def _close(got, want, rtol=RTOL):
    assert len(got) == len(want) == 2 * ITERS + 1
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=rtol), (got, want)


@pytest.fixture(scope="module")
def single(corpus):
    return _run(corpus, 1)


@pytest.fixture(scope="module")
def ddp(corpus):
    return _run(corpus, 2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_at_dp2_matches_one_process_and_ddp(corpus, single, ddp, strategy):
    got = _run(corpus, 2, _strategy(strategy))
    _close(got, single)
    _close(got, ddp)
    assert single[ITERS - 1] < single[0]        # it learns
    assert min(single[ITERS:2 * ITERS]) > 1.0   # clipping acts at every step


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_same_seed_same_losses(corpus, strategy):
    first = _run(corpus, 2, _strategy(strategy))
    assert _run(corpus, 2, _strategy(strategy)) == first


@pytest.mark.slow
def test_bf16_grad_comm_reduces_in_bf16(corpus, ddp):
    """--megatron-fsdp-grad-comm-dtype bf16 reduce-scatters bf16 gradients (FSDP2's
    reduce_dtype): the first loss (before any update) is unchanged; the gradient norms move by
    bf16 rounding of the reduced gradients (measured up to 3e-4 relative, the losses 2e-6),
    within 1e-3, which an unaveraged (doubled) gradient is not; and they do move beyond the
    fp32 tolerance, so the reduction really ran in bf16."""
    got = _run(corpus, 2, _strategy("optim_grads_params")
               + ["--megatron-fsdp-grad-comm-dtype", "bf16"])
    assert got[0] == pytest.approx(ddp[0], rel=RTOL)
    _close(got, ddp, rtol=1e-3)
    assert any(abs(a - b) > RTOL * abs(b) for a, b in zip(got[ITERS:], ddp[ITERS:]))


@pytest.mark.slow
def test_bf16_run_with_grad_reduce_in_bf16_is_the_bf16_grad_comm_run(corpus):
    """--bf16 --grad-reduce-in-bf16 (Megatron-FSDP's DeepSeek-V3 script passes both) runs as
    --megatron-fsdp-grad-comm-dtype bf16, number for number, and differs from the bf16 run
    that reduces in fp32."""
    base = _strategy("optim_grads_params") + ["--bf16"]
    got = _run(corpus, 2, base + ["--grad-reduce-in-bf16"])
    assert got == _run(corpus, 2, base + ["--megatron-fsdp-grad-comm-dtype", "bf16"])
    assert got != _run(corpus, 2, base)


def _ckpt_run(corpus, extra, ranks=2):
    flags = gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                      extra=["--ckpt-format", "torch_dist",
                             "--untie-embeddings-and-output-weights", *extra])
    return run_on_ranks(run_pretrain, ranks, flags)[-1]


def _close_losses(got, want):
    assert [i for i, _ in got] == [i for i, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=RTOL), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_is_bit_exact(corpus, tmp_path, strategy):
    save = str(tmp_path / "ckpt")
    straight = _ckpt_run(corpus, _strategy(strategy) + ["--save", save,
                                                        "--save-interval", str(N)])
    resumed = _ckpt_run(corpus, _strategy(strategy) + ["--load", save, "--ckpt-step", str(N)])
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert resumed["losses"] == straight["losses"][N:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_hybrid_sharding_at_dp4_matches_one_process(corpus, single, strategy):
    """--num-distributed-optimizer-instances 2 at DP=4: two replicas of two shards (FSDP2's
    HSDP on a 2-D mesh). The gradients are reduce-scattered within a replica and all-reduced
    across, and the norms sum the shards of one replica only: a norm summed over all four ranks
    would be sqrt(2) too large, a gradient not reduced across replicas would differ from one
    process's."""
    _close(_run(corpus, 4, _strategy(strategy) + ["--num-distributed-optimizer-instances",
                                                  "2"]), single)


@pytest.mark.slow
def test_hybrid_sharding_resume_is_bit_exact(corpus, tmp_path):
    hsdp = _strategy("optim_grads_params") + ["--num-distributed-optimizer-instances", "2"]
    save = str(tmp_path / "ckpt")
    straight = _ckpt_run(corpus, hsdp + ["--save", save, "--save-interval", str(N)], ranks=4)
    resumed = _ckpt_run(corpus, hsdp + ["--load", save, "--ckpt-step", str(N)], ranks=4)
    assert resumed["losses"] == straight["losses"][N:]
    # The checkpoint holds whole tensors: plain FSDP2 at DP=2 reads it too.
    other = _ckpt_run(corpus, _strategy("optim_grads_params") + ["--load", save, "--ckpt-step",
                                                                 str(N)])
    _close_losses(other["losses"], straight["losses"][N:])

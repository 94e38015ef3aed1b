"""--use-torch-fsdp2: a tiny GPT trained with FSDP2 over two data-parallel ranks gives the losses
and logged gradient norms (and final validation loss) of one process and of two ranks with the
grad-buffer wrapper, and the same losses twice.

Tolerance: as in ``test_parity``, the layouts compute the same sums in another order (FSDP2's
reduce-scatter averages the two ranks' gradients, the single process sums its micro-batches),
and torch's AdamW steps on the shards where the other runs use the fused kernel, so fp32 losses
differ by a few ulps per step; ``RTOL = 1e-5`` is 100x above that and far below what a dropped
micro-batch, an unaveraged gradient or a wrong clipping norm does (1e-3 and more within two
steps: clipping is active, the gradient norm is above --clip-grad 1.0 here). Adam hides a
gradient scaled by a constant (an unaveraged sum over ranks), so the gradient norm each step
returns, the one logged and clipped with, is compared too.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 4
RTOL = 1e-5
BF16_RTOL = 1e-4
BF16_NORM_RTOL = 5e-3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra=(), dropout=0.0):
    return gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=dropout,
                     extra=list(extra))


def run_recording_grad_norms(argv):
    """``run_pretrain`` on this rank, also returning each step's gradient norm."""
    from megatron.training import training

    norms, original = [], training.train_step

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        norms.append(result[2])
        return result

    training.train_step = recording
    try:
        return dict(run_pretrain(argv), grad_norms=norms)
    finally:
        training.train_step = original


def _run(corpus, ranks, extra=(), dropout=0.0):
    """Losses, then gradient norms, then the final validation loss (one list) of the last
    rank."""
    result = run_on_ranks(run_recording_grad_norms, ranks, _flags(corpus, extra, dropout))[-1]
    return ([loss for _, loss in result["losses"]] + result["grad_norms"]
            + [result["valid"]["lm loss"]])


@pytest.fixture(scope="module")
def single(corpus):
    """One process, tied embeddings: the reference of the layouts below."""
    return _run(corpus, 1)


def _close(got, want):
    assert len(got) == len(want) == 2 * ITERS + 1
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=RTOL), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_fsdp2_dp2_matches_one_process_and_ddp(corpus, untie):
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    single = _run(corpus, 1, extra)
    ddp = _run(corpus, 2, extra)
    fsdp = _run(corpus, 2, extra + ["--use-torch-fsdp2"])
    _close(fsdp, single)
    _close(fsdp, ddp)
    assert single[ITERS - 1] < single[0]  # it learns: the comparison is not between constants
    assert min(single[ITERS:2 * ITERS]) > 1.0      # clipping acts at every step


@pytest.mark.slow
def test_fsdp2_same_seed_same_losses(corpus):
    """Also runs the checks and logs that read the shards (inf/nan, params norm, zeros)."""
    flags = ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward",
             "--check-for-nan-in-loss-and-grad", "--log-params-norm", "--log-num-zeros-in-grad"]
    first = _run(corpus, 2, flags)
    assert _run(corpus, 2, flags) == first


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [
    ["--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
     "1", "--torch-fsdp2-no-reshard-after-forward"],
    ["--recompute-activations"],
], ids=["full-uniform", "full-block-no-reshard", "selective"])
def test_fsdp2_with_recomputation_matches_one_process(corpus, single, recompute):
    """Layers recomputed in backward gather their shards again there (FSDP2 runs the
    recomputed forward like any other); gradients and losses stay those of one process."""
    _close(_run(corpus, 2, ["--use-torch-fsdp2", *recompute]), single)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [
    (4, ["--tensor-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (2, ["--context-parallel-size", "2"]),
], ids=["tp2-dp2", "tp2-dp2-sp", "cp2"])
def test_fsdp2_composes_with_tensor_and_context_parallelism(corpus, single, ranks, layout):
    """Tensor parallelism inside, FSDP2 outside: each TP rank's slice is sharded over its
    data-parallel group, norms sum over the shards and then over TP (replicated parameters on
    TP rank 0 only), sequence-parallel norm gradients are summed over TP on the shards. With
    context parallelism the shards spread over data x context parallel ranks."""
    _close(_run(corpus, ranks, ["--use-torch-fsdp2", *layout]), single)


@pytest.mark.slow
def test_fsdp2_bf16_matches_bf16_without_fsdp2(corpus):
    """--bf16: FSDP2 keeps fp32 shards and computes in bf16 through its mixed-precision policy,
    as a bf16 run without FSDP2 computes from bf16 copies of fp32 main weights.

    The first step's forward sees the same bf16 weights, so its loss is identical (and not the
    fp32 one: bf16 is really used). Later steps differ by bf16 rounding of the weight gradients
    (computed in bf16 here, accumulated in fp32 by the fused kernel there): measured 1.1e-5 on
    the losses and 9e-4 on the gradient norms, hence BF16_RTOL and BF16_NORM_RTOL; an
    unaveraged gradient doubles the norm.
    """
    fsdp = _run(corpus, 2, ["--use-torch-fsdp2", "--bf16"])
    ddp = _run(corpus, 2, ["--bf16"])
    fp32 = _run(corpus, 2, ["--use-torch-fsdp2"])
    assert fsdp[0] == ddp[0] and fsdp[0] != fp32[0]
    for a, b in zip(fsdp[:ITERS], ddp[:ITERS]):
        assert a == pytest.approx(b, rel=BF16_RTOL), (fsdp, ddp)
    for a, b in zip(fsdp[ITERS:2 * ITERS], ddp[ITERS:2 * ITERS]):
        assert a == pytest.approx(b, rel=BF16_NORM_RTOL), (fsdp, ddp)
    assert fsdp[-1] == pytest.approx(ddp[-1], rel=BF16_RTOL)
    # Rotary angles reach the layers in fp32 under FSDP2 as without it (a policy casting the
    # units' inputs to bf16 moved the first loss by 5e-7).
    rope = ["--position-embedding-type", "rope"]
    assert _run(corpus, 2, ["--use-torch-fsdp2", "--bf16"] + rope)[0] == \
        _run(corpus, 2, ["--bf16"] + rope)[0]


@pytest.mark.slow
def test_fsdp2_with_dropout_and_recomputation_matches_ddp(corpus):
    """Dropout draws from the same per-rank streams with and without FSDP2 (and is replayed
    exactly by recomputation), so the run matches two ranks with the grad-buffer wrapper."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    fsdp = _run(corpus, 2, ["--use-torch-fsdp2", *recompute], dropout=0.1)
    _close(fsdp, _run(corpus, 2, dropout=0.1))
    assert fsdp[0] != _run(corpus, 2, ["--use-torch-fsdp2"])[0]  # dropout was on

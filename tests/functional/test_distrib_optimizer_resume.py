"""pretrain_gpt end to end with --use-distributed-optimizer: same losses as the replicated
optimizer, and checkpoints that resume at another data-parallel size.

Dropout is off so that runs at different DP sizes see the same computation: each global batch
holds the same samples whatever the DP size (DP ranks, or micro-batches accumulated on one rank),
and only the order of fp32 sums differs.

Tolerances: at the same DP size the distributed and replicated optimizers see bit-identical
averaged gradients (two ranks: a + b in either order, exact halving); only the gradient norm is
summed in another order, moving the clip coefficient by ~1e-7 relative at most (here the losses
come out identical). Across DP sizes the gradient itself is summed in another order (ranks vs
accumulated micro-batches): ~1e-7 relative per step, and over three steps the losses differ by
~1e-7 (measured: 4e-8 at DP=1, 9e-8 at DP=4). We allow 1e-5 for both. A mistake in the
resharded state moves the losses far more: Adam's first moment shifted by one element gave 6e-3.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, dp: int, extra=()):
    """Global batch 4 at every DP size: micro-batch 2 (DP 1, 2) or 1 (DP 4)."""
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2 if dp <= 2 else 1,
                     global_batch=4, extra=["--ckpt-format", "torch"] + list(extra))


def _dist_flags(corpus, dp: int, extra=()):
    return _flags(corpus, dp, ["--use-distributed-optimizer", *extra])


def run_distributed_optimizer(argv):
    """run_pretrain, recording the optimizer and making the DP wrapper reduce-scatter.

    ``setdefault`` leaves the wrapper's and the optimizer's arguments alone once training
    passes ``use_distributed_optimizer`` and ``overlap_param_gather`` itself.
    """
    import megatron.training.training as training

    real_ddp, real_get = training.DistributedDataParallel, training.get_megatron_optimizer
    seen = {}

    def ddp(*args, **kwargs):
        kwargs.setdefault("use_distributed_optimizer", True)
        return real_ddp(*args, **kwargs)

    def get_optimizer(*args, **kwargs):
        if "--overlap-param-gather" in argv:
            kwargs.setdefault("overlap_param_gather", True)
        optimizer = real_get(*args, **kwargs)
        seen["type"] = type(optimizer).__name__
        seen["state_numel"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        seen["model_numel"] = sum(p.numel() for chunk in args[1] for p in chunk.parameters())
        seen["reduce_scatter"] = all(c.use_distributed_optimizer for c in args[1])
        return optimizer

    training.DistributedDataParallel, training.get_megatron_optimizer = ddp, get_optimizer
    try:
        out = run_pretrain(argv)
    finally:
        training.DistributedDataParallel, training.get_megatron_optimizer = real_ddp, real_get
    out.update(seen)
    return out


def _run(dp: int, argv, distributed=True):
    fn = run_distributed_optimizer if distributed else run_pretrain
    return run_on_ranks(fn, dp, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _close(a, b):
    assert len(a) == len(b) and len(a) > 0, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= REL_TOL * abs(y), (a, b)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """2N iterations at DP=2 with the distributed optimizer, uninterrupted, saving a
    checkpoint at iteration N (and 2N) on the way."""
    save = str(tmp_path_factory.mktemp("dist_opt_ckpt") / "ckpt")
    out = _run(2, _dist_flags(corpus, 2, ["--save", save, "--save-interval", str(N)]))
    assert out["iteration"] == 2 * N
    out["save"] = save
    return out


def _resume(corpus, dp: int, straight):
    """Load iteration N of ``straight``'s checkpoint at ``dp`` ranks and run to 2N."""
    out = _run(dp, _dist_flags(corpus, dp, ["--load", straight["save"], "--ckpt-step", str(N)]))
    assert [i for i, _ in out["losses"]] == list(range(N + 1, 2 * N + 1))
    return out


def test_matches_replicated_optimizer_at_dp2(corpus, straight):
    replicated = _run(2, _flags(corpus, 2), distributed=False)
    assert straight["type"] == "DistributedOptimizer" and straight["reduce_scatter"]
    # Each of the 2 DP ranks keeps fp32 state for half the model (the last rank reports).
    assert abs(straight["state_numel"] - straight["model_numel"] / 2) <= 2
    _close(_losses(straight), _losses(replicated))
    assert _losses(straight)[-1] < _losses(straight)[0]


def test_resume_at_same_dp_is_bit_exact(corpus, straight):
    resumed = _resume(corpus, 2, straight)
    assert _losses(resumed) == _losses(straight)[N:]


def test_resume_at_dp1_matches_continuing_at_dp2(corpus, straight):
    resumed = _resume(corpus, 1, straight)
    assert resumed["type"] == "DistributedOptimizer"
    assert resumed["state_numel"] == resumed["model_numel"]  # one rank holds everything
    _close(_losses(resumed), _losses(straight)[N:])


@pytest.mark.slow
def test_resume_at_dp4_matches_continuing_at_dp2(corpus, straight):
    resumed = _resume(corpus, 4, straight)
    assert abs(resumed["state_numel"] - resumed["model_numel"] / 4) <= 4
    _close(_losses(resumed), _losses(straight)[N:])


@pytest.mark.slow
def test_overlap_param_gather_gives_the_same_losses(corpus, straight, tmp_path):
    """Gathers overlapping the next forward (and finished before each save) change nothing:
    bit for bit against the same buckets without overlap. The bucket size itself may move the
    last bits (on an AVX-512 CPU the fused kernels' results follow the buffer's layout by an
    ulp), so against the default buckets the losses agree within the file's tolerance."""
    buckets = ["--ddp-bucket-size", "5000"]
    out = _run(2, _dist_flags(corpus, 2, ["--overlap-param-gather", *buckets,
                                          "--save", str(tmp_path / "ckpt"),
                                          "--save-interval", str(N)]))
    same_buckets = _run(2, _dist_flags(corpus, 2, buckets))
    assert _losses(out) == _losses(same_buckets)
    _close(_losses(out), _losses(straight))


@pytest.mark.slow
def test_pipeline_parallel_tied_embedding_matches_replicated(corpus):
    """PP=2 x DP=2: the tied word embedding has a bucket of its own on both stages, so the
    embedding all-reduce after the reduce-scatter adds matching shards."""
    extra = ["--pipeline-model-parallel-size", "2"]
    replicated = _run(4, _flags(corpus, 2, extra), distributed=False)
    distributed = _run(4, _dist_flags(corpus, 2, extra))
    _close(_losses(distributed), _losses(replicated))

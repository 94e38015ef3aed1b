"""pretrain_gpt end to end with ``--enable-mhc-connections``: a tiny GPT with 3 residual streams
learns, the same seed gives the same losses, a run resumed from a checkpoint (torch and
torch_dist) continues bit for bit, and tensor parallelism with sequence parallelism (TP 2),
pipeline parallelism (PP 2, the streams passed between stages), context parallelism (CP 2) and
the 'mhc' selective recompute give the single-process run.

Parallel tolerances are the feature's promise: losses within 1e-4 and gradient norms within 1e-3
of one process (split sums only reorder fp32 rounding); recomputation is bit for bit.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_torch_fsdp2 import run_recording_grad_norms
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
MHC = ["--enable-mhc-connections", "--mhc-num-residual-streams", "3",
       "--mhc-sinkhorn-iterations", "10", "--mhc-init-gating-factor", "0.05"]
LOSS_ATOL, NORM_ATOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mhc_learns_repeats_and_resumes_bit_for_bit(corpus, tmp_path, fmt):
    save = str(tmp_path / "ckpt")

    def run(extra):
        argv = gpt_flags(corpus, 2 * N, lr=2e-3, extra=MHC + ["--ckpt-format", fmt] + extra)
        return run_on_ranks(run_pretrain, 1, argv)[-1]

    straight = run(["--save", save, "--save-interval", str(N)])
    losses = _losses(straight)
    assert len(losses) == 2 * N and sum(losses[N:]) / N < sum(losses[:N]) / N - 0.1, losses
    assert _losses(run([])) == losses
    resumed = run(["--load", save, "--ckpt-step", str(N)])
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == losses[N:]


def _train(corpus, world, tp=1, extra=()):
    flags = gpt_flags(corpus, 2 * N, tp=tp, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=MHC + ["--num-layers", "4", *extra])
    return run_on_ranks(run_recording_grad_norms, world, flags)[-1]


@pytest.fixture(scope="module")
def baseline(corpus):
    return _train(corpus, 1)


def _check(base, out, what, exact=False):
    want, got = _losses(base), _losses(out)
    assert want[-1] < want[0] - 0.1, want
    assert len(got) == len(want) == 2 * N, what
    if exact:
        assert got == want and out["grad_norms"] == base["grad_norms"], what
        return
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= LOSS_ATOL, (what, step, want, got)
    for step, (a, b) in enumerate(zip(base["grad_norms"], out["grad_norms"]), start=1):
        assert abs(a - b) <= NORM_ATOL, (what, step, base["grad_norms"], out["grad_norms"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "cp2", "pp2_recompute"])
def test_mhc_parallel_layouts_match_one_process(corpus, baseline, layout):
    if layout == "tp2_sp":
        out = _train(corpus, 2, tp=2, extra=["--sequence-parallel"])
    elif layout == "pp2":
        out = _train(corpus, 2, extra=["--pipeline-model-parallel-size", "2"])
    elif layout == "pp2_recompute":
        # A stage's output is where backward starts: its recompute hook must fire there too.
        out = _train(corpus, 2, extra=["--pipeline-model-parallel-size", "2",
                                       "--recompute-granularity", "selective",
                                       "--recompute-modules", "mhc"])
    else:
        out = _train(corpus, 2, extra=["--context-parallel-size", "2"])
    _check(baseline, out, layout)


@pytest.mark.slow
@pytest.mark.parametrize("group", [None, "1"])
def test_mhc_recompute_is_bit_for_bit(corpus, baseline, group):
    extra = ["--recompute-granularity", "selective", "--recompute-modules", "mhc"]
    if group:
        extra += ["--mhc-recompute-layer-num", group]
    _check(baseline, _train(corpus, 1, extra=extra), f"recompute {group}", exact=True)

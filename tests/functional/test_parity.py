"""The parity suite: one tiny GPT trained under every parallel layout gives the same losses.

The model (4 layers, hidden 32, 4 heads, sequence 16, dropout 0, fp32), seed, data (the counting
corpus of ``gpt_runs``) and global batch (8 samples in micro-batches of 2) are fixed; only the
layout changes. Each layout's training losses over ``ITERS`` iterations and its final validation
loss (forward-only schedule) are compared with the single-process run.

Tolerance: every layout computes the same sums in a different order (tensor-parallel all-reduces,
sequence-parallel reduce-scatters, data-parallel averaging, the tied embedding's gradient summed
over the first and last stage, micro-batch accumulation), so fp32 results differ by a few ulps
(~1e-7 relative) per step, and Adam passes such differences on without amplifying them much over
8 steps. Measured on every layout below: at most 4.6e-8 relative (DP = 2), 2.3e-8 otherwise.
``RTOL = 1e-5`` leaves a 200x margin for other CPUs' kernels and still catches a wrong gradient,
a dropped micro-batch or a stage wired out of order, each of which moves the loss by 1e-3 or
more within two steps.

The default run covers PP = 2, TP = 2 x PP = 2 with sequence parallelism, interleaved PP = 2 x
virtual 2, and bit-exact resume with PP = 2; the other layouts (up to 8 ranks) are marked slow.
"""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 8
RTOL = 1e-5
MODEL = ["--num-layers", "4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, tp=1, pp=1, vp_layers=None, iters=ITERS, dropout=0.0, extra=()):
    extra = list(MODEL) + ["--pipeline-model-parallel-size", str(pp)] + list(extra)
    if isinstance(vp_layers, str):  # "first:last" layer counts of an uneven split
        first, last = vp_layers.split(":")
        extra += ["--decoder-first-pipeline-num-layers", first,
                  "--decoder-last-pipeline-num-layers", last]
        vp_layers = None
    if tp > 1:
        extra.append("--sequence-parallel")
    if vp_layers is not None:
        extra += ["--num-layers-per-virtual-pipeline-stage", str(vp_layers)]
    return gpt_flags(corpus, iters, tp=tp, micro_batch=2, global_batch=8, dropout=dropout,
                     extra=extra)


def _train(corpus, tp=1, pp=1, dp=1, vp_layers=None, **kw):
    """Run the layout; return the last rank's result (it holds the losses: last stage)."""
    results = run_on_ranks(run_pretrain, tp * pp * dp, _flags(corpus, tp, pp, vp_layers, **kw))
    return results[-1]


def _losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.fixture(scope="module")
def baseline(corpus):
    return _train(corpus)


LAYOUTS = [
    pytest.param(1, 2, 1, None, id="tp1-pp2-dp1"),
    pytest.param(2, 2, 1, None, id="tp2-pp2-dp1-sp"),
    pytest.param(1, 2, 1, 1, id="tp1-pp2x2virtual-dp1"),
    pytest.param(2, 1, 1, None, id="tp2-pp1-dp1-sp", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, None, id="tp1-pp1-dp2", marks=pytest.mark.slow),
    pytest.param(2, 1, 2, None, id="tp2-pp1-dp2-sp", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, None, id="tp1-pp2-dp2", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, None, id="tp2-pp2-dp2-sp", marks=pytest.mark.slow),
    pytest.param(1, 4, 1, None, id="tp1-pp4-dp1", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, 1, id="tp1-pp2x2virtual-dp2", marks=pytest.mark.slow),
    pytest.param(2, 2, 1, 1, id="tp2-pp2x2virtual-dp1-sp", marks=pytest.mark.slow),
    pytest.param(1, 3, 1, "1:2", id="tp1-pp3-uneven-1-1-2", marks=pytest.mark.slow),
]
# Every layout with DP > 1 again with the distributed optimizer (sharded fp32 main params and
# Adam state): the same sums in another order, so the same tolerance applies.
DISTRIBUTED_OPTIMIZER_LAYOUTS = [
    pytest.param(tp, pp, dp, vp, id=f"tp{tp}-pp{pp}-dp{dp}-distopt" + ("-vp" if vp else ""),
                 marks=pytest.mark.slow)
    for tp, pp, dp, vp in [(1, 1, 2, None), (2, 1, 2, None), (1, 2, 2, None), (2, 2, 2, None),
                           (1, 2, 2, 1)]
]


def _check_parity(baseline, out):
    base, got = _losses(baseline), _losses(out)
    assert len(base) == ITERS and [i for i, _ in out["losses"]] == list(range(1, ITERS + 1))
    assert base[-1] < base[0] - 0.2, base   # the run learns, so the comparison means something
    for step, (a, b) in enumerate(zip(base, got), start=1):
        assert abs(a - b) <= RTOL * abs(a), (step, base, got)
    want, have = baseline["valid"]["lm loss"], out["valid"]["lm loss"]
    assert abs(want - have) <= RTOL * abs(want), (want, have)


@pytest.mark.parametrize("tp,pp,dp,vp_layers", LAYOUTS)
def test_layout_matches_single_process(corpus, baseline, tp, pp, dp, vp_layers):
    _check_parity(baseline, _train(corpus, tp, pp, dp, vp_layers))


@pytest.mark.parametrize("tp,pp,dp,vp_layers", DISTRIBUTED_OPTIMIZER_LAYOUTS)
def test_distributed_optimizer_layout_matches_single_process(corpus, baseline, tp, pp, dp,
                                                             vp_layers):
    _check_parity(baseline, _train(corpus, tp, pp, dp, vp_layers,
                                   extra=["--use-distributed-optimizer"]))


def _resume(corpus, tmp_path, vp_layers, layout=()):
    """2N iterations straight == N, save, new processes load and run N more (dropout on)."""
    n = 4
    layout = list(layout)
    kw = dict(tp=1, pp=2, vp_layers=vp_layers, iters=2 * n, dropout=0.1)
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=layout))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=layout + ["--save", save, "--exit-interval", str(n),
                                      "--ckpt-format", "torch"]))[-1]   # its per-stage files
    assert first["iteration"] == n
    assert sorted(os.listdir(os.path.join(save, f"iter_{n:07d}"))) == ["mp_rank_00_000",
                                                                        "mp_rank_00_001"]
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=layout + ["--load", save]))[-1]
    assert [i for i, _ in second["losses"]] == list(range(n + 1, 2 * n + 1))
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)


def test_resume_with_pipeline_parallelism_is_bit_exact(corpus, tmp_path):
    _resume(corpus, tmp_path, None)


@pytest.mark.slow
def test_resume_with_interleaved_pipeline_is_bit_exact(corpus, tmp_path):
    _resume(corpus, tmp_path, 1)


@pytest.mark.slow
def test_resume_with_a_pipeline_layout_is_bit_exact(corpus, tmp_path):
    _resume(corpus, tmp_path, None, ["--pipeline-model-parallel-layout", "E|tt|t|tL"])


@pytest.mark.slow
def test_tp_pp_dp_mapping_matches_single_process(corpus, baseline):
    # PP 2 x DP 2: with one data-parallel copy the two rank orders are the same layout.
    # Numbered tp-cp-ep-pp-dp, rank 1 is the last stage of the first copy (under the default
    # order it would be the first stage of the second copy), so it holds losses too.
    results = run_on_ranks(run_pretrain, 4, _flags(corpus, pp=2,
                                                   extra=["--use-tp-pp-dp-mapping"]))
    assert all(loss is not None for _, loss in results[1]["losses"])
    assert all(loss is None for _, loss in results[2]["losses"])  # a first stage
    _check_parity(baseline, results[1])
    _check_parity(baseline, results[-1])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param(["--pipeline-model-parallel-layout", "Et|t*3L"], id="layout-1-3"),
    # pp 2 x vp 2, rank 0 [E] [t], rank 1 [t t] [t L]: an empty chunk, uneven virtual stages.
    pytest.param(["--pipeline-model-parallel-layout", "E|tt|t|tL"], id="layout-vp-0-2-1-1"),
    # 4 layers + embedding + loss = 6 places over pp 2 x vp 3: rank 0 [E] [t] [t],
    # rank 1 [t] [t] [L].
    pytest.param(["--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split",
                  "--num-virtual-stages-per-pipeline-rank", "3"], id="account-both-vp3"),
])
def test_pipeline_layout_matches_single_process(corpus, baseline, extra):
    _check_parity(baseline, _train(corpus, pp=2, extra=extra))

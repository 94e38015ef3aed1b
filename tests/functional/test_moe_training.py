"""A tiny GPT with mixture-of-experts layers trained under several layouts gives the losses of
the single-process run, and resumes bit for bit.

The model is the parity suite's (4 layers, hidden 32, fp32, dropout 0) with 4 experts, top-2
routing, the load-balancing loss (coefficient 0.01) and the z loss (1e-3), so the auxiliary
losses' gradients (scaled as the main loss's: 1 / micro-batches) are part of every step.
Tolerance: the same sums in another order give ulp-level differences per step (see
test_parity.py); a router's top-k choice could flip on such a difference only for a near tie,
so 1e-4 relative leaves margin while a missing aux-loss gradient, a wrong scale or a
mis-sliced sequence-parallel gather moves the losses by more within a few steps.
"""

import os
import re

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 6
RTOL = 1e-4
# Grad norms are logged with 3 decimals and agree to ~1e-6 relative, so the printed values
# differ at most by one in the last digit (a value next to a rounding boundary).
NORM_ATOL = 1.5e-3
MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3", "--no-bias-gelu-fusion"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, tp=1, pp=1, iters=ITERS, extra=()):
    extra = MOE + ["--pipeline-model-parallel-size", str(pp)] + list(extra)
    if tp > 1:
        extra.append("--sequence-parallel")
    return gpt_flags(corpus, iters, tp=tp, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=extra)


def _train(corpus, tp=1, pp=1, dp=1, **kw):
    return run_on_ranks(run_pretrain, tp * pp * dp, _flags(corpus, tp, pp, **kw))[-1]


def _train_logged(corpus, log_dir, tp=1, pp=1, dp=1, **kw):
    """:func:`_train`, with the logged grad norms added to the result as ``grad_norms``.

    The norm matters on its own: with Adam, a gradient clipped by a wrong norm (say, one
    missing another EP rank's experts) is nearly the same update, so the losses barely move.
    """
    os.makedirs(log_dir, exist_ok=True)
    result = run_on_ranks(_run_logged_per_rank, tp * pp * dp, _flags(corpus, tp, pp, **kw),
                          log_dir)[-1]
    norms = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            norms = norms or [float(re.search(r"grad norm: (\S+) \|", line).group(1))
                              for line in f.read().splitlines() if "| lm loss: " in line]
    return {**result, "grad_norms": norms}


def _losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.fixture(scope="module")
def baseline(corpus, tmp_path_factory):
    return _train_logged(corpus, str(tmp_path_factory.mktemp("baseline_log")))


def _check_parity(base, out, rtol=RTOL, norm_atol=NORM_ATOL):
    a, b = _losses(base), _losses(out)
    assert len(a) == ITERS and a[-1] < a[0] - 0.2, a   # it learns
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert abs(x - y) <= rtol * abs(x), (step, a, b)
    if "grad_norms" not in base or "grad_norms" not in out:
        return                                   # a run without logs: losses only
    m, n = base["grad_norms"], out["grad_norms"]
    assert len(m) == ITERS == len(n), (m, n)
    for step, (x, y) in enumerate(zip(m, n), start=1):
        assert abs(x - y) <= norm_atol, ("grad norm", step, m, n)


LAYOUTS = [
    pytest.param(2, 1, 1, (), id="tp2-sp"),
    pytest.param(1, 2, 1, (), id="pp2"),
    pytest.param(1, 1, 2, ("--use-distributed-optimizer",), id="dp2-distopt"),
    pytest.param(2, 2, 1, (), id="tp2-sp-pp2", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, ("--use-distributed-optimizer",), id="pp2-dp2-distopt",
                 marks=pytest.mark.slow),
    pytest.param(1, 2, 1, ("--num-layers-per-virtual-pipeline-stage", "1"), id="pp2x2virtual",
                 marks=pytest.mark.slow),
    pytest.param(2, 1, 1, ("--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"), id="tp2-sp-recompute",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 1, ("--moe-grouped-gemm",), id="grouped-gemm", marks=pytest.mark.slow),
    # Expert parallelism: the experts are dealt over the data-parallel ranks.
    pytest.param(1, 1, 2, ("--expert-model-parallel-size", "2"), id="ep2",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 2, ("--expert-model-parallel-size", "2",
                           "--moe-token-dispatcher-type", "alltoall"), id="ep2-alltoall"),
    pytest.param(1, 1, 4, ("--expert-model-parallel-size", "4",
                           "--moe-token-dispatcher-type", "alltoall"), id="ep4-alltoall",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 4, ("--expert-model-parallel-size", "4"), id="ep4",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 4, ("--expert-model-parallel-size", "2"), id="dp4-ep2",
                 marks=pytest.mark.slow),
    pytest.param(2, 1, 2, ("--expert-model-parallel-size", "2",
                           "--moe-token-dispatcher-type", "alltoall"), id="tp2-sp-ep2"),
    pytest.param(1, 2, 2, ("--expert-model-parallel-size", "2"), id="pp2-ep2",
                 marks=pytest.mark.slow),
    # Context parallelism (the "dp" column counts cp x dp ranks): the load-balancing loss
    # covers whole sequences. With 2 ranks and ep 2 the experts fold over the cp group.
    pytest.param(1, 1, 2, ("--context-parallel-size", "2"), id="cp2", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, ("--context-parallel-size", "2", "--expert-model-parallel-size", "2"),
                 id="cp2-ep2"),
    pytest.param(1, 1, 2, ("--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                           "--moe-token-dispatcher-type", "alltoall"), id="cp2-ep2-alltoall",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 4, ("--context-parallel-size", "2", "--expert-model-parallel-size", "2"),
                 id="cp2-dp2-ep2", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, ("--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                           "--moe-token-dispatcher-type", "alltoall"), id="ep2-grouped-gemm",
                 marks=pytest.mark.slow),
    # The distributed optimizer shards the experts over expert-DP (2 here, 1 in dp2-ep2).
    pytest.param(1, 1, 4, ("--expert-model-parallel-size", "2", "--use-distributed-optimizer"),
                 id="dp4-ep2-distopt", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, ("--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                           "--moe-token-dispatcher-type", "alltoall"),
                 id="dp2-ep2-distopt-alltoall"),
    pytest.param(1, 1, 4, ("--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                           "--moe-token-dispatcher-type", "alltoall", "--overlap-grad-reduce",
                           "--overlap-param-gather", "--ddp-bucket-size", "2000"),
                 id="dp4-ep2-distopt-alltoall-overlap", marks=pytest.mark.slow),
    # Expert tensor parallelism other than TP: each rank routes its own tokens (its sequence
    # slice under TP) and the dispatched rows are gathered over the expert-TP group.
    pytest.param(1, 1, 2, ("--expert-tensor-parallel-size", "2"), id="dp2-etp2"),
    pytest.param(2, 1, 1, ("--expert-tensor-parallel-size", "1", "--expert-model-parallel-size",
                           "2", "--moe-token-dispatcher-type", "alltoall"), id="tp2-sp-etp1-ep2"),
    pytest.param(2, 1, 2, ("--expert-tensor-parallel-size", "4"), id="tp2-sp-dp2-etp4",
                 marks=pytest.mark.slow),
    pytest.param(1, 1, 4, ("--expert-tensor-parallel-size", "2", "--expert-model-parallel-size",
                           "2", "--use-distributed-optimizer"), id="dp4-etp2-ep2-distopt",
                 marks=pytest.mark.slow),
    pytest.param(2, 2, 1, ("--expert-tensor-parallel-size", "1", "--expert-model-parallel-size",
                           "2"), id="tp2-sp-pp2-etp1-ep2", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, ("--expert-tensor-parallel-size", "2", "--moe-grouped-gemm",
                           "--moe-token-dispatcher-type", "alltoall"),
                 id="dp2-etp2-grouped-gemm-alltoall", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,pp,dp,extra", LAYOUTS)
def test_moe_layout_matches_single_process(corpus, baseline, tmp_path, tp, pp, dp, extra):
    _check_parity(baseline, _train_logged(corpus, str(tmp_path), tp, pp, dp, extra=extra))


@pytest.mark.slow
def test_fp16_distopt_ep_matches_single_process_fp16(corpus, tmp_path):
    """DP 4 x EP 2 with the distributed optimizer in fp16 against the single-process fp16 run.

    The loss scale starts low enough (2^16) that no step overflows, so both runs step alike.
    Tolerances: the weights are fp16, rounded from fp32 main copies that differ by ulps of
    summation order, so now and then an element rounds the other way. Losses: 5e-4 relative,
    one fp16 ulp (2^-11), where they agree to ~1e-4 over 6 steps. Grad norms (~1.4): 5e-3,
    where they agree to ~3e-3 by step 6; one that misses the other EP rank's experts is ~0.08
    smaller.
    """
    fp16 = ["--fp16", "--initial-loss-scale", "65536"]
    base = _train_logged(corpus, str(tmp_path / "single"), extra=fp16)
    out = _train_logged(corpus, str(tmp_path / "dp4-ep2"), dp=4,
                        extra=fp16 + ["--expert-model-parallel-size", "2",
                                      "--use-distributed-optimizer"])
    _check_parity(base, out, rtol=5e-4, norm_atol=5e-3)


@pytest.fixture(scope="module")
def bf16_baseline(corpus, tmp_path_factory):
    return _train_logged(corpus, str(tmp_path_factory.mktemp("bf16_log")), extra=["--bf16"])


@pytest.mark.parametrize("tp,dp,extra", [
    pytest.param(1, 2, ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "alltoall"), id="dp2-ep2-alltoall"),
    pytest.param(2, 1, ("--expert-tensor-parallel-size", "1", "--expert-model-parallel-size",
                        "2"), id="tp2-sp-etp1-ep2"),
])
def test_bf16_layouts_match_single_process_bf16(corpus, bf16_baseline, tmp_path, tp, dp, extra):
    """bf16 weights and activations (fp32 main copies and gradients, Megatron's bf16) at EP 2
    and at expert TP 1 under TP 2, against the one-process bf16 run.

    Tolerances: a bf16 rounding is 2^-8 relative, and a layout sums in another order, so
    activations differ by a few bf16 ulps per layer; over 6 steps the losses agree to ~2.5e-4
    relative and the grad norms to ~0.02 (measured 1e-4 .. 2.4e-4 and 0.004 .. 0.017). So 2e-3
    and 0.025; one expert-TP shard missing from the norm moves it by 0.03 - 0.05 (the fp32
    runs).
    """
    out = _train_logged(corpus, str(tmp_path), tp, 1, dp, extra=("--bf16",) + extra)
    _check_parity(bf16_baseline, out, rtol=2e-3, norm_atol=0.025)


@pytest.mark.slow
def test_sequence_aux_loss_under_context_parallelism(corpus, tmp_path):
    """seq_aux_loss counts each whole sequence's token choices, across the cp ranks."""
    extra = ("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1")
    _check_parity(_train_logged(corpus, str(tmp_path / "one"), extra=extra),
                  _train_logged(corpus, str(tmp_path / "cp2"), 1, 1, 2,
                                extra=extra + ("--context-parallel-size", "2")))


def _run_logged(argv, log_path):
    """Rank body: :func:`run_pretrain` with this rank's stdout written to ``log_path``
    (``log_path.<rank>`` on ranks other than 0)."""
    import sys

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(log_path if rank == 0 else f"{log_path}.{rank}", "w") as log:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
        try:
            return run_pretrain(argv)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _run_logged_per_rank(argv, log_dir):
    """Rank body: :func:`_run_logged` into ``log_dir/rank<r>.txt``."""
    import torch.distributed as dist

    return _run_logged(argv, os.path.join(log_dir, f"rank{dist.get_rank()}.txt"))


def test_aux_losses_are_logged_under_megatrons_names(corpus, tmp_path):
    log = str(tmp_path / "log.txt")
    run_on_ranks(_run_logged, 1, _flags(corpus, iters=2, extra=["--moe-per-layer-logging"]),
                 log)
    with open(log) as f:
        lines = [l for l in f.read().splitlines() if "| lm loss: " in l]
    assert len(lines) == 2, lines
    for line in lines:
        balance = float(re.search(r"load_balancing_loss: (\S+) \|", line).group(1))
        z = float(re.search(r"z_loss: (\S+) \|", line).group(1))
        assert 0.9 < balance < 2.0 and z > 0, line   # E sum f P is ~1 when balanced
        assert "moe/" not in line   # per-layer values go to TensorBoard only


def _logged_aux_losses(corpus, tmp_path, world, extra):
    log = str(tmp_path / f"log-{world}.txt")
    run_on_ranks(_run_logged, world, _flags(corpus, iters=3, extra=list(extra)), log)
    path = log if world == 1 else f"{log}.{world - 1}"      # the last rank logs
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if "| lm loss: " in l]
    return [(float(re.search(r"load_balancing_loss: (\S+) \|", l).group(1)),
             float(re.search(r"z_loss: (\S+) \|", l).group(1))) for l in lines]


def test_context_parallel_logs_the_one_rank_aux_losses(corpus, tmp_path):
    one = _logged_aux_losses(corpus, tmp_path, 1, ())
    two = _logged_aux_losses(corpus, tmp_path, 2, ("--context-parallel-size", "2"))
    assert len(one) == len(two) == 3
    for (balance, z), (balance_cp, z_cp) in zip(one, two):
        # Printed with 7 significant digits.
        assert balance_cp == pytest.approx(balance, rel=1e-5) and z_cp == pytest.approx(z, rel=1e-5)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bit_exact(corpus, tmp_path, fmt):
    """6 iterations straight == 3, save, new processes load and run 3 more (PP 2)."""
    n, kw = 3, dict(pp=2, iters=6)
    ckpt = ["--ckpt-format", fmt]
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=ckpt))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=ckpt + ["--save", save, "--exit-interval", str(n)]))[-1]
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=ckpt + ["--load", save]))[-1]
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)

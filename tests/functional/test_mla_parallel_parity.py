"""Multi-latent attention trained under every layout it supports gives the single-process run:
context parallelism (CP = 2 by p2p and all_gather, CP = 4 = 2 x 2 by a2a+p2p), tensor
parallelism with sequence parallelism (TP = 2) and pipeline parallelism (PP = 2), fp32, dropout
0, 6 iterations; and a CP = 2 run stopped at iteration 3 resumes bit for bit.

The model is ``test_mla_run``'s (q and kv latents, key/value head sizes 8 + 4 rotary / 6, YaRN
rotary and mscale, RMSNorm, SwiGLU). Tolerances are the feature's promise: losses within 1e-4
and gradient norms within 1e-3 of one process. Measured: at most 6e-7 on losses and 1.3e-7 on
norms (blockwise attention and split sums only reorder fp32 rounding).
"""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.functional.test_mla_run import MLA
from tests.functional.test_torch_fsdp2 import run_recording_grad_norms
from tests.multiprocess import run_on_ranks

ITERS = 6
LOSS_ATOL, NORM_ATOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _train(corpus, world, *, layers=2, tp=1, extra=()):
    flags = gpt_flags(corpus, ITERS, tp=tp, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=MLA + ["--num-layers", str(layers), *extra])
    return run_on_ranks(run_recording_grad_norms, world, flags)[-1]


def _losses(result):
    return [loss for _, loss in result["losses"]]


def _check(base, out, what):
    want, got = _losses(base), _losses(out)
    assert [i for i, _ in out["losses"]] == list(range(1, ITERS + 1)), what
    assert want[-1] < want[0] - 0.1, want  # the run learns, so the comparison means something
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= LOSS_ATOL, (what, step, want, got)
    for step, (a, b) in enumerate(zip(base["grad_norms"], out["grad_norms"]), start=1):
        assert abs(a - b) <= NORM_ATOL, (what, step, base["grad_norms"], out["grad_norms"])
    assert len(out["grad_norms"]) == ITERS


@pytest.fixture(scope="module")
def baseline(corpus):
    return _train(corpus, 1)


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_mla_cp2_matches_one_process(corpus, baseline, comm):
    out = _train(corpus, 2, extra=["--context-parallel-size", "2", "--cp-comm-type", comm])
    _check(baseline, out, f"cp2 {comm}")


@pytest.mark.slow
def test_mla_cp4_hierarchical_a2a_p2p_matches_one_process(corpus, baseline):
    out = _train(corpus, 4, extra=["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                   "--hierarchical-context-parallel-sizes", "2", "2"])
    _check(baseline, out, "cp4 a2a+p2p 2x2")


@pytest.mark.slow
def test_mla_tp2_sequence_parallel_matches_one_process(corpus, baseline):
    _check(baseline, _train(corpus, 2, tp=2, extra=["--sequence-parallel"]), "tp2 sp")


@pytest.mark.slow
def test_mla_pp2_matches_one_process(corpus):
    base = _train(corpus, 1, layers=4)
    out = _train(corpus, 2, layers=4, extra=["--pipeline-model-parallel-size", "2"])
    _check(base, out, "pp2")


@pytest.mark.slow
def test_mla_cp2_resumes_bit_for_bit(corpus, tmp_path):
    cp = ["--context-parallel-size", "2"]
    straight = _train(corpus, 2, extra=cp)
    save = str(tmp_path / "ckpt")
    first = _train(corpus, 2, extra=cp + ["--save", save, "--save-interval", "3",
                                          "--exit-interval", "3"])
    assert first["iteration"] == 3 and os.path.isdir(os.path.join(save, "iter_0000003"))
    second = _train(corpus, 2, extra=cp + ["--load", save])
    assert [i for i, _ in second["losses"]] == [4, 5, 6]
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["grad_norms"] + second["grad_norms"] == straight["grad_norms"]

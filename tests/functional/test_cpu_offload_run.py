"""pretrain_gpt with ``--optimizer-cpu-offload``: the same losses as without, bit for bit, with
the replicated and the distributed optimizer, and a checkpoint saved with offload resumes
without it (and the reverse) bit for bit.

On this CPU machine the offload path runs whole (host copies, host step, copies back) over CPU
parameters; the host part applies the same arithmetic to the same values, so the losses are
equal, not close.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, ranks, extra):
    argv = gpt_flags(corpus, 2 * N, dropout=0.0, extra=list(extra))
    return run_on_ranks(run_pretrain, ranks, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--bf16"], ["--use-distributed-optimizer"]],
                         ids=["bf16", "distributed"])
def test_offloaded_run_equals_plain_run_and_resumes_across(corpus, tmp_path, extra):
    ranks = 2 if "--use-distributed-optimizer" in extra else 1
    save = str(tmp_path / "ckpt")
    plain = _run(corpus, ranks, extra)
    offloaded = _run(corpus, ranks, extra + OFFLOAD + ["--save", save, "--save-interval",
                                                       str(N), "--ckpt-format", "torch"])
    assert _losses(offloaded) == _losses(plain)
    assert _losses(plain)[-1] < _losses(plain)[0]
    load = ["--load", save, "--ckpt-step", str(N), "--ckpt-format", "torch"]
    assert _losses(_run(corpus, ranks, extra + load)) == _losses(plain)[N:]
    assert _losses(_run(corpus, ranks, extra + OFFLOAD + load)) == _losses(plain)[N:]

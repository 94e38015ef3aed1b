"""pretrain_gpt end to end with ``--optimizer soap`` and ``--optimizer adaptive_muon``: the loss
falls, a run resumed from a ``--ckpt-format torch`` checkpoint continues bit for bit (the
eigenbases, Kronecker factors and moments included), and ``--use-distributed-optimizer`` (the
layer-wise deal over the data-parallel ranks) gives the very losses of the run without it.

References: the run that never stopped (dropout off, one rank: a resume repeats the same
arithmetic, so the losses must be identical, and a resume without the optimizer state must not
be), and the same optimizer at the same data-parallel size without the deal (every rank sees
the same averaged gradients, the owner's step is broadcast, so the losses must be identical).
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
MODEL = ["--num-query-groups", "2", "--swiglu", "--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, optimizer, extra, ranks=1, lr=5e-3):
    argv = gpt_flags(corpus, 2 * N, dropout=0.0, lr=lr, micro_batch=1,
                     extra=["--optimizer", optimizer, *MODEL, *extra])
    return run_on_ranks(run_pretrain, ranks, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_run_learns_and_resumes_bit_for_bit(corpus, tmp_path, optimizer):
    save = str(tmp_path / "ckpt")
    straight = _run(corpus, optimizer, ["--save", save, "--save-interval", str(N)])
    losses = _losses(straight)
    assert len(losses) == 2 * N and sum(losses[N:]) / N < sum(losses[:N]) / N - 0.1, losses
    load = ["--load", save, "--ckpt-step", str(N)]
    resumed = _run(corpus, optimizer, load)
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == losses[N:]
    fresh = _run(corpus, optimizer, load + ["--no-load-optim"])
    assert _losses(fresh)[1] != losses[N + 1]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_distributed_optimizer_is_the_layer_wise_deal(corpus, tmp_path, optimizer):
    plain = _losses(_run(corpus, optimizer, [], ranks=2))
    save = str(tmp_path / "dealt")
    dealt = _losses(_run(corpus, optimizer, ["--use-distributed-optimizer", "--save", save,
                                             "--save-interval", str(N)], ranks=2))
    assert dealt == plain
    # The torch-format file holds the whole (gathered) state: the deal resumes from it.
    resumed = _run(corpus, optimizer, ["--use-distributed-optimizer", "--load", save,
                                       "--ckpt-step", str(N)], ranks=2)
    assert _losses(resumed) == dealt[N:]

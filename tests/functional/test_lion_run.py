"""pretrain_gpt end to end with ``--optimizer lion``: the loss falls, the distributed optimizer
gives the replicated optimizer's losses, and a run resumed from a checkpoint (``--ckpt-format``
torch and torch_dist, replicated and distributed optimizer) continues bit for bit, Lion's
momentum (``exp_avg``) included.

Dropout is off and ``--clip-grad 0``: at DP 2 both optimizers then see bit-identical averaged
gradients (a + b, exact halving) and apply the same per-element arithmetic, so their losses are
equal, not close (a clip coefficient summed in another order could tip the sign of an element
whose momentum is near zero). Losing the momentum at the checkpoint changes the first resumed
losses (checked below), so the resume checks can fail.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
LION = ["--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99", "--clip-grad",
        "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, ranks, extra):
    argv = gpt_flags(corpus, 2 * N, dropout=0.0, lr=2e-3, extra=LION + list(extra))
    return run_on_ranks(run_pretrain, ranks, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_lion_learns_and_resumes_bit_for_bit(corpus, tmp_path, fmt):
    save = str(tmp_path / "ckpt")
    straight = _run(corpus, 1, ["--save", save, "--save-interval", str(N), "--ckpt-format", fmt])
    losses = _losses(straight)
    assert len(losses) == 2 * N and sum(losses[N:]) / N < sum(losses[:N]) / N - 0.1, losses
    load = ["--load", save, "--ckpt-step", str(N), "--ckpt-format", fmt]
    resumed = _run(corpus, 1, load)
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == losses[N:]
    fresh = _run(corpus, 1, load + ["--no-load-optim"])
    assert _losses(fresh)[1:] != losses[N + 1:]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distributed_lion_matches_replicated_and_resumes_bit_for_bit(corpus, tmp_path, fmt):
    replicated = _run(corpus, 2, [])
    save = str(tmp_path / "ckpt")
    dist_flags = ["--use-distributed-optimizer", "--ckpt-format", fmt]
    straight = _run(corpus, 2, dist_flags + ["--save", save, "--save-interval", str(N)])
    assert _losses(straight) == _losses(replicated)
    resumed = _run(corpus, 2, dist_flags + ["--load", save, "--ckpt-step", str(N)])
    assert _losses(resumed) == _losses(straight)[N:]


@pytest.mark.slow
def test_lion_steps_fsdp2_shards_like_the_replicated_optimizer(corpus):
    """Lion over FSDP2's sharded DTensor parameters. FSDP2 reduce-scatters the gradients, which
    may sum them in another order (a few ulps); Lion's update is the sign of each element's
    momentum, so only an element within those ulps of zero could tip. Measured: the losses are
    identical; 1e-5 leaves room for such a tip, far below a wrong shard (1e-3 and more)."""
    replicated = _losses(_run(corpus, 2, []))
    fsdp = _losses(_run(corpus, 2, ["--use-torch-fsdp2"]))
    assert fsdp == pytest.approx(replicated, rel=1e-5)

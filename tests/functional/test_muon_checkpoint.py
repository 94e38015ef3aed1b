"""``--optimizer muon`` and ``dist_muon`` in training, with their state in both checkpoint
formats.

References: the run that never stopped (a resume at the same layout must give its losses bit for
bit), ``--optimizer muon`` at the same data-parallel size (``dist_muon`` deals whole weights
over the ranks and broadcasts them, so its losses must be identical), and the one-process run
(another data-parallel size sums the gradients in another order: within ``LOSS_ATOL``).
"""

import os

import pytest

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

LOSS_ATOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


def _run(corpus, optimizer, dp, extra=()):
    flags = gpt_flags(corpus, 8, dropout=0.0, micro_batch=1, extra=[
        "--optimizer", optimizer, "--muon-fp32-matmul-prec", "high", *extra])
    return run_on_ranks(run_pretrain, dp, flags)[-1]


def _losses(out, first=1):
    assert [i for i, _ in out["losses"]] == list(range(first, 9))
    return dict(out["losses"])


@pytest.mark.slow
def test_dist_muon_is_muon_and_resumes_from_torch_dist_at_any_dp(corpus, tmp_path):
    muon = _losses(_run(corpus, "muon", 2))
    save = str(tmp_path / "dist_muon")
    dist_muon = _losses(_run(corpus, "dist_muon", 2, ["--save", save, "--save-interval", "4",
                                                      "--ckpt-format", "torch_dist"]))
    assert dist_muon == muon
    reader = DistCheckpointReader(os.path.join(save, "iter_0000004"))
    keys = set(reader.tensor_keys())
    assert ("optimizer.state.momentum_buffer.decoder.layers.self_attention.linear_qkv.weight"
            in keys)
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in keys
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" not in keys
    assert "optimizer.state.momentum_buffer.embedding.word_embeddings.weight" not in keys
    load = ["--load", save, "--ckpt-step", "4", "--ckpt-format", "torch_dist"]
    resumed = _losses(_run(corpus, "dist_muon", 2, load), first=5)
    assert resumed == {i: dist_muon[i] for i in range(5, 9)}
    one = _losses(_run(corpus, "muon", 1, load), first=5)
    for i in range(5, 9):
        assert abs(one[i] - dist_muon[i]) <= LOSS_ATOL, (i, one, dist_muon)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,extra", [("torch_dist", []), ("torch", []),
                                       ("torch_dist", ["--bf16"])])
def test_muon_resumes_bit_exact(corpus, tmp_path, fmt, extra):
    save = str(tmp_path / "muon")
    flags = ["--ckpt-format", fmt, *extra]
    full = _losses(_run(corpus, "muon", 1, flags + ["--save", save, "--save-interval", "4"]))
    again = _losses(_run(corpus, "muon", 1, flags + ["--load", save, "--ckpt-step", "4"]),
                    first=5)
    assert again == {i: full[i] for i in range(5, 9)}


@pytest.mark.slow
def test_dist_muon_torch_format_resumes_at_dp1(corpus, tmp_path):
    """The torch format's file holds the whole (gathered) state: one process continues."""
    save = str(tmp_path / "torch")
    full = _losses(_run(corpus, "dist_muon", 2, ["--save", save, "--save-interval", "4"]))
    load = ["--load", save, "--ckpt-step", "4"]
    again = _losses(_run(corpus, "dist_muon", 2, load), first=5)
    assert again == {i: full[i] for i in range(5, 9)}
    one = _losses(_run(corpus, "muon", 1, load), first=5)
    for i in range(5, 9):
        assert abs(one[i] - full[i]) <= LOSS_ATOL, (i, one, full)


@pytest.mark.slow
@pytest.mark.parametrize("extra,ranks", [
    (["--tensor-model-parallel-size", "2"], 4),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01",
      "--swiglu"], 2)])
def test_dist_muon_is_muon_with_tensor_and_expert_parallelism(corpus, extra, ranks):
    """TP=2 x DP=2 (each tensor-parallel pair owns the same weights and gathers them together)
    and EP=2 (expert weights stepped by every rank)."""
    flags = ["--train-iters", "4", *extra]
    muon = [loss for _, loss in _run(corpus, "muon", ranks, flags)["losses"]]
    dist_muon = [loss for _, loss in _run(corpus, "dist_muon", ranks, flags)["losses"]]
    assert len(muon) == 4 and dist_muon == muon

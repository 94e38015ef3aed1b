"""--standalone-embedding-stage trains the same model as one process, on gloo ranks.

* Losses: the parity suite's tiny GPT (4 layers, 8 steps) at pp 3 (rank 0 the embedding, ranks
  1 and 2 two layers each) and at pp 2 x vp 2 (rank 0 [E] [], an empty virtual stage that only
  passes the hidden states on), against the single-process run, with the parity suite's
  tolerance (see test_parity).
* Gradients and checkpoint keys: one plain SGD step (no momentum history, no weight decay, no
  warm-up, no clipping) moves every weight by ``lr x gradient``; the torch_dist checkpoint
  written after it at pp 3 must hold the same keys (Megatron-Core's global layer numbering) with
  the same values as the single-process one, and each tensor's step (against a run with lr 0)
  must agree within ``STEP_RTOL`` = 1e-5 of its norm. The two runs sum the same fp32 terms in
  another order: measured at most 7.6e-8; a gradient missing or landing on another layer is off
  by the order of the step itself.
* The torch format files: Megatron's per-stage numbering, rank 0's file has the embedding and
  no layer, ranks 1 and 2 each ``layers.0`` and ``layers.1``.
"""

import os

import pytest

from tests.functional.gpt_runs import run_pretrain, write_counting_corpus
from tests.functional.test_parity import _check_parity, _flags, _train
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

STANDALONE = ["--standalone-embedding-stage"]
STEP_RTOL = 1e-5
SGD_STEP = ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", "0.5", "--min-lr", "0.5",
            "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--weight-decay", "0",
            "--clip-grad", "0", "--ckpt-format", "torch_dist", "--save-interval", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


@pytest.fixture(scope="module")
def baseline(corpus):
    return _train(corpus)


@pytest.mark.parametrize("pp,extra", [
    pytest.param(3, [], id="pp3"),
    pytest.param(2, ["--num-virtual-stages-per-pipeline-rank", "2"], id="pp2-vp2"),
])
def test_losses_match_single_process(corpus, baseline, pp, extra):
    _check_parity(baseline, _train(corpus, pp=pp, extra=STANDALONE + extra))


def _one_step(corpus, save, pp, extra=(), lr=None):
    flags = _flags(corpus, pp=pp, iters=1, extra=SGD_STEP + ["--save", save] + list(extra))
    if lr is not None:
        flags += ["--lr", lr, "--min-lr", lr]
    run_on_ranks(run_pretrain, pp, flags)
    return os.path.join(save, "iter_0000001")


def test_one_sgd_step_saves_the_single_process_weights_under_its_keys(corpus, tmp_path):
    from megatron.checkpoint.dist.reader import DistCheckpointReader

    one = DistCheckpointReader(_one_step(corpus, str(tmp_path / "one"), 1))
    start = DistCheckpointReader(_one_step(corpus, str(tmp_path / "start"), 1, lr="0"))
    split = DistCheckpointReader(_one_step(corpus, str(tmp_path / "split"), 3, STANDALONE))
    keys = [k for k in one.tensor_keys() if not k.startswith("optimizer.")]
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys
    assert one.summary() == split.summary()
    assert one.shape("decoder.layers.self_attention.linear_qkv.weight")[0] == 4
    worst = 0.0
    for key in keys:
        want, got, before = (r.read(key).double() for r in (one, split, start))
        assert (got - want).norm() <= 1e-6 * want.norm(), key
        step = (want - before).norm()
        assert step > 0, key
        worst = max(worst, float((got - before - (want - before)).norm() / step))
        assert (got - before - (want - before)).norm() <= STEP_RTOL * step, key
    print("worst relative difference of one step:", worst)


def _flat(tree, prefix=""):
    """The dotted names of a legacy checkpoint's nested ``model`` dict."""
    if not isinstance(tree, dict):
        return [prefix[:-1]]
    return [name for key, sub in tree.items() for name in _flat(sub, f"{prefix}{key}.")]


def _file_keys(save, pp):
    from megatron.checkpoint.layout import load_state_file

    keys = {}
    for rank in range(pp):
        path = os.path.join(save, "iter_0000001", f"mp_rank_00_{rank:03d}",
                            "model_optim_rng.pt")
        keys[rank] = sorted(_flat(load_state_file(path)["model"]))
    return keys


def test_torch_format_numbers_layers_per_stage(corpus, tmp_path):
    save = str(tmp_path / "torch")
    run_on_ranks(run_pretrain, 3, _flags(corpus, pp=3, iters=1, extra=STANDALONE + [
        "--save", save, "--save-interval", "1", "--ckpt-format", "torch",
        "--lr-warmup-iters", "0"]))
    keys = _file_keys(save, 3)
    layers = {rank: sorted({k.split("layers.")[1].split(".")[0] for k in names
                            if "layers." in k}) for rank, names in keys.items()}
    assert layers == {0: [], 1: ["0", "1"], 2: ["0", "1"]}
    assert any("embedding" in k for k in keys[0])
    assert not any("final" in k for k in keys[0] + keys[1])
    assert any("final" in k for k in keys[2])

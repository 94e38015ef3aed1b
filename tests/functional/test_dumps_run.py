"""pretrain_gpt.py with Megatron's --save-*-interval dumps, read back against the run itself.

The run trains with plain SGD (no momentum, weight decay or clipping, constant learning rate), so
the step is ``params_after = params_before - lr * wgrad``: the dumped gradients of iteration 2
must carry the dumped parameters of iteration 1 into those of iteration 2, which must be the
weights of the iteration-2 checkpoint. The dumped activations and data gradients of a linear
layer must satisfy ``y = x W^T`` and ``dx = dy W`` with the weights its forward used (fp64).
Dumping must not change the losses.
"""

import json
import os

import pytest
import torch

from megatron.checkpoint.safe_unpickle import torch_load
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

LR = 5e-3
SGD = ["--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0", "--clip-grad", "0",
       "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--lr", str(LR)]
LINEAR = "language_model.encoder.layers.1.mlp.dense_h_to_4h"


def _flat(tree, prefix=""):
    """A checkpoint's nested model dict as ``{"a.b.c": tensor}``, as parameters are named."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def _dump(save, label, iteration):
    path = os.path.join(save, label, f"iter_{iteration:07d}", "mp_rank_00.pth")
    return torch.load(path, weights_only=True)["model_chunk0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    prefix = write_counting_corpus(str(root / "data" / "counting"))
    save = str(root / "save")
    dumps = ["--save", save, "--ckpt-format", "torch",   # the checkpoint is read as one file
             "--save-interval", "2", "--save-params-interval", "1",
             "--save-wgrads-interval", "2", "--save-activations-interval", "2",
             "--save-dgrads-interval", "2"]
    plain = run_on_ranks(run_pretrain, 1, gpt_flags(prefix, 2, dropout=0.0, extra=SGD))[0]
    dumped = run_on_ranks(run_pretrain, 1, gpt_flags(prefix, 2, dropout=0.0,
                                                     extra=SGD + dumps))[0]
    return save, plain, dumped


@pytest.mark.slow
def test_dumps_fire_on_their_iterations_and_leave_the_losses_alone(runs):
    save, plain, dumped = runs
    assert dumped["losses"] == plain["losses"]
    for label, iterations in (("params", [1, 2]), ("wgrads", [2]), ("activations", [2]),
                              ("dgrads", [2])):
        assert sorted(os.listdir(os.path.join(save, label))) == [
            f"iter_{i:07d}" for i in iterations]


@pytest.mark.slow
def test_params_and_wgrads_are_the_sgd_step_and_the_checkpoint(runs):
    save = runs[0]
    before, after, grads = _dump(save, "params", 1), _dump(save, "params", 2), _dump(
        save, "wgrads", 2)
    assert set(before) == set(after) == set(grads)
    checkpoint = _flat(torch_load(os.path.join(save, "iter_0000002", "mp_rank_00",
                                               "model_optim_rng.pt"))["model"])
    for name, value in after.items():
        assert torch.equal(value, checkpoint[name]), name
        assert grads[name].abs().sum() > 0, name
        step = before[name].double() - LR * grads[name].double()
        torch.testing.assert_close(step, value.double(), rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
def test_activations_and_dgrads_of_a_linear_layer_match_its_weights(runs):
    save = runs[0]
    weights = _dump(save, "params", 1)          # the weights iteration 2's passes used
    acts, dgrads = _dump(save, "activations", 2), _dump(save, "dgrads", 2)
    w = weights[LINEAR + ".weight"].double()                              # [4h, h]
    x, y = acts[LINEAR + "/input0"].double(), acts[LINEAR + "/output0"].double()  # (s, b, .)
    torch.testing.assert_close(x @ w.T, y, rtol=1e-5, atol=1e-6)
    assert torch.equal(acts[LINEAR + "/output1"], weights[LINEAR + ".bias"])  # the bias, unadded
    dy, dx = dgrads[LINEAR + "/output0"].double(), dgrads[LINEAR + "/input0"].double()
    assert dx.abs().max() > 0
    torch.testing.assert_close(dy @ w, dx, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_tokens_per_expert_lines_count_every_routed_token(tmp_path):
    """One JSON line per MoE layer and iteration; each micro-batch's counts add up to its
    tokens x top-k (one rank holds every expert)."""
    prefix = write_counting_corpus(str(tmp_path / "data" / "counting"))
    save = str(tmp_path / "save")
    moe = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
           "--no-bias-gelu-fusion", "--save", save, "--save-tokens-per-expert-interval", "2"]
    run_on_ranks(run_pretrain, 1, gpt_flags(prefix, 4, dropout=0.0, extra=moe))
    with open(os.path.join(save, "tokens_per_expert", "rank0.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [(r["iter"], r["block"], r["layer"]) for r in lines] == [
        (2, "decoder", 0), (2, "decoder", 1), (4, "decoder", 0), (4, "decoder", 1)]
    for record in lines:
        assert len(record["tpe"]) == 2                     # global batch 4 / micro-batch 2
        for counts in record["tpe"]:
            assert len(counts) == 4 and sum(counts) == 2 * 16 * 2  # micro-batch x seq x top-k

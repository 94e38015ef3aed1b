"""Checkpoints without a router bias load into MoE models with linear biases as zero biases.

Before MoE layers with ``--add-bias-linear`` carried ``mlp.router.bias`` (Megatron-Core's
``decoder.layers.mlp.router.bias``), their router computed ``x W^T``. A checkpoint of that time
is made here by deleting the key from one this project saved (from the torch file's model state;
from the torch_dist metadata). Reference: the same checkpoint with the key kept and set to zero,
i.e. the model before the router bias existed. Loaded with --no-load-optim, the losses that
follow (computed from the loaded model's logits) must equal the reference's bit for bit, and
differ from those of the checkpoint's own trained bias (so the test can fail). The converter
writes zeros in the bias's place.
"""

import glob
import os
import pickle
import shutil

import pytest
import torch

from megatron.checkpoint.safe_unpickle import torch_load
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import _flags, _losses, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main as convert_main

N = 2   # iterations before the save; 2 more after the load
DIST_KEY = "decoder.layers.mlp.router.bias"


def _run(corpus, fmt, extra=(), iters=2 * N):
    flags = _flags(corpus, iters=iters, extra=["--ckpt-format", fmt] + list(extra))
    return run_on_ranks(run_pretrain, 1, flags)[-1]


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """``saved(fmt)``: the folder of a run that saved at iteration N (one per format)."""
    made = {}

    def get(fmt):
        if fmt not in made:
            made[fmt] = str(tmp_path_factory.mktemp(f"saved_{fmt}") / "save")
            _run(corpus, fmt, ["--save", made[fmt], "--exit-interval", str(N)])
        return made[fmt]
    return get


def _torch_file(root):
    files = glob.glob(os.path.join(root, "iter_*", "mp_rank_00", "model_optim_rng.pt"))
    assert len(files) == 1, files
    return files[0]


def _edit_router_biases(tree, action):
    """Apply ``action(tree, key)`` to every router bias of a nested model state; their count."""
    count = 0
    for key in list(tree):
        if isinstance(tree[key], dict):
            count += _edit_router_biases(tree[key], action)
        elif key.endswith("mlp.router.bias"):
            action(tree, key)
            count += 1
    return count


def _torch_copy(src, dst, action):
    shutil.copytree(src, dst)
    path = _torch_file(dst)
    state = torch.load(path, weights_only=False)   # written by this test's own run
    assert _edit_router_biases(state["model"], action) == 4   # one per MoE layer
    torch.save(state, path)
    return dst


def _drop(tree, key):
    del tree[key]


def _zero(tree, key):
    tree[key] = torch.zeros_like(tree[key])


def _dist_without_router_bias(src, dst):
    """A copy of a torch_dist folder whose metadata no longer lists the router bias."""
    shutil.copytree(src, dst)
    path, = glob.glob(os.path.join(dst, "iter_*", ".metadata"))
    with open(path, "rb") as f:
        meta = pickle.load(f)                      # written by this test's own run
    assert DIST_KEY in meta.state_dict_metadata
    del meta.state_dict_metadata[DIST_KEY]
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != DIST_KEY}
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return dst


def _resume(corpus, root, fmt="torch", extra=("--no-load-optim",)):
    return _losses(_run(corpus, fmt, ["--load", root] + list(extra)))


@pytest.mark.slow
def test_checkpoint_without_router_bias_loads_as_zero_bias(corpus, saved, tmp_path, capfd):
    """Both formats: the loaded model is the zero-bias one; the trained bias would differ."""
    reference = _resume(corpus, _torch_copy(saved("torch"), str(tmp_path / "zero"), _zero))
    assert _resume(corpus, saved("torch")) != reference
    capfd.readouterr()
    stripped = _torch_copy(saved("torch"), str(tmp_path / "old"), _drop)
    assert _resume(corpus, stripped) == reference
    note = capfd.readouterr().out
    assert note.count("NOTE: ") == 1 and "no language_model.encoder.layers.0.mlp.router.bias" \
        in note and "filled with zeros" in note, note
    old_dist = _dist_without_router_bias(saved("torch_dist"), str(tmp_path / "old_dist"))
    assert _resume(corpus, old_dist, "torch_dist") == reference
    assert "filled with zeros" in capfd.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_optimizer_state_without_router_bias_is_refused(corpus, saved, tmp_path, fmt):
    """The optimizer state has no entry for the bias either: say which flags go on."""
    old = (_torch_copy(saved("torch"), str(tmp_path / "old"), _drop) if fmt == "torch" else
           _dist_without_router_bias(saved("torch_dist"), str(tmp_path / "old")))
    with pytest.raises(AssertionError, match=r"its optimizer state has no entry for \S*"
                       r"mlp.router.bias .*pass --no-load-optim \(fresh optimizer state\) or "
                       r"--finetune"):
        _resume(corpus, old, fmt, extra=())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_converter_writes_zeros_for_an_absent_router_bias(saved, tmp_path, capsys, fmt):
    """Converting to the torch format: the bias is zero, every other tensor the source's."""
    if fmt == "torch":
        old = _torch_copy(saved("torch"), str(tmp_path / "old"), _drop)
    else:
        old = _dist_without_router_bias(saved("torch_dist"), str(tmp_path / "old"))
    out = str(tmp_path / "out")
    assert convert_main(["--model-type", "GPT", "--load-dir", old, "--save-dir", out]) == 0
    assert "no decoder.layers.mlp.router.bias" in capsys.readouterr().out or fmt == "torch"
    got = flatten_state_dict(torch_load(_torch_file(out))["model"])
    want = flatten_state_dict(torch_load(_torch_file(saved("torch")))["model"])
    biases = [k for k in got if k.endswith("mlp.router.bias")]
    assert len(biases) == 4
    for name in biases:
        assert torch.equal(got[name], torch.zeros_like(want[name]))
    for name, tensor in want.items():
        if not name.endswith("mlp.router.bias") and fmt == "torch":
            assert torch.equal(got[name], tensor), name

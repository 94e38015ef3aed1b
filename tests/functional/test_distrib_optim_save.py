"""Torch-format checkpoints of the distributed optimizer, written in Megatron-LM's layout: the
param groups in ``model_optim_rng.pt``, the fp32 main parameters and Adam moments in
``distrib_optim.pt`` beside it.

The files are read by the naive layout of the unit tests (Megatron-LM's buffer rebuilt from its
documented rules, not from this project's code). References: the model weights saved in the same
file (an fp32 model's main parameters are its weights, bit for bit), and the Adam moments saved
by the replicated optimizer in the same run at the same DP size (its file keeps them per
parameter). Checkpoints in the project's earlier layout (``param_state`` inside the model file),
made here from the new files by the naive reader, still load, and resume exactly like the new
layout, at the DP size that saved them and at another one.
"""

import os
import shutil

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks
from tests.unit.test_distrib_optim_file import KEYS, megatron_order, naive_buckets

N = 2
# The replicated optimizer's moments against the distributed one's, relative to each tensor's
# largest element: the same averaged gradients (two ranks), only the clipping norm summed in
# another order (measured: 2.3e-7 at most). A value in another parameter's slot is off by O(1).
MOMENT_RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra=(), tp=1, distributed=True):
    return gpt_flags(corpus, 2 * N, tp=tp, dropout=0.0, micro_batch=2, global_batch=4,
                     extra=(["--use-distributed-optimizer"] if distributed else [])
                     + ["--ckpt-format", "torch"] + list(extra))


def _losses(dp, argv):
    return [loss for _, loss in run_on_ranks(run_pretrain, dp, argv)[-1]["losses"]]


def _rank_dir(root, rank="mp_rank_00"):
    return os.path.join(root, f"iter_{N:07d}", rank)


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def naive_state(rank_dir, model_tree, dp, dtypes=(torch.float32, torch.float32)):
    """``{name: {key: tensor of the parameter's shape}}`` read from ``distrib_optim.pt`` at the
    naive layout's offsets (one bucket: no --overlap-grad-reduce)."""
    content = _load(os.path.join(rank_dir, "distrib_optim.pt"))
    assert content["buckets_coalesced"] is True and set(content) == {"buckets_coalesced", 0}
    (dtype, entry), = content[0].items()
    assert dtype == dtypes
    shapes = {n: model_tree[n].shape for n in megatron_order()}
    where, unpadded = naive_buckets({n: s.numel() for n, s in shapes.items()}, None, dp)
    assert entry["numel_unpadded"] == sum(unpadded) == entry["param"].numel()
    return {n: {k: entry[k][start:start + shapes[n].numel()].reshape(shapes[n])
                for k in KEYS} for n, (_, start) in where.items()}


def _model_tree(state):
    """The model's tensors by dotted name."""
    out, stack = {}, [("", state["model"])]
    while stack:
        prefix, tree = stack.pop()
        for key, value in tree.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            elif isinstance(value, torch.Tensor):
                out[prefix + key] = value
    return out


def _group_names(groups):
    """Names per param group, as the builder groups them: matrices decayed, the rest not."""
    decayed = [n for n in megatron_order() if not n.endswith(".bias") and "layernorm" not in n]
    rest = [n for n in megatron_order() if n not in decayed]
    return [decayed if float(g["wd_mult"]) > 0 else rest for g in groups]


def _check_files(rank_dir, dp, dtypes=(torch.float32, torch.float32)):
    """The model file holds the param groups only; the fp32 main parameters in
    ``distrib_optim.pt`` are the saved weights (rounded to a half-precision model's dtype)."""
    state = _load(os.path.join(rank_dir, "model_optim_rng.pt"))
    opt = state["optimizer"]
    assert set(opt["optimizer"]) == {"param_groups"} and "param_state" not in opt
    assert all("params" not in g and g["step"] == N for g in opt["optimizer"]["param_groups"])
    tree = _model_tree(state)
    values = naive_state(rank_dir, tree, dp, dtypes)
    for name in megatron_order():
        main = values[name]["param"]
        assert main.dtype == torch.float32 and torch.equal(main.to(tree[name].dtype),
                                                           tree[name]), name
    return state, values


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("distrib_optim_save")
    new = str(root / "new")
    losses = _losses(2, _flags(corpus, ["--save", new, "--save-interval", str(N)]))
    return {"new": new, "losses": losses, "root": root}


@pytest.mark.slow
def test_dp2_files_hold_megatrons_layout_and_the_replicated_moments(corpus, saved):
    _, values = _check_files(_rank_dir(saved["new"]), 2)
    replicated = str(saved["root"] / "replicated")
    run_on_ranks(run_pretrain, 2, _flags(corpus, ["--save", replicated, "--save-interval",
                                                  str(N)], distributed=False))
    opt = _load(os.path.join(_rank_dir(replicated), "model_optim_rng.pt"))["optimizer"]
    inner = opt.get("optimizer", opt)
    for g, names in enumerate(_group_names(inner["param_groups"])):
        for name, index in zip(names, inner["param_groups"][g]["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                want, got = inner["state"][index][key], values[name][key]
                scale = want.abs().max()
                assert scale > 0 and (got - want).abs().max() <= MOMENT_RTOL * scale, (name, key)


@pytest.mark.slow
def test_tp2_dp2_each_rank_folder_holds_its_shard(corpus, tmp_path):
    save = str(tmp_path / "tp2")
    run_on_ranks(run_pretrain, 4, _flags(corpus, ["--save", save, "--save-interval", str(N)],
                                         tp=2))
    for tp_rank in range(2):
        state, _ = _check_files(_rank_dir(save, f"mp_rank_{tp_rank:02d}"), 2)
        assert state["args"].tensor_model_parallel_size == 2
    resumed = _losses(4, _flags(corpus, ["--load", save, "--ckpt-step", str(N)], tp=2))
    straight = _losses(4, _flags(corpus, tp=2))
    assert resumed == straight[N:]


@pytest.mark.slow
def test_bf16_files_key_the_buffer_by_param_and_grad_dtype(corpus, tmp_path):
    """bf16 weights, fp32 gradient reduction (Megatron's default): the buffer's key is
    (bfloat16, float32), the fp32 main parameters round to the saved weights, and the run
    resumes bit for bit."""
    save, bf16 = str(tmp_path / "bf16"), ["--bf16"]
    straight = _losses(2, _flags(corpus, bf16 + ["--save", save, "--save-interval", str(N)]))
    _check_files(_rank_dir(save), 2, (torch.bfloat16, torch.float32))
    resumed = _losses(2, _flags(corpus, bf16 + ["--load", save, "--ckpt-step", str(N)]))
    assert resumed == straight[N:]


def to_old_layout(new_dir, old_dir, dp):
    """Copy of ``new_dir`` in the project's earlier layout: ``param_state`` (per group, per
    parameter) inside ``model_optim_rng.pt``, no ``distrib_optim.pt``."""
    shutil.copytree(new_dir, old_dir)
    rank_dir = _rank_dir(old_dir)
    model_file = os.path.join(rank_dir, "model_optim_rng.pt")
    state = _load(model_file)
    values = naive_state(rank_dir, _model_tree(state), dp)
    groups = state["optimizer"]["optimizer"]["param_groups"]
    names = _group_names(groups)
    for group, group_names in zip(groups, names):
        group["params"] = list(range(len(group_names)))
    state["optimizer"]["param_state"] = [[{k: values[n][k].clone() for k in KEYS}
                                          for n in group_names] for group_names in names]
    torch.save(state, model_file)
    os.remove(os.path.join(rank_dir, "distrib_optim.pt"))


@pytest.mark.slow
def test_resume_from_new_and_old_layouts_is_bit_exact(corpus, saved):
    old = str(saved["root"] / "old")
    to_old_layout(saved["new"], old, 2)
    for dp in (2, 1):
        from_new = _losses(dp, _flags(corpus, ["--load", saved["new"], "--ckpt-step", str(N)]))
        from_old = _losses(dp, _flags(corpus, ["--load", old, "--ckpt-step", str(N)]))
        assert len(from_new) == N and from_old == from_new, dp
        if dp == 2:
            assert from_new == saved["losses"][N:]


@pytest.mark.slow
@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_pipeline_stages(corpus, tmp_path, capfd, untie):
    """PP 2: each stage's folder gets its distrib_optim.pt, with the word embedding tied across
    the stages too (a bucket of its own on both); the run resumes bit for bit, and the
    converter carries the Adam state of every stage to PP 1."""
    from tools.checkpoint import convert as tool

    save = str(tmp_path / "pp2")
    pp = ["--pipeline-model-parallel-size", "2"] + (
        ["--untie-embeddings-and-output-weights"] if untie else [])
    straight = _losses(2, _flags(corpus, pp + ["--save", save, "--save-interval", str(N)]))
    assert "distrib_optim.pt not written: " not in capfd.readouterr().out
    for stage in range(2):
        rank_dir = _rank_dir(save, f"mp_rank_00_{stage:03d}")
        opt = _load(os.path.join(rank_dir, "model_optim_rng.pt"))["optimizer"]
        assert os.path.exists(os.path.join(rank_dir, "distrib_optim.pt"))
        assert "param_state" not in opt
    resumed = _losses(2, _flags(corpus, pp + ["--load", save, "--ckpt-step", str(N)]))
    assert resumed == straight[N:]
    out = str(tmp_path / "pp1")
    tool.convert(tool.build_parser().parse_args([
        "--model-type", "GPT", "--load-dir", save, "--save-dir", out, "--ckpt-step", str(N),
        "--target-pipeline-parallel-size", "1"]))
    state = _load(os.path.join(_rank_dir(out), "model_optim_rng.pt"))
    assert state["conversion"]["optimizer"] == "resharded"

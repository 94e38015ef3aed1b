"""Checkpoints of mixture-of-experts runs at expert parallelism > 1, in both formats.

A run at EP 2 saves and resumes bit for bit; a checkpoint saved at one expert-parallel size
resumes at another (the experts and their Adam state re-dealt over the expert ranks) and
continues the single-process run's losses within the MoE parity tolerance (1e-4 relative, see
test_moe_training.py: the layouts sum the same terms in another order). The torch format's
folders carry Megatron-LM's names, ``mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}``.
"""

import os
import shutil

import pytest
import torch

from megatron.training import checkpointing
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import _check_parity, _flags, _losses, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks

N = 3   # iterations before the save; 3 more after it
FORMATS = ["torch", "torch_dist"]


def _ep(ep):
    return ["--expert-model-parallel-size", str(ep)] if ep > 1 else []


def _run(corpus, world, ep, fmt, extra=()):
    flags = _flags(corpus, extra=["--ckpt-format", fmt] + _ep(ep) + list(extra))
    return run_on_ranks(run_pretrain, world, flags)[-1]


@pytest.fixture(scope="module")
def straight(corpus):
    """The single-process run's 6 iterations (the reference every layout matches)."""
    return _run(corpus, 1, 1, "torch")


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """``saved(ep, fmt)``: (folder, first 3 iterations' result) of a world-2 run at ``ep``
    that saved at iteration 3; each made once per module. Tests copy before they change it."""
    made = {}

    def get(ep, fmt):
        if (ep, fmt) not in made:
            save = str(tmp_path_factory.mktemp(f"ckpt_ep{ep}_{fmt}") / "save")
            first = _run(corpus, 2, ep, fmt, ["--save", save, "--exit-interval", str(N)])
            made[ep, fmt] = save, first
        return made[ep, fmt]
    return get


@pytest.mark.parametrize("fmt", ["torch", pytest.param("torch_dist", marks=pytest.mark.slow)])
def test_ep2_resume_is_bit_exact(corpus, saved, fmt):
    """EP 2 over world 2: 6 iterations straight == 3, save, load in new processes, 3 more."""
    straight_ep2 = _run(corpus, 2, 2, fmt)
    save, first = saved(2, fmt)
    second = _run(corpus, 2, 2, fmt, ["--load", save])
    assert _losses(first) == _losses(straight_ep2)[:N]
    assert _losses(second) == _losses(straight_ep2)[N:], (straight_ep2, second)


@pytest.mark.parametrize("fmt,save_ep,load_ep", [
    ("torch", 2, 1), ("torch_dist", 1, 2),
    pytest.param("torch_dist", 2, 1, marks=pytest.mark.slow),
    pytest.param("torch", 1, 2, marks=pytest.mark.slow)])
def test_resume_at_another_ep(corpus, straight, saved, fmt, save_ep, load_ep):
    """Save at one EP (world 2, dp 2), resume at the other: the losses continue the
    single-process run's."""
    save, first = saved(save_ep, fmt)
    second = _run(corpus, 2, load_ep, fmt, ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_ep2_dp4_resumes_at_ep4(corpus, straight, tmp_path, fmt):
    """World 4 (expert-dp 2) saves at EP 2 and resumes at EP 4."""
    save = str(tmp_path / "save")
    first = _run(corpus, 4, 2, fmt, ["--save", save, "--exit-interval", str(N)])
    second = _run(corpus, 4, 4, fmt, ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


def test_folder_names_are_megatrons(saved):
    """EP 2 alone: ``mp_rank_00_{ep:03d}``, told from a pipeline stage by the saved args;
    each file numbers its experts locally."""
    save, _ = saved(2, "torch")
    iter_dir = os.path.join(save, f"iter_{N:07d}")
    assert sorted(os.listdir(iter_dir)) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert checkpointing.saved_sizes(iter_dir) == (1, 1, 2)
    encoder = checkpointing.load_state_file(os.path.join(
        iter_dir, "mp_rank_00_001", "model_optim_rng.pt"))["model"]["language_model"]["encoder"]
    numbers = {k.split(".local_experts.")[1].split(".")[0] for k in encoder
               if ".local_experts." in k}
    assert numbers == {"0", "1"}   # expert rank 1 holds global experts 2, 3 as local 0, 1


@pytest.mark.slow
def test_folder_names_with_pp_and_ep(corpus, tmp_path):
    """EP 2 with PP 2 at world 4: ``mp_rank_00_{pp:03d}_{ep:03d}``."""
    save = str(tmp_path / "pp2ep2")
    flags = _flags(corpus, pp=2, iters=2, extra=["--ckpt-format", "torch", "--save", save]
                   + _ep(2))
    run_on_ranks(run_pretrain, 4, flags)
    iter_dir = os.path.join(save, "iter_0000002")
    assert sorted(os.listdir(iter_dir)) == ["mp_rank_00_000_000", "mp_rank_00_000_001",
                                            "mp_rank_00_001_000", "mp_rank_00_001_001"]
    assert checkpointing.saved_sizes(iter_dir) == (1, 2, 2)


def test_missing_expert_file_names_it(corpus, saved, tmp_path):
    save = str(tmp_path / "save")
    shutil.copytree(saved(2, "torch")[0], save)
    shutil.rmtree(os.path.join(save, f"iter_{N:07d}", "mp_rank_00_001"))
    with pytest.raises(AssertionError, match="mp_rank_00_001/model_optim_rng.pt: missing"):
        _run(corpus, 1, 1, "torch", ["--load", save])


def test_torch_dist_ep2_save_equals_ep1_save(saved):
    """Every tensor and byte entry of the EP 2 save is the EP 1 save's, at the global expert
    offsets (Megatron-Core's keys, section 8 of FORMATS.md): the same keys, shapes and values
    (within the float reordering of the two runs' 3 steps)."""
    import torch

    from megatron.checkpoint.dist.reader import DistCheckpointReader

    one, two = (DistCheckpointReader(os.path.join(saved(ep, "torch_dist")[0], f"iter_{N:07d}"))
                for ep in (1, 2))
    assert one.summary() == two.summary()
    assert sorted(one.byte_keys()) == sorted(two.byte_keys())
    expert = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert one.shape(expert) == (4, 4, 128, 32)
    for key in one.tensor_keys():
        a, b = one.read(key), two.read(key)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), key


def _convert(src, dst, *flags):
    from tools.checkpoint.convert import main

    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst] + list(flags)) == 0
    return dst


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif hasattr(value, "shape"):
            out[f"{prefix}{key}"] = value
    return out


def _rank_state(root, tp_rank, pp_rank, pp_size, ep_rank=0, ep_size=1):
    iteration, release = checkpointing.read_tracker(root)
    return checkpointing.load_state_file(checkpointing.checkpoint_file(
        root, iteration, tp_rank, pp_rank, pp_size, release, ep_rank, ep_size))


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), pytest.param(2, 2, 4, marks=pytest.mark.slow)],
                         ids=["ep2", "tp2-pp2-ep4"])
def test_converter_ep_round_trip_is_bit_identical(saved, tmp_path, tp, pp, ep):
    """EP 1 -> (TP, PP, EP) -> TP 1, PP 1, EP 1 gives back every weight and Adam moment bit for
    bit; the middle checkpoint has Megatron-LM's expert-rank folders and local numbering."""
    src = saved(1, "torch")[0]
    mid = _convert(src, str(tmp_path / "mid"), "--target-tensor-parallel-size", str(tp),
                   "--target-pipeline-parallel-size", str(pp),
                   "--target-expert-parallel-size", str(ep))
    names = sorted(os.listdir(os.path.join(mid, f"iter_{N:07d}")))
    assert names == sorted(checkpointing.rank_dir_name(t, p, pp, e, ep) for t in range(tp)
                           for p in range(pp) for e in range(ep))
    assert checkpointing.saved_sizes(os.path.join(mid, f"iter_{N:07d}")) == (tp, pp, ep)
    back = _convert(mid, str(tmp_path / "back"), "--target-tensor-parallel-size", "1",
                    "--target-pipeline-parallel-size", "1", "--target-expert-parallel-size", "1")
    want, got = _rank_state(src, 0, 0, 1), _rank_state(back, 0, 0, 1)
    a, b = _flat(want["model"]), _flat(got["model"])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    moments = lambda s: {(i, k): v for i, e in s["optimizer"]["state"].items()  # noqa: E731
                         for k, v in e.items() if k.startswith("exp_avg")}
    assert moments(want).keys() == moments(got).keys()
    for key, value in moments(want).items():
        assert torch.equal(value, moments(got)[key]), key
    if tp == pp == 1:
        # Expert rank 1's local expert 0 is global expert 2.
        rank1 = _flat(_rank_state(mid, 0, 0, 1, 1, ep)["model"])
        name = "language_model.encoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
        assert torch.equal(rank1[name.format(0)], a[name.format(2)])
        assert name.format(2) not in rank1
        for key in a:   # every expert rank's file holds the dense tensors
            if ".local_experts." not in key:
                assert torch.equal(rank1[key], a[key]), key


@pytest.mark.slow
def test_converted_ep2_checkpoint_resumes_at_ep2(corpus, straight, saved, tmp_path):
    """EP 1 training checkpoint -> converter at EP 2 (Adam state carried) -> training at EP 2
    continues the single-process losses."""
    save, first = saved(1, "torch")
    mid = _convert(save, str(tmp_path / "ep2"), "--target-expert-parallel-size", "2")
    second = _run(corpus, 2, 2, "torch", ["--load", mid])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


# -- the distributed optimizer: its state sharded over expert-dp, saved whole per expert rank --

DISTOPT = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def saved_distopt(corpus, tmp_path_factory):
    """``saved_distopt(fmt)``: (folder, first 3 iterations' result) of a world-4 run at EP 2
    (expert-dp 2) with the distributed optimizer that saved at iteration 3."""
    made = {}

    def get(fmt):
        if fmt not in made:
            save = str(tmp_path_factory.mktemp(f"ckpt_distopt_{fmt}") / "save")
            first = _run(corpus, 4, 2, fmt, DISTOPT + ["--save", save, "--exit-interval", str(N)])
            made[fmt] = save, first
        return made[fmt]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_distributed_optimizer_ep2_resume_is_bit_exact(corpus, saved_distopt, fmt):
    straight_ep2 = _run(corpus, 4, 2, fmt, DISTOPT)
    save, first = saved_distopt(fmt)
    second = _run(corpus, 4, 2, fmt, DISTOPT + ["--load", save])
    assert _losses(first) == _losses(straight_ep2)[:N]
    assert _losses(second) == _losses(straight_ep2)[N:], (straight_ep2, second)


@pytest.mark.parametrize("fmt,world,ep", [
    ("torch", 2, 1),
    pytest.param("torch_dist", 2, 1, marks=pytest.mark.slow),
    pytest.param("torch", 4, 4, marks=pytest.mark.slow),
    pytest.param("torch_dist", 4, 4, marks=pytest.mark.slow)])
def test_distributed_optimizer_resumes_at_another_ep(corpus, straight, saved_distopt, fmt,
                                                     world, ep):
    """EP 2 x expert-dp 2 saves; EP 1 on 2 ranks (or EP 4 on 4) resumes with the experts' Adam
    state re-dealt, on the single-process losses."""
    save, first = saved_distopt(fmt)
    second = _run(corpus, world, ep, fmt, DISTOPT + ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})

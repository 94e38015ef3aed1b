"""Checkpoints of mixture-of-experts runs whose expert TP differs from TP (torch_dist only).

With ``--expert-tensor-parallel-size`` != TP the experts' tensors are cut by the expert-TP
rank: a torch_dist save at such a layout stores the same global tensors as any other, resumes
bit for bit at its own layout, and resumes at another one (one process; expert TP = TP)
continuing the single-process run's losses within the MoE parity tolerance (1e-4 relative,
test_moe_training.py). The torch format cannot name such files and refuses them
(test_checkpoint_expert_tp.py has the unit cases; here the training run's own refusal).

Losses only: grad norms are not compared here (the resumed runs do not log them). The runs
clip gradients (the default --clip-grad 1.0), so they need every rank to compute the same grad
norm, experts included: with per-rank norms the data-parallel replicas drift apart, and no
single saved copy resumes them bit for bit.
"""

import os

import pytest
import torch

from megatron.training import checkpointing
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import _check_parity, _flags, _losses, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks

N = 3   # iterations before the save; 3 more after it
# (tp, world, flags): expert TP below TP (each rank holds whole experts, dealt over EP) and
# above it (the experts split over the data-parallel ranks).
ETP1 = (2, 2, ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
               "--moe-token-dispatcher-type", "alltoall"])
ETP2 = (1, 2, ["--expert-tensor-parallel-size", "2"])
DISTOPT = (2, 4, ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                  "--use-distributed-optimizer"])
LAYOUTS = {"tp2-etp1-ep2": ETP1, "tp1-etp2": ETP2, "tp2-etp1-ep2-dp2-distopt": DISTOPT}


def _run(corpus, layout, extra=(), fmt="torch_dist", **kw):
    tp, world, flags = layout
    return run_on_ranks(run_pretrain, world, _flags(corpus, tp=tp, extra=[
        "--ckpt-format", fmt] + flags + list(extra), **kw))[-1]


@pytest.fixture(scope="module")
def straight(corpus):
    """The single-process run's 6 iterations (the reference every layout matches)."""
    return _run(corpus, (1, 1, []))


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """``saved(name)``: (folder, first 3 iterations' result) of a run at ``LAYOUTS[name]``
    that saved at iteration 3; each made once per module."""
    made = {}

    def get(name):
        if name not in made:
            save = str(tmp_path_factory.mktemp(f"ckpt_{name}") / "save")
            first = _run(corpus, LAYOUTS[name], ["--save", save, "--exit-interval", str(N)])
            made[name] = save, first
        return made[name]
    return get


@pytest.mark.parametrize("name", ["tp2-etp1-ep2", pytest.param("tp1-etp2",
                                                                marks=pytest.mark.slow)])
def test_expert_tp_save_resumes_in_one_process(corpus, straight, saved, name):
    """Save at expert TP != TP on two ranks, resume in one process: the losses continue the
    single-process run's."""
    save, first = saved(name)
    second = _run(corpus, (1, 1, []), ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_tp_resume_is_bit_exact(corpus, saved, name):
    """6 iterations straight == 3, save, load in new processes at the same layout, 3 more
    (Adam state, distributed or not, included)."""
    straight_here = _run(corpus, LAYOUTS[name])
    save, first = saved(name)
    second = _run(corpus, LAYOUTS[name], ["--load", save])
    assert _losses(first) == _losses(straight_here)[:N]
    assert _losses(second) == _losses(straight_here)[N:], (straight_here, second)


@pytest.mark.slow
@pytest.mark.parametrize("save_at,load_at", [("tp2-etp1-ep2", ETP2), ("tp1-etp2", ETP1),
                                             ("tp2-etp1-ep2-dp2-distopt", ETP2)])
def test_expert_tp_resumes_at_another_expert_tp(corpus, straight, saved, save_at, load_at):
    """Expert TP 1 under TP 2 resumes at expert TP 2 under TP 1 and back; the distributed
    optimizer's state (sharded over expert-DP 2) resumes at expert TP 2 without it."""
    save, first = saved(save_at)
    second = _run(corpus, load_at, ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


@pytest.mark.slow
def test_expert_tp_save_holds_the_one_process_tensors(corpus, saved, tmp_path):
    """The global tensors of the expert-TP-1-under-TP-2 save are the one-process save's at
    the same iteration: the same keys and shapes, and values within 1e-3 of each tensor's norm.
    The two runs sum in other orders, and Adam moves an element whose gradient is near zero by
    up to the learning rate on such a difference: 3 steps leave under 1e-4 (measured). A
    misplaced piece (an expert, a row block or SwiGLU half in another's place) differs by the
    order of the norm itself."""
    from megatron.checkpoint.dist.reader import DistCheckpointReader

    one = str(tmp_path / "one")
    _run(corpus, (1, 1, []), ["--save", one, "--exit-interval", str(N)])
    a, b = (DistCheckpointReader(os.path.join(path, f"iter_{N:07d}"))
            for path in (one, saved("tp2-etp1-ep2")[0]))
    assert a.summary() == b.summary()
    assert a.shape("decoder.layers.mlp.experts.experts.linear_fc1.weight") == (4, 4, 128, 32)
    for key in a.tensor_keys():
        x, y = a.read(key).double(), b.read(key).double()
        assert (x - y).norm() <= 1e-3 * x.norm(), key


def test_converter_reads_an_expert_tp_save(saved, tmp_path):
    """The converter reads the torch_dist save of expert TP 1 under TP 2 by its global
    tensors and writes Megatron's torch format at TP 1, EP 2 (expert TP = TP there)."""
    from megatron.checkpoint.dist.reader import DistCheckpointReader
    from tools.checkpoint.convert import main

    src = saved("tp2-etp1-ep2")[0]
    dst = str(tmp_path / "torch")
    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst,
                 "--target-tensor-parallel-size", "1", "--target-expert-parallel-size", "2"]) == 0
    reader = DistCheckpointReader(os.path.join(src, f"iter_{N:07d}"))
    fc2 = reader.read("decoder.layers.mlp.experts.experts.linear_fc2.weight")
    state = checkpointing.load_state_file(checkpointing.checkpoint_file(dst, N, 0, 0, 1,
                                                                        ep_rank=1, ep_size=2))
    assert state["args"].expert_tensor_parallel_size == 1
    encoder = state["model"]["language_model"]["encoder"]
    for layer in range(4):
        for local in range(2):   # EP rank 1 holds global experts 2, 3
            name = f"layers.{layer}.mlp.experts.local_experts.{local}.linear_fc2.weight"
            assert torch.equal(encoder[name], fc2[layer, 2 + local]), name


def test_torch_format_save_at_expert_tp_is_refused(corpus, tmp_path):
    """The training run itself stops in one line before it writes anything (at its first
    save; at flag validation once that checks it too)."""
    save = str(tmp_path / "save")
    with pytest.raises(AssertionError, match=r"--ckpt-format torch cannot save "
                       r"--expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1: "
                       r".*; use --ckpt-format torch_dist"):
        _run(corpus, ETP2, ["--save", save], fmt="torch", iters=2)
    assert checkpointing.read_tracker(save) is None

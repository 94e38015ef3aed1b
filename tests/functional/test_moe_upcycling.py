"""--moe-use-upcycling end to end: a dense run's checkpoint becomes an MoE run's start.

The dense model (hidden 32, FFN 64, fp32, dropout 0, biases, GeLU through the bias-GeLU
fusion as the experts compute it) trains 3 iterations and saves. The
upcycling run loads it, saves the MoE model at iteration 1 and trains on. References:

* the dense model's own first-step loss on the same samples (a ``--finetune`` run from the
  dense checkpoint: iteration 0, the same data from sample 0): where Megatron's construction
  keeps the function (granularity 1, top-k then softmax; granularity 2 with squared ReLU, a
  power of ReLU, whose scale is exact) the upcycled model's first loss equals it to float
  tolerance (1e-5 relative: the MoE sums the same products in another order);
* the dense checkpoint's tensors, cut by hand, for the saved experts;
* the single-process upcycling run, for EP 2;
* the upcycling run itself, for a restart from the saved upcycled checkpoint (bit for bit).
"""

import os

import pytest

# Each test runs two or three training processes (10-25 s on two cores).
pytestmark = pytest.mark.slow
import torch

from megatron.training import checkpointing
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

RTOL = 1e-5
TOPK2 = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, ffn, extra=()):
    return gpt_flags(corpus, iters, dropout=0.0, global_batch=4,
                     extra=["--ffn-hidden-size", str(ffn)] + list(extra))


def _run(flags, world=1):
    return run_on_ranks(run_pretrain, world, flags)[-1]


@pytest.fixture(scope="module")
def dense(corpus, tmp_path_factory):
    """``dense(act)``: the folder of a 3-iteration dense run (FFN 64) with activation flags
    ``act``, made once per module."""
    made = {}

    def get(act=(), fmt="torch"):
        if (act, fmt) not in made:
            save = str(tmp_path_factory.mktemp("dense") / "save")
            _run(_flags(corpus, 3, 64, list(act) + ["--save", save, "--ckpt-format", fmt]))
            made[act, fmt] = save
        return made[act, fmt]
    return get


def _dense_first_loss(corpus, load, act=()):
    result = _run(_flags(corpus, 2, 64, list(act) + ["--load", load, "--finetune"]))
    return result["losses"][0][1]


def _upcycle(corpus, load, save, iters=2, granularity=1, act=(), extra=(), world=1):
    ffn = 64 // granularity
    flags = _flags(corpus, iters, ffn, list(act) + TOPK2 + [
        "--moe-use-upcycling", "--moe-upcycling-granularity", str(granularity),
        "--load", load, "--save", save,
        "--ckpt-format", "torch"] + list(extra))   # read back by _model; extra may override
    return _run(flags, world)


def _model(save, iteration=1, rank_dir="mp_rank_00"):
    path = os.path.join(save, f"iter_{iteration:07d}", rank_dir, "model_optim_rng.pt")
    return checkpointing.load_state_file(path)["model"]["language_model"]["encoder"]


@pytest.mark.parametrize("act", [(), ("--swiglu", "--disable-bias-linear")],
                         ids=["gelu-bias", "swiglu-nobias"])
def test_granularity1_first_step_equals_dense(corpus, dense, tmp_path, act):
    load = dense(act)
    want = _dense_first_loss(corpus, load, act)
    got = _upcycle(corpus, load, str(tmp_path / "moe"), act=act)
    assert got["losses"][0][0] == 2          # training resumes after the upcycled iteration 1
    assert abs(got["losses"][0][1] - want) <= RTOL * want, (got["losses"], want)


def test_granularity2_squared_relu_first_step_equals_dense(corpus, dense, tmp_path):
    act = ("--squared-relu",)
    load = dense(act)
    want = _dense_first_loss(corpus, load, act)
    got = _upcycle(corpus, load, str(tmp_path / "moe"), granularity=2, act=act)
    assert abs(got["losses"][0][1] - want) <= RTOL * want, (got["losses"], want)


def test_granularity2_experts_are_the_hand_split_dense_mlp(corpus, dense, tmp_path):
    """SwiGLU, E 4, G 2: expert e = piece e % 2 of [gate; value] rows and fc2 columns, times
    (G)^(1/3); the router rows of experts 2c and 2c + 1 are equal."""
    load = dense(("--swiglu",))
    save = str(tmp_path / "moe")
    _upcycle(corpus, load, save, iters=2, granularity=2, act=("--swiglu",))
    dense_tree = _model(load, 3)
    moe = _model(save, 1)
    scale = 2.0 ** (1 / 3)
    for layer in range(2):
        fc1 = dense_tree[f"layers.{layer}.mlp.dense_h_to_4h.weight"].double()     # [128, 32]
        fc2 = dense_tree[f"layers.{layer}.mlp.dense_4h_to_h.weight"].double()     # [32, 64]
        gate, value = fc1[:64], fc1[64:]
        for e in range(4):
            rows = slice(32 * (e % 2), 32 * (e % 2 + 1))
            prefix = f"layers.{layer}.mlp.experts.local_experts.{e}"
            want1 = torch.cat([gate[rows], value[rows]]) * scale
            want2 = fc2[:, rows] * scale
            torch.testing.assert_close(moe[prefix + ".linear_fc1.weight"].double(), want1)
            torch.testing.assert_close(moe[prefix + ".linear_fc2.weight"].double(), want2)
        router = moe[f"layers.{layer}.mlp.router.weight"]
        assert torch.equal(router[0], router[1]) and torch.equal(router[2], router[3])
        assert not torch.equal(router[0], router[2])
        assert torch.equal(moe[f"layers.{layer}.self_attention.query_key_value.weight"],
                           dense_tree[f"layers.{layer}.self_attention.query_key_value.weight"])


def test_restart_from_upcycled_checkpoint_is_bit_exact(corpus, dense, tmp_path):
    """The upcycling run trains iterations 2..5; a new run without the flag, from the
    iteration-1 checkpoint it saved, trains the same iterations with the same losses."""
    save = str(tmp_path / "moe")
    straight = _upcycle(corpus, dense(), save, iters=5)
    resumed = _run(_flags(corpus, 5, 64, TOPK2 + ["--load", save, "--ckpt-step", "1"]))
    assert [i for i, _ in straight["losses"]] == [2, 3, 4, 5]
    assert resumed["losses"] == straight["losses"]


def test_second_upcycling_into_a_used_save_is_refused(corpus, dense, tmp_path):
    save = str(tmp_path / "moe")
    _upcycle(corpus, dense(), save, iters=2)
    with pytest.raises(AssertionError, match=r"--save .* already holds a checkpoint; upcycling "
                       r"is for the first run only: drop --moe-use-upcycling"):
        _upcycle(corpus, dense(), save, iters=2)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_ep2_upcycling_equals_one_process(corpus, dense, tmp_path, fmt):
    """World 2, EP 2: the experts each rank saves are the single-process run's (exactly), and
    the first losses agree (the dispatch sums in another order)."""
    one = _upcycle(corpus, dense(), str(tmp_path / "one"), iters=3)
    save = str(tmp_path / "ep2")
    two = _upcycle(corpus, dense(), save, iters=3, world=2,
                   extra=["--expert-model-parallel-size", "2", "--ckpt-format", fmt])
    for (i, a), (j, b) in zip(one["losses"], two["losses"]):
        assert i == j and abs(a - b) <= 1e-4 * a, (one["losses"], two["losses"])
    if fmt != "torch":
        return
    whole = _model(str(tmp_path / "one"))
    for ep_rank in range(2):
        part = _model(save, rank_dir=f"mp_rank_00_{ep_rank:03d}")
        for key, value in part.items():
            if ".local_experts." in key:
                head, tail = key.split(".local_experts.")
                local, rest = tail.split(".", 1)
                key = f"{head}.local_experts.{2 * ep_rank + int(local)}.{rest}"
            assert torch.equal(value, whole[key]), key


def _tp_shard(full, rank, stride, dim):
    """Rank ``rank`` of 2's share: ``stride`` interleaved blocks along ``dim``."""
    blocks = full.chunk(2 * stride, dim=dim)
    return torch.cat([blocks[rank + 2 * j] for j in range(stride)], dim=dim)


def test_tp2_upcycling_equals_one_process(corpus, dense, tmp_path):
    """TP 2 (sequence parallel), SwiGLU, granularity 2, from a torch_dist dense checkpoint:
    each rank's expert shards are the one-process experts' shards ([gate_r; value_r] rows of
    linear_fc1, columns r of linear_fc2), and the losses agree."""
    act = ("--swiglu",)
    load = dense(act, "torch_dist")     # any layout loads it; the MoE runs save torch files
    one_dir, two_dir = str(tmp_path / "one"), str(tmp_path / "tp2")
    one = _upcycle(corpus, load, one_dir, iters=3, granularity=2, act=act)
    two = _upcycle(corpus, load, two_dir, iters=3, granularity=2, act=act, world=2,
                   extra=["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    for (i, a), (j, b) in zip(one["losses"], two["losses"]):
        assert i == j and abs(a - b) <= 1e-4 * a, (one["losses"], two["losses"])
    whole = _model(one_dir)
    for rank in range(2):
        part = _model(two_dir, rank_dir=f"mp_rank_{rank:02d}")
        for layer in range(2):
            for e in range(4):
                key = f"layers.{layer}.mlp.experts.local_experts.{e}"
                assert torch.equal(part[key + ".linear_fc1.weight"],
                                   _tp_shard(whole[key + ".linear_fc1.weight"], rank, 2, 0))
                assert torch.equal(part[key + ".linear_fc2.weight"],
                                   _tp_shard(whole[key + ".linear_fc2.weight"], rank, 1, 1))


def test_pp2_upcycling_equals_one_process(corpus, dense, tmp_path):
    """PP 2: each stage upcycles its own layers from the torch_dist dense checkpoint."""
    load = dense((), "torch_dist")
    one = _upcycle(corpus, load, str(tmp_path / "one"), iters=3)
    two = _upcycle(corpus, load, str(tmp_path / "pp2"), iters=3, world=2,
                   extra=["--pipeline-model-parallel-size", "2"])
    assert [i for i, _ in two["losses"]] == [2, 3]
    for (i, a), (j, b) in zip(one["losses"], two["losses"]):
        assert i == j and abs(a - b) <= 1e-4 * a, (one["losses"], two["losses"])


@pytest.mark.parametrize("world,extra", [
    (2, ["--use-distributed-optimizer"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-tensor-parallel-size", "1", "--ckpt-format", "torch_dist"]),
    (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--no-bias-gelu-fusion",
         "--disable-bias-linear", "--swiglu"]),
], ids=["dp2-distopt", "tp2-etp1", "ep2-grouped-gemm-swiglu"])
def test_other_layouts_start_from_the_dense_loss(corpus, dense, tmp_path, world, extra):
    """Granularity 1: under each layout the first step's loss is the dense model's (the
    1-process --finetune run from the torch_dist dense checkpoint)."""
    act = tuple(a for a in extra if a in ("--swiglu", "--disable-bias-linear",
                                           "--no-bias-gelu-fusion"))
    load = dense(act, "torch_dist")
    want = _dense_first_loss(corpus, load, act)
    got = _upcycle(corpus, load, str(tmp_path / "moe"), world=world, extra=extra)
    assert abs(got["losses"][0][1] - want) <= 1e-4 * want, (got["losses"], want)

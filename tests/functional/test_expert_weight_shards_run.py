"""pretrain_gpt end to end with --expert-tensor-parallel-num-weight-shards: a tiny MoE GPT gives
the losses and gradient / parameter norms of the same layout without the shards, runs
deterministically, resumes bit for bit, and its torch_dist checkpoints load without the shards
(and plain ones with them); so do --tensor-parallel-num-weight-shards in an MoE model and both
flags together.

World 2, EP 1, expert TP 1, 2 expert weight shards: each rank keeps half the rows of every
expert's fc1 and fc2 weight and reads its own samples, against plain DP 2 (expert DP 2). The
experts' biases, the router and the dense layers are whole copies. Dropout is off. The matmuls
see the same gathered weights; what differs is the order of fp32 sums (the shard's gradient is
reduce-scattered over the expert weight-shard group instead of all-reduced over expert data
parallelism; the norm sums the shards' squares over that group): ~1e-7 relative per step, and a
router's top-k choice could flip only on a near tie. We allow 1e-5. Clipping is on at every
step (--clip-grad 0.05), so counting each expert shard twice, or its bias on both ranks, in the
clipped norm moves the losses and norms by far more.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.functional.test_weight_shards_run import run_recording
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

N = 3  # iterations before the checkpoint, and after it
REL_TOL = 1e-5
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--no-bias-gelu-fusion"]
# The replica check compares each expert shard over the ranks holding its rows (none other
# here); comparing it over expert data parallelism would stop the run.
SHARDS = ["--expert-tensor-parallel-num-weight-shards", "2",
          "--check-weight-hash-across-dp-replicas-interval", "1"]
EXPERT_SHARDS_EP1 = 2 * 4 * 2   # layers x experts x (fc1, fc2) weights


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra=(), micro_batch=2):
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=micro_batch, global_batch=4,
                     extra=[*MOE, "--ckpt-format", "torch_dist", "--clip-grad", "0.05",
                            "--log-params-norm", *extra])


def _run(argv, world=2):
    outs = run_on_ranks(run_recording, world, argv)
    for out in outs[1:]:   # every rank clips by the same norm
        assert out["norms"] == outs[0]["norms"]
        assert out["params_norms"] == outs[0]["params_norms"]
    return outs[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _close(a, b):
    assert len(a) == len(b) and len(a) > 0, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= REL_TOL * abs(y), (a, b)


def _same_run(a, b):
    _close(_losses(a), _losses(b))
    _close(a["norms"], b["norms"])
    _close(a["params_norms"], b["params_norms"])


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """2N iterations at DP 2 with 2 expert weight shards, saving at iteration N on the way."""
    save = str(tmp_path_factory.mktemp("expert_shards_ckpt") / "ckpt")
    out = _run(_flags(corpus, [*SHARDS, "--save", save, "--save-interval", str(N)]))
    assert out["iteration"] == 2 * N
    out["save"] = save
    return out


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):
    """The same run without expert weight shards, saving at iteration N on the way."""
    save = str(tmp_path_factory.mktemp("plain_moe_ckpt") / "ckpt")
    out = _run(_flags(corpus, ["--save", save, "--save-interval", str(N)]))
    out["save"] = save
    return out


def test_same_losses_and_norms_as_plain_dp2(straight, plain):
    assert straight["shards"] == EXPERT_SHARDS_EP1 and plain["shards"] == 0
    _same_run(straight, plain)
    assert all(norm > 0.05 for norm in plain["norms"])   # clipped at every step
    assert _losses(straight)[-1] < _losses(straight)[0]


def test_deterministic(corpus, straight):
    again = _run(_flags(corpus, SHARDS))
    assert _losses(again) == _losses(straight)
    assert again["norms"] == straight["norms"]
    assert again["params_norms"] == straight["params_norms"]


def test_resume_is_bit_exact(corpus, straight):
    resumed = _run(_flags(corpus, [*SHARDS, "--load", straight["save"], "--ckpt-step",
                                   str(N)]))
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == _losses(straight)[N:]
    assert resumed["norms"] == straight["norms"][N:]


def test_checkpoint_with_shards_loads_without_them(corpus, straight):
    unsharded = _run(_flags(corpus, ["--load", straight["save"], "--ckpt-step", str(N)]))
    assert unsharded["shards"] == 0
    _close(_losses(unsharded), _losses(straight)[N:])
    _close(unsharded["norms"], straight["norms"][N:])


def test_checkpoint_without_shards_loads_with_them(corpus, plain):
    sharded = _run(_flags(corpus, [*SHARDS, "--load", plain["save"], "--ckpt-step", str(N)]))
    assert sharded["shards"] == EXPERT_SHARDS_EP1
    _close(_losses(sharded), _losses(plain)[N:])
    _close(sharded["norms"], plain["norms"][N:])


def test_ep2_grouped_experts_with_shards_match_plain_ep2(corpus):
    """World 4, EP 2 (expert DP 2), grouped GEMM: 2 expert weight shards against none."""
    extra = ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]
    sharded = _run(_flags(corpus, [*extra, *SHARDS], micro_batch=1), world=4)
    plain = _run(_flags(corpus, extra, micro_batch=1), world=4)
    assert sharded["shards"] == 2 * 2 * 2 and plain["shards"] == 0   # 2 local experts
    _same_run(sharded, plain)


def test_dense_and_expert_shards_together_match_plain_dp2(corpus, plain):
    """Both flags: the attention weights and the experts' weights cut in two."""
    both = _run(_flags(corpus, [*SHARDS, "--tensor-parallel-num-weight-shards", "2"]))
    assert both["shards"] == EXPERT_SHARDS_EP1 + 2 * 2   # + (qkv, dense) per layer
    _same_run(both, plain)


def test_glu_interleaved_experts_checkpoint_loads_without_shards(corpus, tmp_path):
    """SwiGLU experts whose fc1 rows are GLU-interleaved: a shard is whole [gate | value]
    blocks, so the sharded checkpoint holds the unsharded fc1 and continues without shards."""
    glu = ["--swiglu", "--moe-mlp-glu-interleave-size", "8"]
    save = str(tmp_path / "ckpt")
    sharded = _run(_flags(corpus, [*glu, *SHARDS, "--save", save, "--save-interval", str(N)]))
    assert sharded["shards"] == EXPERT_SHARDS_EP1
    unsharded = _run(_flags(corpus, [*glu, "--load", save, "--ckpt-step", str(N)]))
    assert unsharded["shards"] == 0
    _close(_losses(unsharded), _losses(sharded)[N:])
    _close(unsharded["norms"], sharded["norms"][N:])


def test_dense_shards_with_moe_match_plain_and_load_without_them(corpus, plain, tmp_path):
    """--tensor-parallel-num-weight-shards alone in an MoE model (no longer refused): the
    attention weights are shards, the experts whole; its checkpoint continues without shards."""
    dense = ["--tensor-parallel-num-weight-shards", "2",
             "--check-weight-hash-across-dp-replicas-interval", "1"]
    save = str(tmp_path / "ckpt")
    sharded = _run(_flags(corpus, [*dense, "--save", save, "--save-interval", str(N)]))
    assert sharded["shards"] == 2 * 2   # (qkv, dense) per layer; the layers' MLPs are MoE
    _same_run(sharded, plain)
    unsharded = _run(_flags(corpus, ["--load", save, "--ckpt-step", str(N)]))
    assert unsharded["shards"] == 0
    _close(_losses(unsharded), _losses(plain)[N:])

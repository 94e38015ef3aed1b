"""pretrain_gpt end to end at DP 2 with bf16 gradient buffers (--bf16 --grad-reduce-in-bf16),
with the replicated and the distributed optimizer, and with both grad-buffer refinements.

Each run accumulates two micro-batches per rank, so the bf16 accumulation and the bf16
reduction both take part. The wrapper is checked to hold the buffers the flags ask for (bf16,
fp32 for the matched norms), the losses to stay near the fp32-buffer run's while differing from
them (the flag changes the arithmetic), and a run resumed from its checkpoint to reproduce the
uninterrupted run's losses bit for bit. The exact roundings are checked against a naive
reference in tests/distributed/test_grad_reduce_precision.py.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
BF16_GRADS = ["--bf16", "--grad-reduce-in-bf16"]
VARIANTS = {
    "replicated": BF16_GRADS,
    "distributed": BF16_GRADS + ["--use-distributed-optimizer"],
    "refined": BF16_GRADS + ["--use-distributed-optimizer",
                             "--ddp-reduce-scatter-with-fp32-accumulation",
                             "--ddp-param-name-patterns-for-fp32-local-accumulation",
                             "*layernorm*", "*final_norm*"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra):
    """DP 2, micro-batch 1, global batch 4: two micro-batches accumulated per rank."""
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=1, global_batch=4,
                     extra=list(extra))


def run_recording_buffers(argv):
    """run_pretrain, recording each wrapped chunk's buffer dtypes and fp32-local parameters."""
    import megatron.training.training as training

    real_ddp = training.DistributedDataParallel
    seen = {"dtypes": set(), "fp32_local": []}

    def ddp(*args, **kwargs):
        wrapper = real_ddp(*args, **kwargs)
        seen["dtypes"].update(str(d) for d in wrapper.grad_buffers)
        seen["fp32_local"] += wrapper.fp32_local_param_names
        return wrapper

    training.DistributedDataParallel = ddp
    try:
        out = run_pretrain(argv)
    finally:
        training.DistributedDataParallel = real_ddp
    out.update(seen)
    return out


def _run(argv):
    return run_on_ranks(run_recording_buffers, 2, argv)[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.fixture(scope="module")
def fp32_buffers(corpus, tmp_path_factory):
    """The default --bf16 run (fp32 buffers) with the distributed optimizer, checkpointed at N."""
    save = str(tmp_path_factory.mktemp("fp32_buffers") / "ckpt")
    out = _run(_flags(corpus, ["--bf16", "--use-distributed-optimizer", "--save", save,
                               "--save-interval", str(N)]))
    out["save"] = save
    return out


@pytest.mark.slow
def test_a_checkpoint_of_fp32_buffers_resumes_with_bf16_buffers(corpus, fp32_buffers):
    """The buffers' dtype is not part of the checkpoint: switching it on resume continues the
    run, with losses near those of continuing in fp32."""
    flags = VARIANTS["distributed"] + ["--load", fp32_buffers["save"], "--ckpt-step", str(N)]
    resumed = _run(_flags(corpus, flags))
    assert resumed["dtypes"] == {"torch.bfloat16"}
    reference = _losses(fp32_buffers)[N:]
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(_losses(resumed), reference))


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_grad_run_trains_and_resumes_bit_for_bit(corpus, fp32_buffers, variant, tmp_path):
    assert fp32_buffers["dtypes"] == {"torch.float32"}
    save = str(tmp_path / "ckpt")
    straight = _run(_flags(corpus, VARIANTS[variant] + ["--save", save,
                                                        "--save-interval", str(N)]))
    assert straight["iteration"] == 2 * N
    assert "torch.bfloat16" in straight["dtypes"]
    if variant == "refined":
        assert straight["fp32_local"] and all("norm" in n for n in straight["fp32_local"])
    else:
        assert straight["fp32_local"] == []
    losses, reference = _losses(straight), _losses(fp32_buffers)
    assert losses != reference and losses[-1] < losses[0]
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses, reference)), (losses,
                                                                                 reference)
    resumed = _run(_flags(corpus, VARIANTS[variant] + ["--load", save, "--ckpt-step", str(N)]))
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == losses[N:]

"""--use-torch-fsdp2 --fp16: FSDP2 keeps fp32 shards (the main weights), gathers them as fp16
for forward and backward, reduce-scatters the scaled gradients in fp32, and the optimizer
unscales the shards, checks them for inf/nan over every rank and skips the step together.

Reference: the one-process --fp16 run (fp16 model weights, fp32 main copies, the same dynamic
scaler), and for the first loss two ranks without FSDP2 (the same fp16 weights and the same
averaging of the two ranks' losses, so that loss is identical to the bit). Later steps
differ by where the weight gradients are rounded (to fp16 on the one process, kept in fp32 by
FSDP2's reduction) and by the summation order over two ranks: measured at most 1.7e-5 on the
losses and 1.5e-4 (relative) on the gradient norms over 6 steps, hence FP16_ATOL = 2e-4 and
FP16_NORM_RTOL = 2e-3. Adam hides a gradient scaled by a constant, so the norms (the ones
clipped with and logged) are what catch an unscaled gradient (4096x) or an unaveraged one (2x);
the scaler's decisions are compared exactly.
"""

import math

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 6
FP16_ATOL = 2e-4
FP16_NORM_RTOL = 2e-3
# From 2^12 the scale doubles after every 2 clean steps and never overflows here.
GROWING = ["--fp16", "--initial-loss-scale", str(2 ** 12), "--loss-scale-window", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _train_recording_steps(argv, poison_rank=None, poison_step=None):
    """run_pretrain, with ``(skipped, loss scale after the step)`` and the gradient norm of
    every iteration (``steps``, ``norms``). With
    ``poison_rank``, that rank writes an inf into its own shard of one gradient before the
    optimizer step of iteration ``poison_step`` (no other rank sees it locally)."""
    import torch.distributed as dist

    from megatron.core.distributed.torch_fsdp2 import local_tensor
    from megatron.optimizer.optimizer import FullyShardedOptimizer
    from megatron.training import training

    steps, norms = [], []
    real_train_step, real_step = training.train_step, FullyShardedOptimizer.step

    def recording(*args, **kwargs):
        out = real_train_step(*args, **kwargs)
        steps.append((bool(out[1]), float(out[3])))
        norms.append(out[2])
        return out

    def poisoning(self):
        if len(steps) + 1 == poison_step and dist.get_rank() == poison_rank:
            grad = next(p.grad for p in self.get_parameters() if p.grad is not None)
            local_tensor(grad).view(-1)[0] = float("inf")
        return real_step(self)

    training.train_step, FullyShardedOptimizer.step = recording, poisoning
    try:
        return dict(run_pretrain(argv), steps=steps, norms=norms)
    finally:
        training.train_step, FullyShardedOptimizer.step = real_train_step, real_step


def _train(corpus, ranks, extra, **kwargs):
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=list(extra))
    return run_on_ranks(_train_recording_steps, ranks, flags, **kwargs)


def _losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.mark.slow
def test_fsdp2_fp16_matches_one_process_fp16(corpus):
    single = _train(corpus, 1, GROWING)[0]
    fsdp = _train(corpus, 2, GROWING + ["--use-torch-fsdp2"])
    ddp = _train(corpus, 2, GROWING)[-1]
    fp32 = _train(corpus, 2, ["--use-torch-fsdp2"])[-1]
    a, b = _losses(single), _losses(fsdp[-1])
    assert len(a) == len(b) == ITERS
    # Two ranks without FSDP2 see the same fp16 weights in the first forward: same loss; the
    # fp32 one differs (fp16 is really used).
    assert b[0] == _losses(ddp)[0] and b[0] != _losses(fp32)[0]
    assert ddp["steps"] == fsdp[-1]["steps"]
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert abs(x - y) <= FP16_ATOL, (step, a, b)
    assert a[-1] < a[0] - 0.3, a
    want = [(False, 2.0 ** e) for e in (12, 13, 13, 14, 14, 15)]
    assert single["steps"] == want and all(r["steps"] == want for r in fsdp)
    for step, (x, y) in enumerate(zip(single["norms"], fsdp[-1]["norms"]), start=1):
        assert x == pytest.approx(y, rel=FP16_NORM_RTOL), (step, single["norms"],
                                                           fsdp[-1]["norms"])
    x, y = single["valid"]["lm loss"], fsdp[-1]["valid"]["lm loss"]
    assert abs(x - y) <= FP16_ATOL


@pytest.mark.slow
def test_fsdp2_fp16_overflow_on_one_shard_skips_the_step_on_every_rank(corpus):
    """Rank 1 alone finds an inf in its gradient shard at step 3: both ranks skip it, the
    scale halves (--hysteresis 1) on both, and the weights stay as they were, so step 4 sees
    the loss a run without step 3's update would (checked against the clean run: different)."""
    flags = GROWING + ["--use-torch-fsdp2", "--hysteresis", "1"]
    clean = _train(corpus, 2, flags)
    poisoned = _train(corpus, 2, flags, poison_rank=1, poison_step=3)
    steps = [r["steps"] for r in poisoned]
    assert steps[0] == steps[1]
    assert [skipped for skipped, _ in steps[0]] == [False, False, True, False, False, False]
    assert [math.log2(scale) for _, scale in steps[0]] == [12, 13, 12, 12, 13, 13]
    a, b = _losses(clean[-1]), _losses(poisoned[-1])
    assert a[:3] == b[:3] and a[3] != b[3]
    assert _losses(poisoned[0]) == b   # one loss for the whole data-parallel group

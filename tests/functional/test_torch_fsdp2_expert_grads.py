"""--use-torch-fsdp2 with experts at every precision and expert layout of two ranks: the
experts' and the dense layers' gradient norms, each step, are those of the same run without
FSDP2 (the grad-buffer wrapper).

FSDP2 divides a gradient differently by mesh size and reduce dtype (see
tests/distributed/test_torch_fsdp2_expert_grads.py), and the experts are sharded over a mesh
of their own: two ranks at DP 2 x EP 1, one at DP 2 x EP 2. Each of them is run in fp32, bf16
and fp16 (static loss scale; FSDP2 reduces both half precisions in fp32), with and without
--calculate-per-token-loss (short documents and --eod-mask-loss, so micro-batches count
different tokens).

Observable: before clipping, each step, the norm of the dense gradients and that of the
expert gradients apart, each computed by the optimizer's own norm over its groups (the
logged norm mixes them: halved experts moved it by 9% in test_torch_fsdp2_moe), and the
losses. Step 1 sees the same weights in both runs; step 2 the weights after one AdamW step.
Measured worst relative differences over all twelve combinations (norms; the losses were
equal; the test runs the seven listed below):
fp32 6e-8 (RTOL = 1e-5); bf16 1.0e-5 and fp16 7.0e-5, where the gradients are rounded in
another place (FSDP2 reduces in fp32 what the run without it accumulates in its own way), hence
HALF_RTOL = 1e-3. An expert gradient divided by the data-parallel size twice or not at all is
off by 2x. The losses barely see it: AdamW's first step does not depend on the gradients' scale.
"""

import math

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain
from tests.functional.test_per_token_loss import corpus  # noqa: F401 (fixture)
from tests.multiprocess import run_on_ranks

ITERS = 2
RTOL = 1e-5
HALF_RTOL = 1e-3
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--no-bias-gelu-fusion",
       "--moe-aux-loss-coeff", "0.01", "--untie-embeddings-and-output-weights"]
PRECISION = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--loss-scale", "1024"]}
PER_TOKEN = ["--calculate-per-token-loss"]


def _train_recording_norms(argv):
    """run_pretrain, with each step's (dense, expert) gradient norms before clipping."""
    from megatron.optimizer.clip_grads import is_expert_parallel
    from megatron.optimizer.optimizer import MegatronOptimizer

    norms, real = [], MegatronOptimizer.clip_grad_norm

    def recording(self, clip_grad):
        params = self.get_parameters()
        # An infinite clip bound: each part's norm, nothing clipped.
        norms.append(tuple(self._clip_grad_norm([p for p in params if is_expert_parallel(p)
                                                 == expert], math.inf)
                           for expert in (False, True)))
        return real(self, clip_grad)

    MegatronOptimizer.clip_grad_norm = recording
    try:
        return dict(run_pretrain(argv), norms=norms)
    finally:
        MegatronOptimizer.clip_grad_norm = real


def _run(corpus, extra):  # noqa: F811
    """Losses and (dense, expert) norms of the last of two ranks."""
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--eod-mask-loss", "--eval-iters", "0", *MOE, *extra])
    result = run_on_ranks(_train_recording_norms, 2, flags)[-1]
    return [loss for _, loss in result["losses"]], result["norms"]


def _check(corpus, ep, precision, per_token):  # noqa: F811
    layout = (["--expert-model-parallel-size", str(ep)] + PRECISION[precision]
              + (PER_TOKEN if per_token else []))
    fsdp_losses, fsdp_norms = _run(corpus, layout + ["--use-torch-fsdp2"])
    ddp_losses, ddp_norms = _run(corpus, layout)
    rtol = RTOL if precision == "fp32" else HALF_RTOL
    assert len(fsdp_norms) == len(ddp_norms) == ITERS
    assert fsdp_losses == pytest.approx(ddp_losses, rel=rtol), (fsdp_losses, ddp_losses)
    for step, (got, want) in enumerate(zip(fsdp_norms, ddp_norms), start=1):
        assert got == pytest.approx(want, rel=rtol), (step, fsdp_norms, ddp_norms)
        assert min(want) > 0, want


def test_fsdp2_fp16_experts_alone_match_ddp(corpus):  # noqa: F811
    """The fast case: fp16 with each expert on one rank (its mesh has one rank), the case
    FSDP2 divides apart."""
    _check(corpus, 2, "fp16", False)


# Each precision on both expert meshes, and each mesh with both losses, across the set (the
# fast case above adds fp16 / one-rank mesh / averaged).
SLOW_CASES = [(1, "fp32", False), (2, "fp32", True), (1, "bf16", True), (2, "bf16", False),
              (1, "fp16", False), (2, "fp16", True)]


@pytest.mark.slow
@pytest.mark.parametrize("ep, precision, per_token", SLOW_CASES,
                         ids=[f"dp2-ep{ep}-{p}-{'per-token' if t else 'averaged'}"
                              for ep, p, t in SLOW_CASES])
def test_fsdp2_expert_and_dense_grad_norms_match_ddp(corpus, ep, precision,  # noqa: F811
                                                     per_token):
    _check(corpus, ep, precision, per_token)

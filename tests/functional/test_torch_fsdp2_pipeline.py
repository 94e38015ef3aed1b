"""--use-torch-fsdp2 with pipeline parallelism: each stage's layers are sharded by FSDP2 over
that stage's data-parallel group, the micro-batches of a step accumulate unsharded gradients
and only the last one's backward reduce-scatters (one reduce-scatter per FSDP2 unit per step,
counted here), and the tied embedding's two copies (first and last stage) are summed over the
embedding group on their shards, which FSDP2 lays out alike on both stages.

Reference: one process with the same global batch. Tolerances: the layouts sum the same terms
in another order in fp32 (measured 1.2e-7 on the losses and 1.6e-7 relative on the gradient
norms), so LOSS_ATOL = 1e-4 and NORM_ATOL = 1e-3 are wide; a dropped micro-batch, an
unaveraged gradient or a stage's tied embedding left unsummed moves the gradient norm by 0.1
and more (clipping acts at every step: the norm is above --clip-grad 1.0).
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 4
LOSS_ATOL = 1e-4
NORM_ATOL = 1e-3
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run_counting_reduce_scatters(argv):
    """run_pretrain on this rank, with each step's gradient norm and number of
    reduce-scatters, and the number of FSDP2 units holding parameters on this rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from megatron.training import training

    calls, per_step, norms, units = [0], [], [], []
    original_step, original_rs = training.train_step, dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return original_rs(*args, **kwargs)

    def recording(*args, **kwargs):
        before = calls[0]
        result = original_step(*args, **kwargs)
        per_step.append(calls[0] - before)
        norms.append(result[2])
        units.append(sum(isinstance(m, FSDPModule)
                         and m._get_fsdp_state()._fsdp_param_group is not None
                         for chunk in args[2] for m in chunk.modules()))
        return result

    training.train_step, dist.reduce_scatter_single = recording, counting
    try:
        out = run_pretrain(argv)
    finally:
        training.train_step, dist.reduce_scatter_single = original_step, original_rs
    return dict(losses=[loss for _, loss in out["losses"]], valid=out["valid"].get("lm loss"),
                norms=norms, reduce_scatters=per_step, units=units)


def _run(corpus, ranks, extra):
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=list(extra))
    return run_on_ranks(_run_counting_reduce_scatters, ranks, flags)


def _close(got, want):
    assert len(got["losses"]) == len(want["losses"]) == ITERS
    for a, b in zip(got["losses"] + [got["valid"]], want["losses"] + [want["valid"]]):
        assert abs(a - b) <= LOSS_ATOL, (got, want)
    for a, b in zip(got["norms"], want["norms"]):
        assert abs(a - b) <= NORM_ATOL, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [
    ([], []),
    (["--untie-embeddings-and-output-weights"], []),
    (["--num-layers", "4"], ["--num-layers-per-virtual-pipeline-stage", "1"]),
], ids=["tied", "untied", "interleaved"])
def test_fsdp2_pp2_dp2_matches_one_process(corpus, model, layout):
    """PP 2 x FSDP 2 on four ranks; with interleaving each rank holds two model chunks, each
    sharded by FSDP2 on its own and reduced before its own last backward."""
    single = _run(corpus, 1, model)[0]
    ranks = _run(corpus, 4, PP2 + ["--use-torch-fsdp2", *model, *layout])
    _close(ranks[-1], single)
    assert single["losses"][-1] < single["losses"][0]
    assert min(single["norms"]) > 1.0      # clipping acts at every step
    for rank in ranks:
        # Two micro-batches per rank and step, one reduce-scatter per unit: the first
        # micro-batch's backward reduced nothing.
        assert rank["units"][0] >= 2
        assert rank["reduce_scatters"] == rank["units"], rank


@pytest.mark.slow
def test_fsdp2_pp2_fp16_matches_pp2_fp16_without_fsdp2(corpus):
    """Half precision through the pipeline: activations pass between stages in fp16, each
    stage's scaled gradients are unscaled on its shards, and the overflow flag reaches both
    stages (the scaler's decisions are compared through the logged norms and losses)."""
    fp16 = ["--fp16", "--initial-loss-scale", str(2 ** 12), "--loss-scale-window", "2"]
    fsdp = _run(corpus, 4, PP2 + ["--use-torch-fsdp2", *fp16])[-1]
    ddp = _run(corpus, 4, PP2 + fp16)[-1]
    assert fsdp["losses"][0] == ddp["losses"][0]
    for a, b in zip(fsdp["losses"], ddp["losses"]):
        assert abs(a - b) <= 2e-4, (fsdp, ddp)
    for a, b in zip(fsdp["norms"], ddp["norms"]):
        assert a == pytest.approx(b, rel=2e-3), (fsdp, ddp)

"""Context parallelism: a tiny GPT trained with every sequence split over cp ranks gives the
single-process losses, alone and combined with tensor, sequence, pipeline and data parallelism.

The model (2 layers, hidden 32, 4 heads, sequence 16, dropout 0, fp32), seed, data (the counting
corpus of ``gpt_runs``) and global batch (8 samples in micro-batches of 2) are fixed; only the
layout changes. Each layout's training losses over ``ITERS`` iterations and its final validation
loss are compared with one process.

Tolerance: context parallelism computes attention blockwise and merges the blocks by their
log-sum-exp in fp32, the loss as a sum of per-rank sums, and the gradients as an average over
data x context ranks, so results differ from one process by rounding that Adam carries over the
steps. Measured on every layout below: at most 6.0e-7 absolute (~1e-7 relative on losses of
~5.5). ``ATOL = 2e-5`` (30x that, inside the 1e-4 the feature promises) still catches the
subtlest wiring error tried: dropping the cp factor of the backward loss, which Adam's scale
invariance and gradient clipping nearly hide, moves the loss by 4.4e-4 by step 4.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 6
ATOL = 2e-5
GQA_ROPE = ["--group-query-attention", "--num-query-groups", "2",
            "--position-embedding-type", "rope"]
RESET = ["--reset-attention-mask", "--reset-position-ids"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, *, cp=1, tp=1, pp=1, comm="p2p", model=(), extra=()):
    extra = ["--num-layers", "4" if pp > 1 else "2", "--pipeline-model-parallel-size", str(pp),
             "--context-parallel-size", str(cp), "--cp-comm-type", comm,
             *model, *extra]
    if tp > 1:
        extra.append("--sequence-parallel")
    return gpt_flags(corpus, ITERS, tp=tp, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=extra)


def _train(corpus, world, **kw):
    """The last rank's result (last pipeline stage: it holds the logged losses)."""
    return run_on_ranks(run_pretrain, world, _flags(corpus, **kw))[-1]


def _losses(result):
    return [loss for _, loss in result["losses"]]


def _check(base, out, what):
    want, got = _losses(base), _losses(out)
    assert len(want) == ITERS and [i for i, _ in out["losses"]] == list(range(1, ITERS + 1))
    assert want[-1] < want[0] - 0.1, want  # the run learns, so the comparison means something
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= ATOL, (what, step, want, got)
    a, b = base["valid"]["lm loss"], out["valid"]["lm loss"]
    assert abs(a - b) <= ATOL, (what, a, b)


@pytest.fixture(scope="module")
def baseline(corpus):
    return _train(corpus, 1)


@pytest.fixture(scope="module")
def baseline_pp(corpus):
    """The 4-layer model the pipeline layouts split (one process)."""
    return _train(corpus, 1, pp=1, extra=["--num-layers", "4"])


@pytest.fixture(scope="module")
def baseline_gqa_rope(corpus):
    return _train(corpus, 1, model=GQA_ROPE)


@pytest.fixture(scope="module")
def baseline_reset(corpus):
    """One process with per-document attention masks and position ids (the counting corpus's
    documents are 8-60 tokens, so most 16-token samples hold an end of document)."""
    return _train(corpus, 1, extra=RESET)


def _check_flags_matter(baseline, flagged):
    """The flags change the run by far more than ATOL, so matching it means something."""
    gap = max(abs(a - b) for a, b in zip(_losses(baseline), _losses(flagged)))
    assert gap > 50 * ATOL, (gap, _losses(baseline), _losses(flagged))


def test_cp2_reset_attention_mask_and_position_ids(corpus, baseline, baseline_reset):
    # Mask and positions are built on the whole sequence, then split by tokens (the mask by
    # query rows, every key column kept); each exchange honours the mask across chunks.
    _check_flags_matter(baseline, baseline_reset)
    for comm in ("p2p", "a2a"):
        _check(baseline_reset, _train(corpus, 2, cp=2, comm=comm, extra=RESET),
               f"cp2 reset mask/positions {comm}")


def test_cp2_each_comm_type(corpus, baseline):
    for comm in ("p2p", "all_gather", "a2a"):
        _check(baseline, _train(corpus, 2, cp=2, comm=comm), f"cp2 {comm}")


def test_cp2_gqa_rope(corpus, baseline_gqa_rope):
    # Keys and values travel unexpanded (2 groups for 4 heads); rotary angles are those of each
    # local token's global position.
    for comm in ("p2p", "a2a"):
        _check(baseline_gqa_rope, _train(corpus, 2, cp=2, comm=comm, model=GQA_ROPE),
               f"cp2 gqa rope {comm}")


def test_tp2_cp2_sequence_parallel(corpus, baseline):
    _check(baseline, _train(corpus, 4, cp=2, tp=2), "tp2 cp2 sp")


def test_cp2_pp2_one_f_one_b_and_interleaved(corpus, baseline_pp):
    _check(baseline_pp, _train(corpus, 4, cp=2, pp=2), "cp2 pp2")
    _check(baseline_pp, _train(corpus, 4, cp=2, pp=2,
                               extra=["--num-layers-per-virtual-pipeline-stage", "1"]),
           "cp2 pp2 interleaved")


def test_cp2_dp2_distributed_optimizer(corpus, baseline):
    _check(baseline, _train(corpus, 4, cp=2, extra=["--use-distributed-optimizer"]),
           "cp2 dp2 distopt")


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_cp4(corpus, baseline, comm):
    _check(baseline, _train(corpus, 4, cp=4, comm=comm), f"cp4 {comm}")


@pytest.mark.slow
def test_cp4_gqa_rope_all_gather(corpus, baseline_gqa_rope):
    _check(baseline_gqa_rope, _train(corpus, 4, cp=4, comm="all_gather", model=GQA_ROPE),
           "cp4 gqa rope all_gather")


@pytest.mark.slow
def test_tp2_cp2_a2a_and_all_gather(corpus, baseline):
    for comm in ("a2a", "all_gather"):
        _check(baseline, _train(corpus, 4, cp=2, tp=2, comm=comm), f"tp2 cp2 sp {comm}")


@pytest.mark.slow
def test_cp2_dp2_without_distributed_optimizer(corpus, baseline):
    _check(baseline, _train(corpus, 4, cp=2), "cp2 dp2")


@pytest.mark.slow
def test_cp2_recompute_and_flash_path(corpus, baseline):
    _check(baseline, _train(corpus, 2, cp=2, extra=["--recompute-granularity", "selective"]),
           "cp2 selective recompute")
    _check(baseline, _train(corpus, 2, cp=2, extra=["--recompute-granularity", "full",
                                                    "--recompute-method", "uniform",
                                                    "--recompute-num-layers", "1"]),
           "cp2 full recompute")
    _check(baseline, _train(corpus, 2, cp=2, extra=["--use-flash-attn"]), "cp2 flash")


@pytest.mark.slow
def test_tp2_cp2_dp2_on_8_ranks(corpus, baseline):
    _check(baseline, _train(corpus, 8, cp=2, tp=2, extra=["--use-distributed-optimizer"]),
           "tp2 cp2 dp2 distopt")


@pytest.mark.slow
def test_reset_attention_mask_all_gather_cp4_and_pipeline(corpus, baseline_reset):
    _check(baseline_reset, _train(corpus, 2, cp=2, comm="all_gather", extra=RESET),
           "cp2 reset all_gather")
    _check(baseline_reset, _train(corpus, 4, cp=4, extra=RESET), "cp4 reset p2p")
    # A middle pipeline stage reads the batch for the mask alone.
    reset_pp = _train(corpus, 1, extra=["--num-layers", "4", *RESET])
    _check(reset_pp, _train(corpus, 4, cp=2, pp=2, extra=RESET), "cp2 pp2 reset")


HIERARCHICAL = ["--hierarchical-context-parallel-sizes", "2", "2"]


@pytest.mark.slow
def test_cp4_hierarchical_a2a_p2p_matches_one_process_and_the_ring(corpus, baseline):
    # CP 4 = 2 x 2: all-to-all inside cp ranks {0, 1} and {2, 3}, a ring between the pairs.
    hierarchical = _train(corpus, 4, cp=4, comm="a2a+p2p", extra=HIERARCHICAL)
    _check(baseline, hierarchical, "cp4 a2a+p2p 2x2")
    ring = _train(corpus, 4, cp=4, comm="p2p")
    for step, (a, b) in enumerate(zip(_losses(ring), _losses(hierarchical)), start=1):
        assert abs(a - b) <= ATOL, ("a2a+p2p against p2p", step, _losses(ring),
                                    _losses(hierarchical))


@pytest.mark.slow
def test_cp4_hierarchical_with_gqa_rope_reset_masks_and_per_layer_types(
        corpus, baseline_gqa_rope, baseline_reset, baseline):
    _check(baseline_gqa_rope, _train(corpus, 4, cp=4, comm="a2a+p2p", model=GQA_ROPE,
                                     extra=HIERARCHICAL), "cp4 a2a+p2p gqa rope")
    _check(baseline_reset, _train(corpus, 4, cp=4, comm="a2a+p2p", extra=HIERARCHICAL + RESET),
           "cp4 a2a+p2p reset mask/positions")
    # One --cp-comm-type per layer (Megatron's list): layer 1 by all-to-all, layer 2 by a2a+p2p.
    _check(baseline, _train(corpus, 4, cp=4, comm="a2a", extra=[
        "--cp-comm-type", "a2a", "a2a+p2p", *HIERARCHICAL]), "cp4 per-layer a2a, a2a+p2p")

"""A tiny gpt-oss-shaped GPT trains, and trains the same under TP 2 + sequence parallelism with
expert parallelism 2 as in one process.

gpt-oss in Megatron's flags: quick GeGLU experts with the linear half offset by 1 and clamped
(``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value``), biases everywhere
(router and experts included), learned attention sinks (``--softmax-type learnable``),
windowed and full layers alternating (``--window-size 3,0 --window-attn-skip-freq 2``),
rope, RMSNorm, grouped-query attention, top-2 of 4 experts with the fused bias-GeLU off (the
experts are gated). Tolerance as in test_moe_training.py: 1e-4 relative on the losses.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_moe_training import ITERS, _check_parity
from tests.multiprocess import run_on_ranks

GPT_OSS = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "0.01", "--quick-geglu", "--glu-linear-offset", "1",
           "--activation-func-clamp-value", "7", "--softmax-type", "learnable",
           "--window-size", "3,0", "--window-attn-skip-freq", "2",
           "--position-embedding-type", "rope", "--normalization", "RMSNorm",
           "--group-query-attention", "--num-query-groups", "2",
           "--untie-embeddings-and-output-weights"]


def _train(corpus, world, extra=()):
    flags = gpt_flags(corpus, ITERS, tp=1, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=GPT_OSS + list(extra))
    return run_on_ranks(run_pretrain, world, flags)[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


@pytest.mark.slow
def test_gpt_oss_trains_and_tp2_ep2_matches_one_process(corpus):
    base = _train(corpus, 1)
    parallel = _train(corpus, 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-model-parallel-size", "2"])
    _check_parity(base, parallel)


@pytest.mark.slow
def test_moe_with_biases_trains_with_the_fused_bias_gelu(corpus):
    """Megatron's default MoE flags (biases, bias-GeLU fusion) run: the loop over experts takes
    the fused tanh bias-GeLU, and the model learns."""
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--num-experts", "4", "--moe-router-topk", "2"])
    losses = [loss for _, loss in run_on_ranks(run_pretrain, 1, flags)[-1]["losses"]]
    assert len(losses) == ITERS and losses[-1] < losses[0] - 0.2, losses

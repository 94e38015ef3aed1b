"""--dataloader-inter-document-masking end to end: on a corpus whose documents end with their
end-of-document token it trains exactly like --reset-attention-mask --reset-position-ids (the
same spans), and context parallelism over 2 ranks gives the single-process losses.

Tolerance: as in test_context_parallel_parity (blockwise attention merged by log-sum-exp, loss
and gradients reduced over ranks): ATOL = 2e-5."""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 4
ATOL = 2e-5
DOCUMENTS = ["--dataloader-inter-document-masking"]
RESET = ["--reset-attention-mask", "--reset-position-ids"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _train(corpus, world, extra):
    flags = gpt_flags(corpus, ITERS, micro_batch=2, global_batch=8, dropout=0.0, extra=extra)
    return run_on_ranks(run_pretrain, world, flags)[-1]


def _losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.mark.slow
def test_single_process_equals_the_eod_reset_flags_and_cp2_equals_single_process(corpus):
    documents = _train(corpus, 1, DOCUMENTS)
    assert _losses(documents) == _losses(_train(corpus, 1, RESET))
    plain = _losses(_train(corpus, 1, []))
    assert max(abs(a - b) for a, b in zip(plain, _losses(documents))) > 50 * ATOL
    split = _train(corpus, 2, DOCUMENTS + ["--context-parallel-size", "2"])
    for a, b in zip(_losses(documents), _losses(split)):
        assert abs(a - b) <= ATOL, (_losses(documents), _losses(split))
    assert abs(documents["valid"]["lm loss"] - split["valid"]["lm loss"]) <= ATOL

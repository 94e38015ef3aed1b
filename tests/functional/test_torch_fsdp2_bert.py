"""--use-torch-fsdp2 with pretrain_bert.py: BERT's masked-LM head reads the word embeddings, so
they stay in the root unit with the pooler and the heads, and the layers are units of their own.

The reference is one rank accumulating the same micro-batches (as for BERT's data-parallel test:
a global batch averages per-micro-batch means); the tolerance is that test's, 1e-4 relative,
for fp32 sums in another order over five Adam steps.
"""

import pytest

from tests.functional.test_pretrain_bert import bert_flags, data, run_bert  # noqa: F401
from tests.multiprocess import run_on_ranks


def _lm(result):
    return [loss for _, loss in result["losses"]]


@pytest.mark.slow
def test_fsdp2_dp2_matches_one_rank_accumulating(data):  # noqa: F811
    flags = bert_flags(data, 5, dropout=0.0, micro_batch=2)
    accumulated = run_on_ranks(run_bert, 1, flags)[0]
    fsdp = run_on_ranks(run_bert, 2, flags + ["--use-torch-fsdp2"])[-1]
    assert [i for i, _ in fsdp["losses"]] == [1, 2, 3, 4, 5]
    for a, b in zip(_lm(accumulated), _lm(fsdp)):
        assert abs(a - b) < 1e-4 * abs(a), (_lm(accumulated), _lm(fsdp))
    assert _lm(fsdp)[-1] < _lm(fsdp)[0]

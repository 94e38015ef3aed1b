"""--attention-output-gate, --qk-l2-norm and --no-rope-freq under tensor parallelism (TP = 2,
with and without sequence parallelism) against the same model in one process.

The gate rows sit inside each query group's block of the fused QKV weight, so the column split
hands each rank whole groups with their gates; weights are drawn on the full shape and split,
so they must be equal bit for bit, and loss and gradients within the float64 tolerance of
tests/distributed/test_gpt_model_tp.py (1e-10: the split sums in another order).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.distributed.test_gpt_model_tp import reference, run_split
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import make_batch

VARIANT = dict(position_embedding_type="rope", num_layers=2, num_query_groups=2,
               attention_output_gate=True, qk_l2_norm=True, no_rope_freq=2,
               normalization="RMSNorm", swiglu=True)


def _body(batch):
    state = parallel_state.initialize_model_parallel(2)
    out = {sp: run_split(state, VARIANT, sp, batch, with_weights=True) for sp in (False, True)}
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_tp2_matches_single_process():
    results = run_on_ranks(_body, 2, make_batch())[0]
    ref_loss, ref_grads, ref_weights, _ = reference(VARIANT)
    for sp, (loss, grads, weights) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10, msg=f"sp={sp}")
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-10,
                                       msg=f"sp={sp} {name}")
        for name in ref_weights:
            assert torch.equal(weights[name], ref_weights[name]), name

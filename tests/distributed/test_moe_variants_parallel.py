"""The MoE variants split over 4 gloo ranks against the single-process layer in fp64 (the
harness of ``test_moe_expert_tp.py``: outputs, input gradients, every weight's gradient
summed as training sums it, logged losses): ``--moe-latent-size`` (the experts exchange
latent-width rows over the expert-parallel all-to-all / all-gather; the projections are
whole on every rank and each rank's gradient is its own tokens' part) with GLU-interleaved
experts and shared expert (each TP rank holds a contiguous run of whole blocks of fc1).

Layouts: tp 1 x dp 4 with expert-tp 2 x ep 2, and tp 2 x dp 2 with sequence parallelism and
expert-tp 1 x ep 2. Tolerance 1e-12: the same float64 sums in another order.
"""

import pytest

from megatron.core.parallel_state import compute_rank_layout
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow
WORLD = 4
VARIANT = dict(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01, moe_latent_size=6,
               moe_mlp_glu_interleave_size=3, moe_shared_expert_intermediate_size=8,
               moe_shared_expert_glu_interleave_size=2)
CASES = [("alltoall", False, VARIANT, dict(swiglu=True)),
         ("allgather", False, dict(VARIANT, moe_grouped_gemm=True), dict(swiglu=True))]


def _body():
    from tests.distributed import test_moe_expert_tp as harness

    plain_shard = harness._shard
    # interleaved fc1 splits into contiguous rows (stride 1), both experts and shared expert
    harness._shard = lambda full, name, rank, size, swiglu: plain_shard(full, name, rank,
                                                                          size, False)
    layouts = [compute_rank_layout(WORLD, 1, 1, ep_size=2, expert_tp_size=2),
               compute_rank_layout(WORLD, 2, 1, ep_size=2, expert_tp_size=1,
                                   sequence_parallel=True)]
    done = 0
    for layout in layouts:
        groups = harness._groups(layout)
        for dispatcher, forced, moe_kwargs, config_kwargs in CASES:
            harness._case(layout, groups, dispatcher, forced, moe_kwargs, config_kwargs)
            done += 1
    return done


def test_latent_interleaved_moe_equals_one_process():
    assert run_on_ranks(_body, WORLD) == [len(CASES) * 2] * WORLD

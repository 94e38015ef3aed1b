"""Multi-latent attention under context parallelism against the same GPT in one process, float64:
each cp rank projects its own tokens (chunks r and 2cp-1-r), rotates their position channels by
their global positions and attends over the whole sequence with keys of ``qk_head_dim +
qk_pos_emb_head_dim`` and values of ``v_head_dim`` channels (different sizes), by every
--cp-comm-type: p2p, all_gather and a2a at CP = 2 (default suite), a2a+p2p at CP = 4 = 2 x 2 and
TP = 2 with sequence parallelism x CP = 2 (slow).

Per-token losses of this rank's tokens and every gradient (summed over the cp ranks, which each
hold part of every sequence) must equal one process's. The splits only reorder sums (~1e-15
relative), so 1e-10 absolute on O(1) losses and gradients; rotating a rank's position channels
by local instead of global positions moves them by 5e-5, far beyond it.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import chunk_positions
from megatron.model import GPTModel
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.distributed.test_multi_latent_attention_tp import FLAGS
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import SEQ, make_batch, make_config, single_process_state

TOL = dict(rtol=0, atol=1e-10)
MLA = dict(FLAGS, q_lora_rank=8)


def _summed_loss_grads(model, ids, pos, labels):
    losses = model(ids, pos, None, labels=labels)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference():
    model = GPTModel(make_config(**MLA), single_process_state())
    return _summed_loss_grads(model, *make_batch())


def _cp_run(state, batch, comm_type, tp_size=1):
    """This rank's (token positions, losses, gradients gathered over tp, summed over cp)."""
    model = GPTModel(make_config(cp_comm_type=comm_type, **MLA), state)
    cp_size, cp_rank = state.cp_size, state.cp_rank
    held = chunk_positions(SEQ, cp_size, cp_rank)
    ids, pos, labels = (t[:, held] for t in batch)
    losses, grads = _summed_loss_grads(model, ids, pos, labels)
    if tp_size > 1:
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from tests.distributed.test_bert_model_tp import _Chunk
        for n, p in model.named_parameters():
            p.grad = grads[n]
        finalize_model_grads([_Chunk(model)], tp_group=state.tp_group, sequence_parallel=True)
        grads = {n: full_tensor(p.grad, p, state.tp_group, tp_size)
                 for n, p in model.named_parameters()}
    for grad in grads.values():          # each rank's tokens give part of every gradient
        dist.all_reduce(grad, group=state.cp_group)
    return held, losses, grads


def _cp2_body(batch):
    state = parallel_state.initialize_model_parallel(1, context_parallel_size=2)
    return [_cp_run(state, batch, comm) for comm in ("p2p", "all_gather", "a2a")]


def _check(ref, results):
    ref_losses, ref_grads = ref
    for held, losses, grads in results:
        torch.testing.assert_close(losses, ref_losses[:, held], **TOL)
        assert sorted(grads) == sorted(ref_grads)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)


def test_mla_cp2_matches_one_process_for_every_comm_type():
    ref = _reference()
    per_rank = run_on_ranks(_cp2_body, 2, make_batch())
    for comm in range(3):
        _check(ref, [runs[comm] for runs in per_rank])


def _cp4_hierarchical_body(batch):
    state = parallel_state.initialize_model_parallel(
        1, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    return _cp_run(state, batch, "a2a+p2p")


def _tp2_sp_cp2_body(batch):
    state = parallel_state.initialize_model_parallel(2, context_parallel_size=2,
                                                     sequence_parallel=True)
    return _cp_run(state, batch, "p2p", tp_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("body", [_cp4_hierarchical_body, _tp2_sp_cp2_body])
def test_mla_cp_on_four_ranks_matches_one_process(body):
    _check(_reference(), run_on_ranks(body, 4, make_batch()))

"""Multi-latent attention under tensor parallelism (TP = 2, with and without sequence
parallelism) against the same GPT in one process: heads split over the up projections and
linear_proj, the down projections and latent norms replicated (their sequence-parallel
gradient partial sums added by the real ``finalize_model_grads``). float64: the splits only
reorder sums, so 1e-10 absolute on O(1) losses and gradients; a wrong head slice, a missing
gradient sum of the shared rotary key or of a replicated weight moves them far more.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.model import GPTModel
from tests.distributed.test_bert_model_tp import _Chunk
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

FLAGS = dict(multi_latent_attention=True, position_embedding_type="rope",
             normalization="RMSNorm", qk_layernorm=True, kv_lora_rank=12, qk_head_dim=6,
             qk_pos_emb_head_dim=4, v_head_dim=5)


def _summed_loss_grads(model, batch):
    ids, pos, labels = batch
    losses = model(ids, pos, None, labels=labels)
    losses.sum().backward()
    return losses.detach()


def _reference(q_lora_rank):
    model = GPTModel(make_config(q_lora_rank=q_lora_rank, **FLAGS), single_process_state())
    losses = _summed_loss_grads(model, make_batch())
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _tp_body(batch, q_lora_rank, sp):
    state = parallel_state.initialize_model_parallel(2)
    model = GPTModel(make_config(q_lora_rank=q_lora_rank, **FLAGS), state, sequence_parallel=sp)
    losses = _summed_loss_grads(model, batch)
    finalize_model_grads([_Chunk(model)], tp_group=state.tp_group, sequence_parallel=sp)
    full = {n: full_tensor(p.grad, p, state.tp_group, 2) for n, p in model.named_parameters()}
    return (losses, full) if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank,sp", [(None, False), (8, False), (8, True)])
def test_mla_tp2_matches_one_process(q_lora_rank, sp):
    ref_losses, ref_grads = _reference(q_lora_rank)
    losses, grads = run_on_ranks(_tp_body, 2, make_batch(), q_lora_rank, sp)[0]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
    assert sorted(grads) == sorted(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-10, msg=n)

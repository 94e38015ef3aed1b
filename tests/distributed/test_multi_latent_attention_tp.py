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


def _tp_body(batch, q_lora_rank, sp, recompute=()):
    state = parallel_state.initialize_model_parallel(2)
    extra = dict(recompute_granularity="selective", recompute_modules=recompute) if recompute \
        else {}
    model = GPTModel(make_config(q_lora_rank=q_lora_rank, **FLAGS, **extra), state,
                     sequence_parallel=sp)
    losses = _summed_loss_grads(model, batch)
    finalize_model_grads([_Chunk(model)], tp_group=state.tp_group, sequence_parallel=sp)
    full = {n: full_tensor(p.grad, p, state.tp_group, 2) for n, p in model.named_parameters()}
    return (losses, full) if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank,sp,recompute", [
    (None, False, ()), (8, False, ()), (8, True, ()),
    # --recompute-modules mla_up_proj: the recomputed up projections' gathers and the shared
    # rotary key's gradient sum run again in backward, in the same order on both ranks.
    (8, True, ("core_attn", "mla_up_proj")), (None, True, ("mla_up_proj",))])
def test_mla_tp2_matches_one_process(q_lora_rank, sp, recompute):
    ref_losses, ref_grads = _reference(q_lora_rank)
    losses, grads = run_on_ranks(_tp_body, 2, make_batch(), q_lora_rank, sp, recompute)[0]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
    assert sorted(grads) == sorted(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-10, msg=n)


# -- --mla-down-proj-fusion and --cache-mla-latents at TP 2 --------------------------------------
# The fused model (same seed: the unfused weights stacked) against the unfused one in one
# process: its gradient is the stack of the two down projections' gradients. The latent cache
# at TP 2 (each rank absorbs its own heads' W_uk / W_uv) against the one-process expanded cache,
# step by step over a generation.

def _stacked(grads):
    out = dict(grads)
    for layer in (0, 1):
        a = f"language_model.encoder.layers.{layer}.self_attention."
        out[a + "linear_qkv_down_proj.weight"] = torch.cat(
            (out.pop(a + "linear_q_down_proj.weight"), out.pop(a + "linear_kv_down_proj.weight")))
    return out


def _tp_fused_body(batch, sp):
    state = parallel_state.initialize_model_parallel(2)
    model = GPTModel(make_config(q_lora_rank=8, mla_down_proj_fusion=True, **FLAGS), state,
                     sequence_parallel=sp)
    losses = _summed_loss_grads(model, batch)
    finalize_model_grads([_Chunk(model)], tp_group=state.tp_group, sequence_parallel=sp)
    full = {n: full_tensor(p.grad, p, state.tp_group, 2) for n, p in model.named_parameters()}
    return (losses, full) if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_fused_down_projection_tp2_matches_unfused_one_process(sp):
    ref_losses, ref_grads = _reference(8)
    losses, grads = run_on_ranks(_tp_fused_body, 2, make_batch(), sp)[0]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
    want = _stacked(ref_grads)
    assert sorted(grads) == sorted(want)
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=0, atol=1e-10, msg=n)


def _stepwise_logits(model, ids, prompt):
    from megatron.text_generation.inference_params import InferenceParams

    s = ids.size(1)
    pos = torch.arange(s).expand(ids.size(0), s)
    cache = InferenceParams(max_batch_size=ids.size(0), max_sequence_length=s)
    with torch.no_grad():
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_params=cache)]
        cache.sequence_len_offset = prompt
        for t in range(prompt, s):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    return torch.cat(steps, dim=1), cache


def _tp_latent_body(ids):
    state = parallel_state.initialize_model_parallel(2)
    model = GPTModel(make_config(q_lora_rank=8, cache_mla_latents=True, **FLAGS), state,
                     parallel_output=False).eval()
    logits, cache = _stepwise_logits(model, ids, 4)
    (held,) = cache.key_value_memory_dict[1]
    return (logits, tuple(held.shape)) if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_latent_cache_tp2_matches_the_one_process_expanded_cache():
    ids = make_batch()[0][:, :10]
    model = GPTModel(make_config(q_lora_rank=8, **FLAGS), single_process_state()).eval()
    want, _ = _stepwise_logits(model, ids, 4)
    got, shape = run_on_ranks(_tp_latent_body, 2, ids)[0]
    assert shape == (10, ids.size(0), FLAGS["kv_lora_rank"] + FLAGS["qk_pos_emb_head_dim"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)

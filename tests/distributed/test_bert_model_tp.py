"""BERT under tensor parallelism (TP = 2, with and without sequence parallelism) and pipeline
parallelism (PP = 2, through the 1F1B schedule), against the same model in one process.

Gradients go through the real ``finalize_model_grads`` (sequence-parallel parameters summed over
the TP group, the tied word embedding summed over the first and last stage) and TP shards are
then gathered to full tensors by each parameter's ``partition_dim``: the LM head's ``[V/tp]``
bias must come back as the whole ``[V]`` bias. Replicated parameters (pooler, binary head, norms,
the LM head's dense) must end with the same gradient on every TP rank.

Tolerance: float64 throughout; the split model sums in another order (partial matmuls summed by
all-reduce, per-rank softmax statistics), a few ulps, ~1e-15 relative. 1e-10 absolute leaves a
wide margin over that, while a missing reduction or a wrong shard shows up at 1e-4 or more.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving,
)
from megatron.model import BertModel
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_bert_model import BATCH, SEQ, bert_loss, loss_and_grads, make_bert_batch
from tests.unit.test_gpt_model import make_config, single_process_state

# name -> (config overrides, BertModel keywords, sequence_parallel)
TP_VARIANTS = {
    "base": ({}, {}, False),
    "base_sp": ({}, {}, True),
    "post_ln_sp": (dict(apply_residual_connection_post_layernorm=True), {}, True),
    "no_binary_head_sp": ({}, dict(num_tokentypes=0, add_binary_head=False), True),
}


class _Chunk(torch.nn.Module):
    """What ``finalize_model_grads`` asks of a data-parallel wrapper, with no data parallelism
    (gradients stay in ``.grad``)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def finish_grad_sync(self):
        pass

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _batch_for(kwargs, seed=0):
    return make_bert_batch(seed, num_tokentypes=kwargs.get("num_tokentypes", 2))


def _rank_spread(grad, group) -> float:
    """Largest difference between this replicated gradient and any other rank's copy."""
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return max((p - grad).abs().max().item() for p in parts)


def _tp_body():
    state = parallel_state.initialize_model_parallel(2)
    results = {}
    for name, (overrides, kwargs, sp) in TP_VARIANTS.items():
        model = BertModel(make_config(**overrides), state, sequence_parallel=sp, **kwargs)
        loss = bert_loss(model, _batch_for(kwargs))
        loss.backward()
        finalize_model_grads([_Chunk(model)], tp_group=state.tp_group, sequence_parallel=sp)
        grads, spread = {}, {}
        for pname, p in model.named_parameters():
            grads[pname] = full_tensor(p.grad, p, state.tp_group, state.tp_size)
            if not getattr(p, "tensor_model_parallel", False):
                spread[pname] = _rank_spread(p.grad, state.tp_group)
        results[name] = (loss.detach(), grads, spread)
    model = BertModel(make_config(), state, parallel_output=False)
    ids, padding, types = make_bert_batch()[:3]
    results["logits"] = tuple(t.detach() for t in model(ids, padding, types))
    return results if dist.get_rank() == 0 else None


def test_tp2_matches_single_process():
    results = run_on_ranks(_tp_body, 2)[0]
    for name, (overrides, kwargs, _) in TP_VARIANTS.items():
        batch = _batch_for(kwargs)
        ref_loss, ref_grads = loss_and_grads(
            BertModel(make_config(**overrides), single_process_state(), **kwargs), batch)
        loss, grads, spread = results[name]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10, msg=name)
        assert grads.keys() == ref_grads.keys()
        for p in grads:
            torch.testing.assert_close(grads[p], ref_grads[p], rtol=0, atol=1e-10,
                                       msg=f"{name} {p}")
        assert grads["lm_head.bias"].shape == ref_grads["lm_head.bias"].shape
        assert grads["lm_head.bias"].abs().max() > 1e-6
        for p, diff in spread.items():
            assert diff <= 1e-12, f"{name}: {p} differs over TP ranks by {diff}"
        if kwargs.get("add_binary_head", True):
            for p in ("binary_head.weight", "binary_head.bias",
                      "language_model.pooler.dense.weight"):
                assert spread[p] == 0.0, f"{name}: {p} differs over TP ranks"
    reference = BertModel(make_config(), single_process_state())
    ids, padding, types = make_bert_batch()[:3]
    ref_logits, ref_binary = reference(ids, padding, types)
    logits, binary = results["logits"]
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(binary, ref_binary, rtol=0, atol=1e-10)


# ---- pipeline parallelism ---------------------------------------------------------------------

NUM_MICROBATCHES = 2
PP_CONFIG = dict(num_layers=4)


def _pp_forward_step(data_iterator, model):
    ids, padding, types, labels, loss_mask, is_random = next(data_iterator)
    first = model.module.pre_process
    output = model(ids if first else None, padding, types if first else None, lm_labels=labels)

    def loss_func(out):
        lm_loss, binary_logits = out
        mask = loss_mask.to(lm_loss.dtype)
        loss = (lm_loss * mask).sum() / mask.sum() + torch.nn.functional.cross_entropy(
            binary_logits, is_random)
        return loss, {"loss": loss.detach()}
    return output, loss_func


def _pp_body():
    state = parallel_state.initialize_model_parallel(1, 2)
    first, last = state.pp_rank == 0, state.pp_rank == 1
    model = BertModel(make_config(**PP_CONFIG), state, pre_process=first, post_process=last)
    chunk = _Chunk(model)
    comm = P2PCommunicator.from_parallel_state(state, torch.float64, "cpu")
    batches = [make_bert_batch(seed) for seed in range(NUM_MICROBATCHES)]
    logged = forward_backward_pipelining_without_interleaving(
        forward_step_func=_pp_forward_step, data_iterator=iter(batches), model=chunk,
        num_microbatches=NUM_MICROBATCHES, communicator=comm,
        tensor_shape=(SEQ, BATCH, make_config().hidden_size))
    finalize_model_grads([chunk], tp_group=state.tp_group, embedding_group=state.embedding_group,
                         is_first_stage=first, is_last_stage=last, pp_size=2)
    offset = 2 * state.pp_rank
    grads = {}
    for name, p in model.named_parameters():
        if name.startswith("language_model.encoder.layers."):
            local = int(name.split(".")[3])
            name = name.replace(f"layers.{local}.", f"layers.{local + offset}.", 1)
        grads[name] = p.grad.detach().clone()
    return [entry["loss"] for entry in logged], grads


def test_pp2_matches_single_process():
    out = run_on_ranks(_pp_body, 2)
    whole = BertModel(make_config(**PP_CONFIG), single_process_state())
    losses = [bert_loss(whole, make_bert_batch(seed)) for seed in range(NUM_MICROBATCHES)]
    (sum(losses) / NUM_MICROBATCHES).backward()
    ref = {n: p.grad for n, p in whole.named_parameters()}
    assert out[0][0] == [] and len(out[1][0]) == NUM_MICROBATCHES
    for got, want in zip(out[1][0], losses):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-10)
    emb = "language_model.embedding.word_embeddings.weight"
    seen = set()
    for rank in range(2):
        for name, grad in out[rank][1].items():
            key = emb if name == "word_embeddings_for_head.weight" else name
            torch.testing.assert_close(grad, ref[key], rtol=0, atol=1e-10,
                                       msg=f"stage {rank} {name}")
            seen.add(key)
    assert seen == set(ref)
    # both copies of the tied embedding hold the summed gradient
    torch.testing.assert_close(out[0][1][emb], out[1][1]["word_embeddings_for_head.weight"],
                               rtol=0, atol=0)

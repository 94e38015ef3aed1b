"""The hybrid context-parallel schedule (megatron/core/pipeline_parallel/hybrid_cp_schedule.py) on 4
gloo ranks (data x context = 4): each rank reads two packed samples, the schedule cuts them into
their sequences, gathers them and runs each over 1, 2 or 4 ranks (padding it to a multiple of
2 x cp). Against one process running every sequence whole: the per-token loss and every
parameter's gradient agree in fp64 (tolerance 1e-10: only the order of sums and the log-sum-exp
merge of attention blocks differ); two runs from the same seed give bit-identical losses.

The model is one causal attention layer between an embedding (learned positions from the
sequence's own position ids) and an output projection; the reference uses naive fp64 attention,
the ranks this project's context-parallel attention (p2p ring and all-to-all) over each
sequence's block.
"""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import context_parallel_attention
from megatron.core.pipeline_parallel.hybrid_cp_schedule import (
    HybridCPSetup, HybridGroups, forward_backward_hybrid_context_parallel)
from tests.multiprocess import run_on_ranks

VOCAB, HIDDEN, HEADS, MAXLEN = 11, 8, 4, 80
MAX_PER_RANK = 16


class TinyAttentionLM(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.pos = torch.nn.Embedding(MAXLEN, HIDDEN, dtype=torch.float64)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, dtype=torch.float64)
        self.out = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def forward(self, batch, cp_group=None, comm_type="p2p"):
        x = self.embed(batch["tokens"]) + self.pos(batch["position_ids"])   # [1, s, h]
        q, k, v = self.qkv(x).transpose(0, 1).reshape(x.size(1), 1, 3, HEADS, -1).unbind(2)
        if cp_group is None:
            attn = _naive_causal(q, k, v)
        else:
            attn = context_parallel_attention(q, k, v, cp_group=cp_group, comm_type=comm_type)
        logits = self.out(x + attn.transpose(0, 1))                          # [1, s, V]
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        mask = batch["loss_mask"].flatten().double()
        return (ce * mask).sum(), mask.sum()


def _naive_causal(q, k, v):
    s = q.size(0)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).flatten(2)


# Each pack is 64 tokens; its sequences have lengths that need 1, 2 or 4 ranks at 16 tokens per
# rank, and most need padding for the cp split. Rank r reads packs 2r and 2r + 1.
PACKS = ([[64], [40, 24], [16, 16, 8, 8, 16], [5, 59], [30, 34], [13, 3, 48], [64], [33, 31]],
         [[17, 47], [64], [8] * 8, [62, 2], [20, 20, 24], [1, 63], [50, 14], [32, 32]])


def _packs(segments, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lengths in segments:
        s = sum(lengths)
        tokens = torch.randint(0, VOCAB - 1, (1, s + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": (torch.rand(1, s, generator=gen) > 0.2).float(),
                    "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
                    "segment_ids": torch.cat([torch.full((n,), i) for i, n in
                                              enumerate(lengths)]).unsqueeze(0)})
    return out


def _reference(b):
    model = TinyAttentionLM(0)
    total, tokens = 0.0, 0.0
    for pack, lengths in zip(_packs(PACKS[b], b), PACKS[b]):
        start = 0
        for n in lengths:
            loss, count = model({k: v[:, start:start + n] for k, v in pack.items()})
            total, tokens, start = total + loss, tokens + count, start + n
    (total / tokens).backward()
    return (total / tokens).item(), {k: p.grad for k, p in model.named_parameters()}


@contextlib.contextmanager
def _use_cp_group(model, group):
    model.cp_group = group
    try:
        yield
    finally:
        model.cp_group = None


def _step(model, b, setup, comm_type):
    """One step of global batch ``b``: the per-token loss and the reduced gradients."""
    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        loss, count = chunk(batch, chunk.cp_group, comm_type)
        return loss, lambda out: (out, count, {"lm loss": torch.stack([out.detach(), count])})

    rank = dist.get_rank()
    packs = _packs(PACKS[b], b)[2 * rank:2 * rank + 2]
    logged = forward_backward_hybrid_context_parallel(
        forward_step_func=forward_step, data_iterator=iter(packs), model=model,
        num_microbatches=2, calculate_per_token_loss=True, hybrid_cp=setup)
    totals = sum(v["lm loss"] for v in logged)
    dist.all_reduce(totals)
    for p in model.parameters():      # what finalize_model_grads does with per-token losses
        dist.all_reduce(p.grad)
        p.grad /= totals[1]
    return (totals[0] / totals[1]).item()


def _setup():
    group = dist.group.WORLD
    return HybridCPSetup(group, HybridGroups(group), MAX_PER_RANK, VOCAB - 1, _use_cp_group)


def _hybrid(comm_type):
    setup, out = _setup(), []
    for b in range(len(PACKS)):
        model = TinyAttentionLM(0)
        model.cp_group = None
        loss = _step(model, b, setup, comm_type)
        out.append((loss, {k: p.grad.clone() for k, p in model.named_parameters()}))
    return out


def _two_steps(comm_type):
    """Two SGD steps; returns the losses, to compare two runs from the same seed bit for bit."""
    setup, model, losses = _setup(), TinyAttentionLM(0), []
    model.cp_group = None
    for b in range(len(PACKS)):
        losses.append(_step(model, b, setup, comm_type))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_hybrid_cp_step_equals_one_process(comm_type):
    results = run_on_ranks(_hybrid, 4, comm_type)
    for b in range(len(PACKS)):
        ref_loss, ref_grads = _reference(b)
        for rank in range(4):
            loss, grads = results[rank][b]
            assert loss == pytest.approx(ref_loss, rel=0, abs=1e-10)
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=0, atol=1e-10, msg=name)


@pytest.mark.slow
def test_same_seed_same_losses_bit_for_bit():
    first = run_on_ranks(_two_steps, 4, "p2p")
    second = run_on_ranks(_two_steps, 4, "p2p")
    assert first == second
    assert all(r == first[0] for r in first)

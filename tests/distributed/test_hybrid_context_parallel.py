"""A hybrid context-parallel step (megatron/core/hybrid_cp_step.py) on 4 gloo ranks (data x context
= 4, each sequence over 1, 2 or 4 of them) against one process running every sequence whole: the
per-token loss and every parameter's gradient agree in fp64 (tolerance 1e-10: the only
differences are the order of sums and the log-sum-exp merge of attention blocks), and two steps
from the same seed give bit-identical losses.

The model is one causal attention layer between an embedding and an output projection; the
single-process reference uses naive fp64 attention, the ranks this project's context-parallel
attention (p2p ring and all-to-all) over each sequence's block.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import context_parallel_attention
from megatron.core.hybrid_cp_step import HybridGroups, run_hybrid_cp_step
from tests.multiprocess import run_on_ranks

VOCAB, HIDDEN, HEADS, MAXLEN = 11, 8, 4, 64
BATCHES = ([64, 32, 16, 16, 8, 8, 24, 40], [8, 32, 16, 16, 8, 8, 24, 16])
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


def _samples(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in lengths:
        tokens = torch.randint(0, VOCAB, (1, s + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": (torch.rand(1, s, generator=gen) > 0.2).long(),
                    "position_ids": torch.arange(s).unsqueeze(0)})
    return out


def _reference(lengths, seed):
    model = TinyAttentionLM(0)
    total, tokens = 0.0, 0.0
    for sample in _samples(lengths, seed):
        loss, n = model(sample)
        total, tokens = total + loss, tokens + n
    (total / tokens).backward()
    return (total / tokens).item(), {k: p.grad for k, p in model.named_parameters()}


def _hybrid(comm_type):
    group = dist.group.WORLD
    groups = HybridGroups(group)
    out = []
    for seed, lengths in enumerate(BATCHES):
        model = TinyAttentionLM(0)
        loss, tokens = run_hybrid_cp_step(
            _samples(lengths, seed), lambda b, g: model(b, g, comm_type),
            list(model.parameters()), group, groups, MAX_PER_RANK)
        out.append(((loss / tokens).item(),
                    {k: p.grad.clone() for k, p in model.named_parameters()}))
    return out


def _two_steps(comm_type):
    """Two SGD steps; returns the losses, to compare two runs from the same seed bit for bit."""
    group, model = dist.group.WORLD, TinyAttentionLM(0)
    groups, losses = HybridGroups(group), []
    for seed, lengths in enumerate(BATCHES):
        loss, tokens = run_hybrid_cp_step(
            _samples(lengths, seed), lambda b, g: model(b, g, comm_type),
            list(model.parameters()), group, groups, MAX_PER_RANK)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append((loss / tokens).item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_hybrid_cp_step_equals_one_process(comm_type):
    results = run_on_ranks(_hybrid, 4, comm_type)
    for b, lengths in enumerate(BATCHES):
        ref_loss, ref_grads = _reference(lengths, b)
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

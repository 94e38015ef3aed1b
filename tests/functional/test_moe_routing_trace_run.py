"""Training with ``--moe-routing-trace-path``: what the trace holds, checked against the routing
recomputed from the trace's own router weights and inputs, and that tracing leaves the run's
losses unchanged bit for bit.

The model is test_moe_training.py's (4 MoE layers, 4 experts, top-2 softmax, fp32, dropout 0);
a global batch of 8 in micro-batches of 2 is 4 micro-batches of 2 x 16 = 32 tokens per
iteration, each routed once by every MoE layer.
"""

import json
import os

import pytest
import torch

from megatron.model.moe.routing_trace import read_sidecar
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import _flags, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks

MICRO_BATCHES, TOKENS, LAYERS, TOPK, EXPERTS, HIDDEN = 4, 32, 4, 2, 4, 32


def _train(corpus, world, iters, extra=(), pp=1):
    return run_on_ranks(run_pretrain, world, _flags(corpus, pp=pp, iters=iters,
                                                    extra=list(extra)))


def _records(trace_dir, rank):
    with open(os.path.join(trace_dir, f"router_trace_rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def traced(corpus, tmp_path_factory):
    """3 iterations, the first 2 traced with every option; and the same run untraced."""
    trace_dir = str(tmp_path_factory.mktemp("trace"))
    flags = ["--moe-routing-trace-path", trace_dir, "--moe-routing-trace-max-training-iters",
             "2", "--moe-routing-trace-capture-hidden-states",
             "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights"]
    on = _train(corpus, 1, 3, flags)[0]
    off = _train(corpus, 1, 3)[0]
    return trace_dir, on, off


def test_tracing_leaves_the_losses_bit_for_bit(traced):
    _, on, off = traced
    assert len(on["losses"]) == 3
    assert on["losses"] == off["losses"]


def test_one_record_per_layer_and_micro_batch_of_the_traced_iterations(traced):
    trace_dir, _, _ = traced
    records = _records(trace_dir, 0)
    # Step by step, micro-batch by micro-batch, layer by layer; nothing after step 1, and not
    # the end-of-training evaluation's forwards.
    assert [(r["step"], r["layer"]) for r in records] == [
        (step, layer) for step in range(2) for _ in range(MICRO_BATCHES)
        for layer in range(LAYERS)]
    for r in records:
        assert r["stage"] == "pre_dispatch" and r["block"] == "decoder" and r["rank"] == 0
        assert (r["num_tokens"], r["topk"]) == (TOKENS, TOPK)
        indices = torch.tensor(r["top_indices"])
        assert indices.shape == (TOKENS, TOPK)
        assert ((indices[:, 0] < indices[:, 1]) & (indices >= 0).all(1)).all()
        assert (indices < EXPERTS).all()


def test_sidecar_offsets_and_shapes_read_back(traced):
    trace_dir, _, _ = traced
    records = _records(trace_dir, 0)
    for kind, name, width in (("hs", "hidden_states", HIDDEN), ("logit", "logits", EXPERTS)):
        offset = 0
        for r in records:
            assert r[f"{kind}_shape"] == [TOKENS, width]
            assert r[f"{kind}_offset"] == offset
            assert r[f"{kind}_bytes"] == TOKENS * width * 2       # bfloat16
            offset += r[f"{kind}_bytes"]
            assert read_sidecar(r, trace_dir, kind).shape == (TOKENS, width)
        assert os.path.getsize(os.path.join(trace_dir, f"{name}_rank0.bin")) == offset


def test_top_indices_are_the_choice_recomputed_from_saved_weights_and_inputs(traced):
    """Step 0 ran with the dumped weights (taken at the first forward). The reference routes the
    captured input in fp64: softmax then top-2, i.e. the two largest logits. The captured input
    is the fp32 input rounded to bfloat16 (relative error <= 2^-9 per element), which moves an
    expert's logit by at most 2^-9 |h| |w_e|; a token whose gap between its 2nd and 3rd logit
    exceeds twice 2^-8 |h| max_e |w_e| cannot have changed its choice, so those must agree
    exactly (and are nearly all tokens: no ties among them)."""
    trace_dir, _, _ = traced
    state = torch.load(os.path.join(trace_dir, "router_state_rank0.pt"))
    assert sorted(state) == list(range(LAYERS))
    agreed = total = 0
    for r in _records(trace_dir, 0):
        if r["step"] != 0:
            continue
        layer = state[r["layer"]]
        assert layer["score_function"] == "softmax" and layer["topk"] == TOPK
        weight = layer["weight"].double()                                   # [E, h]
        hidden = read_sidecar(r, trace_dir, "hs").double()                  # [T, h]
        logits = hidden @ weight.T                                          # [T, E]
        if layer["bias"] is not None:
            logits = logits + layer["bias"].double()
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, TOPK, dim=-1).indices.sort(dim=-1).values
        ordered = logits.sort(dim=-1, descending=True).values
        gap = ordered[:, TOPK - 1] - ordered[:, TOPK]
        bound = 2 * 2.0 ** -8 * hidden.norm(dim=-1) * weight.norm(dim=-1).max()
        clear = gap > bound
        got = torch.tensor(r["top_indices"])
        assert torch.equal(got[clear], top[clear]), r["layer"]
        agreed += int(clear.sum())
        total += TOKENS
        # The logits file: the fp32 router's logits in bfloat16.
        saved = read_sidecar(r, trace_dir, "logit").double()
        assert torch.allclose(saved, logits, atol=1e-2, rtol=1e-2)
    assert total == MICRO_BATCHES * LAYERS * TOKENS and agreed >= 0.9 * total, (agreed, total)


def test_two_pipeline_stages_write_one_file_each_with_their_layers(corpus, tmp_path):
    """PP 2, full recomputation, every iteration traced: each rank's file holds its own two
    layers (numbered in the whole model), once per micro-batch (the recomputation in backward
    and the evaluation at the end are not recorded)."""
    trace_dir = str(tmp_path / "trace")
    _train(corpus, 2, 2, ["--moe-routing-trace-path", trace_dir, "--recompute-granularity",
                          "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"], pp=2)
    assert sorted(os.listdir(trace_dir)) == ["router_trace_rank0.jsonl",
                                             "router_trace_rank1.jsonl"]
    for rank, layers in ((0, (0, 1)), (1, (2, 3))):
        records = _records(trace_dir, rank)
        assert all(r["rank"] == rank for r in records)
        assert [(r["step"], r["layer"]) for r in records] == [
            (step, layer) for step in range(2) for _ in range(MICRO_BATCHES)
            for layer in layers]

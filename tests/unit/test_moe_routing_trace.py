"""The routing tracer on bare routers (megatron/model/moe/routing_trace.py) and its flags'
checks; training runs are tests/functional/test_moe_routing_trace_run.py's.

A router's records hold the experts of its routing map: without drops, the top-k of its logits
(checked against ``torch.topk`` of the fp64 logits, well separated with these random weights).
"""

import json
import os

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.tensor_parallel.random import checkpoint
from megatron.model.moe import MoEConfig, TopKRouter
from megatron.model.moe.routing_trace import RoutingTracer, read_sidecar, router_identity
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.unit.test_megatron_flags import MINIMAL

SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 4, 2, 8, 4, 2


def _router(**moe):
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                               padded_vocab_size=16, max_position_embeddings=SEQ,
                               seq_length=SEQ, params_dtype=torch.float64)
    return TopKRouter(config, MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=TOPK, **moe),
                      layer_number=2)


def _hidden(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64,
                       requires_grad=True)


class _Block(torch.nn.Module):
    def __init__(self, **moe):
        super().__init__()
        self.router = _router(**moe)


def _traced(tmp_path, **kw):
    block = _Block()
    tracer = RoutingTracer(str(tmp_path), rank=3, **kw)
    assert tracer.attach([block]) == 1
    return block.router, tracer


def _records(tmp_path, rank=3):
    with open(os.path.join(tmp_path, f"router_trace_rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_records_the_top_k_of_each_training_forward(tmp_path):
    router, tracer = _traced(tmp_path, capture_hidden_states=True, capture_logits=True,
                             dump_weights=True)
    hidden = _hidden()
    router(hidden)
    tracer.advance_step()
    records = _records(tmp_path)
    assert len(records) == 1
    record = records[0]
    assert {k: record[k] for k in ("step", "stage", "block", "layer", "rank", "num_tokens",
                                   "topk")} == {
        "step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 3,
        "num_tokens": SEQ * BATCH, "topk": TOPK}
    flat = hidden.detach().reshape(-1, HIDDEN)                              # [T, h]
    logits = flat @ router.weight.detach().T + router.bias.detach()          # [T, E]
    expected = torch.topk(logits, TOPK, dim=-1).indices.sort(dim=-1).values
    assert torch.tensor(record["top_indices"]).tolist() == expected.tolist()
    assert torch.equal(read_sidecar(record, str(tmp_path), "hs"),
                       flat.to(torch.bfloat16))
    assert torch.equal(read_sidecar(record, str(tmp_path), "logit"),
                       logits.to(torch.bfloat16))
    tracer.close()
    state = torch.load(os.path.join(tmp_path, "router_state_rank3.pt"))
    assert list(state) == [1] and torch.equal(state[1]["weight"], router.weight.float())


def test_recomputation_and_evaluation_are_not_recorded(tmp_path):
    router, tracer = _traced(tmp_path)
    out, _ = checkpoint(router, False, _hidden())       # run again in backward
    out.sum().backward()
    router.eval()
    with torch.no_grad():
        router(_hidden(1))
    tracer.advance_step()
    assert len(_records(tmp_path)) == 1


def test_stops_after_max_steps_and_unhooks(tmp_path):
    router, tracer = _traced(tmp_path, max_steps=2, dump_weights=True)
    for _ in range(3):
        router(_hidden())
        tracer.advance_step()
    assert [r["step"] for r in _records(tmp_path)] == [0, 1]
    assert not router._forward_hooks
    assert os.path.exists(os.path.join(tmp_path, "router_state_rank3.pt"))


def test_a_router_call_with_dropped_choices_writes_no_record(tmp_path, capsys):
    block = _Block(moe_expert_capacity_factor=0.5)
    tracer = RoutingTracer(str(tmp_path), rank=0)
    tracer.attach([block])
    block.router(_hidden())
    tracer.advance_step()
    assert _records(tmp_path, 0) == []
    assert "dropped" in capsys.readouterr().out


def test_mtp_routers_are_named_by_depth():
    router = _router()
    assert router_identity("module.language_model.encoder.layers.0.mlp.router",
                           router) == ("decoder", None, 1)
    assert router_identity("mtp.layers.1.transformer_layer.mlp.router",
                           router) == ("mtp", 1, 0)


@pytest.mark.parametrize("extra, named", [
    (["--moe-routing-trace-dump-weights"], "--moe-routing-trace-dump-weights"),
    (["--moe-routing-trace-max-training-iters", "3"], "--moe-routing-trace-path"),
    (["--moe-routing-trace-path", "x", "--num-experts", "4",
      "--moe-routing-trace-max-training-iters", "0"], "got 0"),
    (["--moe-routing-trace-path", "x"], "--num-experts"),
])
def test_flags_stop_in_one_line(extra, named):
    with pytest.raises(ArgumentsError) as error:
        validate_args(parse_args(argv=MINIMAL + ["--no-bias-gelu-fusion"] + extra))
    assert named in str(error.value) and "\n" not in str(error.value)
    assert not torch.distributed.is_initialized()

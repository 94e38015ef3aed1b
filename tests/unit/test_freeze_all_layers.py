"""megatron.training.freeze: what --freeze-all-layers does to the model and to a step's passes."""

import argparse
import contextlib

import torch

from megatron.training.arguments import parse_args
from megatron.training.freeze import freeze_all_model_chunks, grad_context


class _Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(4, 2)
        self.frozen_expert_bias = False


def _chunk():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), _Router())


def test_every_parameter_frozen_and_router_bias_flagged():
    chunks = [_chunk(), _chunk()]
    assert freeze_all_model_chunks(chunks) is chunks
    assert all(not p.requires_grad for c in chunks for p in c.parameters())
    assert all(c[1].frozen_expert_bias for c in chunks)
    assert not hasattr(chunks[0][0], "frozen_expert_bias")


def test_frozen_step_builds_no_graph():
    """A later pipeline stage's input requires grad; under the frozen context no graph is
    built even so."""
    chunk = freeze_all_model_chunks([_chunk()])[0]
    context, forward_only = grad_context(argparse.Namespace(freeze_all_layers=True))
    x = torch.ones(2, 4, requires_grad=True)
    with context:
        out = chunk[0](x)
    assert forward_only and out.grad_fn is None
    context, forward_only = grad_context(argparse.Namespace(freeze_all_layers=False))
    assert isinstance(context, contextlib.nullcontext) and not forward_only


def test_flag_parses():
    assert parse_args(argv=["--freeze-all-layers"]).freeze_all_layers
    assert not parse_args(argv=[]).freeze_all_layers

"""Selective recomputation of modules (``--recompute-modules``) beyond core attention.

Two kinds, as in Megatron-Core:

- :func:`recomputed`: a whole block (``mlp``, ``moe``, ``shared_experts``) keeps only its input;
  its inside is run again in backward (:func:`megatron.core.tensor_parallel.checkpoint`, which
  replays the RNG states, so dropout masks and routing repeat bit for bit).
- :class:`OutputDiscardingCheckpoint`: a cheap function whose *output* is what costs memory
  (``layernorm``: the norms before attention and MLP; ``moe_act``: the experts' activation).
  The function runs without a graph, its output is used by the next layer, then its storage is
  freed (:meth:`discard`); when the gradient reaches a tensor computed after that next layer
  (the hook tensor), the function runs again from its saved input into the same storage, before
  the next layer's backward reads it, and its backward follows from that recomputed graph.
"""

from typing import Callable, List

import torch

from megatron.core import tensor_parallel


def recomputed(function: Callable, *args):
    """``function(*args)``, recomputed in backward when a graph is being built; a plain call
    otherwise. Tensors the function returns as they are (a bias parameter) come back as views,
    so that the recomputation owns them."""
    if not torch.is_grad_enabled():
        return function(*args)

    def run(*inputs):
        out = function(*inputs)
        if isinstance(out, tuple):
            return tuple(o.view_as(o) if torch.is_tensor(o) else o for o in out)
        return out

    return tensor_parallel.checkpoint(run, False, *args)


class _DiscardedOutput(torch.autograd.Function):
    """Forward: ``function(x)`` without a graph. Backward: the graph the recompute built."""

    @staticmethod
    def forward(ctx, record, x):
        ctx.record = record
        with torch.no_grad():
            return record.function(x)

    @staticmethod
    def backward(ctx, grad_output):
        record = ctx.record
        if record.recomputed is None:          # the hook did not run: recompute now
            record.recompute()
        inputs, output = record.recomputed
        torch.autograd.backward(output, grad_output)
        record.recomputed = None
        return None, inputs.grad


class _Record:
    def __init__(self, function: Callable, x: torch.Tensor):
        self.function, self.input, self.output, self.recomputed = function, x.detach(), None, None

    def recompute(self) -> None:
        with torch.enable_grad():
            inputs = self.input.requires_grad_(True)
            output = self.function(inputs)
        if self.output is not None and self.output.untyped_storage().size() == 0:
            # Storage to storage: the tensors saved for backward see their values again
            # without a version bump (an in-place copy would count as a change).
            storage = self.output.untyped_storage()
            storage.resize_(output.untyped_storage().size())
            storage.copy_(output.untyped_storage())
        self.recomputed = (inputs, output)


class OutputDiscardingCheckpoint:
    """Wrap a cheap function whose outputs are discarded after use and recomputed in backward.

    Call the wrapper as the function (once or several times per forward), then
    :meth:`discard` with a tensor computed from what consumed the outputs.
    """

    def __init__(self, function: Callable):
        self.function = function
        self.records: List[_Record] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.function(x)
        record = _Record(self.function, x)
        record.output = _DiscardedOutput.apply(record, x)
        self.records.append(record)
        return record.output

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs of this forward's calls; they come back when ``hook_tensor``'s
        gradient is computed (before the backward of whatever consumed them)."""
        records, self.records = self.records, []
        if not records:
            return
        if not hook_tensor.requires_grad:
            raise RuntimeError("recomputation hook on a tensor that takes no gradient")
        for record in records:
            record.output.untyped_storage().resize_(0)

        def restore(grad):
            for record in records:
                record.recompute()
            return grad

        hook_tensor.register_hook(restore)

"""--freeze-all-layers: a run whose parameters never change (a teacher writing its outputs, a
forward-only pass over the training data that keeps the loop's logging, checkpointing and data
position).

As Megatron-LM does it: every parameter stops requiring gradients, a router's expert bias is
marked frozen, and each step runs the schedule forward-only under ``torch.no_grad()`` (a later
pipeline stage's input arrives requiring grad, so ``forward_only`` alone would still build a
graph), with no gradient reduction and no optimizer step; the log shows learning rate 0.
"""

import contextlib
from typing import List, Tuple

import torch


def freeze_all_model_chunks(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """Freeze every parameter of every chunk in place (and flag routers' expert biases)."""
    for chunk in chunks:
        chunk.requires_grad_(False)
        for module in chunk.modules():
            if hasattr(module, "frozen_expert_bias"):
                module.frozen_expert_bias = True
    return chunks


def grad_context(args) -> Tuple[contextlib.AbstractContextManager, bool]:
    """``(context, forward_only)`` for a training step's passes: ``(no_grad, True)`` when the
    run is frozen, else a no-op context and False."""
    if getattr(args, "freeze_all_layers", False):
        return torch.no_grad(), True
    return contextlib.nullcontext(), False

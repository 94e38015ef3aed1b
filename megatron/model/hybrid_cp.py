"""Switching a built GPT model's context-parallel group per sequence (``--hybrid-context-parallel``).

The hybrid context-parallel schedule (megatron/core/pipeline_parallel/hybrid_cp_schedule.py) runs
each sequence over its own block of ranks. The model was built without context parallelism; for
the duration of one sequence :func:`use_cp_group` points every attention layer (and the rotary
positions of the language model) at the block's group, and restores them afterwards.
"""

import contextlib

from megatron.core.collectives import get_group_rank, get_group_size
from megatron.model.attention import ContextParallelSetup, ParallelAttention
from megatron.model.language_model import TransformerLanguageModel
from megatron.model.multi_latent_attention import MultiLatentAttention


def _setup(module, cp_group):
    if get_group_size(cp_group) == 1:
        return None
    return ContextParallelSetup(cp_group, module.config.layer_cp_comm_type(module.layer_number))


@contextlib.contextmanager
def use_cp_group(model, cp_group):
    """Run ``model`` with ``cp_group`` as its context-parallel group (None: whole sequences)."""
    saved = []
    for module in model.modules():
        if isinstance(module, (ParallelAttention, MultiLatentAttention)):
            saved.append((module, "cp", module.cp))
            module.cp = _setup(module, cp_group)
            if isinstance(module, ParallelAttention):
                saved.append((module, "cp_group", module.cp_group))
                module.cp_group = None if module.cp is None else cp_group
        elif isinstance(module, TransformerLanguageModel):
            saved += [(module, "cp_size", module.cp_size), (module, "cp_rank", module.cp_rank)]
            module.cp_size, module.cp_rank = get_group_size(cp_group), get_group_rank(cp_group)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)

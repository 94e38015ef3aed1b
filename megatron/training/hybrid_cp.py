"""The harness side of ``--hybrid-context-parallel``: what its schedule is given.

The schedule itself is megatron/core/pipeline_parallel/hybrid_cp_schedule.py; the model's
attention is pointed at each sequence's block by megatron/model/hybrid_cp.py. The block groups
are created as the schedules first need them and kept for the run (one setup per layout).
"""

from typing import Dict

from megatron.core.pipeline_parallel.hybrid_cp_schedule import (
    HybridCPSetup, HybridGroups, forward_backward_hybrid_context_parallel)
from megatron.model.hybrid_cp import use_cp_group
from megatron.training import global_vars

# Keyed by the data x context group: a run builds its layout once.
_SETUPS: Dict[object, HybridCPSetup] = {}


def schedule_kwargs(args, pstate) -> dict:
    """``{"hybrid_cp": setup}`` with --hybrid-context-parallel, else nothing."""
    if not args.hybrid_context_parallel:
        return {}
    setup = _SETUPS.get(pstate.dp_cp_group)
    if setup is None:
        setup = HybridCPSetup(
            dp_cp_group=pstate.dp_cp_group, groups=HybridGroups(pstate.dp_cp_group),
            max_seqlen_per_rank=args.max_seqlen_per_dp_cp_rank,
            pad_token=global_vars.get_tokenizer().pad, use_cp_group=use_cp_group)
        _SETUPS[pstate.dp_cp_group] = setup
    return {"hybrid_cp": setup}

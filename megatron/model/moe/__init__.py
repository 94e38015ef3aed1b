"""Mixture of experts (DESIGN.md decision 12): router, token dispatcher, experts, combine."""

from megatron.model.moe.config import MoEConfig
from megatron.model.moe.router import (TopKRouter, drop_over_capacity, expert_capacity,
                                       scores_for_aux_loss, sequence_load_balancing_loss,
                                       sinkhorn, switch_load_balancing_loss, topk_routing, z_loss)
from megatron.model.moe.tracker import MoELossTracker, attach_aux_loss

__all__ = [
    "MoEConfig", "MoELossTracker", "TopKRouter", "attach_aux_loss", "drop_over_capacity",
    "expert_capacity", "scores_for_aux_loss", "sequence_load_balancing_loss", "sinkhorn",
    "switch_load_balancing_loss", "topk_routing", "z_loss",
]

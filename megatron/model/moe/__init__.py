"""Mixture of experts (DESIGN.md decision 12): router, token dispatcher, experts, combine."""

from megatron.model.moe.config import MoEConfig
from megatron.model.moe.dispatcher import (AllGatherTokenDispatcher, AllToAllTokenDispatcher,
                                           Permutation, build_token_dispatcher, permute,
                                           unpermute)
from megatron.model.moe.experts import (ExpertMLP, GroupedMLP, SequentialMLP, SharedExpertMLP,
                                        expert_activation)
from megatron.model.moe.layer import MoELayer
from megatron.model.moe.router import (TopKRouter, drop_over_capacity, expert_capacity,
                                       group_limited_topk, scores_for_aux_loss,
                                       sequence_load_balancing_loss, sinkhorn,
                                       switch_load_balancing_loss, topk_routing,
                                       update_expert_biases, updated_expert_bias, z_loss)
from megatron.model.moe.tracker import MoELossTracker, attach_aux_loss

__all__ = [
    "AllGatherTokenDispatcher", "AllToAllTokenDispatcher", "ExpertMLP", "GroupedMLP",
    "MoEConfig", "MoELayer", "MoELossTracker", "Permutation", "SequentialMLP",
    "SharedExpertMLP", "TopKRouter", "attach_aux_loss", "build_token_dispatcher",
    "drop_over_capacity", "expert_activation", "expert_capacity", "group_limited_topk",
    "permute",
    "scores_for_aux_loss", "sequence_load_balancing_loss", "sinkhorn",
    "switch_load_balancing_loss", "topk_routing", "unpermute", "update_expert_biases",
    "updated_expert_bias", "z_loss",
]

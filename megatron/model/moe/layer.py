"""The mixture-of-experts layer: a drop-in replacement of the transformer layer's MLP.

router -> token dispatcher -> experts -> combine (+ shared expert). ``forward`` takes and
returns ``[s, b, h]`` and, like :class:`~megatron.model.transformer.ParallelMLP`, returns
``(output, None)`` (the bias, if any, is inside each expert). Submodule names follow
Megatron-Core's ``MoELayer`` (``router.weight``, ``experts.local_experts.<i>.linear_fc1.weight``,
``shared_experts.linear_fc1.weight``, ``shared_experts.gate_weight``, with ``--moe-latent-size``
``fc1_latent_proj.weight`` / ``fc2_latent_proj.weight``), so checkpoint keys map one to one.

Process groups are passed explicitly: ``ep_group`` (expert parallelism: the experts are split
over its ranks, tokens travel between them), ``expert_tp_group`` (each expert split over its
ranks), ``tp_group`` (the shared expert's tensor parallelism). None means no parallelism of
that kind.

Which tokens a rank holds decides how the expert-TP group is used. When its ranks hold the same
tokens (``expert_tp_shares_tokens``, the default: expert-TP is the tensor-parallel group and
the input the whole ``[s, b, h]`` of the micro-batch) the dispatched rows are already the same
on each. Otherwise (an expert-TP size other than TP) each rank routes its own tokens, and the
dispatched rows are gathered over the expert-TP group and handed back after the experts
(:mod:`~megatron.model.moe.expert_tp`). With ``sequence_parallel`` the input is this rank's
slice ``[s/tp, b, h]`` of the sequence: the router counts its load-balancing loss over
``tp_group`` and the shared expert runs sequence-parallel.
"""

from typing import Optional, Tuple

import torch

from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.config import TransformerConfig
from megatron.model.module import MegatronModule
from megatron.model.moe.config import MoEConfig
from megatron.model.moe.dispatcher import build_token_dispatcher
from megatron.model.moe.expert_tp import gather_expert_rows, return_own_rows
from megatron.core.utils import get_init_method, get_output_layer_init_method
from megatron.model.moe.experts import (GroupedMLP, SequentialMLP, SharedExpertMLP,
                                        check_expert_tp)
from megatron.model.moe.grouped_tensor import TEGroupedMLP
from megatron.model.moe.latent import LatentProjection
from megatron.model.moe.router import TopKRouter, expert_capacity
from megatron.model.moe.tracker import MoELossTracker
from megatron.model.recompute import OutputDiscardingCheckpoint, recomputed


class MoELayer(MegatronModule):
    """Route each token to its top-k experts and sum their outputs weighted by the routing
    probabilities.

    Args:
        config: the transformer config (hidden size, FFN size, activation, bias, init, dtype).
        moe_config: the MoE settings; ``expert_model_parallel_size`` and
            ``expert_tensor_parallel_size`` (when set) must match the groups' sizes.
        layer_number: 1-based global layer number (logging and initialisation seeds).
        ep_group: the expert-parallel group, or None.
        expert_tp_group: the expert-tensor-parallel group, or None.
        tp_group: the tensor-parallel group of the shared expert, or None.
        tracker: shared by the model's MoE layers: logged auxiliary losses and their gradient
            scale; None: not logged, scale 1.
        init_seed: the model's initialisation seed.
        cp_group: the context-parallel group: the router's load-balancing loss covers the
            whole sequence (see :class:`~megatron.model.moe.router.TopKRouter`).
        dp_group: the data-parallel group, over which ``global_aux_loss`` counts (ditto).
        expert_tp_shares_tokens: whether the ranks of ``expert_tp_group`` hold the same tokens
            (False: each its own; see the module docstring).
        sequence_parallel: the input is this rank's sequence slice over ``tp_group``; needs
            ``expert_tp_shares_tokens=False`` when ``tp_group`` has more than one rank.
        expert_weight_shard_group: the routed experts' weight-shard group
            (``--expert-tensor-parallel-num-weight-shards``; None: none): each expert weight
            is kept as this rank's block of rows and gathered for the matmuls.
    """

    def __init__(self, config: TransformerConfig, moe_config: MoEConfig, layer_number: int = 1,
                 *, ep_group=None, expert_tp_group=None, tp_group=None,
                 tracker: Optional[MoELossTracker] = None, init_seed: int = 1234,
                 cp_group=None, expert_tp_shares_tokens: bool = True,
                 sequence_parallel: bool = False, dp_group=None,
                 expert_weight_shard_group=None):
        super().__init__(config)
        if moe_config.num_moe_experts is None:
            raise ValueError("MoELayer needs --num-experts")
        ep_size = get_group_size(ep_group)
        if ep_size != moe_config.expert_model_parallel_size:
            raise ValueError(f"--expert-model-parallel-size is "
                             f"{moe_config.expert_model_parallel_size} but the ep_group passed "
                             f"has {ep_size} ranks")
        check_expert_tp(moe_config, config, expert_tp_group)
        sliced = sequence_parallel and get_group_size(tp_group) > 1
        if sliced and expert_tp_shares_tokens:
            raise ValueError("MoELayer: with sequence_parallel each tensor-parallel rank holds "
                             "its own tokens; pass expert_tp_shares_tokens=False")
        self.moe_config = moe_config
        self.layer_number = layer_number
        self.expert_tp_group = expert_tp_group
        self.gather_over_expert_tp = (not expert_tp_shares_tokens
                                      and get_group_size(expert_tp_group) > 1)
        self.router = TopKRouter(config, moe_config, layer_number, tracker, init_seed,
                                 cp_group=cp_group, sp_group=tp_group if sliced else None,
                                 dp_group=dp_group)
        self.token_dispatcher = build_token_dispatcher(moe_config.moe_token_dispatcher_type,
                                                       moe_config.num_moe_experts, ep_group)
        experts_class = GroupedMLP if moe_config.moe_grouped_gemm else SequentialMLP
        if moe_config.moe_single_grouped_weight or moe_config.moe_single_grouped_bias:
            experts_class = TEGroupedMLP
        self.experts = experts_class(config, moe_config, layer_number, get_group_rank(ep_group),
                                     ep_size, expert_tp_group, init_seed,
                                     weight_shard_group=expert_weight_shard_group)
        self.shared_experts = None
        if moe_config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, moe_config, layer_number, tp_group,
                                                  init_seed, sequence_parallel=sliced)
        self._build_latent_projections(config, init_seed, sliced)
        self._wrap_activations()

    def _build_latent_projections(self, config: TransformerConfig, init_seed: int,
                                  sequence_parallel: bool) -> None:
        """``--moe-latent-size``: ``fc1_latent_proj`` / ``fc2_latent_proj`` around the routed
        experts (:mod:`~megatron.model.moe.latent`)."""
        self.fc1_latent_proj = self.fc2_latent_proj = None
        latent = self.moe_config.moe_latent_size
        if latent is None:
            return
        piece = f"layer.{self.layer_number - 1}.mlp"
        self.fc1_latent_proj = LatentProjection(
            config, config.hidden_size, latent, get_init_method(config),
            f"{piece}.fc1_latent_proj", init_seed, sequence_parallel)
        self.fc2_latent_proj = LatentProjection(
            config, latent, config.hidden_size, get_output_layer_init_method(config),
            f"{piece}.fc2_latent_proj", init_seed, sequence_parallel)

    def _capacity(self, num_tokens: int) -> Optional[int]:
        cfg = self.moe_config
        if not cfg.moe_pad_expert_input_to_capacity:
            return None
        return expert_capacity(num_tokens, cfg.num_moe_experts, cfg.moe_router_topk,
                               cfg.moe_expert_capacity_factor)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """``[s, b, h]`` -> (``[s, b, h]``, None) (``s / tp`` with ``sequence_parallel``)."""
        seq_length, batch, hidden = hidden_states.shape
        probs, routing_map = self.router(hidden_states)                      # [s*b, E] each
        tokens = hidden_states.reshape(-1, hidden)                           # [s*b, h]
        if self.fc1_latent_proj is not None:
            tokens = self.fc1_latent_proj(tokens)                            # [s*b, latent]
        if self.moe_config.moe_apply_probs_on_input:
            tokens, probs = _probs_on_input(tokens, probs, routing_map)
        probs = probs.to(hidden_states.dtype)        # a no-op unless --moe-router-dtype is set
        rows, counts, handle = self.token_dispatcher.dispatch(
            tokens, probs, routing_map, self._capacity(tokens.size(0)))      # [N, h]
        if self.gather_over_expert_tp:
            group_rows, group_counts, rows_handle = gather_expert_rows(
                rows, counts, self.expert_tp_group)                          # [N', h]
            expert_output = return_own_rows(self._experts(group_rows, group_counts),
                                            rows_handle, self.expert_tp_group)   # [N, h]
        else:
            expert_output = self._experts(rows, counts)                      # [N, h]
        output = self.token_dispatcher.combine(expert_output, handle)        # [s*b, h|latent]
        if self.fc2_latent_proj is not None:
            output = self.fc2_latent_proj(output)                            # [s*b, h]
        output = output.view(seq_length, batch, hidden)                      # [s, b, h]
        if self.shared_experts is not None:
            output = output + (recomputed(self.shared_experts, hidden_states)
                               if self._recomputes_inside("shared_experts")
                               else self.shared_experts(hidden_states))
        return output, None

    def _experts(self, rows: torch.Tensor, counts) -> torch.Tensor:
        """The experts on their rows; with --recompute-modules moe_act, the activations'
        outputs are freed once used and recomputed in backward."""
        output = self.experts(rows, counts)
        if self.activation_checkpoint is not None and output.requires_grad:
            self.activation_checkpoint.discard(output)
        return output

    def _recomputes_inside(self, module: str) -> bool:
        """A part of this layer recomputed on its own (not when the whole layer is: ``moe``)."""
        return self.config.recomputes(module) and not self.config.recomputes("moe")

    def _wrap_activations(self) -> None:
        """--recompute-modules moe_act: every expert module's activation through one
        :class:`~megatron.model.recompute.OutputDiscardingCheckpoint`."""
        self.activation_checkpoint = None
        if not self._recomputes_inside("moe_act"):
            return
        for module in self.experts.modules():
            if hasattr(module, "activation_func"):
                if self.activation_checkpoint is None:
                    self.activation_checkpoint = OutputDiscardingCheckpoint(
                        module.activation_func)
                module.activation_func = self.activation_checkpoint


def _probs_on_input(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """``--moe-apply-probs-on-input``: each token ``[T, h]`` scaled by its one routing
    probability (top-1; the product in the wider dtype, then cast back), and the combine's
    probabilities made 1 where the token is routed, so the expert's output is not scaled
    again."""
    scale = probs.sum(dim=-1, keepdim=True)                                  # [T, 1]
    wide = torch.promote_types(tokens.dtype, scale.dtype)
    scaled = (tokens.to(wide) * scale.to(wide)).to(tokens.dtype)
    return scaled, routing_map.to(probs.dtype)

"""Multi-token prediction (``--mtp-num-layers``, DeepSeek-V3), as Megatron-Core builds it.

Depth K (0-based) predicts the token K + 2 places ahead. Its input is the hidden state the
previous depth produced (depth 0: the main model's, after its final norm) and the embedding of
the input tokens shifted left K + 1 places; each goes through its own norm, the two are
concatenated (embedding first) and projected back to the hidden size, then one transformer
layer and a final norm. The main model's output head turns the result into logits. Module and
parameter names follow Megatron-Core (``mtp.layers.K.enorm``, ``hnorm``, ``eh_proj``,
``transformer_layer``, ``final_layernorm``), so checkpoint keys map one to one.

Training loss: depth K's cross entropy against the labels shifted left K + 1 places, masked by
the loss mask shifted the same way (the vacated last places count as masked), averaged over
the unmasked tokens, times ``--mtp-loss-scaling-factor / --mtp-num-layers``. Like the MoE
auxiliary losses it is not added to the returned loss: it is attached to it
(:func:`~megatron.model.moe.tracker.attach_aux_loss`), so it reaches the gradients with the
main loss's scale (``backward_scale`` of :class:`MTPLossTracker`) and the logged ``lm loss``
stays the main head's. The unscaled per-depth values are logged as ``mtp_{K+1} loss``.

Sequence parallelism (``--sequence-parallel``): as in Megatron-Core, the hidden state and the
embedding enter a depth split along the sequence (``[s/tp, b, h]``), the projection gathers the
sequence, and its output, gathered over its hidden columns, is split along the sequence again
before the transformer layer; the norms' gradients are partial per tensor-parallel rank and
all-reduced like the decoder's. Token ids and labels stay whole on every tensor-parallel rank.
Context parallelism (``--context-parallel-size``): each rank holds chunks ``r`` and
``2 cp - 1 - r`` of every sequence, so the shift left crosses chunk boundaries: each chunk's
vacated last place takes the first token of the chunk after it in the whole sequence, wherever
that chunk lives (:func:`roll_left` with the cp group), as Megatron-Core's ``roll_tensor``
does. The loss of a depth is divided by the unmasked tokens of the whole cp group and scaled
by cp, as the main loss is, so a cp run trains as one process does.

``--mtp-use-repeated-layer``: one depth's module (``mtp.layers.0``) is built and applied
``--mtp-num-layers`` times, each application feeding the next, as Megatron-Core does.
``--mtp-detach-heads``: the MTP heads train on their loss without moving the main model: the
main model's hidden state and the shifted tokens' embedding enter them detached, and their
logits use a detached copy of the output weight; only the MTP layers' own parameters receive
the MTP loss's gradient (and are clipped by a gradient norm of their own).
``--mtp-hsm``: in training, each depth after the first takes a per-token random pick among the
earlier depths' hidden states (:mod:`~megatron.model.mtp_hsm`).
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.collectives import all_reduce, get_group_rank, get_group_size
from megatron.core.config import TransformerConfig
from megatron.core.parallel_state import ModelGroups
from megatron.core.utils import get_init_method
# mtp_hsm imports this module: its functions are looked up when called.
from megatron.model import mtp_hsm
from megatron.model.module import MegatronModule
from megatron.model.moe import MoEConfig, MoELossTracker
from megatron.model.norms import get_norm
from megatron.model.sequence_shift import roll_left, sequence_ends  # noqa: F401
from megatron.model.transformer import ParallelTransformerLayer
from megatron.model.utils import init_rng


# The gradient-norm group of detached MTP heads' parameters (Megatron-Core's name): the
# optimizer clips them by their own norm and leaves them out of the logged one.
MTP_GRAD_NORM_GROUP = "mtp"


class MTPLossTracker:
    """The per-depth MTP losses of an iteration (summed over micro-batches) and the gradient
    scale of the attached losses (set by the training loop, as for the MoE trackers)."""

    def __init__(self, num_depths: int):
        self.num_depths = num_depths
        self.backward_scale = 1.0
        self.values: Optional[torch.Tensor] = None

    def record(self, depth: int, value: torch.Tensor) -> None:
        if self.values is None:
            self.values = torch.zeros(self.num_depths, dtype=torch.float64, device=value.device)
        self.values[depth] += value.detach().to(torch.float64)

    def report(self, num_microbatches: int = 1, group=None) -> Dict[str, float]:
        """``{"mtp_1 loss": ...}``: per depth, the mean over micro-batches, averaged over
        ``group`` (the data x context-parallel ranks; every rank must call it). Clears."""
        if self.values is None:
            return {}
        values = all_reduce(self.values.clone(), group) / get_group_size(group)
        self.values = None
        return {f"mtp_{k + 1} loss": float(v) / num_microbatches
                for k, v in enumerate(values.tolist())}


def mtp_moe_config(moe_config: Optional[MoEConfig], num_layers: int) -> Optional[MoEConfig]:
    """The MoE settings of the MTP layers: Megatron-Core gives them the last decoder layer's
    kind, MoE or dense."""
    if moe_config is None or not moe_config.is_moe_layer(num_layers):
        return None
    return dataclasses.replace(moe_config, moe_layer_freq=1)


class MultiTokenPredictionLayer(MegatronModule):
    """One depth: ``[s, b, h]`` hidden and embedded shifted tokens -> ``[s, b, h]``.

    Args:
        config: the transformer config.
        groups: the model's process groups (sequence parallelism: the inputs and the output
            are ``[s/tp, b, h]``).
        depth: 0-based depth; its transformer layer is global layer ``num_layers + depth + 1``
            (MoE logging, initialisation seeds).
        moe_config / moe_tracker: see :func:`mtp_moe_config`.
        init_seed: the model's initialisation seed.
    """

    def __init__(self, config: TransformerConfig, groups: ModelGroups, depth: int,
                 moe_config: Optional[MoEConfig] = None,
                 moe_tracker: Optional[MoELossTracker] = None, init_seed: int = 1234):
        super().__init__(config)
        sp = self.sequence_parallel = groups.sequence_parallel
        self.tp_group = groups.tp_group
        with init_rng(init_seed, f"mtp.{depth}"):
            self.enorm = get_norm(config, sp)
            self.hnorm = get_norm(config, sp)
            self.eh_proj = tensor_parallel.ColumnParallelLinear(
                2 * config.hidden_size, config.hidden_size, init_method=get_init_method(config),
                tp_group=groups.tp_group, bias=False, gather_output=not sp,
                sequence_parallel=sp, params_dtype=config.params_dtype)
            self.final_layernorm = get_norm(config, sp)
        with init_rng(init_seed, f"layer.{config.num_layers + depth}"):
            self.transformer_layer = ParallelTransformerLayer(
                config, config.num_layers + depth + 1, groups, moe_config=moe_config,
                moe_tracker=moe_tracker, init_seed=init_seed)

    def forward(self, hidden_states: torch.Tensor, embedded: torch.Tensor,
                attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        both = torch.cat([self.enorm(embedded), self.hnorm(hidden_states)], dim=-1)  # [s, b, 2h]
        projected, _ = self.eh_proj(both)                                            # [s, b, h]
        if self.sequence_parallel:   # both [s/tp, b, 2h]; projected [s, b, h/tp]
            projected = tensor_parallel.gather_from_tensor_model_parallel_region(
                projected, self.tp_group)                                            # [s, b, h]
            projected = tensor_parallel.scatter_to_sequence_parallel_region(
                projected, self.tp_group)                                            # [s/tp, b, h]
        output = self.transformer_layer(projected, attention_mask, rotary_pos_emb)   # [s, b, h]
        return self.final_layernorm(output)


class MultiTokenPredictionBlock(MegatronModule):
    """``--mtp-num-layers`` depths, run one after the other (module name ``layers``).

    Args:
        repeated_layer: ``--mtp-use-repeated-layer``: build one depth and apply it
            ``num_depths`` times.
        detach_heads: ``--mtp-detach-heads``: the main model's hidden state and the embedded
            tokens enter detached; the parameters are tagged ``grad_norm_group = "mtp"``.
        hidden_state_mixing: ``--mtp-hsm`` (:mod:`~megatron.model.mtp_hsm`; needs
            ``num_depths >= 2``). Its RNG stream is created here when the streams are seeded.
    """

    def __init__(self, config: TransformerConfig, groups: ModelGroups, num_depths: int,
                 moe_config: Optional[MoEConfig] = None,
                 moe_tracker: Optional[MoELossTracker] = None, init_seed: int = 1234,
                 repeated_layer: bool = False, detach_heads: bool = False,
                 hidden_state_mixing: bool = False):
        super().__init__(config)
        if hidden_state_mixing and num_depths < 2:
            raise ValueError(f"--mtp-hsm needs --mtp-num-layers >= 2, got {num_depths}")
        self.num_depths = num_depths
        self.repeated_layer = repeated_layer
        self.detach_heads = detach_heads
        self.cp_group = groups.cp_group
        self.sp_group = groups.tp_group if groups.sequence_parallel else None
        self.hidden_state_mixing = hidden_state_mixing
        self.hsm_seed = None
        if hidden_state_mixing:
            self.hsm_seed = mtp_hsm.hsm_seed(get_group_rank(groups.dp_group))
            mtp_hsm.add_hsm_stream(self.hsm_seed)
        layer_moe = mtp_moe_config(moe_config, config.num_layers)
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, groups, k, layer_moe, moe_tracker, init_seed)
            for k in range(1 if repeated_layer else num_depths))
        if detach_heads:
            for param in self.parameters():
                param.grad_norm_group = MTP_GRAD_NORM_GROUP

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor], embedding,
                ends: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Each depth's output ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism);
        ``input_ids`` / ``position_ids`` ``[b, s]`` are the main model's (this cp rank's
        tokens), ``embedding`` its embedding (its output split like ``hidden_states``);
        ``ends``: the last places of packed sequences (:func:`sequence_ends`), or None."""
        outputs = []
        if self.detach_heads:
            hidden_states = hidden_states.detach()
        mixing = self.hidden_state_mixing and self.training
        history = [hidden_states]
        for depth in range(self.num_depths):
            layer = self.layers[0 if self.repeated_layer else depth]
            input_ids = roll_left(input_ids, self.cp_group, ends)
            if position_ids is not None:
                position_ids = roll_left(position_ids, self.cp_group, ends)
            embedded = embedding(input_ids, position_ids)                    # [s, b, h]
            if self.detach_heads:
                embedded = embedded.detach()
            layer_input = hidden_states
            if mixing and depth > 0:
                history, layer_input = self._mix(history, ends)
            hidden_states = layer(layer_input, embedded, attention_mask, rotary_pos_emb)
            outputs.append(hidden_states)
            history.append(hidden_states)
        return outputs

    def _mix(self, history: List[torch.Tensor], ends: Optional[torch.Tensor]):
        """``(history with its older entries shifted, the mixed input [s, b, h])``."""
        older = mtp_hsm.roll_history(torch.stack(history[:-1]), self.cp_group, ends,
                                     self.sp_group)                          # [n, s, b, h]
        newest = history[-1]                                                 # [s, b, h]
        owners, owner = mtp_hsm.sequence_owner(self.sp_group, self.cp_group)
        picks = mtp_hsm.draw_picks(len(history), newest.size(0), newest.size(1), owners,
                                   owner, self.hsm_seed, newest.device)      # [s, b]
        return (list(older.unbind(0)) + [newest],
                mtp_hsm.mix_hidden_states(older, newest, picks))

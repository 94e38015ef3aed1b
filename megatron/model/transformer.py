"""Pre-norm transformer layers on tensor- and sequence-parallel linear layers.

Activations are ``[s, b, h]``. With sequence parallelism they are ``[s/tp, b, h]`` between the
tensor-parallel regions: norms and dropouts work on this rank's slice of the sequence, the
column-parallel projections all-gather it on the way in and the row-parallel ones reduce-scatter
on the way out, in place of tensor parallelism's two all-reduces per layer.

Each layer is built inside an RNG fork seeded from its global layer number
(:func:`megatron.model.utils.init_rng`), so a layer has the same weights whichever pipeline
stage builds it.
"""

import contextlib
from typing import Callable, Optional, Tuple

import torch

from megatron.core import tensor_parallel
from megatron.core.collectives import get_group_size
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.heterogeneous import BlockConfig, layer_config
from megatron.core.pipeline_parallel.layer_layout import stage_layer_counts, stage_offset
from megatron.core.parallel_state import ModelGroups
from megatron.core.utils import get_init_method, get_output_layer_init_method
from megatron.fused_kernels.bias_dropout_add import get_bias_dropout_add_func
from megatron.fused_kernels.bias_gelu import bias_gelu_impl, bias_gelu_unfused
from megatron.fused_kernels.swiglu import bias_swiglu_impl, bias_swiglu_unfused
from megatron.model.activation_offload import HostActivationStash
from megatron.model.attention import ParallelAttention, dropout_rng_context
from megatron.model.gated_delta_net import GatedDeltaNet, is_gdn, linear_attention_pattern
from megatron.model.linear_replacement import LinearReplacement
from megatron.model.multi_latent_attention import MultiLatentAttention
from megatron.model.enums import AttnMaskType
from megatron.model.hyper_connection import (HyperConnection, MHCRecomputeGroup,
                                             contract_streams, expand_streams)
from megatron.model.module import MegatronModule
from megatron.model.moe import MoEConfig, MoELayer, MoELossTracker
from megatron.model.norms import get_norm
from megatron.model.recompute import OutputDiscardingCheckpoint, recomputed
from megatron.model.utils import (glu_activation, init_rng, openai_gelu, plain_swiglu,
                                  squared_relu)


def _bias_activation(config: TransformerConfig) -> Callable:
    """``(input, bias or None) -> activation(input + bias)`` as the flags select it."""
    if config.gated_linear_unit and not plain_swiglu(config):
        glu = glu_activation(config)
        return lambda x, bias: glu(x if bias is None else x + bias)
    if config.swiglu:
        fused = config.bias_swiglu_fusion
        return bias_swiglu_impl if fused else bias_swiglu_unfused
    if config.openai_gelu:
        return lambda x, bias: openai_gelu(x if bias is None else x + bias)
    if config.squared_relu:
        # As in Megatron, the GeLU fusion does not apply: the bias is added, then relu(x)^2.
        return lambda x, bias: squared_relu(x if bias is None else x + bias)
    return bias_gelu_impl if config.bias_gelu_fusion else bias_gelu_unfused


class ParallelMLP(MegatronModule):
    """``dense_h_to_4h`` (column-parallel), GeLU, squared ReLU, SwiGLU or quick GeGLU,
    ``dense_4h_to_h`` (row-parallel).

    With a gated unit (SwiGLU, quick GeGLU) ``dense_h_to_4h`` has ``2 * ffn`` outputs: the full weight is ``[gate; value]``
    and is split with stride 2, so each rank holds ``[gate_r; value_r]`` and the model is the same
    under any tensor-parallel size. With a ``weight_shard_group`` both weights are kept as this
    rank's block of rows (:mod:`megatron.core.tensor_parallel.weight_shards`).
    """

    def __init__(self, config: TransformerConfig, tp_group, sequence_parallel: bool,
                 init_method, output_layer_init_method, weight_shard_group=None):
        super().__init__(config)
        ffn = config.ffn_hidden_size
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, 2 * ffn if config.gated_linear_unit else ffn,
            init_method=init_method,
            tp_group=tp_group, bias=config.add_bias_linear, gather_output=False,
            skip_bias_add=True, sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype, stride=2 if config.gated_linear_unit else 1,
            weight_shard_group=weight_shard_group)
        self.activation_func = _bias_activation(config)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            ffn, config.hidden_size, init_method=output_layer_init_method, tp_group=tp_group,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=sequence_parallel, params_dtype=config.params_dtype,
            weight_shard_group=weight_shard_group)

    def forward(self, hidden_states: torch.Tensor):
        """``[s, b, h]`` -> (output ``[s, b, h]``, unadded bias); ``s/tp`` with sequence
        parallelism."""
        intermediate, bias = self.dense_h_to_4h(hidden_states)   # [s, b, (2*)ffn/tp]
        intermediate = self.activation_func(intermediate, bias)  # [s, b, ffn/tp]
        return self.dense_4h_to_h(intermediate)


def is_linear_attention_layer(config: TransformerConfig, layer_number: int) -> bool:
    """Whether the 1-based global ``layer_number`` is a gated delta net layer."""
    if not is_gdn(config.experimental_attention_variant) or layer_number > config.num_layers:
        return False
    pattern = linear_attention_pattern(config.linear_attention_freq, config.num_layers)
    return pattern[layer_number - 1] == 1


class ParallelTransformerLayer(MegatronModule):
    """norm -> self-attention -> bias-dropout-add -> norm -> MLP -> bias-dropout-add.

    On the MoE layers of an MoE model (``moe_config.is_moe_layer``) the MLP is a
    :class:`~megatron.model.moe.MoELayer` (``mlp.router``, ``mlp.experts.local_experts.N``),
    its experts split over the expert-tensor-parallel group (by default the tensor-parallel
    group, Megatron-Core's default) and dealt over the expert-parallel group.
    Under sequence parallelism, when the experts are split over the tensor-parallel group, the
    MoE layer sees the whole sequence: its input is all-gathered over the tensor-parallel ranks
    and its output cut back to this rank's slice. Every rank then routes the same tokens and
    computes the same router gradient, so the gather's backward only takes this rank's slice
    (no reduce-scatter) and the router needs no gradient all-reduce. With an expert-TP size
    other than TP each rank routes its own tokens (its slice, under sequence parallelism) and
    the MoE layer gathers the dispatched rows over the expert-TP group itself.

    Args:
        config: the transformer config.
        layer_number: 1-based global layer number.
        groups: the process groups and sequence parallelism
            (:class:`~megatron.core.parallel_state.ModelGroups`); activations are ``[s/tp, b, h]``
            under sequence parallelism.
        self_attn_mask_type: ``causal`` (GPT) or ``padding`` (BERT's bidirectional attention).
        moe_config: the MoE settings (None: dense MLPs).
        moe_tracker: the model's auxiliary-loss tracker, shared by its MoE layers.
        init_seed: the model's initialisation seed (the MoE layer's own seeds derive from it).
        block: this layer's block of a heterogeneous model (:mod:`megatron.core.heterogeneous`;
            ``config`` then already holds its query groups and MLP size), or None.
        hyper_connections: read and write ``--mhc-num-residual-streams`` residual streams
            through ``self_attention_hyper_connection`` and ``mlp_hyper_connection``
            (:mod:`megatron.model.hyper_connection`); the layer maps ``[s, b, n*h]`` to itself.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, groups: ModelGroups,
                 self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 moe_config: Optional[MoEConfig] = None,
                 moe_tracker: Optional[MoELossTracker] = None, init_seed: int = 1234,
                 block: Optional[BlockConfig] = None, hyper_connections: bool = False):
        super().__init__(config)
        tp_group, tp_size = groups.tp_group, groups.tp_size
        sequence_parallel = groups.sequence_parallel
        self.layer_number = layer_number
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        self.apply_residual_connection_post_layernorm = (
            config.apply_residual_connection_post_layernorm)
        init_method = get_init_method(config)
        output_init = get_output_layer_init_method(config)
        self.block = block
        attention, mlp = ((block.attention, block.mlp) if block is not None
                          else (None, None))
        # A no-op half has neither norm nor module: the layer's input passes it unchanged.
        self.attention_no_op = attention is not None and attention.no_op
        self.mlp_no_op = mlp is not None and mlp.no_op
        if not self.attention_no_op:
            self.input_layernorm = get_norm(config, sequence_parallel)
        if self.attention_no_op:
            self.self_attention = None
        elif attention is not None and attention.replace_with_linear:
            self.self_attention = LinearReplacement(config, tp_group, sequence_parallel,
                                                    init_method)
        elif is_linear_attention_layer(config, layer_number):
            self.self_attention = GatedDeltaNet(config, layer_number, tp_group, tp_size,
                                                sequence_parallel, init_method, output_init)
        else:
            attention_cls = (MultiLatentAttention if config.multi_latent_attention
                             else ParallelAttention)
            self.self_attention = attention_cls(
                config, layer_number, tp_group, tp_size, sequence_parallel, init_method,
                output_init, self_attn_mask_type, cp_group=groups.cp_group,
                hierarchical_cp_groups=groups.hierarchical_cp_groups,
                **({} if config.multi_latent_attention
                   else {"weight_shard_group": groups.weight_shard_group}))
        if not self.mlp_no_op:
            self.post_attention_layernorm = get_norm(config, sequence_parallel)
        self.tp_group = tp_group
        self.moe_sequence_gather = self.moe_forward_only = False
        if self.mlp_no_op:
            self.mlp = None
        elif mlp is not None and mlp.replace_with_linear:
            self.mlp = LinearReplacement(config, tp_group, sequence_parallel, init_method)
        elif moe_config is not None and moe_config.is_moe_layer(layer_number):
            expert_tp_group = tp_group if groups.expert_tp_group is None else groups.expert_tp_group
            # Both groups are blocks of consecutive ranks: the same size means the same group.
            shares_tokens = get_group_size(expert_tp_group) == tp_size
            # Without sequence parallelism the tensor-parallel ranks then route the same tokens
            # as if they were their own: right for a forward (generation turns sequence
            # parallelism off), but the experts' gradients would count each token tp times.
            self.moe_forward_only = not shares_tokens and tp_size > 1 and not sequence_parallel
            self.mlp = MoELayer(config, moe_config, layer_number, ep_group=groups.ep_group,
                                expert_tp_group=expert_tp_group, tp_group=tp_group,
                                tracker=moe_tracker, init_seed=init_seed,
                                cp_group=groups.cp_group, dp_group=groups.dp_group,
                                expert_tp_shares_tokens=shares_tokens,
                                sequence_parallel=sequence_parallel and not shares_tokens,
                                expert_weight_shard_group=groups.expert_weight_shard_group)
            self.moe_sequence_gather = sequence_parallel and tp_size > 1 and shares_tokens
        else:
            self.mlp = ParallelMLP(config, tp_group, sequence_parallel, init_method, output_init,
                                   weight_shard_group=groups.weight_shard_group)
        # --recompute-modules: the MLP or MoE block whole; the two norms' outputs.
        self.recompute_mlp = self.mlp is not None and config.recomputes(
            "moe" if isinstance(self.mlp, MoELayer) else "mlp")
        self.norm_checkpoints = None
        if config.recomputes("layernorm"):
            self.norm_checkpoints = (OutputDiscardingCheckpoint(self.input_layernorm),
                                     OutputDiscardingCheckpoint(self.post_attention_layernorm))
        self.hyper_connections = hyper_connections
        if hyper_connections:
            # Built last, so the other weights draw what they draw without hyper-connections.
            def site():
                return HyperConnection(config.hidden_size, config.mhc_num_residual_streams,
                                       config.mhc_sinkhorn_iterations,
                                       config.mhc_init_gating_factor, config.params_dtype,
                                       sequence_parallel)
            self.self_attention_hyper_connection = site()
            self.mlp_hyper_connection = site()

    def _run_mlp(self, hidden_states: torch.Tensor):
        if self.recompute_mlp:
            return recomputed(self.mlp, hidden_states)
        chunks = min(self.config.mlp_chunks_for_training, hidden_states.size(0))
        if chunks > 1 and self.training:
            # --mlp-chunks-for-training, as Megatron-Core: pieces of the sequence dimension in
            # turn, the outputs concatenated, the bias (one vector) taken from the first.
            outputs = [self.mlp(piece) for piece in hidden_states.chunk(chunks, dim=0)]
            return torch.cat([out for out, _ in outputs], dim=0), outputs[0][1]
        return self.mlp(hidden_states)

    def _norm(self, which: int, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.norm_checkpoints is not None:
            return self.norm_checkpoints[which](hidden_states)
        norm = self.post_attention_layernorm if which else self.input_layernorm
        return norm(hidden_states)

    def _discard_norm(self, which: int, hook_tensor: torch.Tensor) -> None:
        if self.norm_checkpoints is not None:
            self.norm_checkpoints[which].discard(hook_tensor)

    def _mlp(self, ln_output: torch.Tensor):
        if self.moe_forward_only and torch.is_grad_enabled():
            raise ConfigError(
                f"training an MoE layer whose experts are split over other ranks than the "
                f"tensor-parallel ones (--expert-tensor-parallel-size "
                f"{get_group_size(self.mlp.expert_tp_group)}, --tensor-model-parallel-size "
                f"{get_group_size(self.tp_group)}) needs --sequence-parallel")
        if not self.moe_sequence_gather:
            return self._run_mlp(ln_output)
        whole = tensor_parallel.gather_from_sequence_parallel_region(
            ln_output, self.tp_group, tensor_parallel_output_grad=False)     # [s, b, h]
        output, bias = self._run_mlp(whole)                                  # [s, b, h]
        return tensor_parallel.scatter_to_sequence_parallel_region(output, self.tp_group), bias

    def _bias_dropout_add(self, x, bias, residual):
        fn = get_bias_dropout_add_func(self.config.bias_dropout_fusion, self.training)
        # Under sequence parallelism each rank drops out its own slice of the sequence, so the
        # masks must differ across ranks: draw them from the tensor-parallel stream.
        active = self.sequence_parallel and self.training and self.hidden_dropout > 0
        with dropout_rng_context(active):
            return fn(x, bias, residual, self.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor] = None,
                inference_params=None, mhc_group: Optional[MHCRecomputeGroup] = None,
                mhc_group_end: bool = False) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism);
        ``[s, b, n*h]`` with hyper-connections.

        ``inference_params``: the key/value cache of a generation (see
        :meth:`ParallelAttention.forward`), or None. ``mhc_group``: the recompute group of the
        hyper-connections' reads and writes (``--recompute-modules mhc``), closed by this
        layer's last write when ``mhc_group_end``.
        """
        if self.hyper_connections:
            return self._forward_mhc(hidden_states, attention_mask, rotary_pos_emb,
                                     inference_params, mhc_group, mhc_group_end)
        ln_input = hidden_states
        if not self.attention_no_op:
            ln_output = self._norm(0, hidden_states)
            attn_output, attn_bias = self.self_attention(ln_output, attention_mask,
                                                         rotary_pos_emb,
                                                         inference_params=inference_params)
            residual = (ln_output if self.apply_residual_connection_post_layernorm
                        else hidden_states)
            ln_input = self._bias_dropout_add(attn_output, attn_bias, residual)
            self._discard_norm(0, ln_input)
        if self.mlp_no_op:
            return ln_input
        ln_output = self._norm(1, ln_input)
        mlp_output, mlp_bias = self._mlp(ln_output)
        residual = ln_output if self.apply_residual_connection_post_layernorm else ln_input
        output = self._bias_dropout_add(mlp_output, mlp_bias, residual)
        self._discard_norm(1, output)
        return output

    def _mhc_site(self, which: int, hidden_states, sublayer: Callable, group, last: bool):
        """Read the streams, norm, run ``sublayer``, write the streams back."""
        hc = (self.self_attention_hyper_connection, self.mlp_hyper_connection)[which]
        h_pre, h_post, h_res = hc.compute_mappings(hidden_states)
        if group is None:
            layer_input = hc.aggregate(hidden_states, h_pre)                 # [s, b, h]
        else:
            layer_input = group(hc.aggregate, hidden_states, h_pre)
        ln_output = self._norm(which, layer_input)
        out, bias = sublayer(ln_output)
        bda = self._bias_dropout_add

        def write(h_res, residual, h_post, out, *bias):
            return hc.combine(h_res, residual, h_post, out, bias[0] if bias else None, bda)
        args = (h_res, hidden_states, h_post, out) + (() if bias is None else (bias,))
        output = write(*args) if group is None or last else group(write, *args)
        self._discard_norm(which, output)
        return output                                                        # [s, b, n*h]

    def _forward_mhc(self, hidden_states, attention_mask, rotary_pos_emb, inference_params,
                     group, group_end):
        def attention(ln_output):
            return self.self_attention(ln_output, attention_mask, rotary_pos_emb,
                                       inference_params=inference_params)
        hidden_states = self._mhc_site(0, hidden_states, attention, group, False)
        output = self._mhc_site(1, hidden_states, self._mlp, group, group_end)
        if group is not None and group_end:
            group.close(output)
        return output


def get_num_layers_and_offset(config: TransformerConfig, pp_size: int, pp_rank: int,
                              vp_size: Optional[int] = None,
                              vp_rank: Optional[int] = None) -> Tuple[int, int]:
    """Number of layers of this (virtual) pipeline stage and the global index of its first.

    Without virtual stages, stage ``p`` holds layers ``[p L/pp, (p+1) L/pp)``. With ``vp``
    virtual stages (interleaving), the layers are cut into ``pp * vp`` chunks of
    ``L / (pp * vp)``, dealt round-robin: chunk ``v`` of stage ``p`` starts at layer
    ``v * L / vp + p * L / (pp * vp)``. E.g. 8 layers, pp 2, vp 2: stage 0 holds layers 0-1
    and 4-5, stage 1 holds 2-3 and 6-7. A pipeline layout or the embedding / loss counted as
    layers change the counts, not the order (see :mod:`megatron.core.pipeline_parallel.
    layer_layout`).
    """
    first, last = config.first_pipeline_num_layers, config.last_pipeline_num_layers
    if vp_size is not None and (first is not None or last is not None):
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                          "--num-layers-per-virtual-pipeline-stage")
    # getattr: converters and tests pass a stand-in holding only the split they know.
    counts = stage_layer_counts(
        config.num_layers, pp_size, vp_size,
        layout=getattr(config, "pipeline_model_parallel_layout", None),
        account_embedding=getattr(config, "account_for_embedding_in_pipeline_split", False),
        account_loss=getattr(config, "account_for_loss_in_pipeline_split", False),
        first=first, last=last)
    if len(counts[pp_rank]) != (vp_size or 1):
        raise ConfigError(f"the pipeline layout has {len(counts[pp_rank])} virtual stages per "
                          f"rank, the run {vp_size or 1}")
    vp_rank = vp_rank or 0
    return counts[pp_rank][vp_rank], stage_offset(counts, pp_rank, vp_rank)


class ParallelTransformer(MegatronModule):
    """The layers of one (virtual) pipeline stage, plus the final norm on the last stage.

    Args:
        config: the transformer config.
        groups: the process groups and sequence parallelism (see
            :class:`ParallelTransformerLayer`).
        num_layers: layers on this stage.
        layer_offset: global index of this stage's first layer.
        pre_process: this is the first stage (input comes from the embedding, not
            :meth:`set_input_tensor`).
        post_process: this is the last stage (apply ``final_layernorm``).
        init_seed: seed the per-layer initialisation seeds derive from.
        self_attn_mask_type: ``causal`` (GPT) or ``padding`` (BERT's bidirectional attention).
        moe_config / moe_tracker: see :class:`ParallelTransformerLayer`.
    """

    def __init__(self, config: TransformerConfig, groups: ModelGroups, num_layers: int,
                 layer_offset: int, pre_process: bool = True, post_process: bool = True,
                 init_seed: int = 1234, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 moe_config: Optional[MoEConfig] = None,
                 moe_tracker: Optional[MoELossTracker] = None):
        super().__init__(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.num_layers = num_layers
        self.layer_offset = layer_offset
        self.input_tensor = None
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        # As Megatron: nothing to distribute when sequence parallelism already splits the input.
        self.distribute_saved_activations = (config.distribute_saved_activations
                                             and groups.tp_size > 1
                                             and not groups.sequence_parallel)
        self.tp_group = groups.tp_group
        layers = []
        blocks = config.heterogeneous_blocks
        for i in range(num_layers):
            number = layer_offset + i + 1
            with init_rng(init_seed, f"layer.{layer_offset + i}"):
                layers.append(ParallelTransformerLayer(
                    layer_config(config, blocks, number), number, groups, self_attn_mask_type,
                    moe_config, moe_tracker, init_seed,
                    block=blocks[number - 1] if blocks else None,
                    hyper_connections=config.enable_mhc_connections))
        self.layers = torch.nn.ModuleList(layers)
        self.activation_stash = HostActivationStash(
            retain_buffers=config.cpu_offloading_retain_pinned_cpu_buffers)
        if post_process:
            with init_rng(init_seed, "final_norm"):
                self.final_layernorm = get_norm(config, groups.sequence_parallel)

    def set_input_tensor(self, input_tensor) -> None:
        """Input of a stage that is not the first: the previous stage's output."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"expected one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _run_layers(self, start: int, end: int, hidden_states, attention_mask, rotary_pos_emb,
                    inference_params=None):
        recompute_mhc = (self.config.enable_mhc_connections and self.config.recomputes("mhc")
                         and torch.is_grad_enabled() and inference_params is None)
        size = self.config.mhc_recompute_layer_num or self.num_layers
        group = None
        for i in range(start, end):
            layer = self.layers[i]
            kwargs = {}
            if recompute_mhc:
                group = group or MHCRecomputeGroup()
                end_of_group = (i + 1) % size == 0 or i == self.num_layers - 1
                kwargs = {"mhc_group": group, "mhc_group_end": end_of_group}
            with self._offload_context(layer, inference_params):
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb,
                                      inference_params=inference_params, **kwargs)
            if kwargs and kwargs["mhc_group_end"]:
                group = None
        return hidden_states

    def _offload_context(self, layer, inference_params):
        """The host stash for a layer among the first ``--cpu-offloading-num-layers`` (global
        numbering) while training, else nothing."""
        if (layer.layer_number > self.config.cpu_offloading_num_layers
                or inference_params is not None or not torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return self.activation_stash

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        """Full recomputation: keep only the inputs of checkpointed chunks of layers.

        ``uniform``: every chunk of ``--recompute-num-layers`` consecutive layers is one
        checkpoint. ``block``: the first ``--recompute-num-layers`` layers of the stage are
        checkpointed one by one, the rest run normally. With --distribute-saved-activations
        each tensor-parallel rank keeps only its 1/tp share of every chunk's input.
        """
        def chunk(start, end):
            def custom_forward(x):
                return self._run_layers(start, end, x, attention_mask, rotary_pos_emb)
            return custom_forward

        def checkpointed(function, x):
            return tensor_parallel.checkpoint(function, self.distribute_saved_activations, x,
                                              tp_group=self.tp_group)

        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            for start in range(0, self.num_layers, n):
                hidden_states = checkpointed(chunk(start, start + n), hidden_states)
            return hidden_states
        for i in range(self.num_layers):
            if i < n:
                hidden_states = checkpointed(chunk(i, i + 1), hidden_states)
            else:
                hidden_states = self._run_layers(i, i + 1, hidden_states, attention_mask,
                                                 rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor] = None,
                inference_params=None) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> same shape.

        With hyper-connections the first stage widens its input to ``[s, b, n*h]``, stages
        pass that on, and the last stage averages the streams back before the final norm.
        ``inference_params``: the key/value cache of a generation, or None. Generation keeps
        no activations for backward, so it never recomputes.
        """
        if not self.pre_process:
            hidden_states = self.input_tensor
        elif self.config.enable_mhc_connections:
            hidden_states = expand_streams(hidden_states, self.config.mhc_num_residual_streams)
        if (self.recompute_granularity == "full" and torch.is_grad_enabled()
                and inference_params is None):
            hidden_states = self._checkpointed_forward(hidden_states, attention_mask,
                                                       rotary_pos_emb)
        else:
            hidden_states = self._run_layers(0, self.num_layers, hidden_states, attention_mask,
                                             rotary_pos_emb, inference_params)
        if self.num_layers == 0 and not self.pre_process and not self.post_process:
            # An empty virtual stage (--standalone-embedding-stage): a copy, so that its output
            # has a graph of its own and freeing it after the send leaves the input alone.
            hidden_states = hidden_states.clone()
        if self.post_process:
            if self.config.enable_mhc_connections:
                hidden_states = contract_streams(hidden_states,
                                                 self.config.mhc_num_residual_streams)
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

"""GPT: the language model of one pipeline stage, with the LM head and loss on the last stage."""

from collections import OrderedDict
from typing import Optional

import torch

from megatron.core import config_logger, tensor_parallel
from megatron.core.collectives import all_reduce, get_group_size
from megatron.core.config import TransformerConfig
from megatron.core.parallel_state import ModelGroups
from megatron.fused_kernels import ops as fused_ops
from megatron.model.attention import dropout_rng_context
from megatron.model.dsa import attach_dsa_tracker
from megatron.model.language_model import (TransformerLanguageModel, parallel_lm_logits,
                                           scale_embedding_output,
                                           tie_word_embeddings_over_stages)
from megatron.model.module import MegatronModule
from megatron.model.moe import MoEConfig, MoELossTracker, attach_aux_loss
from megatron.model.multi_token_prediction import (MTPLossTracker, MultiTokenPredictionBlock,
                                                   roll_left, sequence_ends)
from megatron.model.transformer import get_num_layers_and_offset


class GPTModel(MegatronModule):
    """Megatron's GPT on tensor-, sequence- and pipeline-parallel layers.

    Args:
        config: the transformer config.
        pstate: this rank's :class:`~megatron.core.parallel_state.ParallelState` (or any object
            with ``tp_group``, ``tp_size``, ``pp_size``, ``pp_rank``, ``virtual_pp_size``,
            ``virtual_pp_rank``); the virtual rank is read once, here.
        pre_process: this is the first (virtual) stage: it owns the embedding.
        post_process: this is the last (virtual) stage: final norm, LM head, loss.
        parallel_output: return logits split over the vocabulary (``[b, s, V/tp]``); otherwise
            gather them to ``[b, s, V]``. The loss is always computed on the split logits.
        init_seed: the seed every piece's initialisation derives from; the same seed gives the
            same model under any TP / PP split.
        sequence_parallel: ``--sequence-parallel``; None (the default) takes the layout's
            (``pstate.sequence_parallel``).
        moe_config: the MoE settings (``--num-experts`` ...), or None for dense MLPs. An MoE
            model keeps its auxiliary-loss tracker in ``moe_tracker`` (the training loop sets
            its gradient scale and logs it).
        mtp_num_layers: ``--mtp-num-layers``: multi-token prediction depths after the last
            layer (:mod:`~megatron.model.multi_token_prediction`), in ``mtp``; their losses go
            through ``mtp_tracker``. With pipeline parallelism they sit on the last stage, as
            Megatron-Core places them; a last stage without the embedding then reads the
            input tokens too and keeps ``word_embeddings_for_head`` even with untied
            embeddings (a copy of the input table, kept in step like the tied one).
        mtp_loss_scaling_factor: ``--mtp-loss-scaling-factor``.
        mtp_use_repeated_layer / mtp_detach_heads / mtp_hsm: ``--mtp-use-repeated-layer``,
            ``--mtp-detach-heads``, ``--mtp-hsm`` (see :class:`MultiTokenPredictionBlock`);
            detached heads also read a detached output weight.
        mtp_standalone / mtp_stage: Megatron's standalone MTP stage (the layout's ``m``
            letters in a stage before the loss's): ``mtp_standalone`` says the run has one,
            ``mtp_stage`` that this stage is it. That stage applies the final norm and the
            MTP layers after its decoder layers and returns the main and the K MTP hidden
            states concatenated along the sequence, ``[(1+K)s, b, h]``; the loss stage
            (``post_process``) splits them, applies the output layer to each and computes
            the main and the MTP losses. Without the embedding the MTP stage keeps a copy,
            ``word_embeddings_for_head``, summed with the first stage's over the embedding
            group (which then holds the MTP stage's rank).

    With context parallelism (``pstate.cp_group`` of more than one rank) every ``[b, s]`` input
    holds this rank's ``s / cp`` tokens of each sequence and the loss is per local token.

    With tied embeddings (the default) and more than one pipeline stage, a last stage that has no
    embedding keeps ``word_embeddings_for_head``, a ``[V/tp, h]`` copy initialised exactly like
    the first stage's word embeddings; the pipeline code keeps the two in step (their gradients
    are summed over the embedding group).

    With ``config.config_logger_dir`` (--config-logger-dir) the model writes its constructor
    arguments, initial weights and every LM-head forward's inputs and logits there, under
    Megatron's file names (:mod:`megatron.core.config_logger`).
    """

    def __init__(self, config: TransformerConfig, pstate, pre_process: bool = True,
                 post_process: bool = True, parallel_output: bool = True,
                 init_seed: int = 1234, sequence_parallel: Optional[bool] = None,
                 moe_config: Optional[MoEConfig] = None, mtp_num_layers: Optional[int] = None,
                 mtp_loss_scaling_factor: float = 0.1, mtp_use_repeated_layer: bool = False,
                 mtp_detach_heads: bool = False, mtp_hsm: bool = False,
                 mtp_standalone: bool = False, mtp_stage: bool = False):
        super().__init__(config)
        if config.config_logger_dir:
            self._logger_ranks = config_logger.rank_string(pstate)
            config_logger.log_config_to_disk(
                config.config_logger_dir, config_logger.constructor_arguments(locals()),
                type(self).__name__, self._logger_ranks)
        config.check_splittable(pstate.tp_size, pstate.pp_size)
        if (mtp_num_layers and pstate.pp_size > 1
                and config.position_embedding_type == "learned_absolute"):
            raise ValueError("--mtp-num-layers with --pipeline-model-parallel-size > 1 needs "
                             "--position-embedding-type rope, yarn or none (learned absolute "
                             "positions would need a copy on the last stage)")
        groups = ModelGroups.of(pstate, sequence_parallel)
        self.tp_group = pstate.tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        self.sequence_parallel = groups.sequence_parallel
        self.fp16_lm_cross_entropy = config.fp16_lm_cross_entropy
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        vp_size = getattr(pstate, "virtual_pp_size", None)
        vp_rank = getattr(pstate, "virtual_pp_rank", None) if vp_size is not None else None
        num_layers, offset = get_num_layers_and_offset(config, pstate.pp_size, pstate.pp_rank,
                                                       vp_size, vp_rank)
        self.moe_tracker = None
        # Kept whole on every stage: the checkpoint layout follows --moe-layer-freq even on a
        # stage without MoE layers.
        self.moe_config = None
        if moe_config is not None and moe_config.num_moe_experts is not None:
            self.moe_tracker = MoELossTracker(config.num_layers + (mtp_num_layers or 0),
                                              config.num_layers)
            self.moe_config = moe_config
        self.mtp_num_layers = mtp_num_layers or 0
        self.mtp_standalone = bool(mtp_num_layers) and mtp_standalone
        if self.mtp_standalone and post_process and mtp_stage:
            raise ValueError("a standalone MTP stage is a stage before the loss stage, not the "
                             "last one")
        self.language_model = TransformerLanguageModel(
            config, groups, num_layers, offset, pre_process, post_process, init_seed,
            moe_config=moe_config, moe_tracker=self.moe_tracker,
            final_norm=mtp_stage if self.mtp_standalone else None)
        self.mtp = self.mtp_tracker = None
        self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
        self.mtp_detach_heads = mtp_detach_heads
        self.mtp_cp_group = groups.cp_group
        # Whether this stage's word-embedding table is kept in step over the embedding group:
        # the MTP layers embed tokens, so the stage holding them keeps a copy (the last stage
        # beside the loss, a standalone MTP stage without the embedding), summed with the
        # first stage's; the standalone loss stage only holds one when it is the output layer.
        self.shares_embedding_over_stages = (
            self.share_embeddings_and_output_weights
            or (bool(mtp_num_layers) and not (self.mtp_standalone and post_process)))
        if mtp_num_layers and (mtp_stage if self.mtp_standalone else post_process):
            self.mtp = MultiTokenPredictionBlock(config, groups, mtp_num_layers,
                                                 moe_config if self.moe_config else None,
                                                 self.moe_tracker, init_seed,
                                                 repeated_layer=mtp_use_repeated_layer,
                                                 detach_heads=mtp_detach_heads,
                                                 hidden_state_mixing=mtp_hsm)
        if mtp_num_layers and post_process:
            self.mtp_tracker = MTPLossTracker(mtp_num_layers)
        if self.shares_embedding_over_stages:
            copy_here = not pre_process and (post_process or (self.mtp_standalone and mtp_stage))
            tie_word_embeddings_over_stages(self, init_seed, copy_here)
        self.dsa_tracker = attach_dsa_tracker(self, config.num_layers + (mtp_num_layers or 0))
        from megatron.model import fine_grained_offload
        layers = list(self.language_model.encoder.layers)
        if self.mtp is not None:
            layers += [mtp_layer.transformer_layer for mtp_layer in self.mtp.layers]
        self.activation_offload = fine_grained_offload.install(self, layers, config,
                                                               pstate.pp_rank)
        # The training logits, written into the same storage every micro-batch (CPU only:
        # CUDA's caching allocator already reuses the block).
        self._logits_buffer = tensor_parallel.ReusableOutputBuffer() if post_process else None
        # Called with each training forward's logits [s, b, V/tp] before the loss (offline
        # distillation sets it); with ``keeps_logits`` the logits must outlive the loss.
        self.logits_observer = None
        if config.config_logger_dir:
            self._start_config_logging()

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding table this stage uses (embedding, LM head, or both)."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if not hasattr(self, "word_embeddings_for_head"):
            raise RuntimeError("shared_embedding_or_output_weight() called on a stage without "
                               "an embedding while --untie-embeddings-and-output-weights is set")
        return self.word_embeddings_for_head.weight

    def set_input_tensor(self, input_tensor) -> None:
        """Activations from the previous stage: ``[s, b, h]`` (``[s/tp, b, h]`` with SP)."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor] = None,
                inference_params=None, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run this stage.

        Args:
            input_ids: ``[b, s]`` token ids (first stage; None elsewhere).
            position_ids: ``[b, s]`` (learned absolute positions; rotary uses ``0 .. s-1``
                unless the config's ``rotary_from_position_ids`` (--sft) makes it follow them).
            attention_mask: bool ``[b or 1, 1, s, s]``, True = masked out; None = causal.
            labels: ``[b, s]`` target ids, or None.
            inference_params: the key/value cache of a generation
                (:class:`~megatron.text_generation.inference_params.InferenceParams`), or None;
                with it the ``s`` tokens are the ones at positions ``sequence_len_offset ..``
                and attend over every cached position before them.
            loss_mask: ``[b, s]``, the tokens the multi-token prediction loss counts (None:
                all); only read with ``mtp_num_layers``.

        Returns:
            On a stage that is not last, hidden states ``[s, b, h]`` (``[s/tp, b, h]`` with SP).
            On the last stage, logits ``[b, s, V/tp]`` (``[b, s, V]`` without
            ``parallel_output``) when ``labels`` is None, else the per-token loss ``[b, s]``
            (of the main head; in training the MTP loss is attached to it).
        """
        hidden = self.language_model(input_ids, position_ids, attention_mask,
                                     inference_params=inference_params)
        mtp_outputs = None
        if self.mtp_standalone and self.mtp is not None:
            outputs = self._mtp_outputs(hidden, input_ids, position_ids, attention_mask)
            return torch.cat([hidden] + outputs, dim=0)                  # [(1+K)s, b, h]
        if not self.post_process:
            return hidden
        if self.mtp_standalone:
            hidden, *mtp_outputs = hidden.chunk(1 + self.mtp_tracker.num_depths, dim=0)
        observer = self.logits_observer if labels is not None and self.training else None
        keep = observer is not None and observer.keeps_logits
        # Logits that only feed the loss are dead after the output layer's backward.
        buffer = (self._logits_buffer if labels is not None and torch.is_grad_enabled()
                  and hidden.device.type == "cpu" and not keep else None)
        logits = self._head(hidden, buffer)                                  # [s, b, V/tp]
        if self.config.config_logger_dir:
            self._log_inputs_and_logits(input_ids, position_ids, attention_mask, logits)
        if observer is not None:
            observer(logits)
        if labels is None:
            logits = logits.transpose(0, 1).contiguous()                         # [b, s, V/tp]
            if not self.parallel_output:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                    logits, self.tp_group)                                       # [b, s, V]
            return logits
        loss = self._per_token_loss(logits, labels, inplace=not keep)            # [b, s]
        if self.mtp_tracker is not None and self.training and torch.is_grad_enabled():
            if mtp_outputs is None:
                mtp_outputs = self._mtp_outputs(hidden, input_ids, position_ids, attention_mask)
            loss = self._with_mtp_loss(loss, mtp_outputs, position_ids, labels, loss_mask)
        return loss

    def _start_config_logging(self) -> None:
        """--config-logger-dir, once built: write the initial weights, as Megatron's
        ``GPTModel_init_ckpt`` file, and keep each forward's embedding output (Megatron's
        ``decoder_input``) for :meth:`_log_inputs_and_logits`."""
        self._decoder_input = None
        config_logger.log_config_to_disk(self.config.config_logger_dir, self.state_dict(),
                                         f"{type(self).__name__}_init_ckpt",
                                         self._logger_ranks)
        if self.pre_process:
            def keep(_module, _inputs, output):
                self._decoder_input = output.detach()
            self.language_model.embedding.register_forward_hook(keep)

    def _log_inputs_and_logits(self, input_ids, position_ids, attention_mask, logits) -> None:
        """--config-logger-dir: this forward's inputs, embedding output (None on a stage
        without the embedding) and logits ``[s, b, V/tp]``, as Megatron's
        ``input_and_logits`` file."""
        payload = OrderedDict(input_ids=input_ids, position_ids=position_ids,
                              attention_mask=attention_mask, decoder_input=self._decoder_input,
                              logits=logits.detach().clone())
        self._decoder_input = None
        config_logger.log_config_to_disk(self.config.config_logger_dir, payload,
                                         "input_and_logits", self._logger_ranks)

    def _head(self, hidden: torch.Tensor, buffer=None, detach_weight: bool = False
              ) -> torch.Tensor:
        """``[s, b, h]`` -> logits ``[s, b, V/tp]``, in ``--output-logit-dtype`` when given;
        ``detach_weight``: no gradient reaches the output weight (detached MTP heads).

        A wider logit dtype than the hidden states' (fp32 in a bf16 run) forms the product of
        the half-precision values with an fp32 sum and keeps it unrounded, as a GEMM with an
        fp32 output does (each product of two bf16 values is exact in fp32); a narrower one
        rounds the product."""
        dtype = self.config.logit_dtype
        if dtype is None or dtype == hidden.dtype:
            return self._head_in(hidden, None, buffer, detach_weight)
        if dtype.itemsize > hidden.dtype.itemsize:
            return self._head_in(hidden.to(dtype), dtype, None, detach_weight)
        return self._head_in(hidden, None, None, detach_weight).to(dtype)

    def _head_in(self, hidden: torch.Tensor, dtype: Optional[torch.dtype], buffer,
                 detach_weight: bool = False) -> torch.Tensor:
        """The output layer's product with the weight cast to ``dtype`` (None: as stored)."""
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
            weight = weight.detach() if detach_weight else weight
            logits = parallel_lm_logits(hidden, weight if dtype is None else weight.to(dtype),
                                        self.tp_group, self.sequence_parallel,
                                        output_buffer=buffer)
        else:
            layer = self.language_model.output_layer
            weight = layer.weight.detach() if detach_weight else None
            if dtype is not None:
                weight = (layer.weight if weight is None else weight).to(dtype)
            logits, _ = layer(hidden, weight=weight, output_buffer=buffer)
        if self.config.use_mup and self.config.mup_output_mult != 1.0:
            logits = logits * self.config.mup_output_mult                  # --mup-output-mult
        return logits

    def _per_token_loss(self, logits: torch.Tensor, labels: torch.Tensor,
                        inplace: bool = True) -> torch.Tensor:
        """Logits ``[s, b, V/tp]`` and labels ``[b, s]`` -> cross entropy ``[b, s]``;
        ``inplace``: the fused kernel's backward may overwrite the logits."""
        if not self.fp16_lm_cross_entropy and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        target = labels.transpose(0, 1).contiguous()                             # [s, b]
        if self.config.cross_entropy_loss_fusion:
            # The logits feed nothing but the loss, so the backward may overwrite them with
            # their gradient: no second [s, b, V/tp] tensor (pure torch if no kernels load).
            loss = fused_ops.vocab_parallel_cross_entropy(logits, target, self.tp_group,
                                                          inplace_backward=inplace)  # [s, b]
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target,
                                                                self.tp_group)  # [s, b]
        return loss.transpose(0, 1).contiguous()                                 # [b, s]

    def _packed_ends(self, position_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """--sft packs conversations: the last place of each, where every shift stops."""
        if self.config.rotary_from_position_ids and position_ids is not None:
            return sequence_ends(position_ids, self.mtp_cp_group)
        return None

    def _mtp_outputs(self, hidden, input_ids, position_ids, attention_mask):
        """The MTP depths' hidden states, each shaped as ``hidden``."""
        rotary = None
        if self.language_model.rotary_pos_emb is not None:
            rotary = self.language_model.rotary_angles(input_ids.size(1), position_ids, None,
                                                       hidden.device)   # [s, 1|b, 1, d]
        return self.mtp(input_ids, position_ids, hidden, attention_mask, rotary,
                        self._mtp_embedding, self._packed_ends(position_ids))

    def _with_mtp_loss(self, loss, outputs, position_ids, labels, loss_mask) -> torch.Tensor:
        """``loss`` with every depth's scaled MTP loss attached (see the MTP module)."""
        ends = self._packed_ends(position_ids)
        mask = (torch.ones_like(labels, dtype=torch.float32) if loss_mask is None
                else loss_mask.float())
        total = 0.0
        for depth, output in enumerate(outputs):
            labels = roll_left(labels, self.mtp_cp_group, ends)
            mask = roll_left(mask, self.mtp_cp_group, ends)
            logits = self._head(output, detach_weight=self.mtp_detach_heads)      # [s, b, V/tp]
            per_token = self._per_token_loss(logits, labels)                      # [b, s]
            masked_sum = (per_token.float() * mask).sum()
            value = masked_sum / self._mtp_token_count(mask)
            self.mtp_tracker.record(depth, value)
            # --calculate-per-token-loss: the sum, as the main loss (Megatron-Core's rule); the
            # gradients are divided by the global batch's token count of the main loss.
            attached = masked_sum if self.config.calculate_per_token_loss else value
            total = total + attached * (self.mtp_loss_scaling_factor / len(outputs))
        return attach_aux_loss(loss, total, self.mtp_tracker)

    def _mtp_token_count(self, mask: torch.Tensor) -> torch.Tensor:
        """What a depth's masked loss sum is divided by: the unmasked tokens, or under context
        parallelism those of the whole cp group over cp (as the main loss, so the cp ranks'
        gradients, averaged, and their logged values, averaged, are one process's)."""
        cp_group = self.mtp_cp_group
        if get_group_size(cp_group) == 1:
            return mask.sum()
        return all_reduce(mask.sum(), cp_group) / get_group_size(cp_group)

    def _mtp_embedding(self, input_ids: torch.Tensor,
                       position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """``[b, s]`` ids -> ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism): the
        first stage's embedding, or on a last stage without it the same computation on its copy
        of the table (no position table: refused with pipeline parallelism)."""
        if self.pre_process:
            return self.language_model.embedding(input_ids, position_ids)
        embedded = self.word_embeddings_for_head(input_ids)                  # [b, s, h]
        embedded = embedded.transpose(0, 1).contiguous()                     # [s, b, h]
        embedded = scale_embedding_output(embedded, self.config)
        if self.config.fp32_residual_connection:
            embedded = embedded.float()
        if not self.sequence_parallel:
            return torch.nn.functional.dropout(embedded, self.config.hidden_dropout,
                                               self.training)
        embedded = tensor_parallel.scatter_to_sequence_parallel_region(
            embedded, self.tp_group)                                         # [s/tp, b, h]
        with dropout_rng_context(self.training and self.config.hidden_dropout > 0):
            return torch.nn.functional.dropout(embedded, self.config.hidden_dropout,
                                               self.training)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """``{"language_model": {...}, "word_embeddings_for_head": {"weight": ...}}`` as
        Megatron saves it (the second key only on a last stage without an embedding)."""
        state = {"language_model": self.language_model.state_dict_for_save_checkpoint(
            prefix, keep_vars)}
        if self.mtp is not None:
            state["mtp"] = self.mtp.state_dict(prefix=prefix, keep_vars=keep_vars)
        if hasattr(self, "word_embeddings_for_head"):
            state["word_embeddings_for_head"] = self.word_embeddings_for_head.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        return state

"""BERT: a bidirectional encoder with the masked-LM head and the sentence-order (binary) head.

One pipeline stage of the model. The first stage embeds words, positions and token types; every
stage runs its layers with the bidirectional padding mask; the last stage applies the final norm,
the pooler (the first token through ``dense`` + tanh), the LM head (``dense`` -> GeLU ->
LayerNorm -> logits against the tied word embeddings + a vocabulary-split bias) and the binary
head (a ``[2, h]`` linear layer on the pooled output).

Checkpoint nesting, under ``model``::

    language_model   embedding (+ tokentype_embeddings), encoder, pooler (last, binary head)
    lm_head          bias [V/tp], dense.{weight,bias}, layernorm.{weight,bias}     (last)
    binary_head      weight [2, h], bias [2]                                (last, binary head)
    word_embeddings_for_head   weight [V/tp, h]                         (last, when PP > 1)
"""

from typing import Optional

import torch

from megatron.core import config_logger, device, tensor_parallel
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.parallel_state import ModelGroups
from megatron.core.utils import get_init_method
from megatron.fused_kernels import ops as fused_ops
from megatron.fused_kernels.bias_gelu import gelu_tanh
from megatron.fused_kernels.layer_norm import FusedLayerNorm
from megatron.model.enums import AttnMaskType
from megatron.model.language_model import (TransformerLanguageModel, get_linear_layer,
                                           parallel_lm_logits, tie_word_embeddings_over_stages)
from megatron.model.module import MegatronModule
from megatron.model.transformer import get_num_layers_and_offset
from megatron.model.utils import init_rng, openai_gelu


def bert_extended_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` padding mask (1 = token, 0 = padding) -> bool ``[b, 1, s, s]``, True = masked.

    Entry ``(i, j)`` is kept only when both query ``i`` and key ``j`` are real tokens: real
    queries never see padding, and padded queries see nothing (their outputs are ignored).
    """
    keep = attention_mask.bool()
    keep_pairs = keep.unsqueeze(1) & keep.unsqueeze(2)                     # [b, s, s]
    return ~keep_pairs.unsqueeze(1)                                        # [b, 1, s, s]


def bert_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """``0 .. s-1`` for every sequence of the ``[b, s]`` batch."""
    s = input_ids.size(1)
    return torch.arange(s, dtype=torch.long, device=input_ids.device).unsqueeze(0).expand_as(
        input_ids)


class BertLMHead(MegatronModule):
    """Masked-LM head: ``dense`` (h -> h), GeLU, LayerNorm, then logits against the word
    embeddings plus ``bias``.

    The GeLU is the same function as the encoder MLP's: this project's GeLU is the tanh form
    everywhere (``--openai-gelu`` selects the same curve with exact constants), so one
    activation describes the whole model, as a Hugging Face BERT config requires. ``bias`` is this
    rank's ``[V/tp]`` slice, marked like the vocabulary-split embedding (``partition_dim`` 0) so
    checkpoints split and merge it as they do the vocabulary. Under sequence parallelism
    ``dense`` and ``layernorm`` see only this rank's part of the sequence; their parameters are
    marked ``sequence_parallel`` so their gradients get summed over the tensor-parallel group.

    Args:
        config: the transformer config.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        tp_size: its size.
        sequence_parallel: the input is ``[s/tp, b, h]``.
    """

    def __init__(self, config: TransformerConfig, tp_group, tp_size: int,
                 sequence_parallel: bool = False):
        super().__init__(config)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        vocab_per_rank = config.padded_vocab_size // tp_size   # divisible: check_splittable
        self.bias = torch.nn.Parameter(torch.zeros(vocab_per_rank, dtype=config.params_dtype,
                                                   device=device.current_device()))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        self.dense = get_linear_layer(config.hidden_size, config.hidden_size,
                                      get_init_method(config),
                                      config.params_dtype)
        self.layernorm = FusedLayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                                        sequence_parallel=sequence_parallel,
                                        params_dtype=config.params_dtype)
        for param in (self.dense.weight, self.dense.bias):
            param.sequence_parallel = sequence_parallel
        self.gelu = openai_gelu if config.openai_gelu else gelu_tanh

    def forward(self, hidden_states: torch.Tensor,
                word_embeddings_weight: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> logits of this rank's
        vocabulary slice ``[s, b, V/tp]`` (always the whole sequence)."""
        hidden = self.layernorm(self.gelu(self.dense(hidden_states)))
        return parallel_lm_logits(hidden, word_embeddings_weight, self.tp_group,
                                  self.sequence_parallel, bias=self.bias)   # [s, b, V/tp]


class BertModel(MegatronModule):
    """Megatron's BERT on tensor-, sequence- and pipeline-parallel layers.

    Args:
        config: the transformer config (``--untie-embeddings-and-output-weights`` is not
            supported: the LM head always uses the word embeddings).
        pstate: this rank's :class:`~megatron.core.parallel_state.ParallelState` (or any object
            with ``tp_group``, ``tp_size``, ``pp_size``, ``pp_rank``, ``virtual_pp_size``,
            ``virtual_pp_rank``).
        num_tokentypes: rows of the token-type (segment) table; 0 for none.
        add_binary_head: keep the pooler and the sentence-order head
            (``--bert-no-binary-head`` turns this off).
        parallel_output: return LM logits split over the vocabulary (``[b, s, V/tp]``);
            otherwise gather them to ``[b, s, V]``. The loss always uses the split logits.
        pre_process: this is the first (virtual) stage: it owns the embedding.
        post_process: this is the last (virtual) stage: final norm, pooler, heads, loss.
        init_seed: the seed every piece's initialisation derives from (pieces ``embedding``,
            ``layer.N``, ``final_norm``, ``pooler``, ``lm_head``, ``binary_head``), so the same
            seed gives the same model under any TP / PP split.
        sequence_parallel: ``--sequence-parallel``.

    As in :class:`~megatron.model.gpt_model.GPTModel`, with more than one pipeline stage a last
    stage without the embedding keeps ``word_embeddings_for_head``, initialised exactly like the
    first stage's word embeddings; the two gradients are summed over the embedding group.
    """

    def __init__(self, config: TransformerConfig, pstate, num_tokentypes: int = 2,
                 add_binary_head: bool = True, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True, init_seed: int = 1234,
                 sequence_parallel: bool = False):
        super().__init__(config)
        if config.config_logger_dir:
            config_logger.log_config_to_disk(
                config.config_logger_dir, config_logger.constructor_arguments(locals()),
                type(self).__name__, config_logger.rank_string(pstate))
        if config.untie_embeddings_and_output_weights:
            raise ConfigError("BERT ties its LM head to the word embeddings: "
                              "--untie-embeddings-and-output-weights is not supported "
                              "(got untie_embeddings_and_output_weights=True)")
        if getattr(pstate, "cp_size", 1) != 1:
            # Without this the layers would ignore the cp group and every cp rank would run
            # whole sequences (pretrain_bert.py refuses the flag before getting here).
            raise ConfigError(f"BERT has no context parallelism: build it on a layout with "
                              f"--context-parallel-size 1, got {pstate.cp_size}")
        config.check_splittable(pstate.tp_size, pstate.pp_size)
        self.tp_group = pstate.tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        self.add_binary_head = add_binary_head
        groups = ModelGroups.of(pstate, sequence_parallel)
        self.sequence_parallel = sequence_parallel = groups.sequence_parallel
        self.fp16_lm_cross_entropy = config.fp16_lm_cross_entropy
        self.share_embeddings_and_output_weights = True
        vp_size = getattr(pstate, "virtual_pp_size", None)
        vp_rank = getattr(pstate, "virtual_pp_rank", None) if vp_size is not None else None
        num_layers, offset = get_num_layers_and_offset(config, pstate.pp_size, pstate.pp_rank,
                                                       vp_size, vp_rank)
        self.language_model = TransformerLanguageModel(
            config, groups, num_layers, offset, pre_process, post_process, init_seed,
            num_tokentypes=num_tokentypes, add_pooler=add_binary_head,
            encoder_attn_mask_type=AttnMaskType.padding)
        if post_process:
            with init_rng(init_seed, "lm_head"):
                self.lm_head = BertLMHead(config, pstate.tp_group, pstate.tp_size,
                                          sequence_parallel)
            if add_binary_head:
                with init_rng(init_seed, "binary_head"):
                    self.binary_head = get_linear_layer(
                        config.hidden_size, 2, get_init_method(config),
                        config.params_dtype)
        tie_word_embeddings_over_stages(self, init_seed)
        from megatron.model import fine_grained_offload
        self.activation_offload = fine_grained_offload.install(
            self, self.language_model.encoder.layers, config, pstate.pp_rank)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding table this stage uses (embedding, LM head, or both)."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def set_input_tensor(self, input_tensor) -> None:
        """Activations from the previous stage: ``[s, b, h]`` (``[s/tp, b, h]`` with SP)."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids: Optional[torch.Tensor], attention_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None,
                lm_labels: Optional[torch.Tensor] = None):
        """Run this stage.

        Args:
            input_ids: ``[b, s]`` token ids (first stage; None elsewhere).
            attention_mask: ``[b, s]`` padding mask, 1 on tokens and 0 on padding (every stage).
            tokentype_ids: ``[b, s]`` segment ids, or None (all 0).
            lm_labels: ``[b, s]`` masked-LM targets, or None. Positions without a target may
                hold any id, -1 included: their loss is computed against id 0 and is meant to be
                removed by the loss mask.

        Returns:
            On a stage that is not last, hidden states ``[s, b, h]`` (``[s/tp, b, h]`` with
            SP). On the last stage ``(lm_output, binary_logits)``: ``lm_output`` is the logits
            ``[b, s, V/tp]`` (``[b, s, V]`` without ``parallel_output``) when ``lm_labels`` is
            None, else the per-token loss ``[b, s]`` (float32 unless
            ``--fp16-lm-cross-entropy``); ``binary_logits`` is ``[b, 2]``, or None without
            the binary head.
        """
        extended_mask = bert_extended_attention_mask(attention_mask)       # [b, 1, s, s]
        position_ids = bert_position_ids(attention_mask)
        output = self.language_model(input_ids, position_ids, extended_mask,
                                     tokentype_ids=tokentype_ids)
        if not self.post_process:
            return output
        hidden, pooled = output if self.add_binary_head else (output, None)
        logits = self.lm_head(hidden, self.shared_embedding_or_output_weight())  # [s, b, V/tp]
        binary_logits = self.binary_head(pooled) if self.add_binary_head else None  # [b, 2]
        if lm_labels is None:
            logits = logits.transpose(0, 1).contiguous()                   # [b, s, V/tp]
            if not self.parallel_output:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                    logits, self.tp_group)                                 # [b, s, V]
            return logits, binary_logits
        return self._lm_loss(logits, lm_labels), binary_logits

    def _lm_loss(self, logits: torch.Tensor, lm_labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` of ``[s, b, V/tp]`` logits, as GPT computes it."""
        if not self.fp16_lm_cross_entropy and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        target = lm_labels.clamp(min=0).transpose(0, 1).contiguous()       # [s, b]
        if self.config.cross_entropy_loss_fusion:
            # The logits feed only the loss, so the backward may overwrite them in place.
            loss = fused_ops.vocab_parallel_cross_entropy(logits, target, self.tp_group,
                                                          inplace_backward=True)  # [s, b]
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target,
                                                                self.tp_group)  # [s, b]
        return loss.transpose(0, 1).contiguous()                           # [b, s]

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Megatron's BERT nesting: ``language_model``, ``lm_head``, ``binary_head`` and
        ``word_embeddings_for_head``, each where this stage has it."""
        state = {"language_model": self.language_model.state_dict_for_save_checkpoint(
            prefix, keep_vars)}
        if self.post_process:
            state["lm_head"] = self.lm_head.state_dict(prefix=prefix, keep_vars=keep_vars)
            if self.add_binary_head:
                state["binary_head"] = self.binary_head.state_dict(prefix=prefix,
                                                                   keep_vars=keep_vars)
        if hasattr(self, "word_embeddings_for_head"):
            state["word_embeddings_for_head"] = self.word_embeddings_for_head.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        return state

"""Embedding + transformer stack of one pipeline stage, and the tensor-parallel LM head.

Saved in Megatron's nesting::

    language_model
      embedding       word_embeddings.weight, position_embeddings.weight,   (first stage)
                      tokentype_embeddings.weight                           (BERT's segments)
      encoder         layers.N...., final_layernorm.*                        (final norm: last)
      pooler          dense.{weight,bias}                                    (last, BERT only)
      output_layer    weight                                                 (last, untied only)
"""

from typing import Optional

import torch

from megatron.core import device, tensor_parallel
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.config import TransformerConfig
from megatron.core.context_parallel import chunk_positions
from megatron.core.parallel_state import ModelGroups
from megatron.core.utils import get_embedding_init_method, get_init_method
from megatron.model.attention import dropout_rng_context
from megatron.model.enums import AttnMaskType
from megatron.model.module import MegatronModule
from megatron.model.rotary_pos_embedding import build_rotary_embedding
from megatron.model.transformer import ParallelTransformer
from megatron.model.utils import init_rng


def parallel_lm_logits(input_: torch.Tensor, word_embeddings_weight: torch.Tensor, tp_group,
                       sequence_parallel: bool, bias: Optional[torch.Tensor] = None,
                       output_buffer: Optional[tensor_parallel.ReusableOutputBuffer] = None
                       ) -> torch.Tensor:
    """Logits of this rank's vocabulary slice: ``[s, b, h] -> [s, b, V/tp]``.

    ``word_embeddings_weight`` is this rank's ``[V/tp, h]`` rows. The input is replicated over
    the tensor-parallel group (its gradient is all-reduced), or, with sequence parallelism,
    ``[s/tp, b, h]`` and all-gathered (its gradient reduce-scattered).

    The product runs through the tensor-parallel linear function, as a column-parallel layer's
    does: under ``--gradient-accumulation-fusion`` the ``[V/tp, h]`` weight gradient is added
    straight into ``main_grad``, with no separate vocabulary-sized gradient tensor and no
    second pass to add it there. ``output_buffer``: kept storage for the logits (see
    :class:`~megatron.core.tensor_parallel.ReusableOutputBuffer`), for logits that only feed
    the loss.
    """
    async_grad_allreduce = not sequence_parallel and get_group_size(tp_group) > 1
    return tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        input_, word_embeddings_weight, bias, tp_group, async_grad_allreduce,
        sequence_parallel, output_buffer)                                   # [s, b, V/tp]


def scale_embedding_output(embeddings: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """The embedding output times --mup-embedding-mult under --use-mup (untouched at 1)."""
    if config.use_mup and config.mup_embedding_mult != 1.0:
        return embeddings * config.mup_embedding_mult
    return embeddings


def build_word_embeddings(config: TransformerConfig, tp_group):
    """The vocab-parallel word embedding table (built first inside the ``embedding`` seed, so a
    second call under the same seed reproduces it exactly).

    Its weight is marked ``is_embedding_or_output_parameter``, as the output layer's is:
    ``--decoupled-lr`` gives these their own learning rate.
    """
    table = tensor_parallel.VocabParallelEmbedding(
        config.padded_vocab_size, config.hidden_size,
        init_method=get_embedding_init_method(config), tp_group=tp_group,
        params_dtype=config.params_dtype)
    table.weight.is_embedding_or_output_parameter = True
    return table


def tie_word_embeddings_over_stages(model, init_seed: int, copy_here: Optional[bool] = None
                                    ) -> None:
    """Set up the word-embedding table a model shares between its first and last stage.

    With pipeline parallelism a last stage without the embedding gets its own copy,
    ``word_embeddings_for_head``, drawn under the ``embedding`` seed so it starts equal to the
    first stage's table; both are marked ``shared_embedding`` so their gradients are summed
    over the embedding group. ``model`` has ``pre_process``, ``post_process``, ``config``,
    ``tp_group`` and ``language_model``. ``copy_here``: whether this stage keeps the copy
    (None: a last stage without the embedding; a standalone MTP stage keeps one too).
    """
    if copy_here is None:
        copy_here = model.post_process and not model.pre_process
    if copy_here:
        with init_rng(init_seed, "embedding"):
            model.word_embeddings_for_head = build_word_embeddings(model.config, model.tp_group)
        model.word_embeddings_for_head.weight.shared = True
        model.word_embeddings_for_head.weight.shared_embedding = True
    elif model.pre_process and not model.post_process:
        model.language_model.embedding.word_embeddings.weight.shared_embedding = True


def get_linear_layer(rows: int, columns: int, init_method, params_dtype: torch.dtype
                     ) -> torch.nn.Linear:
    """A plain ``torch.nn.Linear(rows, columns)``, replicated on every tensor-parallel rank:
    weight from ``init_method``, bias zero.

    The weight is drawn on the CPU (in float32 at least, as the tensor-parallel layers draw
    theirs) and then cast and moved, so the values do not depend on the device or on
    ``params_dtype`` beyond its rounding.
    """
    layer = torch.nn.utils.skip_init(torch.nn.Linear, rows, columns, dtype=params_dtype,
                                     device=device.current_device())
    master = torch.empty(columns, rows, dtype=torch.promote_types(params_dtype, torch.float32))
    init_method(master)
    with torch.no_grad():
        layer.weight.copy_(master)
        layer.bias.zero_()
    return layer


class Embedding(MegatronModule):
    """Word embeddings (vocab-parallel) + learned absolute position embeddings + token-type
    embeddings (BERT's segment A / B) + dropout.

    Args:
        config: the transformer config.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        add_position_embedding: learned absolute positions (``--position-embedding-type
            learned_absolute``).
        sequence_parallel: scatter the output along the sequence to ``[s/tp, b, h]``.
        num_tokentypes: rows of the token-type table (0: no table, as in GPT). The table is
            drawn after the word and position tables, so adding it leaves them unchanged.
    """

    def __init__(self, config: TransformerConfig, tp_group, add_position_embedding: bool,
                 sequence_parallel: bool = False, num_tokentypes: int = 0):
        super().__init__(config)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.add_position_embedding = add_position_embedding
        self.num_tokentypes = num_tokentypes
        self.word_embeddings = build_word_embeddings(config, tp_group)
        if add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype,
                device=device.current_device())
            get_embedding_init_method(config)(self.position_embeddings.weight)
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(
                num_tokentypes, config.hidden_size, dtype=config.params_dtype,
                device=device.current_device())
            get_embedding_init_method(config)(self.tokentype_embeddings.weight)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[b, s]`` ids, positions and token types -> ``[s, b, h]`` (``[s/tp, b, h]`` with
        sequence parallelism).

        With a token-type table, ``tokentype_ids`` None means type 0 everywhere.
        """
        embeddings = self.word_embeddings(input_ids)                         # [b, s, h]
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        if self.num_tokentypes > 0:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        elif tokentype_ids is not None:
            raise ValueError("token-type ids were given but the embedding has no token-type "
                             "table (num_tokentypes is 0)")
        embeddings = embeddings.transpose(0, 1).contiguous()                 # [s, b, h]
        embeddings = scale_embedding_output(embeddings, self.config)
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if not self.sequence_parallel:
            return self.embedding_dropout(embeddings)
        embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
            embeddings, self.tp_group)                                       # [s/tp, b, h]
        with dropout_rng_context(self.training and self.embedding_dropout.p > 0):
            return self.embedding_dropout(embeddings)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        state = {"word_embeddings": self.word_embeddings.state_dict(prefix=prefix,
                                                                    keep_vars=keep_vars)}
        if self.add_position_embedding:
            state["position_embeddings"] = self.position_embeddings.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        if self.num_tokentypes > 0:
            state["tokentype_embeddings"] = self.tokentype_embeddings.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        return state


class Pooler(MegatronModule):
    """BERT's pooler: ``tanh(dense(h))`` of one token (``[CLS]``, position 0).

    ``dense`` is a plain linear layer replicated on the tensor-parallel ranks. Under sequence
    parallelism the hidden states are first gathered to the whole sequence; the gradient is then
    only split back (not summed), since every rank computes the same pooled output.

    Args:
        config: the transformer config.
        tp_group: the tensor-parallel group (None: no tensor parallelism).
        sequence_parallel: the input is ``[s/tp, b, h]``.
    """

    def __init__(self, config: TransformerConfig, tp_group, sequence_parallel: bool = False):
        super().__init__(config)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dense = get_linear_layer(config.hidden_size, config.hidden_size,
                                      get_init_method(config),
                                      config.params_dtype)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> ``[b, h]``."""
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, self.tp_group, tensor_parallel_output_grad=False)  # [s, b, h]
        pooled = hidden_states[sequence_index, :, :]                          # [b, h]
        return torch.tanh(self.dense(pooled))


class TransformerLanguageModel(MegatronModule):
    """Embedding (first stage), this stage's layers, pooler and untied output layer (last stage).

    Every parameter-owning piece is built under its own seed (``embedding``, ``layer.N``,
    ``final_norm``, ``pooler``, ``output_layer``), so the model does not depend on the parallel
    split.

    Args:
        config: the transformer config.
        groups: the process groups and sequence parallelism
            (:class:`~megatron.core.parallel_state.ModelGroups`). Under sequence parallelism
            activations between tensor-parallel regions are ``[s/tp, b, h]``; with more than
            one context-parallel rank every activation holds this rank's ``s / cp`` tokens and
            rotary angles are those of their global positions.
        num_layers: layers on this stage.
        layer_offset: global index of this stage's first layer.
        pre_process: first stage.
        post_process: last stage.
        init_seed: seed every piece's initialisation seed derives from.
        num_tokentypes: rows of the embedding's token-type table (BERT: 2; GPT: 0).
        add_pooler: the last stage also returns the pooled first token (BERT).
        encoder_attn_mask_type: :class:`AttnMaskType` of the self-attention: ``causal`` (GPT;
            a missing mask means causal) or ``padding`` (BERT; bidirectional, the mask hides
            padding, a missing mask hides nothing).
        moe_config / moe_tracker: the MoE settings and the auxiliary-loss tracker (None:
            dense MLPs); see :class:`~megatron.model.transformer.ParallelTransformerLayer`.
        final_norm: whether this stage applies the final norm; None: the last stage does
            (a standalone MTP stage applies it before the loss stage, see GPTModel).
    """

    def __init__(self, config: TransformerConfig, groups: ModelGroups, num_layers: int,
                 layer_offset: int, pre_process: bool = True, post_process: bool = True,
                 init_seed: int = 1234, num_tokentypes: int = 0, add_pooler: bool = False,
                 encoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 moe_config=None, moe_tracker=None, final_norm: Optional[bool] = None):
        super().__init__(config)
        tp_group, tp_size = groups.tp_group, groups.tp_size
        sequence_parallel = groups.sequence_parallel
        self.cp_size = get_group_size(groups.cp_group)
        self.cp_rank = get_group_rank(groups.cp_group)
        self.pre_process = pre_process
        self.post_process = post_process
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel
        self.add_pooler = add_pooler
        self.untie_embeddings_and_output_weights = config.untie_embeddings_and_output_weights
        if pre_process:
            with init_rng(init_seed, "embedding"):
                self.embedding = Embedding(
                    config, tp_group,
                    config.position_embedding_type == "learned_absolute", sequence_parallel,
                    num_tokentypes)
        self.rotary_pos_emb = build_rotary_embedding(config)
        self.rotary_from_position_ids = (config.rotary_from_position_ids
                                         and self.rotary_pos_emb is not None)
        self.encoder = ParallelTransformer(config, groups, num_layers, layer_offset, pre_process,
                                           post_process if final_norm is None else final_norm,
                                           init_seed,
                                           self_attn_mask_type=encoder_attn_mask_type,
                                           moe_config=moe_config, moe_tracker=moe_tracker)
        if post_process and add_pooler:
            with init_rng(init_seed, "pooler"):
                self.pooler = Pooler(config, tp_group, sequence_parallel)
        if post_process and self.untie_embeddings_and_output_weights:
            with init_rng(init_seed, "output_layer"):
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size,
                    init_method=(get_embedding_init_method(config) if config.use_mup
                                 else get_init_method(config)), tp_group=tp_group,
                    bias=False, gather_output=False, sequence_parallel=sequence_parallel,
                    params_dtype=config.params_dtype)
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def set_input_tensor(self, input_tensor) -> None:
        self.encoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], tokentype_ids=None,
                inference_params=None, pooling_sequence_index: int = 0):
        """Hidden states ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) after this
        stage's layers (and the final norm on the last stage); with the pooler, on the last
        stage, the pair ``(hidden states, pooled [b, h])``.

        ``tokentype_ids``: ``[b, s]`` segment ids (first stage, with a token-type table).
        ``inference_params``: the key/value cache of a generation, or None; with it the ``s``
        tokens sit at positions ``sequence_len_offset ..`` (learned positions come from
        ``position_ids``, rotary angles from the offset).
        ``pooling_sequence_index``: the position the pooler reads.
        """
        hidden = (self.embedding(input_ids, position_ids, tokentype_ids) if self.pre_process
                  else None)
        rotary = None
        if self.rotary_pos_emb is not None:
            local = hidden if self.pre_process else self.encoder.input_tensor
            seq_len = local.size(0) * (self.tp_size if self.sequence_parallel else 1)
            rotary = self.rotary_angles(seq_len, position_ids, inference_params, local.device)
        hidden = self.encoder(hidden, attention_mask, rotary, inference_params=inference_params)
        if self.post_process and self.add_pooler:
            return hidden, self.pooler(hidden, pooling_sequence_index)
        return hidden

    def rotary_angles(self, seq_len: int, position_ids: Optional[torch.Tensor],
                      inference_params=None, dev=None) -> torch.Tensor:
        """The rotary angles of this rank's ``seq_len`` tokens: ``[s, 1, 1, d]`` for positions
        ``0 .. s-1`` (this cp rank's chunks of them with context parallelism; from the cache's
        offset in a generation), or ``[s, b, 1, d]`` from ``position_ids`` ``[b, s]`` when the
        config's ``rotary_from_position_ids`` asks for them (--sft: every packed conversation
        rotates from 0; the ids are already this cp rank's)."""
        if inference_params is not None:
            return self.rotary_pos_emb(seq_len, inference_params.sequence_len_offset)
        if self.rotary_from_position_ids and position_ids is not None:
            return self.rotary_pos_emb.at_positions(position_ids)           # [s, b, 1, d]
        if self.cp_size > 1:
            full = seq_len * self.cp_size
            return self.rotary_pos_emb(full).index_select(0, chunk_positions(
                full, self.cp_size, self.cp_rank, dev))                     # [s/cp, 1, 1, d]
        return self.rotary_pos_emb(seq_len)                                 # [s, 1, 1, d]

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        state = {}
        if self.pre_process:
            state["embedding"] = self.embedding.state_dict_for_save_checkpoint(prefix, keep_vars)
        state["encoder"] = self.encoder.state_dict_for_save_checkpoint(prefix, keep_vars)
        if self.post_process and self.add_pooler:
            state["pooler"] = self.pooler.state_dict(prefix=prefix, keep_vars=keep_vars)
        if self.post_process and self.untie_embeddings_and_output_weights:
            state["output_layer"] = self.output_layer.state_dict(prefix=prefix,
                                                                 keep_vars=keep_vars)
        return state

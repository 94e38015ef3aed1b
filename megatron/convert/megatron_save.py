"""Writing the canonical stream as a Megatron checkpoint at a target TP x PP: the saving half of
:mod:`megatron.convert.megatron_io` (which re-exports :func:`save_megatron`; its docstring gives
the split rules, what is kept and dropped, and the memory bound).
"""

import argparse
import os
import tempfile
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint import mcore_torch, optimizer_state
from megatron.checkpoint.dist.keys import extra_state_value
from megatron.checkpoint.layout import CHECKPOINT_VERSION, checkpoint_dir_name, checkpoint_file
from megatron.checkpoint.names import dotted_names
from megatron.checkpoint.publish import fsync_path, publish
from megatron.convert.megatron_layout import (BERT_HEAD_KEYS, MTP_LAYER, SCHEDULER_KEY,
                                              TOKENTYPE_KEYS, expert_of, get_path,
                                              layer_tensor_names, layer_tensor_shapes,
                                              mtp_split_rule, mtp_tensor_shapes, read_rank_file,
                                              split_tensor, tp_split_rule)
from megatron.convert.target import staged_target
from megatron.convert.schema import (BERT_VOCAB_TENSOR, ConversionError, ModelMeta, Piece,
                                     bert_head_shapes, fit_vocab_rows, padded_vocab_size)
from megatron.convert.zip_checksums import refresh_zip_checksums

# The model state's names: Megatron's legacy ones (FORMATS.md section 6), or Megatron-Core's
# state dict of its TransformerEngine or local layers (``--saver core``,
# :mod:`megatron.checkpoint.mcore_torch`).
LEGACY_KEYS = "legacy"

# Saving
# ---------------------------------------------------------------------------------------------

class SaveTarget:
    """The target layout: checked sizes, vocabulary rows, stage of every layer, file skeletons."""

    def __init__(self, meta: ModelMeta, tp: int, pp: int, divisible_by: Optional[int],
                 optimizer: bool = False, ep: int = 1, key_style: str = LEGACY_KEYS):
        self.meta, self.tp, self.pp, self.ep = meta, tp, pp, ep
        self.optimizer = optimizer and meta.optimizer is not None
        self.key_style = key_style
        self._check_sizes()
        self._check_key_style()
        self.divisible_by = divisible_by or meta.make_vocab_size_divisible_by or 1
        self.vocab_rows = padded_vocab_size(meta.vocab_size, self.divisible_by, tp)
        self.per_stage = meta.num_layers // pp
        self.release = meta.iteration == 0
        self.names = [layer_tensor_names(meta, i) for i in range(meta.num_layers)]
        self.shapes = [layer_tensor_shapes(meta, i) for i in range(meta.num_layers)]
        self.tied = not meta.untie_embeddings_and_output_weights
        self.mtp_shapes = mtp_tensor_shapes(meta) if meta.mtp_num_layers else {}
        self.heads = (dict(bert_head_shapes(meta, self.vocab_rows))
                      if meta.model_type == "BERT" else {})

    def _check_key_style(self) -> None:
        """Megatron-Core's keys (``--saver core``) are written for GPT layers, embeddings and
        heads; what else a model holds is refused by name."""
        if self.key_style == LEGACY_KEYS:
            return
        if self.key_style not in mcore_torch.SPECS:
            raise ConversionError(f"key style {self.key_style!r}: one of {LEGACY_KEYS!r}, "
                                  f"{', '.join(map(repr, mcore_torch.SPECS))}")
        if self.meta.model_type != "GPT":
            raise ConversionError("--saver core writes GPT models; write a BERT with --saver "
                                  "legacy (or --target-ckpt-format torch_dist)")
        if self.meta.mtp_num_layers:
            raise ConversionError("--saver core: multi-token prediction layers are written to "
                                  "--ckpt-format torch_dist only here; add "
                                  "--target-ckpt-format torch_dist")
        if self.optimizer:
            raise ConversionError("--saver core writes the weights only (its Adam state would "
                                  "follow Megatron-Core's parameter order)")

    def file_keys(self, pp_rank: int) -> Dict[str, str]:
        """``{legacy dotted name: key in the file}`` of a ``pp_rank`` file's model state."""
        cached = getattr(self, "_file_keys", {})
        if pp_rank not in cached:
            with torch.device("meta"):
                legacy = self._legacy_skeleton(pp_rank)
            cached[pp_rank] = ({name: name for name in dotted_names(legacy)}
                               if self.key_style == LEGACY_KEYS
                               else mcore_torch.file_keys(legacy, self.key_style))
            self._file_keys = cached
        return cached[pp_rank]

    def _check_sizes(self) -> None:
        meta, tp, pp, ep = self.meta, self.tp, self.pp, self.ep
        if meta.model_type not in ("GPT", "BERT"):
            raise ConversionError(f"model type {meta.model_type!r}: only GPT and BERT "
                                  "checkpoints can be written")
        if meta.model_type == "BERT" and meta.untie_embeddings_and_output_weights:
            raise ConversionError("--untie-embeddings-and-output-weights: a BERT's LM head is "
                                  "tied to the word embeddings")
        if tp < 1 or pp < 1:
            raise ConversionError(f"--target-tensor-parallel-size ({tp}) and "
                                  f"--target-pipeline-parallel-size ({pp}) must be >= 1")
        for flag, value in (("--num-attention-heads", meta.num_attention_heads),
                            ("--num-query-groups", meta.num_query_groups),
                            ("--ffn-hidden-size", meta.ffn_hidden_size),
                            ("--moe-ffn-hidden-size", meta.expert_ffn_size),
                            ("--moe-shared-expert-intermediate-size",
                             meta.moe_shared_expert_intermediate_size or 0)):
            if value % tp != 0:
                raise ConversionError(f"--target-tensor-parallel-size {tp} does not divide "
                                      f"{flag} ({value}); choose a divisor of {value}")
        if ep < 1 or (ep > 1 and (not meta.num_experts or meta.num_experts % ep)):
            raise ConversionError(f"--target-expert-parallel-size {ep} does not divide "
                                  f"--num-experts ({meta.num_experts or 0}); choose a divisor")
        if pp > meta.num_layers or meta.num_layers % pp != 0:
            raise ConversionError(f"--target-pipeline-parallel-size {pp} does not divide "
                                  f"--num-layers ({meta.num_layers}) into equal stages")

    def ranks(self) -> List[Tuple[int, int, int]]:
        """``(tp_rank, pp_rank, ep_rank)`` of every target file."""
        return [(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def local_experts(self) -> int:
        return (self.meta.num_experts or 0) // self.ep

    def route(self, tp_rank: int, pp_rank: int, keys: tuple) -> List[Tuple[tuple, tuple]]:
        """The files (``(tp, pp, ep)``) and key paths a write of ``keys`` goes to: a dense
        tensor to every expert rank's file, expert J's to rank J / (E / ep)'s, under its local
        number (Megatron-LM's legacy layout)."""
        from megatron.checkpoint.experts import local_expert, renumber

        expert = local_expert(keys[-1])
        if expert is None:
            return [((tp_rank, pp_rank, e), keys) for e in range(self.ep)]
        per_rank = self.local_experts()
        return [((tp_rank, pp_rank, expert // per_rank),
                 keys[:-1] + (renumber(keys[-1], expert % per_rank),))]

    def stage_of(self, layer: int) -> Tuple[int, int]:
        return layer // self.per_stage, layer % self.per_stage

    def shard_shape(self, shape: Tuple[int, ...], rule: Optional[Tuple[int, int]]):
        if rule is None:
            return shape
        shape = list(shape)
        shape[rule[0]] //= self.tp
        return tuple(shape)

    def model_skeleton(self, pp_rank: int) -> dict:
        """One TP rank's ``model`` tree of ``pp_rank``, as empty (unallocated) tensors: the
        legacy nesting, or Megatron-Core's flat keys (``key_style``)."""
        legacy = self._legacy_skeleton(pp_rank)
        if self.key_style == LEGACY_KEYS:
            return legacy
        extra = extra_state_value(self.key_style)
        return mcore_torch.to_mcore_state(legacy, self.key_style, pp_rank == self.pp - 1, extra)

    def _legacy_skeleton(self, pp_rank: int) -> dict:
        meta, dtype = self.meta, self.meta.params_dtype
        first, last = pp_rank == 0, pp_rank == self.pp - 1
        vocab_shard = (self.vocab_rows // self.tp, meta.hidden_size)
        language_model = {}
        if first:
            embedding = {"word_embeddings": {"weight": torch.empty(vocab_shard, dtype=dtype)}}
            if meta.position_embedding_type == "learned_absolute":
                embedding["position_embeddings"] = {"weight": torch.empty(
                    (meta.max_position_embeddings, meta.hidden_size), dtype=dtype)}
            if self.heads and meta.num_tokentypes:
                embedding["tokentype_embeddings"] = {"weight": torch.empty(
                    (meta.num_tokentypes, meta.hidden_size), dtype=dtype)}
            language_model["embedding"] = embedding
        encoder = {}
        for local in range(self.per_stage):
            index = pp_rank * self.per_stage + local
            for name in self.names[index]:
                expert = expert_of(name)
                if expert is not None and expert[0] >= self.local_experts():
                    continue   # each expert rank's file numbers its experts 0 .. E/ep - 1
                shape = self.shard_shape(self.shapes[index][name],
                                         tp_split_rule(name, meta.gated_linear_unit))
                # The router's expert bias stays float32 whatever the weights' dtype.
                encoder[f"layers.{local}.{name}"] = torch.empty(shape, dtype=(
                    torch.float32 if name == "mlp.router.expert_bias" else dtype))
        if last:
            norm = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
            for name in norm:
                encoder[f"final_layernorm.{name}"] = torch.empty(meta.hidden_size, dtype=dtype)
        language_model["encoder"] = encoder
        if last and not self.tied:
            language_model["output_layer"] = {"weight": torch.empty(vocab_shard, dtype=dtype)}
        model = {"language_model": language_model}
        if last and meta.mtp_num_layers:
            model["mtp"] = self._mtp_skeleton()
        if last and not first and self.head_copy:
            model["word_embeddings_for_head"] = {"weight": torch.empty(vocab_shard, dtype=dtype)}
        if last:
            self._add_bert_heads(model)
        return model

    @property
    def head_copy(self) -> bool:
        """Whether a last stage without the embedding keeps ``word_embeddings_for_head``: for
        the tied output layer, or for multi-token prediction's input embedding."""
        return self.tied or bool(self.meta.mtp_num_layers)

    def _mtp_skeleton(self) -> dict:
        """The last stage's ``mtp`` tree (flat keys ``layers.K.<name>``), one TP rank's."""
        tree = {}
        for depth in range(self.meta.mtp_num_layers):
            for name, shape in self.mtp_shapes.items():
                expert = expert_of(name[len(MTP_LAYER):]) if name.startswith(MTP_LAYER) else None
                if expert is not None and expert[0] >= self.local_experts():
                    continue
                dtype = (torch.float32 if name.endswith("mlp.router.expert_bias")
                         else self.meta.params_dtype)
                tree[f"layers.{depth}.{name}"] = torch.empty(
                    self.shard_shape(shape, mtp_split_rule(name, self.meta.swiglu)), dtype=dtype)
        return tree

    def _add_bert_heads(self, model: dict) -> None:
        """A BERT's pooler, LM head and binary head into a last stage's ``model`` tree (the
        ``lm_head`` bias as this rank's vocabulary rows)."""
        for kind, shapes in self.heads.items():
            node = model
            for key in BERT_HEAD_KEYS[kind]:
                node = node.setdefault(key, {})
            for name, shape in shapes.items():
                if (kind, name) == BERT_VOCAB_TENSOR:
                    shape = (self.vocab_rows // self.tp,)
                node[name] = torch.empty(shape, dtype=self.meta.params_dtype)

    def args(self) -> argparse.Namespace:
        """The source's args with the layout, vocabulary and shape fields of the target."""
        meta = self.meta
        values = {k: v for k, v in (meta.source_args or {}).items() if k != SCHEDULER_KEY}
        values.update(
            num_layers=meta.num_layers, hidden_size=meta.hidden_size,
            ffn_hidden_size=meta.ffn_hidden_size, num_attention_heads=meta.num_attention_heads,
            num_query_groups=meta.num_query_groups,
            group_query_attention=meta.group_query_attention, kv_channels=meta.kv_channels,
            max_position_embeddings=meta.max_position_embeddings,
            position_embedding_type=meta.position_embedding_type,
            use_rotary_position_embeddings=meta.position_embedding_type == "rope",
            rotary_percent=meta.rotary_percent, rotary_base=meta.rotary_base,
            qk_layernorm=meta.qk_layernorm, **meta.rope_scaling_fields,
            normalization=meta.normalization, norm_epsilon=meta.norm_epsilon,
            swiglu=meta.swiglu, openai_gelu=meta.openai_gelu, quick_geglu=meta.quick_geglu,
            glu_linear_offset=meta.glu_linear_offset,
            activation_func_clamp_value=meta.activation_func_clamp_value,
            add_bias_linear=meta.add_bias_linear, add_qkv_bias=meta.add_qkv_bias,
            untie_embeddings_and_output_weights=meta.untie_embeddings_and_output_weights,
            apply_residual_connection_post_layernorm=meta.apply_residual_connection_post_layernorm,
            params_dtype=meta.params_dtype, fp16=meta.params_dtype == torch.float16,
            bf16=meta.params_dtype == torch.bfloat16,
            tokenizer_type=meta.tokenizer_type, vocab_file=meta.vocab_file,
            merge_file=meta.merge_file, tokenizer_model=meta.tokenizer_model,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            padded_vocab_size=self.vocab_rows, make_vocab_size_divisible_by=self.divisible_by,
            num_layers_per_virtual_pipeline_stage=None,
            virtual_pipeline_model_parallel_size=None,
            decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
            pipeline_model_parallel_layout=None, mtp_standalone=False,
            iteration=meta.iteration, consumed_train_samples=meta.consumed_train_samples,
            consumed_valid_samples=meta.consumed_valid_samples,
            window_size=meta.window_size, window_attn_skip_freq=meta.window_attn_skip_freq,
            softmax_type=meta.softmax_type, mtp_num_layers=meta.mtp_num_layers or None)
        if meta.seq_length is not None:
            values["seq_length"] = meta.seq_length
        if meta.num_experts:
            # Experts are split over TP like the MLP and dealt over the expert ranks.
            values.update(
                num_experts=meta.num_experts, moe_router_topk=meta.moe_router_topk,
                moe_ffn_hidden_size=meta.expert_ffn_size,
                moe_router_score_function=meta.moe_router_score_function,
                moe_router_pre_softmax=meta.moe_router_pre_softmax,
                moe_router_topk_scaling_factor=meta.moe_router_topk_scaling_factor,
                moe_router_num_groups=meta.moe_router_num_groups,
                moe_router_group_topk=meta.moe_router_group_topk,
                moe_router_enable_expert_bias=meta.moe_router_enable_expert_bias,
                moe_shared_expert_intermediate_size=meta.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=meta.moe_shared_expert_gate,
                moe_layer_freq=meta.moe_layer_freq, expert_model_parallel_size=self.ep,
                expert_tensor_parallel_size=self.tp)
            if meta.moe_aux_loss_coeff is not None:
                # transformers' router loss is Megatron's aux_loss, the type whose coefficient
                # hf_mixtral.router_aux_loss_coef reads back.
                values.update(moe_router_load_balancing_type="aux_loss",
                              moe_aux_loss_coeff=meta.moe_aux_loss_coeff)
        values["multi_latent_attention"] = meta.multi_latent_attention
        if meta.multi_latent_attention:
            values.update({name: getattr(meta, name) for name in (
                "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim")})
        if meta.model_type == "BERT":
            values["bert_binary_head"] = meta.bert_binary_head
        if self.key_style != LEGACY_KEYS:
            # A Megatron-Core model of these layers wrote these keys.
            values.update(transformer_impl=self.key_style, use_legacy_models=False)
        if meta.source_args is None and meta.tokenizer_type == "NullTokenizer":
            values["vocab_size"] = meta.vocab_size - 1  # NullTokenizer adds its end-of-document
        return argparse.Namespace(**values)

    def conversion_record(self) -> dict:
        source = self.meta.source_args
        layout = None
        if source is not None:
            layout = [source.get("tensor_model_parallel_size", 1),
                      source.get("pipeline_model_parallel_size", 1)]
            if (source.get("expert_model_parallel_size") or 1) > 1 or self.ep > 1:
                layout.append(source.get("expert_model_parallel_size") or 1)
        return {"from_layout": layout,
                "optimizer": "resharded" if self.optimizer else "dropped", "rng": "dropped"}

    @property
    def half(self) -> bool:
        return self.meta.params_dtype in (torch.float16, torch.bfloat16)

    def shape_tree(self, pp_rank: int) -> dict:
        """One TP rank's model tree of ``pp_rank`` as shapes only (meta tensors)."""
        with torch.device("meta"):
            return self.model_skeleton(pp_rank)


def _create_files(target: SaveTarget, root: str) -> Dict[Tuple[int, int, int], str]:
    """Every target rank's file, complete but for the tensor bytes (written later in place)."""
    args = target.args()
    meta = target.meta
    scheduler = (meta.source_args or {}).get(SCHEDULER_KEY)
    files = {}
    for tp_rank, pp_rank, ep_rank in target.ranks():
        state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                 "iteration": meta.iteration, "model": target.model_skeleton(pp_rank)}
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler
        if target.optimizer:
            state["optimizer"] = optimizer_state.target_skeleton(
                state["model"], meta.optimizer, target.half)
        state["conversion"] = target.conversion_record()
        path = checkpoint_file(root, meta.iteration, tp_rank, pp_rank,
                                             target.pp, target.release, ep_rank, target.ep)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with torch.serialization.skip_data():
            torch.save(state, path)
        files[(tp_rank, pp_rank, ep_rank)] = path
    return files


def _copy_into(path: str, items: list, what: str) -> None:
    """Copy ``(key path under model, tensor)`` items into the file at ``path``, mapped (shared)
    for this call only: the mapping goes when the loaded tensors do, at return."""
    model = read_rank_file(path, shared=True)["model"]
    for keys, tensor in items:
        dst = get_path(model, keys, path)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ConversionError(f"{what}: {'.'.join(keys)} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dst.shape)} for the target layout")
        dst.copy_(tensor)


def _copy_optimizer_into(path: str, items: list, what: str) -> None:
    """Like :func:`_copy_into` for ``(keys from the top of the file, tensor)`` items."""
    state = read_rank_file(path, shared=True)
    for keys, tensor in items:
        dst = state
        for key in keys:
            dst = dst[key]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ConversionError(f"{what}: optimizer state {keys} has shape "
                                  f"{tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)


def _write_optimizer(target: SaveTarget, files: dict, writes: list, field: str, what: str) -> None:
    """Model-tree writes of one optimizer ``field`` view, redirected into the target's
    optimizer state."""
    trees = {pp_rank: target.shape_tree(pp_rank) for pp_rank in {w[1] for w in writes}}
    by_file: Dict[Tuple[int, int, int], list] = {}
    for tp_rank, pp_rank, keys, tensor in writes:
        for rank, local_keys in target.route(tp_rank, pp_rank, keys):
            where = optimizer_state.target_keys(trees[pp_rank], field, target.half,
                                                ".".join(local_keys))
            by_file.setdefault(rank, []).append((where, tensor))
    for rank, items in by_file.items():
        _copy_optimizer_into(files[rank], items, what)


def _write_steps(target: SaveTarget, files: dict) -> None:
    """Every parameter's Adam step count (a skeleton's scalars hold no data until written)."""
    step = torch.tensor(float(target.meta.optimizer["step"]), dtype=torch.float32)
    inner = ("optimizer", "optimizer") if target.half else ("optimizer",)
    for (tp_rank, pp_rank, _), path in files.items():
        index, _ = optimizer_state.target_index(target.shape_tree(pp_rank))
        _copy_optimizer_into(path, [(inner + ("state", i, "step"), step)
                                    for i in index.values()], "the Adam step counts")


def _write(target: SaveTarget, files: Dict[Tuple[int, int, int], str],
           writes: List[Tuple[int, int, tuple, torch.Tensor]], what: str) -> None:
    """Copy ``(tp_rank, pp_rank, key path under model, tensor)`` into the target files (every
    expert rank's, or the one holding the expert: :meth:`SaveTarget.route`), one file mapped at a
    time."""
    by_file: Dict[Tuple[int, int, int], list] = {}
    for tp_rank, pp_rank, keys, tensor in writes:
        for rank, local_keys in target.route(tp_rank, pp_rank, keys):
            if target.key_style != LEGACY_KEYS:
                local_keys = (target.file_keys(pp_rank)[".".join(local_keys)],)
            by_file.setdefault(rank, []).append((local_keys, tensor))
    for rank, items in by_file.items():
        _copy_into(files[rank], items, what)


def check_tensors(what: str, tensors: Dict[str, torch.Tensor],
                   expected: Dict[str, Tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors)
                   if tuple(tensors[k].shape) != tuple(expected[k]))
    if missing or extra or wrong:
        detail = ([f"missing {missing}"] if missing else []) + (
            [f"unexpected {extra}"] if extra else []) + [
            f"{k} has shape {tuple(tensors[k].shape)}, expected {expected[k]}" for k in wrong]
        raise ConversionError(f"{what} does not match the model the meta describes: "
                              + "; ".join(detail))


def _vocab_shards(target: SaveTarget, table: torch.Tensor, what: str) -> List[torch.Tensor]:
    """Each TP rank's rows of ``table`` fitted to the target's padded size, with
    :func:`fit_vocab_rows`'s rule (rows past the table's are zeros; only padding rows are
    dropped), built shard by shard: views where the rows exist, so no whole copy is made."""
    if table.size(0) < target.meta.vocab_size:
        raise ConversionError(f"{what} has {table.size(0)} rows, fewer than the vocabulary size "
                              f"{target.meta.vocab_size} in the meta")
    per_rank = target.vocab_rows // target.tp
    shards = []
    for tp_rank in range(target.tp):
        start = tp_rank * per_rank
        if start + per_rank <= table.size(0):
            shards.append(table[start:start + per_rank])                     # [V/tp, h]
        else:
            shards.append(fit_vocab_rows(table[start:], 0, per_rank))         # zeros appended
    return shards


def embedding_writes(target: SaveTarget, piece: Piece) -> list:
    meta = target.meta
    word = piece.tensors.get("word_embeddings")
    expected = {"word_embeddings": (0 if word is None else word.size(0), meta.hidden_size)}
    if meta.position_embedding_type == "learned_absolute":
        expected["position_embeddings"] = (meta.max_position_embeddings, meta.hidden_size)
    if target.heads and meta.num_tokentypes:
        expected["tokentype_embeddings"] = (meta.num_tokentypes, meta.hidden_size)
    check_tensors("the embeddings", piece.tensors, expected)
    writes = []
    for tp_rank, shard in enumerate(_vocab_shards(target, word, "the word embeddings")):
        writes.append((tp_rank, 0, ("language_model", "embedding", "word_embeddings", "weight"),
                       shard))
        if target.head_copy and target.pp > 1:
            writes.append((tp_rank, target.pp - 1, ("word_embeddings_for_head", "weight"), shard))
    if "position_embeddings" in piece.tensors:
        for tp_rank in range(target.tp):
            writes.append((tp_rank, 0, ("language_model", "embedding", "position_embeddings",
                                        "weight"), piece.tensors["position_embeddings"]))
    if "tokentype_embeddings" in piece.tensors:
        writes += [(tp_rank, 0, TOKENTYPE_KEYS, piece.tensors["tokentype_embeddings"])
                   for tp_rank in range(target.tp)]
    return writes


def _bert_head_writes(target: SaveTarget, piece: Piece) -> list:
    """A BERT head piece: the ``lm_head`` bias split over TP like the word embeddings (fitted to
    the target's padded vocabulary), every other tensor replicated, all on the last stage."""
    expected = dict(target.heads[piece.kind])
    bias = piece.tensors.get("bias")
    if piece.kind == BERT_VOCAB_TENSOR[0]:
        expected["bias"] = (0 if bias is None else bias.size(0),)
    check_tensors(f"the {piece.kind}", piece.tensors, expected)
    writes, last = [], target.pp - 1
    for name, tensor in piece.tensors.items():
        keys = BERT_HEAD_KEYS[piece.kind] + (name,)
        if (piece.kind, name) == BERT_VOCAB_TENSOR:
            shards = _vocab_shards(target, tensor, "the lm_head bias")
        else:
            shards = [tensor] * target.tp
        writes += [(tp_rank, last, keys, shard) for tp_rank, shard in enumerate(shards)]
    return writes


def _layer_writes(target: SaveTarget, piece: Piece) -> list:
    check_tensors(f"layer {piece.index}", piece.tensors, target.shapes[piece.index])
    pp_rank, local = target.stage_of(piece.index)
    writes = []
    for name, tensor in piece.tensors.items():
        rule = tp_split_rule(name, target.meta.gated_linear_unit)
        shards = ([tensor] * target.tp if rule is None
                  else split_tensor(tensor, rule[0], rule[1], target.tp))
        for tp_rank, shard in enumerate(shards):
            writes.append((tp_rank, pp_rank, ("language_model", "encoder",
                                              f"layers.{local}.{name}"), shard))
    return writes


def mtp_writes(target: SaveTarget, piece: Piece) -> list:
    """One multi-token prediction depth, split over TP like a layer, on the last stage."""
    check_tensors(f"MTP depth {piece.index}", piece.tensors, target.mtp_shapes)
    writes = []
    for name, tensor in piece.tensors.items():
        rule = mtp_split_rule(name, target.meta.swiglu)
        shards = ([tensor] * target.tp if rule is None
                  else split_tensor(tensor, rule[0], rule[1], target.tp))
        writes += [(tp_rank, target.pp - 1, ("mtp", f"layers.{piece.index}.{name}"), shard)
                   for tp_rank, shard in enumerate(shards)]
    return writes


def final_writes(target: SaveTarget, piece: Piece) -> list:
    meta, last = target.meta, target.pp - 1
    if piece.kind == "final_norm":
        names = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
        check_tensors("the final norm", piece.tensors, {n: (meta.hidden_size,) for n in names})
        return [(tp_rank, last, ("language_model", "encoder", f"final_layernorm.{name}"), tensor)
                for name, tensor in piece.tensors.items() for tp_rank in range(target.tp)]
    if target.tied:
        raise ConversionError("the stream has an output layer but the meta says the embeddings "
                              "are tied (untie_embeddings_and_output_weights is False)")
    weight = piece.tensors.get("weight")
    check_tensors("the output layer", piece.tensors,
                   {"weight": (weight.size(0) if weight is not None else 0, meta.hidden_size)})
    return [(tp_rank, last, ("language_model", "output_layer", "weight"), shard)
            for tp_rank, shard in enumerate(_vocab_shards(target, weight, "the output layer"))]


def _consume(pieces: Iterator[Piece], target: SaveTarget, files: dict,
             field: Optional[str] = None) -> None:
    """Write every piece into the target files (the optimizer's ``field`` when given, see
    :mod:`megatron.checkpoint.optimizer_state`); check that the stream is complete."""
    wanted = {"embeddings", "final_norm"} | ({"output_layer"} if not target.tied else set())
    wanted |= {("layer", i) for i in range(target.meta.num_layers)} | set(target.heads)
    wanted |= {("mtp", k) for k in range(target.meta.mtp_num_layers)}
    seen = set()
    for piece in pieces:
        key = (piece.kind, piece.index) if piece.kind in ("layer", "mtp") else piece.kind
        if key not in wanted and piece.kind != "output_layer":
            raise ConversionError(f"unexpected piece in the stream: {piece.kind}"
                                  + (f" {piece.index}" if piece.index is not None else ""))
        if key in seen:
            raise ConversionError(f"the stream holds {key} twice")
        seen.add(key)
        if piece.kind == "embeddings":
            writes = embedding_writes(target, piece)
        elif piece.kind == "layer":
            writes = _layer_writes(target, piece)
        elif piece.kind == "mtp":
            writes = mtp_writes(target, piece)
        elif piece.kind in target.heads:
            writes = _bert_head_writes(target, piece)
        else:
            writes = final_writes(target, piece)
        what = piece.kind if piece.index is None else f"{piece.kind} {piece.index}"
        if field is None:
            _write(target, files, writes, what)
        else:
            _write_optimizer(target, files, writes, field, f"{field} of the {what}")
        del writes, piece
    missing = wanted - seen
    if missing:
        names = sorted(str(k if isinstance(k, str) else f"{k[0]} {k[1]}") for k in missing)
        raise ConversionError(f"the stream ended without {', '.join(names[:5])}"
                              + (" ..." if len(names) > 5 else ""))


def _commit(staging: str, save_dir: str, target: SaveTarget, files: dict) -> str:
    """fsync every file, then publish the iteration folder and the tracker (renames)."""
    for path in files.values():
        refresh_zip_checksums(path)
        fsync_path(path)
        fsync_path(os.path.dirname(path))
    name = checkpoint_dir_name(target.meta.iteration, target.release)
    return publish(staging, save_dir, name,
                   "release" if target.release else str(target.meta.iteration))

def save_megatron(pieces: Iterable[Piece], save_dir: str, target_tp: int, target_pp: int, *,
                  make_vocab_size_divisible_by: Optional[int] = None,
                  optimizer_streams: Optional[Dict[str, Iterable[Piece]]] = None,
                  target_ep: int = 1, overwrite: bool = False,
                  key_style: str = LEGACY_KEYS) -> str:
    """Write the stream as a Megatron checkpoint at ``target_tp`` x ``target_pp`` in
    ``save_dir`` (new or empty, or with ``overwrite`` replaced whole once the new checkpoint is
    complete); returns the iteration folder.

    The vocabulary is padded to ``padded_vocab_size(meta.vocab_size, divisible_by, target_tp)``
    rows (``divisible_by`` defaults to the source's), as a training run at the target layout
    computes it; rows past the source's are zeros. A checkpoint with a training position is
    written as ``iter_XXXXXXX`` with that iteration and consumed samples; one without (iteration
    0, e.g. from Hugging Face) as ``release``. The checkpoint is written in a folder next to
    ``save_dir`` (:func:`megatron.convert.target.staged_target`) and renamed into place when every
    file is complete and fsynced; on any failure that folder is removed and ``save_dir`` is left
    as it was.

    ``target_ep`` > 1 writes Megatron-LM's expert-rank files ``mp_rank_..._{ep:03d}``: each
    holds the dense tensors and its E / ``target_ep`` experts under local numbers.

    ``optimizer_streams`` (``{field: stream}`` for ``exp_avg``, ``exp_avg_sq`` and, for a
    half-precision target, ``main``; each stream from the same source, in the weights' shapes)
    adds the Adam state, resharded like the weights, when ``meta.optimizer`` describes it.

    Raises:
        TargetRefusedError: a non-empty save dir without ``overwrite``.
        ConversionError: a target size that does not divide the model, or a stream that does
            not match its meta.
    """
    pieces = iter(pieces)
    first = next(pieces, None)
    if first is None or first.kind != "meta" or first.meta is None:
        raise ConversionError("the stream must start with its meta piece")
    target = SaveTarget(first.meta, target_tp, target_pp, make_vocab_size_divisible_by,
                        optimizer=bool(optimizer_streams), ep=target_ep, key_style=key_style)
    with staged_target(save_dir, overwrite) as root:
        staging = tempfile.mkdtemp(prefix=".tmp_convert_", dir=root)
        files = _create_files(target, staging)
        _consume(pieces, target, files)
        if target.optimizer:
            fields = optimizer_state.MOMENTS + ((optimizer_state.MAIN,) if target.half else ())
            for field in fields:
                stream = iter(optimizer_streams[field])
                next(stream)  # its meta piece: the same model
                _consume(stream, target, files, field)
            _write_steps(target, files)
        name = os.path.basename(_commit(staging, root, target, files))
    return os.path.join(save_dir, name)

"""The ``args`` a torch-format checkpoint records, and what a load checks them against.

A save records the run's flags as the checkpoint's ``args`` (:func:`checkpoint_args`, with the
checkpoint options of a :class:`~megatron.checkpoint.config.CheckpointConfig` and the training
position applied; :func:`plain_args` keeps the plain values). A load reads them back in this
project's conventions (:func:`megatron_args`: Megatron-LM writes some fields otherwise), refuses
a checkpoint whose model-shape flags (:data:`SHAPE_ARGS`) differ from the run's, and refuses the
expert-TP layouts the torch format cannot hold. ``--use-checkpoint-args`` takes
:data:`CHECKPOINT_ARGS` from them.
"""

import argparse
import dataclasses
from typing import Optional

import torch

from megatron.checkpoint import object_storage, safe_unpickle
from megatron.checkpoint.config import CheckpointConfig, torch_format_expert_tp_error
from megatron.checkpoint.layout import CheckpointError
from megatron.training.train_state import TrainState

# Flags that fix the shape of the saved tensors: a checkpoint cannot be loaded if they differ.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "max_position_embeddings",
              "position_embedding_type", "padded_vocab_size", "swiglu", "normalization",
              "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
              "bert_binary_head", "qk_layernorm", "multi_latent_attention")
# The same for mixture-of-experts models: which layers have experts, how many, how large.
MOE_SHAPE_ARGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
                  "moe_shared_expert_intermediate_size")
# How a SHAPE_ARGS entry is named in an error when its dest is not its flag's name.
_ARG_LABELS = {"bert_binary_head": "the BERT binary head (--bert-no-binary-head removes it)"}
# Also taken from the checkpoint with --use-checkpoint-args.
CHECKPOINT_ARGS = SHAPE_ARGS + ("seq_length", "group_query_attention", "rotary_percent",
                                "rotary_base", "apply_residual_connection_post_layernorm",
                                "openai_gelu", "norm_epsilon",
                                # Same shapes, different function: the weights mean nothing
                                # without them.
                                "apply_layernorm_1p", "squared_relu", "rotary_interleaved",
                                "quick_geglu", "glu_linear_offset",
                                "activation_func_clamp_value",
                                "rotary_seq_len_interpolation_factor",
                                "use_rope_scaling", "rope_scaling_factor",
                                "rotary_scaling_factor", "yarn_original_max_position_embeddings",
                                "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim",
                                "yarn_correction_range_round_to_int",
                                "apply_query_key_layer_scaling",
                                "window_size", "window_attn_skip_freq", "softmax_type",
                                "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                                "vocab_size", "null_tokenizer_eod_id",
                                "make_vocab_size_divisible_by",
                                "use_mup", "mup_width_mult", "mup_base_hidden_size",
                                "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
                                "mup_attn_scale_power",
                                # The per-layer blocks: the JSON travels in the saved
                                # arguments, so the file need not exist any more.
                                "heterogeneous_layers_config_path",
                                "heterogeneous_layers_config_encoded_json",
                                "enable_mhc_connections", "mhc_num_residual_streams",
                                "mhc_sinkhorn_iterations")
# Also taken with --use-checkpoint-args, as Megatron takes them: which layers have experts and
# how they route (the weights of a mixture-of-experts model mean nothing without them), the
# multi-token-prediction depth, the dropout rates, and the tiktoken pattern.
MOE_CHECKPOINT_ARGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
                       "moe_router_pre_softmax", "moe_grouped_gemm",
                       "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type",
                       "moe_aux_loss_coeff", "moe_router_score_function",
                       "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                       "moe_router_num_groups", "moe_router_group_topk", "moe_latent_size",
                       "moe_single_grouped_weight", "moe_single_grouped_bias",
                       # Beyond Megatron's list, for the same reason: the shared expert's
                       # gate, where the probabilities apply, the GLU row layouts.
                       "moe_shared_expert_gate", "moe_apply_probs_on_input",
                       "moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size")
OTHER_CHECKPOINT_ARGS = ("mtp_num_layers", "hidden_dropout", "attention_dropout",
                         "tiktoken_pattern")
# Of the flags above, those a run's own value wins over (Megatron's defaults of None: a run
# that gives one keeps it, and a different shape is then refused on load, by flag).
RUN_FIRST_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length",
                  "num_attention_heads", "kv_channels", "max_position_embeddings",
                  "padded_vocab_size")
# Taken too with --use-mp-args-from-checkpoint-args (Megatron's model-parallel set; the last only
# when this run gives none).
MP_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
           "expert_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
# Taken too unless --no-use-tokenizer-model-from-checkpoint-args.
TOKENIZER_MODEL_ARGS = ("tokenizer_type", "tokenizer_model")


def checkpoint_args(args, config: Optional[CheckpointConfig] = None,
                    train_state: Optional[TrainState] = None) -> argparse.Namespace:
    """The flags a save or a load works with, and that a save records as the checkpoint's
    ``args``: a copy of ``args``, with the fields of ``config`` in place of the checkpoint flags
    of the same names (so a conversion saves elsewhere, or a finetuning start loads another
    folder, and the run's flags stay as parsed), and with the training position of
    ``train_state`` under Megatron's keys (``consumed_train_samples``,
    ``consumed_valid_samples``)."""
    fields = dict(vars(args))
    if config is not None:
        fields.update(dataclasses.asdict(config))
    if train_state is not None:
        fields.update(train_state.saved_args_fields())
    return argparse.Namespace(**fields)


def plain_args(args) -> argparse.Namespace:
    """The plain values of ``args``, as a checkpoint records them (an msc:// --save / --load
    as its URL, not its local mirror)."""
    plain = (type(None), bool, int, float, str, list, tuple, dict, torch.dtype)
    saved = argparse.Namespace(**{k: v for k, v in vars(args).items() if isinstance(v, plain)})
    object_storage.recorded_paths(saved)
    return saved


def _expert_tp_size(args, pstate) -> Optional[int]:
    """This run's expert-TP size when its experts are split otherwise than by TP (None for a
    dense model, or experts split by TP)."""
    layout = getattr(pstate, "layout", None)
    if not getattr(args, "num_experts", None) or layout is None:
        return None
    return None if layout.expert_tp_size == layout.tp_size else layout.expert_tp_size


def refuse_torch_save(args, pstate) -> None:
    """The torch format cannot hold experts split otherwise than by TP (see
    :func:`megatron.checkpoint.config.torch_format_expert_tp_error`); every rank raises
    alike, before anything is written."""
    etp = _expert_tp_size(args, pstate)
    if etp is not None:
        raise CheckpointError(torch_format_expert_tp_error(pstate.tp_size, etp,
                                                           "--ckpt-format torch cannot save"))


def refuse_torch_load(args, pstate, saved, path: str) -> None:
    """A torch-format checkpoint neither loads into a run whose experts are split otherwise
    than by TP, nor was written by one (its ``saved`` args say so: Megatron-LM's own)."""
    etp = _expert_tp_size(args, pstate)
    if etp is not None:
        raise CheckpointError(torch_format_expert_tp_error(
            pstate.tp_size, etp, f"{path}: a --ckpt-format torch checkpoint cannot load at",
            f"load it at --expert-tensor-parallel-size {pstate.tp_size} and write it with "
            "--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR, then --load NEW_DIR"))
    saved_tp = getattr(saved, "tensor_model_parallel_size", None)
    saved_etp = getattr(saved, "expert_tensor_parallel_size", None)
    if getattr(saved, "num_experts", None) and saved_etp not in (None, saved_tp):
        raise CheckpointError(torch_format_expert_tp_error(
            saved_tp, saved_etp, f"{path}: a --ckpt-format torch checkpoint saved at",
            "its expert tensors cannot be told apart; save it with --ckpt-format torch_dist"))


def megatron_args(saved: Optional[argparse.Namespace]) -> Optional[argparse.Namespace]:
    """A checkpoint's saved ``args`` in this project's conventions (a copy; None stays None).

    Megatron-LM writes some fields differently from the flags this project derives: without
    ``--group-query-attention`` it stores ``num_query_groups`` = 1 (here: the number of heads);
    older files spell rotary embeddings ``use_rotary_position_embeddings`` and the norm epsilon
    ``layernorm_epsilon``, and may lack ``kv_channels`` / ``ffn_hidden_size`` (derived from the
    hidden size); a ``NullTokenizer``'s end-of-document id is set explicitly
    (``null_tokenizer_eod_id``): within ``vocab_size`` for Megatron-Core's tokenizers, after it
    for older writers. Megatron's own
    classes (``model_type`` and other enums, read as
    :class:`~megatron.checkpoint.safe_unpickle.StandIn`) are dropped: they are not flags here.
    """
    if saved is None:
        return None
    fields = {k: v for k, v in vars(saved).items()
              if not safe_unpickle.stand_ins_in(v)}
    heads = fields.get("num_attention_heads")
    if heads and not fields.get("group_query_attention", False) and "num_query_groups" in fields:
        fields["num_query_groups"] = heads
    if fields.get("use_rotary_position_embeddings"):
        fields["position_embedding_type"] = "rope"
    if fields.get("norm_epsilon") is None and fields.get("layernorm_epsilon") is not None:
        fields["norm_epsilon"] = fields["layernorm_epsilon"]
    if (fields.get("tokenizer_type") == "NullTokenizer"
            and fields.get("null_tokenizer_eod_id") is None and fields.get("vocab_size")):
        # Megatron-Core's tokenizers (their arguments carry null_tokenizer_pad_id): the
        # vocabulary is --vocab-size ids, the last one the end of document. Without that
        # field (Megatron's legacy tokenizer, this project before it recorded the id): the
        # end of document was appended after them.
        size = int(fields["vocab_size"])
        fields["null_tokenizer_eod_id"] = size - 1 if "null_tokenizer_pad_id" in fields else size
    hidden = fields.get("hidden_size")
    if hidden and heads and fields.get("kv_channels") is None:
        fields["kv_channels"] = hidden // heads
    if hidden and fields.get("ffn_hidden_size") is None and not fields.get("swiglu"):
        fields["ffn_hidden_size"] = 4 * hidden
    return argparse.Namespace(**fields)


def _shape_value(ns, name: str):
    """The value of SHAPE_ARGS entry ``name`` that decides tensor shapes: a QKV bias is there
    with ``--add-qkv-bias`` or with the linear biases Megatron adds by default."""
    if name == "add_qkv_bias":
        return bool(getattr(ns, "add_qkv_bias", False) or getattr(ns, "add_bias_linear", True))
    if name in MOE_SHAPE_ARGS[1:] and not getattr(ns, "num_experts", None):
        return None                    # a dense model: the MoE flags shape nothing
    value = getattr(ns, name)
    if name == "moe_layer_freq":       # Megatron saves a list, or the flag's text
        from megatron.model.moe.config import parse_moe_layer_freq

        value = parse_moe_layer_freq(value) if isinstance(value, str) else value
        if isinstance(value, int):     # which layers have experts: N and a list may agree
            value = [int(i % value == 0) for i in range(getattr(ns, "num_layers", 0))]
        return "".join(str(int(v)) for v in value)
    if name == "moe_ffn_hidden_size" and value is None:
        return getattr(ns, "ffn_hidden_size", None)   # Megatron's default
    return value


def check_args(saved, args, path: str, ignore=()) -> None:
    if saved is None:
        return
    saved = megatron_args(saved)
    diffs = [f"{_ARG_LABELS.get(n, '--' + n.replace('_', '-'))} "
             f"(checkpoint {_shape_value(saved, n)!r}, flags {_shape_value(args, n)!r})"
             for n in SHAPE_ARGS + MOE_SHAPE_ARGS
             if n not in ignore and hasattr(saved, n) and hasattr(args, n)
             and _shape_value(saved, n) != _shape_value(args, n)]
    if diffs:
        raise CheckpointError(f"{path}: the model shape differs from the flags: "
                              + "; ".join(diffs))
    _check_phase_batch(saved, args, path)


def _check_phase_batch(saved, args, path: str) -> None:
    """With --phase-transition-iterations, phases are iterations x the global batch: a
    checkpoint written with another batch size would put the phase boundaries elsewhere."""
    if not getattr(args, "phase_transition_iterations", None):
        return
    before = getattr(saved, "global_batch_size", None)
    if before is not None and before != args.global_batch_size:
        raise CheckpointError(f"{path}: --phase-transition-iterations needs the global batch "
                              f"size the checkpoint was trained with ({before}); the flags "
                              f"give --global-batch-size {args.global_batch_size}")

"""The checks behind :func:`megatron.training.arguments.validate_args`, one group of flags each.

Each step derives the sizes its flags imply (data-parallel size, micro-batches, ffn size, kv
channels, ...) and raises :class:`ArgumentsError`, naming the flags and values, on combinations
that cannot work, before any process group exists; :func:`validate_bert_args` adds what
pretrain_bert.py needs. :func:`check_flags` runs the steps in order (after
:func:`megatron.training.arguments.validate_args` has checked the flag registry), and
:mod:`megatron.training.arguments` re-exports the public names.
"""

import argparse
import json
import math
import os
from typing import List, Optional, Tuple

import torch

from megatron.core import device
from megatron.core.config import (ConfigError, check_window_settings, numerics_flag_conflict,
                                  pipeline_layer_counts)
from megatron.core.mup import mup_flag_problem, mup_model_conflict, mup_optimizer_conflict
from megatron.core.parallel_state import (DEFAULT_ORDER, TP_PP_DP_ORDER, LayoutError,
                                          check_degrees)
from megatron.core.pipeline_parallel.layer_layout import (accounted_stage_counts,
                                                          layout_stage_counts,
                                                          ranks_without_parameters,
                                                          mtp_standalone_stage,
                                                          standalone_embedding_layout)
from megatron.core.heterogeneous import check_blocks_splittable
from megatron.core.pipeline_parallel.schedules import check_microbatch_group_size
from megatron.training.distillation.checks import distillation_flags_problem
from megatron.training.configs import (build_checkpoint_config, build_moe_config,
                                       heterogeneous_blocks)


class ArgumentsError(ValueError):
    """Flags that cannot work together; the message names the flags and values."""


def _note(args, message: str) -> None:
    if args.rank == 0:
        print(f"NOTE: {message}", flush=True)


def _fail(message: str):
    raise ArgumentsError(message)


def _require(args, *names: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        _fail(f"missing required flag(s): {', '.join(missing)}")


def _validate_checkpoint_format(args) -> None:
    if args.use_dist_ckpt:
        args.ckpt_format = "torch_dist"
    if (args.ckpt_convert_format is None) != (args.ckpt_convert_save is None):
        _fail("--ckpt-convert-format and --ckpt-convert-save go together (the format to "
              "convert --load to, and the folder to write it in)")
    if args.ckpt_convert_format is not None and not args.load:
        _fail("--ckpt-convert-format needs --load: the checkpoint to convert")
    if args.ckpt_format == "fsdp_dtensor" and (args.save or args.load) \
            and not args.use_torch_fsdp2:
        from megatron.checkpoint.fsdp_dtensor import not_fully_sharded_error

        _fail(not_fully_sharded_error("--ckpt-format fsdp_dtensor"))
    if args.ckpt_format == "torch_dcp":
        from megatron.checkpoint.torch_dcp import layout_error

        error = layout_error("--ckpt-format torch_dcp", getattr(args, "use_torch_fsdp2", False),
                             args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        if error:
            _fail(error)
    if args.dist_ckpt_save_pre_mcore_014 and args.use_distributed_optimizer \
            and not args.ckpt_fully_parallel_save:
        _fail("--dist-ckpt-save-pre-mcore-014 with --no-ckpt-fully-parallel-save and "
              "--use-distributed-optimizer: Megatron-Core before 0.14 then gathers the "
              "optimizer state on one rank (dp_zero_gather_scatter), a layout not built here; "
              "drop --no-ckpt-fully-parallel-save (each rank then writes its own range)")
    if args.num_experts is not None:   # after _validate_moe, which sets the expert-TP size
        try:
            build_checkpoint_config(args).check_expert_tensor_parallel(
                args.tensor_model_parallel_size, args.expert_tensor_parallel_size)
        except ConfigError as err:
            _fail(str(err))


def _validate_msc_checkpoints(args) -> None:
    """msc:// --save / --load (--enable-msc): checked, then pointed at their local mirrors
    (megatron/checkpoint/object_storage.py)."""
    from megatron.checkpoint import object_storage
    from megatron.core.msc import ObjectStorageError

    try:
        object_storage.resolve_urls(args)
    except ObjectStorageError as err:
        _fail(str(err))


def _validate_non_persistent(args) -> None:
    """--non-persistent-*: a type to go with the interval, the folder it needs, and a
    replication layout that fits the world (megatron/checkpoint/non_persistent.py)."""
    kind = args.non_persistent_ckpt_type
    if kind == "in_memory":
        _fail("--non-persistent-ckpt-type in_memory is not implemented in Megatron-LM either: "
              "its flag lists it as to be done (a local checkpoint that avoids serialization), "
              "its argument check accepts only global and local, and its save raises "
              "NotImplementedError for any other type; use local (with --replication for "
              "copies on other nodes) or global")
    if args.non_persistent_save_interval is not None and kind is None:
        _fail("--non-persistent-save-interval needs --non-persistent-ckpt-type global or local")
    if (kind == "global" and args.non_persistent_save_interval is not None
            and not (args.save or args.non_persistent_global_ckpt_dir)):
        _fail("--non-persistent-ckpt-type global needs --save (it writes SAVE/non_persistent) "
              "or --non-persistent-global-ckpt-dir")
    if kind != "local":
        return
    if not args.non_persistent_local_ckpt_dir:
        _fail("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir")
    for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                     ("--use-torch-fsdp2", getattr(args, "use_torch_fsdp2", False))):
        if on:
            _fail(f"--non-persistent-ckpt-type local with {flag} is not built: a local "
                  "checkpoint holds each rank's whole optimizer state; use global")
    from megatron.checkpoint.non_persistent import replication_error
    error = replication_error(args.world_size, args.replication, args.replication_jump,
                              args.replication_factor)
    if error:
        _fail(error)


def _apply_old_spellings(args) -> None:
    """Map flags that older Megatron scripts pass onto their current meaning."""
    if args.batch_size is not None:
        if args.micro_batch_size is None:
            args.micro_batch_size = args.batch_size
        _note(args, "--batch-size is the old name of --micro-batch-size")
    if args.warmup is not None:
        args.lr_warmup_iters = args.warmup
        _note(args, "--warmup is the old name of --lr-warmup-iters")
    if args.model_parallel_size is not None:
        args.tensor_model_parallel_size = args.model_parallel_size
        _note(args, "--model-parallel-size is the old name of --tensor-model-parallel-size")
    if args.layernorm_epsilon is not None:
        args.norm_epsilon = args.layernorm_epsilon
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        _fail("--no-position-embedding is deprecated (as in Megatron); use "
              "--position-embedding-type none")
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
        _note(args, "--checkpoint-activations means --recompute-granularity full "
                    "--recompute-method uniform")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.encoder_seq_length is not None:
        if args.seq_length is not None and args.seq_length != args.encoder_seq_length:
            _fail(f"--seq-length ({args.seq_length}) and --encoder-seq-length "
                  f"({args.encoder_seq_length}) disagree")
        args.seq_length = args.encoder_seq_length
    if args.encoder_num_layers is not None and args.num_layers is None:
        args.num_layers = args.encoder_num_layers


# Every size, count and interval flag with the smallest value it takes, checked before any
# value is derived from them (a --global-batch-size 0 used to surface as "lr decay steps ...
# must be > 0"). 0 is a real setting only where listed with 0: no evaluation (--eval-iters),
# no warmup, no data-loader workers, no manual GC, no extra vocabulary ids.
SIZE_FLAG_MINIMA = (
    ("num_layers", 1), ("encoder_num_layers", 1), ("hidden_size", 1), ("ffn_hidden_size", 1),
    ("num_attention_heads", 1), ("kv_channels", 1), ("num_query_groups", 1),
    ("max_position_embeddings", 1), ("rotary_base", 1), ("make_vocab_size_divisible_by", 1),
    ("vocab_size", 1), ("vocab_extra_ids", 0), ("seq_length", 1), ("encoder_seq_length", 1),
    ("micro_batch_size", 1), ("batch_size", 1), ("global_batch_size", 1),
    ("microbatch_group_size_per_vp_stage", 1), ("gpu_sniff_test_interval", 1),
    ("distributed_timeout_seconds_after_init", 1), ("flight_recorder_trace_buffer_size", 0),
    ("recompute_num_layers", 1), ("train_iters", 1), ("train_samples", 1),
    ("lr_decay_iters", 1), ("lr_decay_samples", 1), ("lr_wsd_decay_iters", 1),
    ("lr_wsd_decay_samples", 1), ("lr_warmup_iters", 0), ("lr_warmup_samples", 0),
    ("warmup", 0), ("log_interval", 1), ("tensorboard_log_interval", 1),
    ("tensorboard_queue_size", 1), ("eval_iters", 0), ("eval_interval", 1),
    ("save_interval", 1), ("exit_interval", 1), ("exit_duration_in_mins", 1),
    ("manual_gc_interval", 0), ("loss_spike_window", 1), ("hysteresis", 1),
    ("error_injection_rate", 0), ("check_weight_hash_across_dp_replicas_interval", 1),
    ("num_workers", 0), ("distributed_timeout_minutes", 1), ("ddp_bucket_size", 1),
    ("tensor_model_parallel_size", 1), ("model_parallel_size", 1),
    ("pipeline_model_parallel_size", 1), ("num_layers_per_virtual_pipeline_stage", 1),
    ("context_parallel_size", 1), ("num_experts", 1), ("expert_model_parallel_size", 1),
    ("expert_tensor_parallel_size", 1), ("moe_ffn_hidden_size", 1), ("moe_router_topk", 1),
    ("moe_shared_expert_intermediate_size", 1), ("num_virtual_stages_per_pipeline_rank", 1),
    ("eval_global_batch_size", 1), ("eval_micro_batch_size", 1), ("save_retain_interval", 1),
    ("non_persistent_save_interval", 1), ("replication_jump", 1), ("replication_factor", 1),
    ("padded_vocab_size", 1), ("save_params_interval", 1), ("save_activations_interval", 1),
    ("save_tokens_per_expert_interval", 1), ("save_wgrads_interval", 1),
    ("save_dgrads_interval", 1),
)
DUMP_INTERVAL_FLAGS = ("save_params_interval", "save_activations_interval",
                       "save_tokens_per_expert_interval", "save_wgrads_interval",
                       "save_dgrads_interval")


def _validate_sizes(args) -> None:
    """Each flag of :data:`SIZE_FLAG_MINIMA` that is given is at least its minimum."""
    for name, minimum in SIZE_FLAG_MINIMA:
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            _fail(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def _validate_watchdogs(args) -> None:
    """The straggler report's count and port, and the hang watchdog's timeout."""
    if args.straggler_minmax_count < 1:
        _fail(f"--straggler-minmax-count must be >= 1, got {args.straggler_minmax_count}")
    if not 1 <= args.straggler_ctrlr_port <= 65535:
        _fail(f"--straggler-ctrlr-port must be a TCP port in 1..65535, got "
              f"{args.straggler_ctrlr_port}")
    timeout = args.hang_dump_timeout_s
    if timeout is None:
        return
    if not timeout > 0:
        _fail(f"--hang-dump-timeout-s must be > 0 seconds, got {timeout}")
    if timeout >= args.distributed_timeout_minutes * 60:
        _fail(f"--hang-dump-timeout-s {timeout:g} must be below --distributed-timeout-minutes "
              f"{args.distributed_timeout_minutes} (x 60 = "
              f"{args.distributed_timeout_minutes * 60} s): a collective times out and ends "
              "the job first, before any stack is written")


def _read_data_args_files(args) -> None:
    """--data-args-path / --per-split-data-args-path: the path flags' values, read from files."""
    if args.data_args_path is not None:
        if args.data_path:
            _fail("give only one of --data-path and --data-args-path")
        try:
            with open(args.data_args_path) as f:
                args.data_path = f.read().split()
        except OSError as err:
            _fail(f"--data-args-path {args.data_args_path}: cannot read it ({err.strerror})")
    if args.per_split_data_args_path is None:
        return
    path = args.per_split_data_args_path
    if any((args.train_data_path, args.valid_data_path, args.test_data_path)):
        _fail("give only one of --per-split-data-args-path and --train/--valid/--test-data-path")
    try:
        with open(path) as f:
            splits = json.load(f)
    except OSError as err:
        _fail(f"--per-split-data-args-path {path}: cannot read it ({err.strerror})")
    except ValueError as err:
        _fail(f"--per-split-data-args-path {path}: not JSON ({err})")
    if not isinstance(splits, dict) or set(splits) - {"train", "valid", "test"}:
        _fail(f"--per-split-data-args-path {path}: expected a JSON object with keys train, "
              f"valid and test, got {type(splits).__name__} "
              f"{sorted(splits) if isinstance(splits, dict) else ''}")
    for split in ("train", "valid", "test"):
        value = splits.get(split)
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, (str, int, float)) for v in value)):
            _fail(f"--per-split-data-args-path {path}: {split!r} must be a list of [weight] "
                  f"prefix values or one string, got {value!r}")
        setattr(args, f"{split}_data_path", [str(v) for v in value] if value else None)


def _one_cp_comm_type(args) -> None:
    """--cp-comm-type takes Megatron's list: one type for every layer, or one per layer (kept
    as a list; Megatron's allgather is all_gather; a list of one type becomes that type)."""
    given = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    types = ["all_gather" if t == "allgather" else t for t in given]
    if len(set(types)) == 1:
        args.cp_comm_type = types[0]
        return
    if len(types) != args.num_layers:
        _fail(f"--cp-comm-type {' '.join(given)}: give one type for every layer, or one per "
              f"layer (--num-layers {args.num_layers}), not {len(types)}")
    args.cp_comm_type = types


def _attention_backend(args) -> None:
    """--attention-backend onto --use-flash-attn / --masked-softmax-fusion (the switches the
    attention reads); ``args.attention_backend`` keeps the flag's value."""
    from megatron.model.attention_backend import AttentionBackendError, backend_name, resolve

    try:
        _, args.use_flash_attn, args.masked_softmax_fusion = resolve(
            backend_name(args.attention_backend), transformer_impl=args.transformer_impl,
            seq_length=args.seq_length or 0, softmax_type=args.softmax_type,
            use_flash_attn=args.use_flash_attn,
            masked_softmax_fusion=args.masked_softmax_fusion, on_cpu=_on_cpu(args),
            half=bool(args.fp16 or args.bf16))
    except AttentionBackendError as err:
        _fail(str(err))


def _validate_surface(args) -> None:
    """The implementation, profiling and data-file flags."""
    _one_cp_comm_type(args)
    _attention_backend(args)
    if args.transformer_impl == "transformer_engine":
        _note(args, "--transformer-impl transformer_engine: this project's own layers compute "
                    "the same function as TransformerEngine's (TransformerEngine itself is not "
                    "used)")
    if args.profile:
        if args.profile_step_start < 0 or args.profile_step_end <= args.profile_step_start:
            _fail(f"--profile-step-end ({args.profile_step_end}) must be larger than "
                  f"--profile-step-start ({args.profile_step_start}) >= 0")
        if args.use_pytorch_profiler and not args.tensorboard_dir:
            _fail("--use-pytorch-profiler writes its trace into --tensorboard-dir; give one")
    _validate_memory_tools(args)
    _read_data_args_files(args)


def _on_cpu(args) -> bool:
    return device.resolves_to_cpu(args.device)


def _validate_memory_tools(args) -> None:
    """--log-memory-interval, --record-memory-history, --nvtx-ranges and
    --pytorch-profiler-collect-chakra."""
    interval = args.log_memory_interval
    if interval is not None and (interval <= 0 or interval % args.log_interval):
        _fail(f"--log-memory-interval ({interval}) must be a positive multiple of "
              f"--log-interval ({args.log_interval})")
    if args.log_device_memory_used and interval is None:
        _note(args, "--log-device-memory-used adds to the --log-memory-interval report; "
                    "without --log-memory-interval it has no effect")
    if args.record_memory_history and _on_cpu(args):
        _fail("--record-memory-history records the CUDA caching allocator's history and this "
              "run is on CPU; drop it (--log-memory-interval reports the process's memory)")
    if args.nvtx_ranges and (not args.profile or _on_cpu(args)):
        _note(args, "--nvtx-ranges marks the profiled iterations for nsys on GPUs; "
                    + ("on CPU" if args.profile else "without --profile") + " it has no effect")
    if args.pytorch_profiler_collect_chakra and not (args.profile
                                                     and args.use_pytorch_profiler):
        _note(args, "--pytorch-profiler-collect-chakra records with --profile "
                    "--use-pytorch-profiler; without them it has no effect")


def _validate_context_parallel(args) -> None:
    """--context-parallel-size: the sequence, heads and masks must split over the cp ranks."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    _hierarchical_cp_sizes(args)
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        _fail(f"--seq-length ({args.seq_length}) is not divisible by 2 x "
              f"--context-parallel-size ({cp}) = {2 * cp}: each sequence is cut into "
              f"{2 * cp} equal chunks")
    types = [args.cp_comm_type] if isinstance(args.cp_comm_type, str) else args.cp_comm_type
    heads = args.num_attention_heads // tp
    inner = (args.hierarchical_context_parallel_sizes or [1])[0]
    for comm_type, ways, flag in (
            ("a2a", cp, f"--context-parallel-size {cp}"),
            ("a2a+p2p", inner, f"the first --hierarchical-context-parallel-sizes {inner}")):
        if comm_type in types and heads % ways:
            _fail(f"--cp-comm-type {comm_type} splits the {heads} attention heads per "
                  f"tensor-parallel rank (--num-attention-heads {args.num_attention_heads} / "
                  f"--tensor-model-parallel-size {tp}) over {flag}; they must divide evenly "
                  "(or use --cp-comm-type p2p or all_gather)")


def _hierarchical_cp_sizes(args) -> None:
    """--hierarchical-context-parallel-sizes: two sizes multiplying to
    --context-parallel-size; --cp-comm-type a2a+p2p needs them."""
    sizes, cp = args.hierarchical_context_parallel_sizes, args.context_parallel_size
    types = [args.cp_comm_type] if isinstance(args.cp_comm_type, str) else args.cp_comm_type
    if sizes is None:
        if "a2a+p2p" in types and cp > 1:
            _fail("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the "
                  "all-to-all and the p2p sizes, multiplying to --context-parallel-size "
                  f"{cp})")
        return
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        _fail(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: expected "
              f"two sizes (all-to-all, p2p) whose product is --context-parallel-size {cp}")


def _validate_parallel(args) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    experts = args.num_experts is not None
    try:  # the layout's own check, so validation and the process groups cannot disagree
        args.data_parallel_size = check_degrees(
            args.world_size, tp, cp, pp,
            ep_size=args.expert_model_parallel_size if experts else 1,
            expert_tp_size=args.expert_tensor_parallel_size if experts else None,
            order=TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping else DEFAULT_ORDER)
    except LayoutError as err:
        _fail(str(err))
    _validate_context_parallel(args)
    if args.sequence_parallel and tp == 1:
        _note(args, "--sequence-parallel has no effect with --tensor-model-parallel-size 1; "
                    "disabling it")
        args.sequence_parallel = False
    if not (_standalone_embedding_split(args) or _custom_pipeline_split(args)):
        _even_pipeline_split(args, pp)
    if args.num_attention_heads % tp != 0:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.group_query_attention and args.num_query_groups % tp != 0:
        _fail(f"--num-query-groups ({args.num_query_groups}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.ffn_hidden_size % tp != 0:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        _fail("--overlap-param-gather needs --use-distributed-optimizer")
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        args.distributed_backend = "gloo"


def _validate_weight_shards(args) -> None:
    """--tensor-parallel-num-weight-shards N: N / tp weight shards out of data parallelism,
    and, in one line each, what does not run with them yet."""
    n = args.tensor_parallel_num_weight_shards
    if n is None:
        return
    flag = f"--tensor-parallel-num-weight-shards {n}"
    tp, dp = args.tensor_model_parallel_size, args.data_parallel_size
    if n < tp or n % tp:
        _fail(f"{flag} must be a multiple of --tensor-model-parallel-size ({tp})")
    if dp % (n // tp):
        _fail(f"{flag}: its {n // tp} weight shards per tensor-parallel rank must divide the "
              f"data-parallel size ({dp})")
    unwired = [("--pipeline-model-parallel-size > 1", args.pipeline_model_parallel_size > 1),
               ("--context-parallel-size > 1", args.context_parallel_size > 1),
               ("--use-tp-pp-dp-mapping", args.use_tp_pp_dp_mapping),
               ("--use-distributed-optimizer", args.use_distributed_optimizer),
               ("--use-torch-fsdp2 / --use-megatron-fsdp",
                args.use_torch_fsdp2 or args.use_megatron_fsdp),
               ("--mtp-num-layers", bool(getattr(args, "mtp_num_layers", None))),
               (f"--optimizer {args.optimizer}",
                args.optimizer not in ("adam", "sgd", "lion"))]
    for what, on in unwired:
        if on:
            _fail(f"{flag} does not run with {what} yet")
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        _fail(f"{flag}: checkpoints of weight shards are written and read with "
              f"--ckpt-format torch_dist only (got {args.ckpt_format})")
    if (args.save or args.load) and (args.swiglu or getattr(args, "quick_geglu", False)):
        _fail(f"{flag}: a gated MLP (--swiglu / --quick-geglu) cut into weight shards has no "
              "torch_dist checkpoint layout yet")


def _validate_expert_weight_shards(args) -> None:
    """--expert-tensor-parallel-num-weight-shards N: N / expert-tp weight shards of every
    routed expert out of expert data parallelism, and, in one line each, what does not run
    with them yet."""
    n = getattr(args, "expert_tensor_parallel_num_weight_shards", None)
    if n is None:
        return
    flag = f"--expert-tensor-parallel-num-weight-shards {n}"
    if args.num_experts is None:
        _fail(f"{flag} cuts the routed experts' weights: it needs --num-experts")
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    if n < etp or n % etp:
        _fail(f"{flag} must be a multiple of --expert-tensor-parallel-size ({etp})")
    stage = args.tensor_model_parallel_size * args.context_parallel_size * args.data_parallel_size
    edp = stage // (etp * ep)
    if edp % (n // etp):
        _fail(f"{flag}: its {n // etp} weight shards per expert-tensor-parallel rank must "
              f"divide the expert-data-parallel size ({edp})")
    unwired = [("--pipeline-model-parallel-size > 1", args.pipeline_model_parallel_size > 1),
               ("--context-parallel-size > 1", args.context_parallel_size > 1),
               ("--use-tp-pp-dp-mapping", args.use_tp_pp_dp_mapping),
               ("--use-distributed-optimizer", args.use_distributed_optimizer),
               ("--use-torch-fsdp2 / --use-megatron-fsdp",
                args.use_torch_fsdp2 or args.use_megatron_fsdp),
               ("--moe-single-grouped-weight / --moe-single-grouped-bias",
                args.moe_single_grouped_weight or args.moe_single_grouped_bias),
               ("--mtp-num-layers", bool(getattr(args, "mtp_num_layers", None))),
               (f"--optimizer {args.optimizer}",
                args.optimizer not in ("adam", "sgd", "lion"))]
    for what, on in unwired:
        if on:
            _fail(f"{flag} does not run with {what} yet")
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        _fail(f"{flag}: checkpoints of weight shards are written and read with "
              f"--ckpt-format torch_dist only (got {args.ckpt_format})")
    gated = args.swiglu or getattr(args, "quick_geglu", False)
    if (args.save or args.load) and gated and args.moe_mlp_glu_interleave_size is None:
        _fail(f"{flag}: a gated expert fc1 (--swiglu / --quick-geglu) cut into weight shards "
              "has no torch_dist checkpoint layout yet (its GLU-interleaved layout, "
              "--moe-mlp-glu-interleave-size, has)")


def _even_pipeline_split(args, pp: int) -> None:
    """The layers split evenly, or by --decoder-first/last-pipeline-num-layers, with or without
    virtual stages."""
    uneven = (args.decoder_first_pipeline_num_layers is not None
              or args.decoder_last_pipeline_num_layers is not None)
    try:
        pipeline_layer_counts(args.num_layers, pp, args.decoder_first_pipeline_num_layers,
                              args.decoder_last_pipeline_num_layers)
    except ConfigError as err:
        _fail(str(err))
    if uneven and pp < 2:
        _fail("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size "
              f">= 2, got {pp}")
    if uneven and args.num_layers_per_virtual_pipeline_stage is not None:
        _fail("--decoder-first/last-pipeline-num-layers cannot be combined with "
              "--num-layers-per-virtual-pipeline-stage")
    _virtual_stages_per_rank(args)
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_vstage = args.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs "
                  f"--pipeline-model-parallel-size >= 2, got {pp}")
        if per_vstage < 1 or (args.num_layers // pp) % per_vstage != 0:
            _fail(f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) "
                  f"= {args.num_layers // pp} layers per stage, not divisible by "
                  f"--num-layers-per-virtual-pipeline-stage ({per_vstage})")
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // per_vstage


def _standalone_embedding_split(args) -> bool:
    """--standalone-embedding-stage: pipeline rank 0 holds only the input embedding, the
    layers are split evenly over the other ranks (virtual stages included, as Megatron-LM
    counted them: layers per rank / --num-layers-per-virtual-pipeline-stage). Written as the
    equivalent --pipeline-model-parallel-layout, which the model, the checkpoints and the
    converters then follow; False when the flag is off."""
    if not args.standalone_embedding_stage:
        return False
    flag, pp = "--standalone-embedding-stage", args.pipeline_model_parallel_size
    if pp < 2:
        _fail(f"{flag} needs --pipeline-model-parallel-size >= 2 (one stage for the embedding, "
              f"the others for the layers), got {pp}")
    for other, value in (("--decoder-first-pipeline-num-layers",
                          args.decoder_first_pipeline_num_layers),
                         ("--decoder-last-pipeline-num-layers",
                          args.decoder_last_pipeline_num_layers),
                         ("--account-for-embedding-in-pipeline-split",
                          args.account_for_embedding_in_pipeline_split or None),
                         ("--account-for-loss-in-pipeline-split",
                          args.account_for_loss_in_pipeline_split or None)):
        if value is not None:
            _fail(f"{flag} cannot be combined with {other} (write the stages out with "
                  "--pipeline-model-parallel-layout instead)")
    vp = _standalone_virtual_stages(args, args.num_layers // (pp - 1))
    try:
        layout = standalone_embedding_layout(args.num_layers, pp, vp)
    except ConfigError as err:
        _fail(str(err))
    if args.pipeline_model_parallel_layout not in (None, layout):
        _fail(f"{flag} cannot be combined with --pipeline-model-parallel-layout; its stages are "
              f"the layout {layout!r}")
    args.pipeline_model_parallel_layout = layout
    args.virtual_pipeline_model_parallel_size = vp
    return True


def _standalone_virtual_stages(args, per_rank: int) -> Optional[int]:
    """Virtual stages per rank with --standalone-embedding-stage, from
    --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank."""
    per_vstage = args.num_layers_per_virtual_pipeline_stage
    stages = args.num_virtual_stages_per_pipeline_rank
    if per_vstage is not None and stages is not None:
        _fail("give only one of --num-layers-per-virtual-pipeline-stage and "
              "--num-virtual-stages-per-pipeline-rank")
    if per_vstage is not None:
        if per_vstage < 1 or per_rank % per_vstage:
            _fail(f"--standalone-embedding-stage: the {per_rank} layers of each pipeline rank "
                  f"after the first are not divisible by --num-layers-per-virtual-pipeline-stage "
                  f"({per_vstage})")
        stages = per_rank // per_vstage
    return stages if stages is not None and stages > 1 else None


def _custom_pipeline_split(args) -> bool:
    """--pipeline-model-parallel-layout or --account-for-embedding/loss-in-pipeline-split: check
    the stage contents they imply and derive the virtual stages; False when neither is given."""
    layout, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    accounted = [f for f, on in (("--account-for-embedding-in-pipeline-split",
                                  args.account_for_embedding_in_pipeline_split),
                                 ("--account-for-loss-in-pipeline-split",
                                  args.account_for_loss_in_pipeline_split)) if on]
    if layout is None and not accounted:
        return False
    name = "--pipeline-model-parallel-layout" if layout is not None else accounted[0]
    others = [("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
              ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers),
              ("--num-layers-per-virtual-pipeline-stage",
               args.num_layers_per_virtual_pipeline_stage)]
    if layout is not None:
        others += [(f, True) for f in accounted] + [
            ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank)]
    for flag, value in others:
        if value is not None:
            _fail(f"{name} cannot be combined with {flag}")
    vp = None if layout is not None else args.num_virtual_stages_per_pipeline_rank
    try:
        if layout is not None:
            vp = len(layout_stage_counts(layout, pp, args.num_layers,
                                         args.mtp_num_layers or 0)[0])
            idle = ranks_without_parameters(layout, pp)
            if idle:
                _fail(f"{name} {layout!r}: pipeline rank(s) {', '.join(map(str, idle))} hold "
                      "only empty stages, so no parameter to train; give every rank a layer, "
                      "the embedding, the MTP layers or the loss (with virtual stages an empty "
                      "stage is fine beside a full one, e.g. 'Et|t|t|tmm||L' at pp 3)")
        else:
            accounted_stage_counts(args.num_layers, pp, vp,
                                   args.account_for_embedding_in_pipeline_split,
                                   args.account_for_loss_in_pipeline_split)
    except ConfigError as err:
        _fail(str(err))
    vp = vp if vp and vp > 1 else None
    if vp is not None and pp < 2:
        _fail(f"{name}: virtual pipeline stages ({vp}) need --pipeline-model-parallel-size >= 2, "
              f"got {pp}")
    args.virtual_pipeline_model_parallel_size = vp
    return True


def _virtual_stages_per_rank(args) -> None:
    """--num-virtual-stages-per-pipeline-rank V: the same split as
    --num-layers-per-virtual-pipeline-stage (layers per stage) / V."""
    stages = args.num_virtual_stages_per_pipeline_rank
    if stages is None:
        return
    pp = args.pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _fail("give only one of --num-layers-per-virtual-pipeline-stage and "
              "--num-virtual-stages-per-pipeline-rank")
    per_stage = args.num_layers // pp
    if pp < 2 or per_stage % stages:
        _fail(f"--num-virtual-stages-per-pipeline-rank {stages} needs "
              f"--pipeline-model-parallel-size >= 2 and the {per_stage} layers per pipeline "
              f"stage (--num-layers {args.num_layers} / {pp}) divisible by it")
    args.num_layers_per_virtual_pipeline_stage = per_stage // stages


# --data-parallel-sharding-strategy -> (on FSDP2, reshard after forward, distributed optimizer)
MEGATRON_FSDP_STRATEGIES = {
    "no_shard": (False, True, False),
    "optim": (False, True, True),
    "optim_grads": (True, False, False),
    "optim_grads_params": (True, True, False),
}
MEGATRON_FSDP_DEFAULTS = (("data_parallel_sharding_strategy", "optim_grads_params"),
                          ("outer_dp_sharding_strategy", "no_shard"),
                          ("megatron_fsdp_main_params_dtype", "fp32"),
                          ("megatron_fsdp_main_grads_dtype", "auto"),
                          ("megatron_fsdp_grad_comm_dtype", "auto"))


def _megatron_fsdp_flag(args) -> str:
    return f"--use-megatron-fsdp --data-parallel-sharding-strategy " \
           f"{args.data_parallel_sharding_strategy}"


def _check_megatron_fsdp_dtypes(args, on_fsdp2: bool) -> None:
    flag = _megatron_fsdp_flag(args)
    if args.megatron_fsdp_main_params_dtype != "fp32":
        _fail(f"--megatron-fsdp-main-params-dtype {args.megatron_fsdp_main_params_dtype} is not "
              f"built yet (the main weights are fp32 here); use fp32")
    if args.megatron_fsdp_main_grads_dtype not in ("auto", "fp32"):
        _fail(f"--megatron-fsdp-main-grads-dtype {args.megatron_fsdp_main_grads_dtype} is not "
              f"built yet (the gradients the optimizer reads are fp32 here); use fp32 or auto")
    comm = args.megatron_fsdp_grad_comm_dtype
    if comm == "fp16" or (comm != "auto" and not on_fsdp2):
        what = ("use auto, fp32 or bf16" if on_fsdp2 else
                "use auto (--accumulate-allreduce-grads-in-fp32 picks the reduction dtype of "
                "the grad-buffer wrapper)")
        _fail(f"--megatron-fsdp-grad-comm-dtype {comm} is not built with {flag}; {what}")
    args.torch_fsdp2_reduce_dtype = {"auto": None, "fp32": "fp32", "bf16": "bf16"}.get(comm)


def _validate_megatron_fsdp(args) -> None:
    """--use-megatron-fsdp: each --data-parallel-sharding-strategy becomes a layout that is
    built (MEGATRON_FSDP_STRATEGIES); the dtype flags map onto FSDP2's mixed-precision policy
    or stop in one line."""
    args.torch_fsdp2_reduce_dtype = None
    if args.num_distributed_optimizer_instances < 1:
        _fail(f"--num-distributed-optimizer-instances must be >= 1, got "
              f"{args.num_distributed_optimizer_instances}")
    if not args.use_megatron_fsdp:
        if args.num_distributed_optimizer_instances != 1:
            _fail(f"--num-distributed-optimizer-instances "
                  f"{args.num_distributed_optimizer_instances} needs --use-megatron-fsdp (hybrid "
                  f"sharding; one distributed-optimizer instance spans the data-parallel group "
                  f"otherwise); drop it")
        for dest, default in MEGATRON_FSDP_DEFAULTS:
            if getattr(args, dest) != default:
                _fail(f"--{dest.replace('_', '-')} {getattr(args, dest)} needs "
                      f"--use-megatron-fsdp (or drop it)")
        return
    # (a second validation of the same flags sees the --use-torch-fsdp2 set below)
    if args.use_torch_fsdp2 and not getattr(args, "megatron_fsdp_on_fsdp2", False):
        _fail("give one of --use-megatron-fsdp and --use-torch-fsdp2 (with "
              "--use-megatron-fsdp, --data-parallel-sharding-strategy optim_grads_params is "
              "FSDP2)")
    if args.outer_dp_sharding_strategy != "no_shard":
        _fail(f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy} is not built yet "
              f"(hybrid sharding over outer data-parallel groups); use no_shard")
    on_fsdp2, reshard, distributed = MEGATRON_FSDP_STRATEGIES[
        args.data_parallel_sharding_strategy]
    if args.num_distributed_optimizer_instances != 1 and not on_fsdp2:
        _fail(f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} "
              f"is not built with {_megatron_fsdp_flag(args)}; hybrid sharding needs "
              f"--data-parallel-sharding-strategy optim_grads or optim_grads_params")
    _check_megatron_fsdp_dtypes(args, on_fsdp2)
    args.use_torch_fsdp2 = args.megatron_fsdp_on_fsdp2 = on_fsdp2
    args.torch_fsdp2_reshard_after_forward = reshard
    # Megatron-FSDP's launch scripts pass --use-distributed-optimizer with every strategy;
    # the strategy decides here what is sharded.
    args.use_distributed_optimizer = distributed
    if not distributed and not on_fsdp2 and args.overlap_param_gather:
        _fail(f"{_megatron_fsdp_flag(args)} cannot be combined with --overlap-param-gather: "
              f"it overlaps the distributed optimizer's gather (use --data-parallel-sharding-"
              f"strategy optim) or drop it")


def _validate_meta_device_init(args) -> None:
    if not args.init_model_with_meta_device:
        return
    if not args.use_torch_fsdp2:
        _fail("--init-model-with-meta-device needs a fully sharded run (--use-torch-fsdp2, or "
              "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads or "
              "optim_grads_params): each rank materialises its FSDP shards; drop it otherwise")
    if args.data_parallel_random_init:
        _fail("--init-model-with-meta-device cannot be combined with --data-parallel-random-init "
              "(there are no weights to broadcast before sharding); drop one")


def _fsdp2_overlaps_already(args, name: str) -> None:
    """--overlap-grad-reduce / --overlap-param-gather (in Megatron's FSDP recipes) ask for what
    FSDP2 always does: one reduce-scatter per layer as the last micro-batch's backward reaches
    it, and each layer's all-gather prefetched; one note, and the DDP-wrapper switches off."""
    given = [flag for flag, on in (("--overlap-grad-reduce", args.overlap_grad_reduce),
                                   ("--overlap-param-gather", args.overlap_param_gather)) if on]
    if given:
        _note(args, f"{' and '.join(given)} with {name}: FSDP2 already overlaps each layer's "
                    "gradient reduce-scatter with backward and prefetches its parameter "
                    "all-gather; no effect here")
    args.overlap_grad_reduce = args.overlap_param_gather = False


def _validate_grad_precision(args) -> None:
    """--grad-reduce-in-bf16 and the grad-buffer wrapper's two refinements of a half-precision
    gradient buffer; runs after _validate_model has settled the buffers' dtype."""
    patterns = args.ddp_param_name_patterns_for_fp32_local_accumulation
    fp32_rs = args.ddp_reduce_scatter_with_fp32_accumulation
    if args.grad_reduce_in_bf16 and not args.bf16:
        _fail("--grad-reduce-in-bf16 needs --bf16 (it keeps a bf16 run's gradient buffers in "
              "bf16); add --bf16 or drop it")
    if args.grad_reduce_in_bf16 and args.use_torch_fsdp2 and args.torch_fsdp2_reduce_dtype is None:
        # As in Megatron: FSDP2 then reduce-scatters gradients in bf16 (an explicit
        # --megatron-fsdp-grad-comm-dtype still decides).
        args.torch_fsdp2_reduce_dtype = "bf16"
    used = [flag for flag, on in (("--ddp-reduce-scatter-with-fp32-accumulation", fp32_rs),
                                  ("--ddp-param-name-patterns-for-fp32-local-accumulation",
                                   bool(patterns))) if on]
    if used and args.use_torch_fsdp2:
        _fail(f"{used[0]} is built for the grad-buffer wrapper, not with FSDP2 "
              "(--use-torch-fsdp2 / --use-megatron-fsdp); use --megatron-fsdp-grad-comm-dtype")
    if fp32_rs and not args.use_distributed_optimizer:
        _fail("--ddp-reduce-scatter-with-fp32-accumulation needs --use-distributed-optimizer "
              "(without it gradients are all-reduced, not reduce-scattered)")
    if fp32_rs and args.optimizer in ("soap", "adaptive_muon"):
        _fail(f"--ddp-reduce-scatter-with-fp32-accumulation with --optimizer {args.optimizer}: "
              "that optimizer deals whole weights over the data-parallel ranks, so gradients "
              "are all-reduced, not reduce-scattered; drop the flag")
    if patterns and (args.accumulate_allreduce_grads_in_fp32 or not (args.bf16 or args.fp16)):
        _fail("--ddp-param-name-patterns-for-fp32-local-accumulation: the gradient buffers are "
              "already fp32 here; it applies to bf16 buffers (--bf16 --grad-reduce-in-bf16) or "
              "fp16 ones (--fp16 without --accumulate-allreduce-grads-in-fp32)")


def _validate_torch_fsdp2(args) -> None:
    """--use-torch-fsdp2: FSDP2 owns the sharding and the gradient reduction; combinations it
    cannot serve (or that are not built on it yet) stop here in one line naming the flags."""
    _validate_meta_device_init(args)
    if not args.use_torch_fsdp2:
        return
    name = _megatron_fsdp_flag(args) if args.use_megatron_fsdp else "--use-torch-fsdp2"
    refused = [
        (args.use_distributed_optimizer, "--use-distributed-optimizer",
         "FSDP2 already shards the optimizer state; drop --use-distributed-optimizer"),
        (args.num_experts is not None
         and args.expert_tensor_parallel_size != args.tensor_model_parallel_size,
         f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}",
         "the experts' norms are summed over the data x context parallel group, which "
         "holds every expert position only when expert TP equals --tensor-model-parallel-"
         f"size {args.tensor_model_parallel_size}; drop --expert-tensor-parallel-size"),
        (args.num_experts is not None and args.num_distributed_optimizer_instances != 1,
         f"--num-experts with --num-distributed-optimizer-instances "
         f"{args.num_distributed_optimizer_instances}",
         "hybrid sharding of the experts is not built; drop --num-distributed-optimizer-"
         "instances"),
    ]
    for bad, flag, why in refused:
        if bad:
            _fail(f"{name} cannot be combined with {flag}: {why}")
    _fsdp2_overlaps_already(args, name)
    replicas, dp_cp = args.num_distributed_optimizer_instances, \
        args.data_parallel_size * args.context_parallel_size
    if dp_cp % replicas:
        _fail(f"--num-distributed-optimizer-instances {replicas} must divide the data x context "
              f"parallel size ({dp_cp}): each replica shards the model over an equal share")


def _validate_model(args) -> None:
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    if args.max_position_embeddings is None:
        if args.position_embedding_type == "learned_absolute":
            _fail("--max-position-embeddings is required with learned absolute position "
                  "embeddings")
        args.max_position_embeddings = args.seq_length
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        _fail(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
              f"({args.max_position_embeddings})")
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            _fail(f"--hidden-size ({args.hidden_size}) must be divisible by "
                  f"--num-attention-heads ({args.num_attention_heads}) unless --kv-channels "
                  "is given")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups != 0:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--num-query-groups ({args.num_query_groups})")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 cannot both be given")
    conflict = numerics_flag_conflict(args)
    if conflict is not None:
        _fail(conflict)
    try:
        check_window_settings(args.window_size, args.window_attn_skip_freq, args.num_layers)
    except ConfigError as err:
        _fail(str(err))
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if (args.rotary_seq_len_interpolation_factor is not None
            and args.rotary_seq_len_interpolation_factor < 1):
        _fail("--rotary-seq-len-interpolation-factor must be >= 1, got "
              f"{args.rotary_seq_len_interpolation_factor}")
    args.params_dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    if args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32":
        _fail(f"--main-grads-dtype {args.main_grads_dtype} cannot be used with "
              "--accumulate-allreduce-grads-in-fp32 (as in Megatron: it needs fp32)")
    if args.bf16 and args.grad_reduce_in_bf16:
        if args.accumulate_allreduce_grads_in_fp32:
            _note(args, "--grad-reduce-in-bf16 overrides --accumulate-allreduce-grads-in-fp32: "
                        "gradients are accumulated and reduced in bf16")
        args.accumulate_allreduce_grads_in_fp32 = False
    elif (args.bf16 and not args.accumulate_allreduce_grads_in_fp32
          and args.main_grads_dtype == "fp32"):
        # As in Megatron: bf16 gradients are reduced and accumulated in fp32, unless the
        # optimizer is asked for bf16 main gradients, which keeps the buffers in bf16.
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.distribute_saved_activations:
        _validate_distribute_saved_activations(args)
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            _fail("--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None:
            _fail("--recompute-granularity full needs --recompute-num-layers")
    elif args.recompute_granularity == "selective" and args.recompute_method is not None:
        _fail(f"--recompute-method {args.recompute_method} applies only to "
              "--recompute-granularity full")
    elif args.recompute_granularity is None and args.recompute_method is not None:
        _fail("--recompute-method needs --recompute-granularity full")


def _validate_distribute_saved_activations(args) -> None:
    """--distribute-saved-activations: Megatron's conditions, in Megatron's order, then
    Megatron-Core's refusal of sequence parallelism (which already splits that input)."""
    flag = "--distribute-saved-activations"
    if args.tensor_model_parallel_size <= 1:
        _fail(f"{flag} splits the saved inputs over the tensor-parallel ranks: it needs "
              f"--tensor-model-parallel-size > 1, got {args.tensor_model_parallel_size}")
    if args.recompute_granularity != "full":
        _fail(f"{flag} applies only to --recompute-granularity full, got "
              f"{args.recompute_granularity}")
    if args.recompute_method is None:
        _fail(f"{flag} needs --recompute-method uniform or block")
    if args.sequence_parallel:
        _fail(f"{flag} cannot be combined with --sequence-parallel, which already splits the "
              "saved inputs over the tensor-parallel ranks")


def _validate_gdn(args) -> None:
    """--experimental-attention-variant: gdn (or gated_delta_net) is built; what it is not built
    with is refused here, naming the flag."""
    variant = args.experimental_attention_variant
    if variant is None:
        return
    if variant == "dsa":
        return                      # _validate_dsa
    if variant not in ("gdn", "gated_delta_net"):
        _fail(f"--experimental-attention-variant {variant}: not built yet (gdn and dsa are)")
    for flag, on in (
            ("--context-parallel-size > 1", args.context_parallel_size > 1),
            ("--reset-attention-mask (packed documents)", args.reset_attention_mask),
            ("--mtp-num-layers", bool(args.mtp_num_layers)),
            ("--use-torch-fsdp2", getattr(args, "use_torch_fsdp2", False)),
            (f"--ckpt-format {args.ckpt_format} (add --ckpt-format torch)",
             args.ckpt_format != "torch" and bool(args.save or args.load))):
        if on:
            _fail(f"--experimental-attention-variant gdn with {flag}: not built yet")


def _validate_mup(args) -> None:
    """--use-mup and --mup-* (megatron/core/mup.py), before any model or group exists."""
    problem = (mup_flag_problem(args.use_mup, args.hidden_size, args.mup_width_mult,
                                args.mup_base_hidden_size, args.mup_embedding_mult,
                                args.mup_output_mult, args.mup_base_head_dim,
                                args.mup_attn_scale_power)
               or mup_model_conflict(args.use_mup, args.multi_latent_attention,
                                     args.init_method_xavier_uniform)
               or mup_optimizer_conflict(args.use_mup, args.optimizer))
    if problem is not None:
        _fail(problem)


def _validate_mhc(args) -> None:
    """--enable-mhc-connections and --mhc-* (megatron/model/hyper_connection.py)."""
    selective_mhc = (args.recompute_granularity == "selective"
                     and "mhc" in (args.recompute_modules or ()))
    if args.mhc_recompute_layer_num is not None and not selective_mhc:
        _note(args, "--mhc-recompute-layer-num has no effect without --recompute-granularity "
                    "selective --recompute-modules mhc")
    if selective_mhc and not args.enable_mhc_connections:
        _fail("--recompute-modules mhc needs --enable-mhc-connections")
    if selective_mhc and "mlp" in args.recompute_modules:
        _fail("--recompute-modules mhc and mlp cannot be used together (as in Megatron-Core)")
    if not args.enable_mhc_connections:
        return
    for flag, given in (("--mtp-num-layers", args.mtp_num_layers is not None),
                        ("--apply-residual-connection-post-layernorm",
                         args.apply_residual_connection_post_layernorm),
                        ("--fp32-residual-connection", args.fp32_residual_connection),
                        ("--heterogeneous-layers-config-path",
                         bool(args.heterogeneous_layers_config_path
                              or args.heterogeneous_layers_config_encoded_json)),
                        ("--experimental-attention-variant",
                         args.experimental_attention_variant is not None)):
        if given:
            _fail(f"--enable-mhc-connections cannot be combined with {flag} (not built)")
    for flag, value in (("--mhc-num-residual-streams", args.mhc_num_residual_streams),
                        ("--mhc-sinkhorn-iterations", args.mhc_sinkhorn_iterations)):
        if value < 1:
            _fail(f"{flag} must be >= 1, got {value}")
    if args.mhc_recompute_layer_num is not None and args.mhc_recompute_layer_num < 1:
        _fail(f"--mhc-recompute-layer-num must be >= 1, got {args.mhc_recompute_layer_num}")


def _validate_eval_batch(args) -> None:
    """--eval-global-batch-size (else the training batch) splits into --eval-micro-batch-size
    (else --micro-batch-size) x data-parallel micro-batches."""
    micro, flag = args.eval_micro_batch_size, "--eval-micro-batch-size"
    if micro is None:
        micro, flag = args.micro_batch_size, "--micro-batch-size"
    per_step = micro * args.data_parallel_size
    eval_batch, batch_flag = args.eval_global_batch_size, "--eval-global-batch-size"
    if eval_batch is None:
        if (args.eval_micro_batch_size is None or args.rampup_batch_size is not None
                or args.step_batch_size_schedule is not None):
            return  # the training batch, checked with the training flags
        eval_batch, batch_flag = args.global_batch_size, "--global-batch-size (evaluation's)"
    if eval_batch % per_step:
        _fail(f"{batch_flag} ({eval_batch}) must be divisible by {flag} ({micro}) x "
              f"data-parallel size ({args.data_parallel_size})")


def _note_no_initialization(args) -> None:
    if not args.perform_initialization and not (args.load or args.pretrained_checkpoint):
        _note(args, "--no-initialization without --load or --pretrained-checkpoint: the weights "
                    "start as zeros")


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _schedule_number(text: str, entry: str) -> int:
    """``250B`` -> 250e9: a number with an optional K/M/B/T suffix, as Megatron reads it."""
    body, scale = text.strip().upper(), 1
    if body[-1:] in _SUFFIXES:
        body, scale = body[:-1], _SUFFIXES[body[-1]]
    try:
        value = float(body)
    except ValueError:
        value = None
    if value is None:
        _fail(f"--step-batch-size-schedule: cannot read {text!r} in entry {entry!r} (expected "
              "a number with an optional K, M, B or T suffix)")
    return int(value * scale)


def parse_step_batch_size_schedule(text: str, seq_length: Optional[int]) -> List[Tuple[int, int]]:
    """``"THRESHOLD:BATCH ..."`` (spaces or commas between entries) -> sorted
    ``[(threshold_samples, global_batch), ...]``.

    Thresholds count tokens when ``seq_length`` is given (Megatron passes the run's
    ``--seq-length``) and are turned into samples by whole division; otherwise they count samples.
    The first threshold must be 0 and thresholds must increase strictly after sorting.
    """
    flag = "--step-batch-size-schedule"
    entries = text.replace(",", " ").split()
    if not entries:
        _fail(f"{flag} is empty; give THRESHOLD:BATCH pairs, e.g. '0:256 1B:512'")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            _fail(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = (_schedule_number(part, entry) for part in entry.split(":", 1))
        if seq_length:
            threshold //= seq_length
        if batch <= 0:
            _fail(f"{flag}: batch size of {entry!r} must be > 0")
        schedule.append((threshold, batch))
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        _fail(f"{flag}: the first threshold must be 0, got {schedule[0][0]} samples")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            _fail(f"{flag}: thresholds must increase strictly, got {before} then {after} "
                  "samples")
    return schedule


def _validate_step_batch_size_schedule(args) -> None:
    """Parse --step-batch-size-schedule into ``args.step_batch_size_samples`` (thresholds in
    samples); the global batch becomes the schedule's last batch, as in Megatron."""
    if args.rampup_batch_size is not None:
        _fail("give only one of --step-batch-size-schedule and --rampup-batch-size")
    if args.train_samples is None:
        _fail("--step-batch-size-schedule needs --train-samples (the schedule counts "
              "samples), not --train-iters")
    args.step_batch_size_samples = parse_step_batch_size_schedule(
        args.step_batch_size_schedule, args.seq_length)
    final = args.step_batch_size_samples[-1][1]
    if args.global_batch_size is not None and args.global_batch_size != final:
        _note(args, f"--global-batch-size ({args.global_batch_size}) is replaced by the last "
                    f"batch of --step-batch-size-schedule ({final})")
    args.global_batch_size = final


def _validate_microbatch_groups(args) -> None:
    """--microbatch-group-size-per-virtual-pipeline-stage: at least the pipeline size, and only
    read by the interleaved schedule. The micro-batch count is checked by the schedule itself,
    each step (a batch-size ramp-up changes it)."""
    group = args.microbatch_group_size_per_vp_stage
    if group is None:
        return
    if args.virtual_pipeline_model_parallel_size is None:
        _note(args, "--microbatch-group-size-per-virtual-pipeline-stage only shapes the "
                    "interleaved pipeline schedule; without virtual pipeline stages it has no "
                    "effect")
    elif group < args.pipeline_model_parallel_size:
        _fail(f"--microbatch-group-size-per-virtual-pipeline-stage ({group}) must be at least "
              f"--pipeline-model-parallel-size ({args.pipeline_model_parallel_size})")


def _validate_interleaved_microbatches(args) -> None:
    """With virtual pipeline stages and a constant batch, the schedule's limits on the
    micro-batch count (whole groups, or a remainder of at least the pipeline size) are checked
    here, in one line, instead of at the first step; a ramp-up or step schedule changes the
    count, so the schedule checks those runs each step. Runs without training steps (the
    evaluation tools, which top their groups up) are not checked."""
    if args.virtual_pipeline_model_parallel_size is None or args.pipeline_model_parallel_size < 2:
        return
    if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
        return
    if not (args.train_iters or args.train_samples):
        return   # no training steps (evaluation tools top their micro-batch groups up)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        return
    group = args.microbatch_group_size_per_vp_stage or args.pipeline_model_parallel_size
    try:
        check_microbatch_group_size(group, args.pipeline_model_parallel_size,
                                    args.global_batch_size // per_step)
    except ValueError as err:
        default = ("" if args.microbatch_group_size_per_vp_stage is not None else
                   " (micro-batch groups default to --pipeline-model-parallel-size)")
        _fail(f"with virtual pipeline stages{default}, {err}")


def _validate_batch_and_schedule(args) -> None:
    _require(args, "micro_batch_size")
    dp = args.data_parallel_size
    if args.step_batch_size_schedule is not None:
        _validate_step_batch_size_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
        _note(args, f"--global-batch-size not given; using micro batch x data-parallel size "
                    f"= {args.global_batch_size}")
    per_step = args.micro_batch_size * dp
    if args.decrease_batch_size_if_needed:
        if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
            _fail("--decrease-batch-size-if-needed cannot be combined with "
                  "--rampup-batch-size or --step-batch-size-schedule")
        if args.global_batch_size < per_step:
            _fail(f"--decrease-batch-size-if-needed: --global-batch-size "
                  f"({args.global_batch_size}) is smaller than --micro-batch-size "
                  f"({args.micro_batch_size}) x data-parallel size ({dp})")
    elif (args.global_batch_size % per_step != 0
          and args.step_batch_size_schedule is None):
        _fail(f"--global-batch-size ({args.global_batch_size}) must be divisible by "
              f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size ({dp})")
    args.num_micro_batches = args.global_batch_size // per_step
    if args.rampup_batch_size is not None:
        if len(args.rampup_batch_size) != 3:
            _fail("--rampup-batch-size takes 3 values: start increment ramp-samples, got "
                  f"{args.rampup_batch_size}")
        args.rampup_batch_size = [int(v) for v in args.rampup_batch_size]
        if args.train_samples is None:
            _fail("--rampup-batch-size needs --train-samples (the schedule counts samples), "
                  "not --train-iters")
    if args.train_iters is not None and args.train_samples is not None:
        _fail("give only one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            _fail("with --train-samples, give the schedule in samples "
                  "(--lr-decay-samples, --lr-warmup-samples), not iterations")
    elif args.lr_decay_samples is not None or args.lr_warmup_samples:
        _fail("with --train-iters, give the schedule in iterations "
              "(--lr-decay-iters, --lr-warmup-iters), not samples")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        _fail("give only one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples")
    if args.train_iters is not None and args.lr_warmup_fraction is None:
        decay_iters = args.lr_decay_iters or args.train_iters
        if args.lr_warmup_iters >= decay_iters:
            _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                  f"--lr-decay-iters or --train-iters ({decay_iters})")
    if args.lr is not None and args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.decoupled_lr is None and args.decoupled_min_lr is not None:
        _note(args, "--decoupled-min-lr has no effect without --decoupled-lr")
    if args.decoupled_lr is not None:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if not 0.0 <= low <= args.decoupled_lr:
            _fail(f"--decoupled-min-lr (else --min-lr) ({low}) must be in [0, --decoupled-lr "
                  f"({args.decoupled_lr})]")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.loss_spike_factor <= 1.0:
        _fail(f"--loss-spike-factor must be > 1, got {args.loss_spike_factor}")
    if args.skip_iterations_with_loss_spike and args.check_for_nan_in_loss_and_grad:
        # Both answer a non-finite loss: one skips the step, the other stops the run.
        if getattr(args, "check_for_nan_given", False):
            _fail("--skip-iterations-with-loss-spike skips a step whose loss is not finite; "
                  "--check-for-nan-in-loss-and-grad stops the run on it: pass one of them")
        args.check_for_nan_in_loss_and_grad = False
        _note(args, "--skip-iterations-with-loss-spike: the inf/nan check of losses and "
                    "gradients (on by default) is off; a step whose loss is not finite is "
                    "skipped instead")
    if (args.check_weight_hash_across_dp_replicas_interval is not None
            and getattr(args, "use_torch_fsdp2", False)):
        _fail("--check-weight-hash-across-dp-replicas-interval compares whole replicas; with "
              "--use-torch-fsdp2 each rank holds a shard, so there is no replica to compare")


def _validate_masking(args) -> None:
    """The BERT data flags; their defaults pass, so GPT runs never trip on them."""
    if not 0.0 < args.mask_prob < 1.0:
        _fail(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        _fail(f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}")


BERT_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")


def _read_heterogeneous_config(args) -> None:
    """Fill ``--heterogeneous-layers-config-encoded-json`` from the file (as Megatron does, so
    the config travels with the checkpoint's arguments), parse it once and refuse what a
    heterogeneous model is not built with."""
    path = args.heterogeneous_layers_config_path
    if not args.heterogeneous_layers_config_encoded_json and path:
        try:
            with open(path, encoding="utf-8") as f:
                args.heterogeneous_layers_config_encoded_json = f.read()
        except OSError as err:
            _fail(f"--heterogeneous-layers-config-path {path}: cannot read it ({err.strerror})")
    if not args.heterogeneous_layers_config_encoded_json:
        return
    try:
        blocks = heterogeneous_blocks(args.heterogeneous_layers_config_encoded_json, path, args)
        check_blocks_splittable(blocks, args.tensor_model_parallel_size, args.hidden_size)
    except ConfigError as err:
        _fail(str(err))
    refused = [flag for flag, on in (
        ("--num-experts", args.num_experts is not None),
        ("--multi-latent-attention", args.multi_latent_attention),
        ("--mtp-num-layers", args.mtp_num_layers is not None),
        ("--recompute-modules layernorm", "layernorm" in (args.recompute_modules or ())),
        ("--experimental-attention-variant", args.experimental_attention_variant is not None),
    ) if on]
    if refused:
        _fail(f"--heterogeneous-layers-config-path is not built with {', '.join(refused)}")


def _validate_mtp(args) -> None:
    """Multi-token prediction: the layouts it is built for."""
    depths = args.mtp_num_layers
    if depths is None:
        for flag in ("mtp_use_repeated_layer", "mtp_detach_heads", "mtp_hsm"):
            if getattr(args, flag, False):
                _fail(f"--{flag.replace('_', '-')} needs --mtp-num-layers")
        return
    if depths < 1:
        _fail(f"--mtp-num-layers must be >= 1, got {depths}")
    if getattr(args, "mtp_hsm", False) and depths < 2:
        _fail(f"--mtp-hsm needs --mtp-num-layers >= 2, got {depths}")
    if args.mtp_detach_heads and (getattr(args, "use_torch_fsdp2", False)
                                  or getattr(args, "use_megatron_fsdp", False)):
        _fail("--mtp-detach-heads with fully sharded data parallelism is not supported (the "
              "MTP layers' separate gradient norm is not kept on sharded parameters, as in "
              "Megatron-Core); use --use-distributed-optimizer")
    if args.mtp_loss_scaling_factor < 0:
        _fail(f"--mtp-loss-scaling-factor must be >= 0, got {args.mtp_loss_scaling_factor}")
    if args.pipeline_model_parallel_size > 1 and args.position_embedding_type == \
            "learned_absolute":
        _fail("--mtp-num-layers with --pipeline-model-parallel-size > 1 needs "
              "--position-embedding-type rope, yarn or none (the MTP layers on the last stage "
              "have no copy of the learned position table)")
    _mtp_standalone(args)


def _mtp_standalone(args) -> None:
    """``--mtp-standalone`` follows the layout, as Megatron sets it: on when the layout's
    ``m`` letters are in a stage before the loss's; given by hand, it must agree."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    standalone = (layout is not None and args.pipeline_model_parallel_size > 1
                  and mtp_standalone_stage(layout) is not None)
    if getattr(args, "mtp_standalone", False) and not standalone:
        if layout is None:
            _fail("--mtp-standalone needs --pipeline-model-parallel-layout with the MTP layers "
                  "('m') in a stage of their own, before the loss's (e.g. 'Ettmm|L' at pp 2)")
        _fail(f"--mtp-standalone: --pipeline-model-parallel-layout {layout!r} puts the MTP "
              "layers beside the loss, not in a stage of their own (e.g. 'Ettmm|L' at pp 2)")
    args.mtp_standalone = standalone


def _load_balancing_lists(args) -> None:
    """--moe-router-load-balancing-type / --moe-aux-loss-coeff take Megatron's lists: one
    element becomes its value (as Megatron does); several types need as many coefficients, each
    type once, and sinkhorn alone."""
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if isinstance(types, list) and len(types) == 1:
        types = args.moe_router_load_balancing_type = types[0]
    if isinstance(coeffs, list) and len(coeffs) == 1:
        coeffs = args.moe_aux_loss_coeff = coeffs[0]
    given = coeffs if isinstance(coeffs, list) else [coeffs]
    if isinstance(types, str):
        if len(given) != 1:
            _fail(f"--moe-aux-loss-coeff {' '.join(map(str, given))}: one coefficient per "
                  f"--moe-router-load-balancing-type, which names one type ({types})")
        return
    if len(given) != len(types):
        _fail(f"--moe-router-load-balancing-type {' '.join(types)} needs one "
              f"--moe-aux-loss-coeff per type, got {' '.join(map(str, given))}")
    if len(set(types)) != len(types):
        _fail(f"--moe-router-load-balancing-type {' '.join(types)} names a type twice")
    if "sinkhorn" in types:
        _fail(f"--moe-router-load-balancing-type {' '.join(types)}: sinkhorn routes by itself "
              "and does not combine with other types")


def _validate_moe(args) -> None:
    """Megatron's checks of the MoE flags."""
    _load_balancing_lists(args)
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            _fail(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    tp = args.tensor_model_parallel_size
    if ep < 1 or args.num_experts % ep:
        _fail(f"--num-experts ({args.num_experts}) must be divisible by "
              f"--expert-model-parallel-size ({ep})")
    cp = getattr(args, "context_parallel_size", 1)
    if cp > 1 and args.moe_router_load_balancing_type == "sinkhorn":
        _fail(f"--moe-router-load-balancing-type sinkhorn with --context-parallel-size {cp}: "
              "Sinkhorn balances one rank's tokens, so it would route differently from CP 1; "
              "use aux_loss, seq_aux_loss or none")
    if cp > 1 and (args.moe_expert_capacity_factor or -1) >= 0:
        _fail(f"--moe-expert-capacity-factor with --context-parallel-size {cp}: the capacity "
              "of one rank's tokens would drop other tokens than CP 1; drop one of them")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if etp != tp and tp > 1:
        # Each tensor-parallel rank routes its own slice of the sequence.
        if args.moe_router_load_balancing_type == "sinkhorn":
            _fail(f"--moe-router-load-balancing-type sinkhorn with --expert-tensor-parallel-size "
                  f"{etp} other than --tensor-model-parallel-size {tp}: each rank balances "
                  "its own slice of the sequence, so it would route differently from one rank; "
                  "use aux_loss, seq_aux_loss or none")
        if (args.moe_expert_capacity_factor or -1) >= 0:
            _fail(f"--moe-expert-capacity-factor with --expert-tensor-parallel-size {etp} other "
                  f"than --tensor-model-parallel-size {tp}: the capacity of one rank's slice "
                  "of the sequence would drop other tokens than one rank; drop one of them")
    if tp > 1 and not args.sequence_parallel:
        _fail(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
              "(as in Megatron)")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    gelu = not (args.swiglu or args.quick_geglu or args.squared_relu or args.openai_gelu)
    if gelu and args.bias_gelu_fusion and args.add_bias_linear and args.moe_grouped_gemm:
        # The loop over experts runs the fused bias-GeLU as Megatron-Core's SequentialMLP does
        # (without biases Megatron turns the fusion off: exact GeLU); its grouped experts don't.
        _fail("--moe-grouped-gemm: the grouped experts have no fused bias-GeLU (Megatron-Core "
              "refuses it with GeLU experts); add --no-bias-gelu-fusion")
    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        _fail(f"--moe-layer-freq must be >= 1, got {freq}")
    if not isinstance(freq, int) and len(freq) != args.num_layers:
        _fail(f"--moe-layer-freq lists {len(freq)} layers, --num-layers is {args.num_layers}")
    if args.moe_ffn_hidden_size % etp:
        _fail(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be divisible by "
              f"--expert-tensor-parallel-size ({etp})")
    build_moe_config(args)


def _validate_routing_trace(args) -> None:
    """--moe-routing-trace-path traces MoE routers; its options need it."""
    path = args.moe_routing_trace_path
    options = (("--moe-routing-trace-max-training-iters",
                args.moe_routing_trace_max_training_iters is not None),
               ("--moe-routing-trace-capture-logits", args.moe_routing_trace_capture_logits),
               ("--moe-routing-trace-capture-hidden-states",
                args.moe_routing_trace_capture_hidden_states),
               ("--moe-routing-trace-dump-weights", args.moe_routing_trace_dump_weights))
    for flag, given in options:
        if given and not path:
            _fail(f"{flag} is an option of the MoE routing trace; give --moe-routing-trace-path")
    given = [flag for flag, on in (("--moe-routing-trace-path", path), *options) if on]
    if given and args.num_experts is None:
        _fail(f"{given[0]} traces the MoE routers: it needs --num-experts")
    iters = args.moe_routing_trace_max_training_iters
    if iters is not None and iters < 1:
        _fail(f"--moe-routing-trace-max-training-iters must be >= 1, got {iters}")


def _has_dense_mlp(args) -> bool:
    freq = args.moe_layer_freq
    if args.num_experts is None:
        return True
    return freq > 1 if isinstance(freq, int) else 0 in freq


def _validate_grouped_gemm(args) -> None:
    """Megatron-Core's checks of its grouped-GEMM layouts and fused MLPs. The grouped-tensor
    path and its single grouped weight / bias are built (same computation, Megatron-Core's
    parameter layout); the fused shared expert and dense MLP compute in MXFP8 / NVFP4, which
    this project does not, so they are refused where Megatron would run them."""
    for flag, on, needs, have in (
            ("--moe-use-grouped-tensor", args.moe_use_grouped_tensor, "--moe-grouped-gemm",
             args.moe_grouped_gemm),
            ("--moe-single-grouped-weight", args.moe_single_grouped_weight,
             "--moe-use-grouped-tensor", args.moe_use_grouped_tensor),
            ("--moe-single-grouped-bias", args.moe_single_grouped_bias,
             "--moe-use-grouped-tensor", args.moe_use_grouped_tensor),
            ("--moe-single-grouped-bias", args.moe_single_grouped_bias,
             "biases (drop --disable-bias-linear)", args.add_bias_linear)):
        if on and not have:
            _fail(f"{flag} needs {needs} (as in Megatron-Core)")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if (args.moe_single_grouped_weight and args.swiglu and etp > 1
            and args.ckpt_format == "torch_dist" and (args.save or args.load)):
        _fail(f"--moe-single-grouped-weight with --swiglu and --expert-tensor-parallel-size "
              f"{etp}: a stacked fc1 split [gate_r; value_r] is not written to or read from "
              "torch_dist here; drop --moe-single-grouped-weight (per-GEMM weights, the same "
              "computation; torch_dist files move between the two layouts)")
    if (args.use_grouped_gemm_for_shared_expert and args.num_experts is not None
            and args.moe_shared_expert_intermediate_size is not None):
        _fused_mlp_refusal(args, "--use-grouped-gemm-for-shared-expert", "FusedSharedExpertMLP",
                           getattr(args, "moe_shared_expert_glu_interleave_size", None) is None)
    if (args.use_grouped_gemm_for_dense_mlp and _has_dense_mlp(args)
            and getattr(args, "use_transformer_engine_op_fuser", False)
            and args.transformer_impl == "transformer_engine"):
        _fused_mlp_refusal(args, "--use-grouped-gemm-for-dense-mlp", "TEFusedDenseMLP", False)


def _fused_mlp_refusal(args, flag: str, module: str, no_interleave: bool) -> None:
    """Refuse Megatron-Core's fused grouped-SwiGLU MLP ``module``: first as Megatron-Core does
    (biases, another activation, no interleave size), else for the precision it computes in."""
    if args.add_bias_linear:
        _fail(f"{flag}: Megatron-Core's {module} has no biases; add --disable-bias-linear")
    if not args.swiglu or args.quick_geglu:
        _fail(f"{flag}: Megatron-Core's {module} needs the SwiGLU activation (--swiglu)")
    if no_interleave:
        _fail(f"{flag}: Megatron-Core's {module} needs "
              "--moe-shared-expert-glu-interleave-size")
    _fail(f"{flag}: Megatron-Core's {module} computes in MXFP8 (NVFP4 with FP4_RECIPE=nvfp4) "
          "through TransformerEngine's fused grouped SwiGLU kernel, which this project does "
          "not compute; drop the flag for the same model in full precision")


def _validate_upcycling(args) -> None:
    """--moe-use-upcycling: an MoE model whose experts are cut from a dense checkpoint's MLPs."""
    granularity = args.moe_upcycling_granularity
    if granularity < 1:
        _fail(f"--moe-upcycling-granularity must be >= 1, got {granularity}")
    if not args.moe_use_upcycling:
        return
    if args.num_experts is None:
        _fail("--moe-use-upcycling needs --num-experts (the MoE model to make)")
    if args.save is None:
        _fail("--moe-use-upcycling needs --save (where the upcycled checkpoint goes)")
    if args.load is None:
        _fail("--moe-use-upcycling needs --load (the dense checkpoint)")
    if args.num_experts % granularity:
        _fail(f"--num-experts ({args.num_experts}) must be a multiple of "
              f"--moe-upcycling-granularity ({granularity})")
    if args.moe_ffn_hidden_size != args.ffn_hidden_size:
        _fail(f"--moe-use-upcycling: --moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must "
              f"equal --ffn-hidden-size ({args.ffn_hidden_size}); the dense FFN is "
              "--ffn-hidden-size x --moe-upcycling-granularity")
    if args.ffn_hidden_size % args.expert_tensor_parallel_size:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
              f"--expert-tensor-parallel-size ({args.expert_tensor_parallel_size})")
    freq = args.moe_layer_freq
    all_moe = freq == 1 if isinstance(freq, int) else all(freq)
    if granularity > 1 and not all_moe:
        _fail(f"--moe-upcycling-granularity {granularity} with dense layers in --moe-layer-freq: "
              "their MLPs would be --ffn-hidden-size, the dense checkpoint's are "
              f"{granularity}x larger; upcycle every layer or use granularity 1")
    for flag in ("moe_latent_size", "moe_mlp_glu_interleave_size",
                 "moe_shared_expert_glu_interleave_size"):
        if getattr(args, flag, None) is not None:
            _fail(f"--moe-use-upcycling with --{flag.replace('_', '-')}: the dense MLPs have "
                  "the hidden width and fc1 in two halves; upcycle without it")
    if args.use_torch_fsdp2:
        _fail("--moe-use-upcycling with FSDP2 (--use-torch-fsdp2 / --use-megatron-fsdp): the "
              "experts are filled from full dense weights, which the sharded parameters do not "
              "hold; upcycle without FSDP2")


def validate_bert_args(args: argparse.Namespace) -> None:
    """What pretrain_bert.py needs beyond :func:`validate_args`.

    BERT samples are built from the WordPiece ``[CLS]``, ``[SEP]``, ``[MASK]`` and ``[PAD]``
    tokens, its position embeddings are learned, and its data are real sentence pairs.

    Raises:
        ArgumentsError: naming the flag, the value seen and what BERT takes.
    """
    if args.enable_mhc_connections:
        _fail("--enable-mhc-connections is built for GPT only (pretrain_gpt.py), not BERT")
    if args.save and args.ckpt_format == "torch_dist":
        if getattr(args, "ckpt_format_given", False):
            _fail("--ckpt-format torch_dist stores GPT models only here; save BERT with "
                  "--ckpt-format torch (or leave the flag out: BERT runs then save torch)")
        # Megatron's BERT scripts save without --ckpt-format; torch_dist holds GPT only here.
        args.ckpt_format = "torch"
        if int(getattr(args, "rank", None) or os.environ.get("RANK", "0")) == 0:
            print("NOTE: --ckpt-format torch_dist (the default) stores GPT models only here: "
                  "this BERT run saves --ckpt-format torch (one file per rank; --load reads "
                  "either)", flush=True)
    if args.tokenizer_type not in BERT_TOKENIZER_TYPES:
        _fail(f"--tokenizer-type {args.tokenizer_type} cannot make BERT samples (they need the "
              "WordPiece [CLS], [SEP], [MASK] and [PAD] tokens); use --tokenizer-type "
              f"{' or '.join(BERT_TOKENIZER_TYPES)} with --vocab-file vocab.txt")
    if args.position_embedding_type != "learned_absolute" or args.use_rotary_position_embeddings:
        _fail(f"--position-embedding-type {args.position_embedding_type}: BERT has learned "
              "absolute position embeddings (learned_absolute) only")
    if not args.add_position_embedding:
        _fail("--no-position-embedding: BERT needs its learned position embeddings")
    if args.untie_embeddings_and_output_weights:
        _fail("--untie-embeddings-and-output-weights: BERT's masked-LM head always uses the "
              "word embeddings")
    if args.mock_data:
        _fail("--mock-data makes GPT samples only; give BERT sentence data with --data-path "
              "(tools/preprocess_data.py --split-sentences)")
    if args.context_parallel_size != 1:
        _fail(f"--context-parallel-size {args.context_parallel_size}: BERT's bidirectional "
              "attention over padded sequences has no context-parallel split here (it is "
              "causal GPT attention only); use --context-parallel-size 1")
    if args.use_mup:
        _fail("--use-mup is built for GPT (pretrain_gpt.py); BERT's heads are not scaled")
    for flag in ("logits_save_dir", "logits_load_dir"):
        if getattr(args, flag, None) is not None:
            _fail(f"--{flag.replace('_', '-')}: offline distillation is built for GPT "
                  "(pretrain_gpt.py) only, not BERT")
    if args.calculate_per_token_loss:
        _fail("--calculate-per-token-loss: BERT's loss function returns per-micro-batch means "
              "(its masked-LM and sentence-order losses), not token sums; drop the flag")
    for flag in ("full_validation", "multiple_validation_sets"):
        if getattr(args, flag):
            _fail(f"--{flag.replace('_', '-')} works with GPT datasets only (as in Megatron-LM); "
                  "BERT evaluates --eval-iters batches of one validation set")


def validation_set_count(args) -> int:
    """Validation sets a run evaluates: one per --valid-data-path prefix with
    --multiple-validation-sets (prefixes without weights), else one."""
    if not (args.multiple_validation_sets and args.valid_data_path):
        return 1
    numbers = [v for v in args.valid_data_path if _is_number(v)]
    if numbers:
        _fail(f"--multiple-validation-sets takes --valid-data-path prefixes without weights "
              f"(each prefix is one validation set); got the weight(s) {numbers}")
    return len(args.valid_data_path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _validate_validation_sets(args) -> None:
    """--full-validation, --multiple-validation-sets and --validation-set-names fit together
    and with the data flags."""
    names = args.validation_set_names
    if args.full_validation and args.mock_data:
        _fail("--full-validation reads the validation data whole, once; --mock-data has no "
              "end: give --data-path or --valid-data-path")
    if args.multiple_validation_sets and not (args.full_validation or args.skip_train):
        _fail("--multiple-validation-sets needs --full-validation (or --skip-train): each set "
              "is read from its start, as in Megatron-LM")
    count = validation_set_count(args)
    if names is None:
        return
    if not args.multiple_validation_sets:
        _fail(f"--validation-set-names {' '.join(names)} needs --multiple-validation-sets")
    if len(names) != count:
        _fail(f"--validation-set-names gives {len(names)} name(s) ({' '.join(names)}) for "
              f"{count} validation set(s) (--valid-data-path prefixes); give one name per set")
    if len(set(names)) != len(names):
        _fail(f"--validation-set-names {' '.join(names)}: each set needs its own name")


def _validate_phase_transitions(args) -> None:
    """--phase-transition-iterations: Megatron's "t1,t2,..." as sorted iterations; phases are
    counted in iterations x a constant global batch."""
    from megatron.training import phases

    try:
        args.phase_transition_iterations = phases.parse(args.phase_transition_iterations)
    except ValueError as err:
        _fail(str(err))
    if args.phase_transition_iterations is None:
        return
    for flag, value in (("--rampup-batch-size", args.rampup_batch_size),
                        ("--step-batch-size-schedule", args.step_batch_size_schedule)):
        if value is not None:
            _fail(f"{phases.FLAG} needs a constant global batch size (phases are counted in "
                  f"iterations x batch); drop {flag}")


def _validate_inter_document_masking(args) -> None:
    """--dataloader-inter-document-masking needs documents: the indexed datasets' samples."""
    if not args.dataloader_inter_document_masking:
        return
    for flag, on in (("--mock-data", args.mock_data), ("--fim-data", args.fim_data)):
        if on:
            _fail(f"--dataloader-inter-document-masking takes the document boundaries of "
                  f"--data-path samples; {flag} samples have none that it keeps")


def _validate_fim(args) -> None:
    """--fim-data: rates are probabilities; fragments need their rate; files, not mock data."""
    if not args.fim_data:
        return
    for flag, value in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
                        ("--fim-fragment-rate", args.fim_fragment_rate)):
        if value is not None and not 0.0 <= value <= 1.0:
            _fail(f"{flag} {value} is not a probability (expected 0 to 1)")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        _fail(f"--fim-split-sample {args.fim_split_sample} needs --fim-fragment-rate (the chance "
              "that each fragment is permuted)")
    if args.mock_data:
        _fail("--fim-data permutes the text of --data-path samples; --mock-data has no text")


def _data_prefixes(args):
    """(flag, entry) for every string of the data-path flags (weights included)."""
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        for entry in getattr(args, flag[2:].replace("-", "_"), None) or ():
            yield flag, entry


def _validate_object_storage(args) -> None:
    """--enable-msc needs its package; msc:// data prefixes need what Megatron requires with
    them: --object-storage-cache-path (the copied .idx files), --data-cache-path (the dataset
    caches cannot go beside the data) and --no-mmap-bin-files (a .bin is read in ranges)."""
    from megatron.core import msc

    if args.enable_msc:
        try:
            msc.client()
        except msc.ObjectStorageError as err:
            _fail(str(err))
    for flag, entry in _data_prefixes(args):
        if isinstance(entry, str) and entry.startswith("s3://"):
            _fail(f"{flag} {entry}: s3:// paths are read here through the Multi-Storage Client: "
                  "give an msc://PROFILE/PATH URL of an s3 profile in the MSC configuration, "
                  "with --enable-msc")
        if not msc.is_msc_url(entry):
            continue
        if not args.enable_msc:
            _fail(f"{flag} {entry}: msc:// URLs are read through the Multi-Storage Client; "
                  "pass --enable-msc")
        try:
            msc.split_url(entry)
        except msc.ObjectStorageError as err:
            _fail(f"{flag} {err}")
        for needed, given, why in (
                ("--object-storage-cache-path", args.object_storage_cache_path,
                 "the local folder where its .idx file is copied"),
                ("--data-cache-path", args.data_cache_path,
                 "the local folder of the dataset caches, which cannot go beside the data"),
                ("--no-mmap-bin-files", not args.mmap_bin_files,
                 "an object's .bin is read in ranges, not memory-mapped")):
            if not given:
                _fail(f"{flag} {entry}: an msc:// data prefix needs {needed} ({why}), as in "
                      "Megatron")
        if args.sft:
            _fail(f"{flag} {entry}: --sft reads local files only here; copy the data to a "
                  "local folder")


def _validate_fault_tolerance(args) -> None:
    """--enable-ft-package and its flags (megatron/training/fault_tolerance.py)."""
    from megatron.training import fault_tolerance

    reason = fault_tolerance.check_flags(args)
    if reason is not None:
        _fail(reason)


def _validate_sft(args) -> None:
    """--sft packs JSONL conversations for SFTTokenizer; the variants Megatron's SFT dataset
    refuses are refused here too, one line each."""
    if args.tokenizer_type == "SFTTokenizer":
        from megatron.tokenizer.sft_tokenizer import PROMPT_FORMATS

        if args.sft_tokenizer_prompt_format not in PROMPT_FORMATS:
            _fail(f"--sft-tokenizer-prompt-format {args.sft_tokenizer_prompt_format!r} is not "
                  f"built; choose one of {', '.join(PROMPT_FORMATS)}")
    if not args.sft:
        return
    if args.tokenizer_type != "SFTTokenizer":
        _fail(f"--sft tokenizes conversations with --tokenizer-type SFTTokenizer, got "
              f"--tokenizer-type {args.tokenizer_type}")
    for flag, given in (("--mock-data", args.mock_data), ("--fim-data", args.fim_data),
                        ("--reset-position-ids", args.reset_position_ids),
                        ("--reset-attention-mask", args.reset_attention_mask)):
        if given:
            _fail(f"--sft cannot be combined with {flag} (an SFT sample sets its own positions "
                  "and attention per conversation)")


def _validate_gigatoken(args) -> None:
    """--use-gigatoken: a HuggingFaceTokenizer and the gigatoken package installed, checked
    before any process group exists."""
    if args.use_gigatoken:
        from megatron.tokenizer.gigatoken_backend import gigatoken_refusal

        refusal = gigatoken_refusal(args.tokenizer_type)
        if refusal:
            _fail(refusal)


def _validate_hybrid_context_parallel(args) -> None:
    """--hybrid-context-parallel: Megatron's requirements (per-token loss, the single
    dataloader, no pipeline or Megatron FSDP, micro-batch 1), plus the layouts not built here,
    one line each."""
    if not args.hybrid_context_parallel:
        if args.max_seqlen_per_dp_cp_rank is not None:
            _fail("--max-seqlen-per-dp-cp-rank is read only with --hybrid-context-parallel")
        return
    dp = args.data_parallel_size
    types = [args.cp_comm_type] if isinstance(args.cp_comm_type, str) else args.cp_comm_type
    for bad, why in (
            (not args.calculate_per_token_loss, "must be used with --calculate-per-token-loss"),
            (args.dataloader_type != "single", f"needs --dataloader-type single, got "
                                               f"{args.dataloader_type}"),
            (args.pipeline_model_parallel_size > 1, "does not support pipeline parallelism"),
            (args.use_megatron_fsdp, "does not support --use-megatron-fsdp"),
            (args.micro_batch_size != 1, f"packs one sample per micro-batch: needs "
                                         f"--micro-batch-size 1, got {args.micro_batch_size}"),
            (args.eval_micro_batch_size not in (None, 1), f"needs --eval-micro-batch-size 1, "
                                                         f"got {args.eval_micro_batch_size}"),
            (args.max_seqlen_per_dp_cp_rank is None or args.max_seqlen_per_dp_cp_rank < 1,
             f"needs --max-seqlen-per-dp-cp-rank >= 1, got {args.max_seqlen_per_dp_cp_rank}"),
            (not args.sft, "cuts packed samples into their sequences: needs --sft"),
            (args.max_seqlen_per_dp_cp_rank and args.seq_length > dp
             * args.max_seqlen_per_dp_cp_rank,
             f"runs a sequence over at most the {dp} data-parallel ranks: --seq-length "
             f"{args.seq_length} exceeds {dp} x --max-seqlen-per-dp-cp-rank "
             f"{args.max_seqlen_per_dp_cp_rank}"),
            (args.context_parallel_size != 1, "builds its context-parallel blocks out of the "
                                              "data-parallel ranks: use --context-parallel-size 1"),
            (dp & (dp - 1) != 0, f"needs a power-of-two data-parallel size, got {dp}"),
            (args.tensor_model_parallel_size > 1, "with tensor parallelism is not built yet"),
            (args.use_torch_fsdp2, "with --use-torch-fsdp2 is not built yet"),
            ("a2a+p2p" in types, "with --cp-comm-type a2a+p2p is not built yet"),
            ("a2a" in types and args.num_attention_heads % dp,
             f"with --cp-comm-type a2a splits the {args.num_attention_heads} heads over up to "
             f"{dp} ranks; they must divide evenly")):
        if bad:
            _fail(f"--hybrid-context-parallel {why}")


def _validate_blend_surplus(args) -> None:
    """--mid-level-dataset-surplus is a fraction of extra samples: finite and >= 0."""
    surplus = args.mid_level_dataset_surplus
    if not (math.isfinite(surplus) and surplus >= 0):
        _fail(f"--mid-level-dataset-surplus must be a finite number >= 0, got {surplus}")


def _validate_emerging_optimizers(args) -> None:
    """--optimizer soap / adaptive_muon (megatron/optimizer/emerging.py)."""
    from megatron.optimizer.emerging import EMERGING_OPTIMIZERS, check_emerging_args

    if args.optimizer not in EMERGING_OPTIMIZERS:
        return
    try:
        check_emerging_args(args)
    except ConfigError as err:
        _fail(str(err))


def _validate_muon(args) -> None:
    if args.optimizer not in ("muon", "dist_muon"):
        return
    from megatron.optimizer.muon import check_muon_settings

    try:
        check_muon_settings(args)
    except ConfigError as err:
        _fail(str(err))
    if args.use_torch_fsdp2:
        _fail("--optimizer muon does not run with --use-torch-fsdp2 (Muon needs each weight "
              "matrix whole); use --optimizer adam")


def _validate_recompute_modules(args) -> None:
    """--recompute-modules (Megatron-Core's default: core_attn) and --moe-layer-recompute, its
    older spelling for adding moe."""
    from megatron.core.config import RECOMPUTE_MODULES

    if args.moe_layer_recompute:
        if args.recompute_granularity == "full":
            _fail("--moe-layer-recompute cannot be combined with --recompute-granularity full "
                  "(which recomputes whole layers already)")
        args.recompute_granularity = "selective"
        args.recompute_modules = list(args.recompute_modules or ["core_attn"])
        if "moe" not in args.recompute_modules:
            args.recompute_modules.append("moe")
    modules = args.recompute_modules
    if modules is None:
        return
    if args.recompute_granularity != "selective":
        _note(args, "--recompute-modules has no effect without --recompute-granularity "
                    "selective")
    elif set(modules) - set(RECOMPUTE_MODULES):
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        _fail(f"--recompute-modules {' '.join(unknown)} is not built; choose from "
              f"{', '.join(RECOMPUTE_MODULES)}, or use --recompute-granularity full")
    elif "mla_up_proj" in modules and not args.multi_latent_attention:
        _fail("--recompute-modules mla_up_proj recomputes multi-latent attention's up "
              "projections: it needs --multi-latent-attention")
    elif "mla_up_proj" in modules and args.experimental_attention_variant == "dsa":
        _fail("--recompute-modules mla_up_proj with --experimental-attention-variant dsa is not "
              "built yet (the indexer reads the query latent); drop mla_up_proj")


def _validate_precision_aware_optimizer(args) -> None:
    """Megatron's rules for --use-precision-aware-optimizer and its dtypes; with --bf16 the
    gradients cannot be both accumulated in fp32 on request and read in bf16."""
    from megatron.optimizer.precision_aware_adam import precision_aware_conflict

    problem = precision_aware_conflict(
        args.use_precision_aware_optimizer, args.optimizer, args.use_distributed_optimizer,
        args.main_grads_dtype, args.main_params_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype)
    if problem is not None:
        _fail(problem)
    if args.use_precision_aware_optimizer and args.optimizer_cpu_offload:
        _fail("--use-precision-aware-optimizer with --optimizer-cpu-offload is not built; drop "
              "one of the two")
    if args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32":
        _fail(f"--main-grads-dtype {args.main_grads_dtype} cannot be used with "
              "--accumulate-allreduce-grads-in-fp32 (as in Megatron: it needs fp32)")


def _validate_optimizer_offload(args) -> None:
    if not args.optimizer_cpu_offload:
        given = [flag for flag, on in (
            ("--use-torch-optimizer-for-cpu-offload", args.use_torch_optimizer_for_cpu_offload),
            ("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d),
            ("--no-pin-cpu-grads", not args.pin_cpu_grads),
            ("--no-pin-cpu-params", not args.pin_cpu_params),
            ("--optimizer-offload-fraction", args.optimizer_offload_fraction != 1.0)) if on]
        if given:
            _note(args, f"{', '.join(given)} has no effect without --optimizer-cpu-offload")
        return
    if args.optimizer in ("muon", "dist_muon"):
        _fail(f"--optimizer-cpu-offload steps adam, sgd or lion on the host; --optimizer "
              f"{args.optimizer} is not offloaded, drop the flag")
    if args.use_torch_fsdp2:
        _fail("--optimizer-cpu-offload does not run with --use-torch-fsdp2 (its parameters are "
              "sharded DTensors); drop one of the two")
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        _fail(f"--optimizer-offload-fraction must be in [0, 1], got "
              f"{args.optimizer_offload_fraction}")
    if _on_cpu(args):
        _note(args, "--optimizer-cpu-offload on a CPU run: the optimizer state already lives in "
                    "host memory, so offloading saves nothing (the host step still runs, on "
                    "copies of the parameters, with the same results)")


def _validate_fine_grained_offload(args) -> None:
    from megatron.model.fine_grained_offload import OFFLOAD_MODULES

    modules = list(args.offload_modules or [])
    if not args.fine_grained_activation_offloading:
        if modules:
            _fail("--offload-modules needs --fine-grained-activation-offloading")
        return
    unknown = [m for m in modules if m not in OFFLOAD_MODULES]
    if unknown or not modules:
        _fail(f"--offload-modules: give one or more of {', '.join(OFFLOAD_MODULES)} with "
              f"--fine-grained-activation-offloading (got {' '.join(modules) or 'none'})")
    if args.cpu_offloading_num_layers:
        _fail("--fine-grained-activation-offloading and --cpu-offloading-num-layers both "
              "offload activations; use one")
    if not 0.0 <= args.activation_offload_fraction <= 1.0:
        _fail(f"--activation-offload-fraction must be in [0, 1], got "
              f"{args.activation_offload_fraction}")
    if args.min_offloaded_tensor_size < 0 or args.delta_offload_bytes_across_pp_ranks < 0:
        _fail("--min-offloaded-tensor-size and --delta-offload-bytes-across-pp-ranks must be "
              ">= 0")
    if "core_attn" in modules and args.context_parallel_size > 1:
        _fail("--offload-modules core_attn is not built with --context-parallel-size > 1 (that "
              "path has no core_attn module to hook); drop it from --offload-modules")
    if _on_cpu(args):
        _note(args, "--fine-grained-activation-offloading on a CPU run: the activations already "
                    "live in host memory, so there is nothing to offload")


def _validate_qk_clip(args) -> None:
    """--qk-clip / --log-max-attention-logit: the combinations whose logits are not seen or
    whose weights cannot be scaled here are refused."""
    if not (args.qk_clip or args.log_max_attention_logit):
        if args.qk_clip_alpha != 0.5 or args.qk_clip_threshold != 100:
            _note(args, "--qk-clip-alpha and --qk-clip-threshold have no effect without "
                        "--qk-clip")
        return
    flag = "--qk-clip" if args.qk_clip else "--log-max-attention-logit"
    if args.context_parallel_size > 1:
        _fail(f"{flag} does not run with --context-parallel-size "
              f"{args.context_parallel_size}: context-parallel attention never materialises "
              "the logits here; drop one of the two")
    if not args.qk_clip:
        return
    if args.use_torch_fsdp2:
        _fail("--qk-clip does not run with FSDP (--use-torch-fsdp2 / --use-megatron-fsdp): the "
              "sharded weights cannot be scaled by rows here; drop one of the two")
    if args.optimizer_cpu_offload:
        _fail("--qk-clip does not run with --optimizer-cpu-offload (the host keeps its own "
              "copies of the weights); drop one of the two")
    if not 0.0 <= args.qk_clip_alpha <= 1.0:
        _fail(f"--qk-clip-alpha must lie in [0, 1], got {args.qk_clip_alpha}")
    if not args.qk_clip_threshold > 0:
        _fail(f"--qk-clip-threshold must be > 0, got {args.qk_clip_threshold}")


def _validate_activation_offload(args) -> None:
    _validate_fine_grained_offload(args)
    n = args.cpu_offloading_num_layers
    if n is None or not 0 <= n < args.num_layers:
        _fail(f"--cpu-offloading-num-layers must be in [0, --num-layers={args.num_layers}), "
              f"got {n}")
    if n == 0:
        if args.cpu_offloading_retain_pinned_cpu_buffers:
            _note(args, "--cpu-offloading-retain-pinned-cpu-buffers has no effect without "
                        "--cpu-offloading-num-layers")
        return
    if _on_cpu(args):
        _note(args, f"--cpu-offloading-num-layers {n} on a CPU run: the activations already "
                    "live in host memory, so there is nothing to offload")


def _validate_run_extras(args) -> None:
    """Megatron flags of the run around the model: selective recompute's modules, weight decay
    of the q/k norms, evaluation batches, progress log and checkpoint retention."""
    _validate_recompute_modules(args)
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":
        args.apply_wd_to_qk_layernorm = True
    padded, tp = args.padded_vocab_size, args.tensor_model_parallel_size
    if padded is not None and padded % tp:
        _fail(f"--padded-vocab-size ({padded}) must be divisible by --tensor-model-parallel-size "
              f"({tp}): each rank holds an equal slice of the vocabulary")
    _validate_eval_batch(args)
    for flag, value in (("--log-progress", args.log_progress),
                        ("--save-retain-interval", args.save_retain_interval)):
        if value and not args.save:
            _fail(f"{flag} works in the --save folder; give --save")
    _validate_dumps(args)


def _validate_dumps(args) -> None:
    """The --save-*-interval dumps write into --save; a reduced gradient is whole only where
    no rank holds just its shard of it."""
    for name in DUMP_INTERVAL_FLAGS:
        value = getattr(args, name)
        if value is not None and not args.save:
            _fail(f"--{name.replace('_', '-')} writes into the --save folder; give --save")
    if args.save_wgrads_interval is not None:
        for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                         ("--use-torch-fsdp2", getattr(args, "use_torch_fsdp2", False))):
            if on:
                _fail(f"--save-wgrads-interval with {flag}: each data-parallel rank holds only "
                      "its shard of the reduced gradients; drop one of them")


def _dsa_refusals(args):
    """What DSA does not support here, as (condition, message) pairs."""
    return [
        (args.dsa_kernel_backend != "none",
         f"--dsa-kernel-backend {args.dsa_kernel_backend}: its GPU kernels are not built; "
         "only none (plain PyTorch) runs"),
        (args.dsa_indexer_topk_freq != 1,
         f"--dsa-indexer-topk-freq {args.dsa_indexer_topk_freq}: sharing top-k across layers "
         "is not built yet (only 1)"),
        (not args.multi_latent_attention,
         "--experimental-attention-variant dsa needs --multi-latent-attention"),
        (args.context_parallel_size > 1,
         "--experimental-attention-variant dsa: context parallelism is not built yet"),
        (args.softmax_type != "vanilla",
         f"--experimental-attention-variant dsa: --softmax-type {args.softmax_type} is not "
         "built yet (only vanilla)"),
        (args.window_size is not None,
         "--experimental-attention-variant dsa: --window-size is not built yet"),
        (args.qk_clip or args.log_max_attention_logit,
         "--experimental-attention-variant dsa: --qk-clip / --log-max-attention-logit are "
         "not built yet"),
        (args.calculate_per_token_loss,
         "--experimental-attention-variant dsa: --calculate-per-token-loss (the indexer loss "
         "summed per token) is not built yet"),
        (args.recompute_granularity == "selective"
         and "core_attn" in (args.recompute_modules or ["core_attn"]),
         "--experimental-attention-variant dsa: recomputing core_attn is not built yet"),
    ]


def _validate_dsa(args) -> None:
    """``--experimental-attention-variant dsa`` and its ``--dsa-*`` flags."""
    variant = args.experimental_attention_variant
    if variant is None:
        return
    if variant != "dsa":
        return                      # _validate_gdn
    _require(args, "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
    for condition, message in _dsa_refusals(args):
        if condition:
            _fail(message)
    for flag, value in (("--dsa-indexer-n-heads", args.dsa_indexer_n_heads),
                        ("--dsa-indexer-topk", args.dsa_indexer_topk)):
        if value < 1:
            _fail(f"{flag} must be at least 1, got {value}")
    if args.dsa_indexer_head_dim < args.qk_pos_emb_head_dim:
        _fail(f"--dsa-indexer-head-dim ({args.dsa_indexer_head_dim}) must hold the "
              f"--qk-pos-emb-head-dim ({args.qk_pos_emb_head_dim}) rotary channels")
    dim = args.dsa_indexer_head_dim
    if args.dsa_indexer_rotate_activation and dim & (dim - 1):
        _fail(f"--dsa-indexer-head-dim ({dim}) must be a power of two for the Hadamard "
              "rotation, or pass --no-dsa-indexer-rotate-activation")
    if args.dsa_indexer_skip_topk_offset < 0:
        _fail(f"--dsa-indexer-skip-topk-offset must be >= 0, got "
              f"{args.dsa_indexer_skip_topk_offset}")
    if (args.dsa_indexer_loss_coeff or 0.0) < 0:
        _fail(f"--dsa-indexer-loss-coeff must be >= 0, got {args.dsa_indexer_loss_coeff}")


def _validate_distillation(args) -> None:
    problem = distillation_flags_problem(args)
    if problem:
        _fail(problem)


def _validate_mla_options(args) -> None:
    """``--cache-mla-latents`` and ``--mla-down-proj-fusion`` (refused before any process group
    exists, with the flag named; the model config repeats the check for direct builders)."""
    for flag, on in (("--cache-mla-latents", args.cache_mla_latents),
                     ("--mla-down-proj-fusion", args.mla_down_proj_fusion)):
        if on and not args.multi_latent_attention:
            _fail(f"{flag} applies to --multi-latent-attention only: add it or drop {flag}")
    if args.mla_down_proj_fusion and args.q_lora_rank is None:
        _fail("--mla-down-proj-fusion fuses the query and key/value down projections: it "
              "needs --q-lora-rank (the query has no down projection without it)")


def check_flags(args):
    """Every check of the parsed flags, in order (``validate_args`` runs it after the flag
    registry's checks); derives the sizes the later checks and the run read."""
    _validate_surface(args)
    _validate_megatron_fsdp(args)
    _validate_precision_aware_optimizer(args)
    _validate_sizes(args)
    _validate_watchdogs(args)
    _apply_old_spellings(args)
    _validate_model(args)
    _validate_dsa(args)
    _validate_mla_options(args)
    _validate_mup(args)
    _validate_gdn(args)
    _validate_mhc(args)
    _validate_parallel(args)
    _validate_weight_shards(args)
    _validate_grouped_gemm(args)
    _validate_moe(args)
    _validate_routing_trace(args)
    _validate_expert_weight_shards(args)
    _read_heterogeneous_config(args)
    _validate_upcycling(args)
    _validate_mtp(args)
    _validate_batch_and_schedule(args)
    _validate_microbatch_groups(args)
    _validate_interleaved_microbatches(args)
    _validate_phase_transitions(args)
    _note_no_initialization(args)
    _validate_run_extras(args)
    _validate_masking(args)
    _validate_fim(args)
    _validate_sft(args)
    _validate_object_storage(args)
    _validate_fault_tolerance(args)
    _validate_gigatoken(args)
    _validate_hybrid_context_parallel(args)
    _validate_inter_document_masking(args)
    _validate_blend_surplus(args)
    _validate_checkpoint_format(args)
    _validate_msc_checkpoints(args)
    _validate_non_persistent(args)
    _validate_torch_fsdp2(args)
    _validate_grad_precision(args)
    _validate_muon(args)
    _validate_emerging_optimizers(args)
    _validate_optimizer_offload(args)
    _validate_activation_offload(args)
    _validate_validation_sets(args)
    _validate_qk_clip(args)
    _validate_distillation(args)
    return args

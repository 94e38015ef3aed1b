"""The typed configs built from validated flags (re-exported by :mod:`megatron.training.arguments`).

:func:`build_configs` turns the namespace :func:`megatron.training.arguments.validate_args`
returns into the config each component takes: model, DDP, checkpointing, data, optimizer,
scheduler, MoE, and the training loop's and logging's own. The flag audit
(tests/unit/test_flag_audit.py) reads the config field each flag fills from
:func:`build_configs` to the end of this module, so the builders stay after it.
"""

import argparse
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.checkpoint.config import CheckpointConfig
from megatron.core.config import TransformerConfig
from megatron.core.heterogeneous import parse_block_configs
from megatron.core.mup import resolve_width_mult
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.data.config import DataConfig, FIMFlags
from megatron.model.moe.config import MoEConfig
from megatron.optimizer.config import OptimizerConfig, SchedulerConfig
from megatron.optimizer.emerging import uses_element_sharding

# --output-logit-dtype choices -> torch dtypes.
LOGIT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class TrainingConfig:
    """How long the loop runs, what it evaluates, when it stops and what it guards against.

    ``train_iters`` is the run's length in iterations (--train-iters, or derived from
    --train-samples before the configs are built).
    """

    micro_batch_size: int
    global_batch_size: int
    train_iters: Optional[int]
    eval_interval: Optional[int]
    eval_iters: int
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    check_for_nan_in_loss_and_grad: bool = False
    skip_iterations_with_loss_spike: bool = False
    start_eval_at_iter: Optional[int] = None
    iterations_to_skip: Tuple[int, ...] = ()
    full_validation: bool = False
    multiple_validation_sets: bool = False
    validation_set_names: Tuple[str, ...] = ()
    phase_transition_iterations: Tuple[int, ...] = ()


@dataclass(frozen=True)
class LoggingConfig:
    """What the loop logs, and how often (the console line, TensorBoard, timers)."""

    log_interval: int
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    log_params_norm: bool = False
    log_timers_to_tensorboard: bool = False
    log_throughput: bool = False
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    moe_per_layer_logging: bool = False


@dataclass
class Configs:
    """The typed configs built from validated flags; each component takes only its own.

    ``optimizer`` is None without --lr, and ``scheduler`` also without --train-iters or
    --train-samples: flags that describe no training (generation, evaluation, conversion).
    """

    model: TransformerConfig
    ddp: DistributedDataParallelConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    moe: Optional[MoEConfig] = None
    training: Optional[TrainingConfig] = None
    logging: Optional[LoggingConfig] = None


def _position_embedding_type(args) -> str:
    """``--position-embedding-type``, except that multi-latent attention's rotary positions are
    chosen by ``--rope-type`` (unset: YaRN, Megatron-Core's MLA default): the DeepSeek recipes
    set ``--rotary-scaling-factor``, ``--mscale`` and ``--mscale-all-dim`` beside
    ``--position-embedding-type rope``. At the default factor 1 YaRN is plain rope."""
    if args.multi_latent_attention and args.position_embedding_type in ("rope", "yarn"):
        return args.rope_type or "yarn"
    return args.position_embedding_type


def heterogeneous_blocks(text: Optional[str], path: Optional[str], args) -> Optional[tuple]:
    """The per-layer blocks of the JSON ``text`` (``--heterogeneous-layers-config-encoded-json``,
    which validation fills from the file ``path``), or None; errors name ``path`` or the flag."""
    if not text:
        return None
    return parse_block_configs(text, path or "--heterogeneous-layers-config-encoded-json",
                               args.num_layers, args.num_attention_heads, args.hidden_size)


def build_configs(args: argparse.Namespace) -> Configs:
    """Typed configs from validated args (``args.padded_vocab_size`` must be set).

    The builders of the other configs follow this function: the flag audit
    (tests/unit/test_flag_audit.py) reads the ``field=args.flag`` pairs from here to the end.
    """
    model = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        padded_vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings, seq_length=args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        position_embedding_type=_position_embedding_type(args), cp_comm_type=args.cp_comm_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rotary_interleaved=args.rotary_interleaved, rotary_from_position_ids=args.sft,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        use_rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        yarn_rotary_scaling_factor=args.rotary_scaling_factor,
        yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings,
        yarn_beta_fast=args.yarn_beta_fast, yarn_beta_slow=args.yarn_beta_slow,
        yarn_mscale=args.mscale, yarn_mscale_all_dim=args.mscale_all_dim,
        yarn_correction_range_round_to_int=args.yarn_correction_range_round_to_int,
        swiglu=args.swiglu, openai_gelu=args.openai_gelu, squared_relu=args.squared_relu,
        quick_geglu=args.quick_geglu, glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        apply_layernorm_1p=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        init_method_xavier_uniform=args.init_method_xavier_uniform,
        perform_initialization=args.perform_initialization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        # FSDP2 keeps fp32 parameters (the main weights) and computes in bf16 through its
        # mixed-precision policy.
        params_dtype=torch.float32 if args.use_torch_fsdp2 else args.params_dtype,
        fp16=args.fp16, bf16=args.bf16,
        fp32_residual_connection=args.fp32_residual_connection,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        masked_softmax_fusion=args.masked_softmax_fusion,
        bias_gelu_fusion=args.bias_gelu_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        use_flash_attn=args.use_flash_attn, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations,
        recompute_modules=tuple(args.recompute_modules or ("core_attn",)),
        mlp_chunks_for_training=args.mlp_chunks_for_training,
        cpu_offloading_num_layers=args.cpu_offloading_num_layers,
        cpu_offloading_retain_pinned_cpu_buffers=args.cpu_offloading_retain_pinned_cpu_buffers,
        fine_grained_activation_offloading=args.fine_grained_activation_offloading,
        offload_modules=tuple(args.offload_modules or ()),
        min_offloaded_tensor_size=args.min_offloaded_tensor_size,
        delta_offload_bytes_across_pp_ranks=args.delta_offload_bytes_across_pp_ranks,
        activation_offload_fraction=args.activation_offload_fraction,
        first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        logit_dtype=LOGIT_DTYPES.get(getattr(args, "logit_dtype", None)),
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type,
        multi_latent_attention=args.multi_latent_attention, q_lora_rank=args.q_lora_rank,
        rope_type=args.rope_type,
        kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        cache_mla_latents=args.cache_mla_latents,
        mla_down_proj_fusion=args.mla_down_proj_fusion,
        qk_l2_norm=args.qk_l2_norm, attention_output_gate=args.attention_output_gate,
        no_rope_freq=args.no_rope_freq,
        experimental_attention_variant=args.experimental_attention_variant,
        linear_attention_freq=args.linear_attention_freq,
        linear_conv_kernel_dim=args.linear_conv_kernel_dim,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
        embedding_init_method_std=args.embedding_init_method_std,
        qk_clip=args.qk_clip, qk_clip_alpha=args.qk_clip_alpha,
        qk_clip_threshold=args.qk_clip_threshold,
        log_max_attention_logit=args.log_max_attention_logit,
        dsa_indexer_n_heads=args.dsa_indexer_n_heads,
        dsa_indexer_head_dim=args.dsa_indexer_head_dim, dsa_indexer_topk=args.dsa_indexer_topk,
        dsa_indexer_loss_coeff=args.dsa_indexer_loss_coeff,
        dsa_indexer_use_sparse_loss=args.dsa_indexer_use_sparse_loss,
        dsa_indexer_rope_interleaved=args.dsa_indexer_rope_interleaved,
        dsa_indexer_rotate_activation=args.dsa_indexer_rotate_activation,
        dsa_indexer_scoring_relu=args.dsa_indexer_scoring_relu,
        dsa_indexer_k_norm_epsilon=args.dsa_indexer_k_norm_epsilon,
        dsa_indexer_k_norm_fp32=args.dsa_indexer_k_norm_fp32,
        use_mup=args.use_mup, mup_width_mult=args.mup_width_mult,
        mup_base_hidden_size=args.mup_base_hidden_size,
        mup_embedding_mult=args.mup_embedding_mult, mup_output_mult=args.mup_output_mult,
        mup_base_head_dim=args.mup_base_head_dim, mup_attn_scale_power=args.mup_attn_scale_power,
        heterogeneous_blocks=heterogeneous_blocks(
            args.heterogeneous_layers_config_encoded_json,
            args.heterogeneous_layers_config_path, args),
        enable_mhc_connections=args.enable_mhc_connections,
        mhc_num_residual_streams=args.mhc_num_residual_streams,
        mhc_sinkhorn_iterations=args.mhc_sinkhorn_iterations,
        mhc_init_gating_factor=args.mhc_init_gating_factor,
        mhc_recompute_layer_num=args.mhc_recompute_layer_num,
        config_logger_dir=args.config_logger_dir or "",
    )
    model.check_splittable(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    return Configs(model=model, ddp=_ddp_config(args),
                   checkpoint=build_checkpoint_config(args), data=build_data_config(args),
                   optimizer=_optimizer_config(args), scheduler=_scheduler_config(args),
                   moe=build_moe_config(args), training=_training_config(args),
                   logging=_logging_config(args))


def build_moe_config(args) -> Optional[MoEConfig]:
    """The MoE settings (None for a dense model); ``--expert-tensor-parallel-size`` defaults
    to the tensor-parallel size, as in Megatron-Core."""
    if args.num_experts is None:
        return None
    return MoEConfig(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_apply_probs_on_input=args.moe_apply_probs_on_input,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_quantile_balancing_ema=args.moe_router_quantile_balancing_ema,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_use_grouped_tensor=args.moe_use_grouped_tensor,
        moe_single_grouped_weight=args.moe_single_grouped_weight,
        moe_single_grouped_bias=args.moe_single_grouped_bias,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=(args.expert_tensor_parallel_size
                                     or args.tensor_model_parallel_size),
        moe_layer_freq=args.moe_layer_freq, moe_per_layer_logging=args.moe_per_layer_logging,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_router_force_biased=args.moe_router_force_biased,
        moe_latent_size=args.moe_latent_size,
        moe_mlp_glu_interleave_size=args.moe_mlp_glu_interleave_size,
        moe_shared_expert_glu_interleave_size=args.moe_shared_expert_glu_interleave_size,
        moe_enable_routing_replay=args.moe_enable_routing_replay)


def _ddp_config(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=uses_element_sharding(args.optimizer,
                                                        args.use_distributed_optimizer),
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
        param_name_patterns_for_fp32_local_accumulation=tuple(
            args.ddp_param_name_patterns_for_fp32_local_accumulation),
        bucket_size=args.ddp_bucket_size,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        use_torch_fsdp2=args.use_torch_fsdp2,
        torch_fsdp2_reshard_after_forward=args.torch_fsdp2_reshard_after_forward,
        torch_fsdp2_reduce_dtype=getattr(args, "torch_fsdp2_reduce_dtype", None),
        torch_fsdp2_replicas=args.num_distributed_optimizer_instances)


def build_checkpoint_config(args) -> CheckpointConfig:
    return CheckpointConfig(
        save=args.save, save_interval=args.save_interval, no_save_optim=args.no_save_optim,
        no_save_rng=args.no_save_rng, load=args.load, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, finetune=args.finetune,
        pretrained_checkpoint=args.pretrained_checkpoint, ckpt_step=args.ckpt_step,
        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        ckpt_format=args.ckpt_format, async_save=args.async_save,
        ckpt_convert_format=args.ckpt_convert_format, ckpt_convert_save=args.ckpt_convert_save,
        dist_ckpt_strictness=args.dist_ckpt_strictness,
        non_persistent_save_interval=args.non_persistent_save_interval,
        non_persistent_ckpt_type=args.non_persistent_ckpt_type,
        non_persistent_global_ckpt_dir=args.non_persistent_global_ckpt_dir,
        non_persistent_local_ckpt_dir=args.non_persistent_local_ckpt_dir,
        replication=args.replication, replication_jump=args.replication_jump,
        replication_factor=args.replication_factor, verify_integrity=args.verify_integrity,
        override_ckpt_iteration=args.override_ckpt_iteration,
        load_main_params_from_ckpt=args.load_main_params_from_ckpt)


def build_data_config(args) -> DataConfig:
    """The data config alone: what a dataset provider needs, before or without the model's
    (which needs the tokenizer's padded vocabulary)."""
    return DataConfig(
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, seed=args.seed,
        data_path=args.data_path, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        split=args.split, data_cache_path=args.data_cache_path, mock_data=args.mock_data,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
        dataloader_type=args.dataloader_type, num_workers=args.num_workers,
        mmap_bin_files=args.mmap_bin_files, fim=_fim_flags(args),
        object_storage_cache_path=args.object_storage_cache_path, enable_msc=args.enable_msc,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        multiple_validation_sets=args.multiple_validation_sets,
        per_dataset_sequences_path=args.per_dataset_sequences_path,
        dataloader_inter_document_masking=args.dataloader_inter_document_masking)


def _fim_flags(args) -> FIMFlags:
    return FIMFlags(
        fim_data=args.fim_data, fim_rate=args.fim_rate, fim_spm_rate=args.fim_spm_rate,
        fim_split_sample=args.fim_split_sample, fim_fragment_rate=args.fim_fragment_rate,
        fim_no_prefix=args.fim_no_prefix, fim_prefix_token=args.fim_prefix_token,
        fim_middle_token=args.fim_middle_token, fim_suffix_token=args.fim_suffix_token,
        fim_pad_token=args.fim_pad_token, fim_eod_token=args.fim_eod_token)


def _optimizer_config(args) -> Optional[OptimizerConfig]:
    if args.lr is None:
        return None
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
        lion_beta1=args.lion_beta1, lion_beta2=args.lion_beta2, clip_grad=args.clip_grad,
        fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=int(args.loss_scale_window),
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
        muon_momentum=args.muon_momentum, muon_nesterov=args.muon_nesterov,
        muon_split_qkv=args.muon_split_qkv, muon_scale_mode=args.muon_scale_mode,
        muon_fp32_matmul_prec=args.muon_fp32_matmul_prec,
        muon_coefficient_type=args.muon_coefficient_type,
        muon_num_ns_steps=args.muon_num_ns_steps, muon_tp_mode=args.muon_tp_mode,
        muon_use_syrk=args.muon_use_syrk,
        muon_extra_scale_factor=args.muon_extra_scale_factor,
        muon_scalar_optimizer=args.muon_scalar_optimizer,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        use_torch_optimizer_for_cpu_offload=args.use_torch_optimizer_for_cpu_offload,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=args.pin_cpu_grads, pin_cpu_params=args.pin_cpu_params,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_grads_dtype=args.main_grads_dtype, main_params_dtype=args.main_params_dtype,
        exp_avg_dtype=args.exp_avg_dtype, exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        use_mup=args.use_mup,
        mup_width_mult=(resolve_width_mult(args.hidden_size, args.mup_width_mult,
                                           args.mup_base_hidden_size) if args.use_mup else 1.0))


def _scheduler_config(args) -> Optional[SchedulerConfig]:
    """The schedule with its lengths in samples, as the training loop steps it."""
    if args.lr is None or (args.train_iters is None and args.train_samples is None):
        return None
    gbs = args.global_batch_size
    if args.train_samples is None:
        decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
        warmup_steps = (args.lr_warmup_fraction * decay_steps
                        if args.lr_warmup_fraction is not None else args.lr_warmup_iters * gbs)
    else:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        wsd_steps = args.lr_wsd_decay_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps
                        if args.lr_warmup_fraction is not None else args.lr_warmup_samples)
    return SchedulerConfig(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=args.lr_wsd_decay_style)


def _training_config(args) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, skip_train=args.skip_train,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        skip_iterations_with_loss_spike=args.skip_iterations_with_loss_spike,
        start_eval_at_iter=args.start_eval_at_iter,
        full_validation=args.full_validation,
        multiple_validation_sets=args.multiple_validation_sets,
        validation_set_names=tuple(args.validation_set_names or ()),
        iterations_to_skip=_iterations_to_skip(args.iterations_to_skip,
                                               args.result_rejected_tracker_filename),
        phase_transition_iterations=tuple(args.phase_transition_iterations or ()))


def _iterations_to_skip(given, tracker_filename) -> Tuple[int, ...]:
    """--iterations-to-skip and the iterations the tracker file rejects, as Megatron merges
    them."""
    from megatron.training.rerun import tracker_iterations_to_skip

    return tuple(sorted(set(given) | set(tracker_iterations_to_skip(tracker_filename))))


def _logging_config(args) -> LoggingConfig:
    return LoggingConfig(
        log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
        tensorboard_log_interval=args.tensorboard_log_interval,
        log_params_norm=args.log_params_norm,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard,
        log_throughput=args.log_throughput, timing_log_level=args.timing_log_level,
        timing_log_option=args.timing_log_option,
        moe_per_layer_logging=args.moe_per_layer_logging)

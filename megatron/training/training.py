"""``pretrain()``: set up, train with periodic evaluation and checkpoints, evaluate at the end.

The loop mirrors Megatron's: each iteration runs the forward/backward schedule over the global
batch's micro-batches, finalises gradients (data-parallel reduction, sequence-parallel norm
grads), steps the optimizer (skipped on fp16 overflow) and the LR schedule, then logs, evaluates
and saves at their intervals.
"""

import argparse
import dataclasses
import functools
import inspect
import math
import os
import signal
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.checkpoint import object_storage
from megatron.checkpoint.config import CheckpointConfig
from megatron.core import config_logger, device
from megatron.core.config import ConfigError
from megatron.core.distributed import (DistributedDataParallel, TorchFullyShardedDataParallel,
                                       finalize_model_grads)
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.data.config import DataConfig
from megatron.data.samplers import (build_pretraining_data_loader, cyclic_iter,
                                    exit_signal_worker_init)
from megatron.optimizer import SchedulerConfig, get_megatron_optimizer, qk_clip
from megatron.optimizer.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import checkpointing, exit_handler, freeze, global_vars
from megatron.training import hooks as training_hooks
from megatron.training import distributed_controls, meta_device_init, phases, upcycling
from megatron.training import fault_tolerance
from megatron.training import hybrid_cp, param_group_map, sniff_test
from megatron.training import log as training_log
from megatron.training import (memory_accounting, moe_logging, numerics, rerun, save_extras,
                               stragglers, watchdog)
from megatron.training.arguments import ArgumentsError, build_configs, parse_args, validate_args
from megatron.training.configs import Configs, LoggingConfig, TrainingConfig
from megatron.training.dumps import IterationDumps
from megatron.training.initialize import initialize_megatron
from megatron.training.microbatches import NumMicroBatchesCalculator, calculator_from_args
from megatron.training.timers import Timers
from megatron.training.train_state import TrainState
from megatron.training.utils import print_rank_0
from megatron.training import validation_sets
from megatron.training.validation import validation_set_count


@dataclasses.dataclass
class TrainingRun:
    """What one training run hands its loop, evaluation, logging and saves, in one place.

    Built by :func:`pretrain` once everything exists; :func:`train`, :func:`evaluate_and_print`
    and the logging and saving steps take it whole instead of a dozen handles each.

    Attributes:
        args: the validated flags (what :func:`train_step`, the log line and the hooks read).
        pstate: this rank's :class:`~megatron.core.parallel_state.ParallelState`.
        training / logging: the loop's and logging's typed configs (how long, when to evaluate
            and stop; what to log and how often).
        ckpt: the checkpoint options (:class:`~megatron.checkpoint.config.CheckpointConfig`).
        calculator: micro-batches per step, following a batch-size ramp-up or step schedule.
        timers / writer: the timers and the scalar writer (TensorBoard; None without one).
        train_state: the run's position and records (:class:`TrainState`).
        forward_step_func: the user's ``forward_step(data_iterator, model)``.
        model / optimizer / scheduler: this rank's model chunks, optimizer and LR schedule.
        saver: the background writer of --async-save, or None.
    """

    args: argparse.Namespace
    pstate: object
    training: TrainingConfig
    logging: LoggingConfig
    ckpt: CheckpointConfig
    calculator: NumMicroBatchesCalculator
    timers: Timers
    writer: object
    train_state: TrainState
    forward_step_func: Callable
    model: List[torch.nn.Module]
    optimizer: object
    scheduler: OptimizerParamScheduler
    saver: Optional[object] = None


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "pretrain"


def _print_error_once(message: str) -> None:
    """Every rank sees the same flags; rank 0 alone prints ``prog: error: message``."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{_prog()}: error: {message}", file=sys.stderr, flush=True)


def _one_line_errors(extra_args_provider: Optional[Callable]) -> Callable:
    """An args provider that makes argparse report a bad flag in one line.

    argparse's own report starts with the usage of every flag (over a hundred lines here)
    before the one line that matters.
    """
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)

        def error(message):
            _print_error_once(f"{message} (see --help)")
            raise SystemExit(2)

        parser.error = error
        return parser

    return provider


def parse_entry_flags(argv, extra_args_provider, args_defaults, before_validation=None):
    """Parse and validate the flags; ``before_validation(args)`` (a tool's own adjustments)
    runs on the parsed flags just before :func:`validate_args`."""
    try:
        args = parse_args(_one_line_errors(extra_args_provider), argv=argv)
        for key, value in (args_defaults or {}).items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
        if args.use_checkpoint_args:
            checkpointing.load_args_from_checkpoint(args)
        checkpointing.null_tokenizer_eod_from_checkpoint(args)
        if before_validation is not None:
            before_validation(args)
        validate_args(args)
        # Check the ramp-up now, not after the process groups and the model are built.
        calculator_from_args(args, args.data_parallel_size)
        return args
    except (ArgumentsError, ConfigError, checkpointing.CheckpointError) as err:
        _print_error_once(str(err))
        raise SystemExit(2)


def get_optimizer_param_scheduler(optimizer, config: SchedulerConfig) -> OptimizerParamScheduler:
    """The LR / weight-decay schedule, with steps counted in samples as Megatron does."""
    return OptimizerParamScheduler(
        optimizer, init_lr=config.init_lr, max_lr=config.max_lr, min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps, lr_decay_steps=config.lr_decay_steps,
        lr_decay_style=config.lr_decay_style, start_wd=config.start_wd, end_wd=config.end_wd,
        wd_incr_steps=config.wd_incr_steps, wd_incr_style=config.wd_incr_style,
        use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
        wsd_decay_steps=config.wsd_decay_steps, lr_wsd_decay_style=config.lr_wsd_decay_style)


def model_stage(model) -> tuple:
    """``(first, last)``: whether a (DDP-wrapped) model chunk is the first / last (virtual)
    pipeline stage, read from the chunk itself (its ``pre_process`` / ``post_process``), so a
    forward step needs no "current virtual stage" state."""
    while not hasattr(model, "pre_process") and hasattr(model, "module"):
        model = model.module
    return model.pre_process, model.post_process


def build_model_chunks(model_provider: Callable, pstate) -> List[torch.nn.Module]:
    """This rank's model: one chunk, or one per virtual pipeline stage with interleaving.

    Chunk ``i`` is built by ``model_provider(pre_process, post_process, vp_stage=i)``, where the
    provider hands the model ``pstate.for_virtual_stage(i)`` (a copy answering for that stage;
    ``pstate`` itself never changes). A provider without a ``vp_stage`` parameter (users' older
    scripts) reads the parallel state from ``global_vars`` instead: while it builds chunk ``i``
    that handle is the stage's copy.
    """
    if pstate.virtual_pp_size is None:
        return [model_provider(pre_process=pstate.is_first_stage(),
                               post_process=pstate.is_last_stage())]
    takes_stage = "vp_stage" in inspect.signature(model_provider).parameters
    chunks = []
    for i in range(pstate.virtual_pp_size):
        stage = pstate.for_virtual_stage(i)
        kwargs = dict(pre_process=stage.is_first_stage(), post_process=stage.is_last_stage())
        if takes_stage:
            chunks.append(model_provider(**kwargs, vp_stage=i))
            continue
        with global_vars.parallel_state_of_stage(stage):
            chunks.append(model_provider(**kwargs))
    return chunks


def _training_configs(configs: Configs) -> Configs:
    """``configs``, checked to describe training: it has an optimizer and a schedule."""
    if configs.optimizer is None:
        raise ConfigError("--lr must be given (the peak learning rate), got None")
    if configs.scheduler is None:
        raise ConfigError("give --train-iters or --train-samples: the length of the "
                          "learning-rate schedule")
    return configs


def fsdp2_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The sub-modules FSDP2 shards as units of their own, in forward order: an untied input
    embedding, every transformer layer, an untied output layer. A tied embedding is read by the
    output layer outside its own forward, so it stays in the root unit. The multi-token
    prediction depths' transformer layers are units too (their norms and projection stay in
    the root); the MTP block calls the embedding and output-layer units again after the main
    stack: FSDP2 gathers a unit at each call, and the gradients of every call reach its shard."""
    from megatron.model.transformer import ParallelTransformerLayer

    language_model = getattr(module, "language_model", None)
    untied = getattr(language_model, "untie_embeddings_and_output_weights", False)
    units = []
    if untied and getattr(language_model, "embedding", None) is not None:
        units.append(language_model.embedding)
    units += [m for m in module.modules() if isinstance(m, ParallelTransformerLayer)]
    if untied and getattr(language_model, "output_layer", None) is not None:
        units.append(language_model.output_layer)
    return units


def fsdp2_expert_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The mixture-of-experts layers' expert modules (every local expert of one layer), which
    FSDP2 shards over the expert-data-parallel group."""
    from megatron.model.moe.experts import SequentialMLP

    return [m for m in module.modules() if isinstance(m, SequentialMLP)]


FSDP2_REDUCE_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp2_compute_dtype(args) -> Optional[torch.dtype]:
    """The dtype FSDP2 gathers the fp32 shards in for forward and backward (None: fp32)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def wrap_for_data_parallel(module: torch.nn.Module, args, pstate, ddp_config):
    """``module`` wrapped for data parallelism over ``pstate.dp_cp_group``: sharded by FSDP2
    with --use-torch-fsdp2 (or --use-megatron-fsdp's optim_grads / optim_grads_params), else
    the grad-buffer wrapper."""
    if ddp_config.use_torch_fsdp2:
        return TorchFullyShardedDataParallel(
            module, dp_group=pstate.dp_cp_group, units=fsdp2_units(module),
            reshard_after_forward=ddp_config.torch_fsdp2_reshard_after_forward,
            compute_dtype=fsdp2_compute_dtype(args),
            reduce_dtype=FSDP2_REDUCE_DTYPES[ddp_config.torch_fsdp2_reduce_dtype],
            replicas=ddp_config.torch_fsdp2_replicas,
            broadcast_first=args.data_parallel_random_init,
            expert_units=fsdp2_expert_units(module), expert_dp_group=pstate.expert_dp_group,
            calculate_per_token_loss=ddp_config.calculate_per_token_loss)
    ddp = DistributedDataParallel(
        module, dp_group=pstate.dp_cp_group,
        accumulate_allreduce_grads_in_fp32=ddp_config.grad_reduce_in_fp32,
        overlap_grad_reduce=ddp_config.overlap_grad_reduce,
        bucket_size=ddp_config.bucket_size,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        reduce_scatter_with_fp32_accumulation=ddp_config.reduce_scatter_with_fp32_accumulation,
        fp32_local_accumulation_patterns=(
            ddp_config.param_name_patterns_for_fp32_local_accumulation),
        gradient_accumulation_fusion=ddp_config.gradient_accumulation_fusion,
        expert_dp_group=pstate.expert_dp_group,
        calculate_per_token_loss=ddp_config.calculate_per_token_loss,
        weight_shard_dp_group=getattr(pstate, "weight_shard_dp_group", None),
        expert_weight_shard_dp_group=getattr(pstate, "expert_weight_shard_dp_group", None))
    if args.data_parallel_random_init:
        ddp.broadcast_params()
    config = getattr(module, "config", None)
    if getattr(config, "config_logger_dir", ""):
        # As Megatron-Core's DistributedDataParallel logs its constructor's arguments.
        config_logger.log_config_to_disk(
            config.config_logger_dir, {"config": config, "ddp_config": ddp_config,
                                       "module": module, "disable_bucketing": False},
            type(ddp).__name__, config_logger.rank_string(pstate))
    return ddp


def setup_model_and_optimizer(model_provider: Callable, args, pstate, *,
                              configs: Optional[Configs] = None):
    """Model chunks wrapped for data parallelism, the optimizer and the LR schedule.

    ``configs`` are the run's configs (``build_configs(args)`` when not given).
    """
    configs = _training_configs(configs or build_configs(args))
    ddp_config = configs.ddp
    build = functools.partial(build_model_chunks, model_provider, pstate)
    on_meta = getattr(args, "init_model_with_meta_device", False)
    if on_meta:
        modules, pieces, rng = meta_device_init.build_on_meta(build)
    else:
        modules = [m.to(device.current_device()) for m in build()]
    n_params = sum(p.numel() for m in modules for p in m.parameters())
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank "
                 f"({pstate.tp_rank}, {pstate.pp_rank}): {n_params}")
    chunks = [wrap_for_data_parallel(module, args, pstate, ddp_config) for module in modules]
    if on_meta:
        meta_device_init.materialise(modules, build, pieces, rng)
    if args.moe_use_upcycling:
        upcycling.upcycle_from_dense(modules, build, args, pstate)
    fsdp2 = ddp_config.use_torch_fsdp2
    optimizer = get_megatron_optimizer(configs.optimizer, chunks,
                                       mp_group=pstate.model_parallel_group,
                                       tp_group=pstate.tp_group, dp_group=pstate.dp_cp_group,
                                       overlap_param_gather=ddp_config.overlap_param_gather,
                                       expert_model_parallel_group=(
                                           pstate.expert_model_parallel_group),
                                       expert_tp_rank=pstate.expert_tp_rank,
                                       expert_tp_group=pstate.expert_tp_group,
                                       grad_shard_group=chunks[0].shard_group if fsdp2
                                       else None,
                                       weight_shard_group=getattr(
                                           pstate, "weight_shard_group", None),
                                       expert_weight_shard_group=getattr(
                                           pstate, "expert_weight_shard_group", None))
    param_group_map.dump_param_to_param_group_map(args, chunks, configs.optimizer, pstate)
    scheduler = get_optimizer_param_scheduler(optimizer, configs.scheduler)
    return chunks, optimizer, scheduler


def pipeline_tensor_shape(args, pstate, micro_batch_size: Optional[int] = None) -> tuple:
    """``(s, b, h)`` of the activations between pipeline stages (``s / cp`` with context
    parallelism, then ``/ tp`` with sequence parallelism, both as the layout has them); fixed,
    so stages never exchange shapes. ``b`` is --micro-batch-size unless given (evaluation's)."""
    seq = args.seq_length // pstate.cp_size
    if pstate.sequence_parallel:
        seq //= pstate.tp_size
    # Hyper-connections pass their n residual streams between stages.
    streams = args.mhc_num_residual_streams if args.enable_mhc_connections else 1
    return (seq, micro_batch_size or args.micro_batch_size, streams * args.hidden_size)


def schedule_kwargs(model, args, pstate, micro_batch_size: Optional[int] = None) -> dict:
    """Keywords of the forward/backward schedule beyond the common ones, for this layout
    (``micro_batch_size``: evaluation's, when it is not --micro-batch-size)."""
    per_token = {"calculate_per_token_loss": args.calculate_per_token_loss}
    if pstate.pp_size == 1:
        return {"no_sync_func": model[0].no_sync, **per_token,
                **hybrid_cp.schedule_kwargs(args, pstate)}
    dtype = torch.float32 if args.fp32_residual_connection else args.params_dtype
    return {
        **per_token,
        # Each chunk defers its own reduction to its own last micro-batch.
        "no_sync_func": [chunk.no_sync for chunk in model],
        "communicator": P2PCommunicator.from_parallel_state(pstate, dtype,
                                                            device.current_device()),
        "tensor_shape": pipeline_tensor_shape(args, pstate, micro_batch_size),
        **_loss_stage_shape(args, pstate, micro_batch_size),
        **_microbatch_groups(args, pstate),
    }


def _loss_stage_shape(args, pstate, micro_batch_size: Optional[int]) -> dict:
    """A standalone MTP stage (--mtp-standalone) hands the loss stage the main and the K MTP
    hidden states, concatenated along the sequence: ``((1+K)s, b, h)``, through the (empty)
    stages between them."""
    if not getattr(args, "mtp_standalone", False):
        return {}
    from megatron.core.pipeline_parallel.layer_layout import mtp_standalone_stage

    seq, batch, hidden = pipeline_tensor_shape(args, pstate, micro_batch_size)
    return {"loss_stage_tensor_shape": ((1 + args.mtp_num_layers) * seq, batch, hidden),
            "mtp_stage": mtp_standalone_stage(args.pipeline_model_parallel_layout)}


def _schedule_for(args, pstate) -> Callable:
    """The forward/backward schedule of a step (and of evaluation) for this run."""
    if args.hybrid_context_parallel:
        return hybrid_cp.forward_backward_hybrid_context_parallel
    return get_forward_backward_func(pstate.pp_size, pstate.virtual_pp_size)


def _microbatch_groups(args, pstate) -> dict:
    """--microbatch-group-size-per-virtual-pipeline-stage, for the interleaved schedule only."""
    if pstate.virtual_pp_size is None or args.microbatch_group_size_per_vp_stage is None:
        return {}
    return {"microbatch_group_size_per_vp_stage": args.microbatch_group_size_per_vp_stage}


def eval_global_batch_size(args, calculator: NumMicroBatchesCalculator) -> int:
    """Samples per evaluation step: --eval-global-batch-size, else the training batch."""
    return args.eval_global_batch_size or calculator.current_running_global_batch_size


def _num_samples(args, iteration: int = 0) -> List[int]:
    train_samples = args.train_samples or args.train_iters * args.global_batch_size
    transitions = getattr(args, "phase_transition_iterations", None)
    if transitions:  # the train dataset of the current phase alone
        train_samples = phases.phase_train_samples(iteration, transitions,
                                                   args.global_batch_size, train_samples)
    eval_runs = args.train_iters // args.eval_interval + 1
    if args.start_eval_at_iter is not None:  # Megatron's count; one run left for the final one
        eval_runs = max(1, eval_runs - args.start_eval_at_iter // args.eval_interval)
    # Evaluation runs the training batch of the moment; build enough for the largest.
    steps = getattr(args, "step_batch_size_samples", None) or [(0, args.global_batch_size)]
    eval_batch = args.eval_global_batch_size or max(batch for _, batch in steps)
    # --full-validation: the validation data's one epoch, whatever its size (Megatron's None).
    valid = None if args.full_validation else eval_runs * args.eval_iters * eval_batch
    return [train_samples, valid, args.eval_iters * eval_batch]


def _train_loader_start(args, train_state: TrainState) -> int:
    """Samples the train loader skips: all consumed, or, with phases, those of this phase."""
    if args.phase_transition_iterations:
        return phases.phase_consumed_samples(train_state.iteration,
                                             args.phase_transition_iterations,
                                             args.global_batch_size)
    return train_state.consumed_train_samples


def build_data_iterators(provider: Callable, args, pstate, train_state: TrainState,
                         data: DataConfig):
    """Train/valid/test iterators on TP rank 0 (other TP ranks receive batches by broadcast),
    each starting after the samples ``train_state`` has consumed; notes in ``train_state``
    which splits have data."""
    sets = args.full_validation or args.multiple_validation_sets
    count = validation_set_count(args)
    suffixes = validation_sets.set_suffixes(count, args.multiple_validation_sets,
                                            args.validation_set_names or ())
    loaders, valid_loaders = [None, None, None], [None] * count
    flags = torch.zeros(3 + count, dtype=torch.int64, device=device.current_device())
    if pstate.tp_rank == 0:
        datasets = list(provider(_num_samples(args, train_state.iteration)))
        valid = validation_sets.as_set_list(datasets[1], count)
        eval_micro = args.eval_micro_batch_size or data.micro_batch_size
        init = (exit_signal_worker_init(args.exit_signal) if args.exit_signal_handler
                and args.exit_signal_handler_for_dataloader else None)

        def loader(ds, start, micro, kind=data.dataloader_type):
            return build_pretraining_data_loader(
                ds, start, micro, pstate.dp_rank, pstate.dp_size,
                kind, data.num_workers, data.seed, worker_init_fn=init)

        loaders[0] = loader(datasets[0], _train_loader_start(args, train_state),
                            data.micro_batch_size)
        # Each set is read from its start with the flags on; a full pass in order.
        valid_start = 0 if sets else train_state.consumed_valid_samples
        valid_kind = "single" if args.full_validation else data.dataloader_type
        valid_loaders = [loader(ds, valid_start, eval_micro, valid_kind) for ds in valid]
        loaders[2] = loader(datasets[2], 0, eval_micro)
        blocks = (validation_sets.count_blocks(valid, eval_micro, pstate.dp_size, suffixes)
                  if args.full_validation else [0] * count)
        flags = torch.tensor([int(loaders[0] is not None),
                              int(any(ld is not None for ld in valid_loaders)),
                              int(loaders[2] is not None)] + blocks,
                             dtype=torch.int64, device=device.current_device())
    if pstate.tp_size > 1:
        dist.broadcast(flags, pstate.tp_ranks[0], group=pstate.tp_group)
    flags = flags.tolist()
    train_state.do_train, train_state.do_valid, train_state.do_test = (
        bool(x) for x in flags[:3])

    def make(loader, cyclic):
        if loader is None:
            return None
        return iter(cyclic_iter(loader)) if cyclic else iter(loader)

    cyclic_train = data.dataloader_type == "cyclic"
    valid_its = [make(ld, True) for ld in valid_loaders]
    if sets:
        _print_validation_sets(suffixes, flags[3:], args, pstate)
        valid_its = validation_sets.ValidationSets(
            suffixes, valid_its, flags[3:] if args.full_validation else None)
    else:
        valid_its = valid_its[0]
    return make(loaders[0], cyclic_train), valid_its, make(loaders[2], True)


def _print_validation_sets(suffixes, blocks, args, pstate) -> None:
    if not args.full_validation:
        print_rank_0("validation sets: " + ", ".join(f"validation{s}" for s in suffixes))
        return
    micro = (args.eval_micro_batch_size or args.micro_batch_size) * pstate.dp_size
    print_rank_0("full validation sets (samples read per evaluation): " + ", ".join(
        f"validation{s}: {b * micro}" for s, b in zip(suffixes, blocks)))


def build_chunk_data_iterators(provider: Callable, args, pstate, train_state: TrainState,
                               data: DataConfig):
    """Train/valid/test iterators; with virtual pipeline stages, a list of one per chunk.

    Every chunk walks the same samples in the same order; the forward step of a chunk that
    needs no data (neither the first nor the last virtual stage) never advances its iterator.
    """
    if pstate.virtual_pp_size is None:
        return build_data_iterators(provider, args, pstate, train_state, data)
    per_chunk = [build_data_iterators(provider, args, pstate, train_state, data)
                 for _ in range(pstate.virtual_pp_size)]
    merged = [list(split) for split in zip(*per_chunk)]
    if isinstance(merged[1][0], validation_sets.ValidationSets):
        merged[1] = validation_sets.merge_chunks(merged[1], pstate.pp_size)
    return tuple(merged)


class _StopSignal:
    """--exit-signal-handler: --exit-signal (SIGTERM by default) or SIGINT is noted, and the run
    saves and stops at the end of the iteration (every rank, agreeing by an all-reduce, whichever
    ranks got the signal).

    Further signals are noted the same way: a launcher may relay the one it got (torchrun passes
    an interrupt on to its workers), so a second signal must not kill the save in progress.
    """

    def __init__(self, exit_signal: int = signal.SIGTERM):
        self.received = 0  # the first signal's number
        signals = dict.fromkeys((signal.Signals(exit_signal), signal.SIGINT))
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum, frame):
        self.received = self.received or signum

    def any_rank_received(self) -> Optional[str]:
        """The name of a signal some rank received (the highest number), or None."""
        flag = torch.tensor([int(self.received)], device=device.current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else None

    def release(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def _forward_backward(forward_step_func, data_iterator, model, optimizer, args, pstate,
                      calculator: NumMicroBatchesCalculator, timers: Timers, check: bool,
                      machine) -> rerun.StepRun:
    """One run of the step's forward and backward passes, gradients finalised. With ``check``
    the losses and gradients are checked for inf/nan (the run's findings); with a rerun
    ``machine`` the losses and this rank's gradient sum of squares are kept as the result."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    check_grads = check and not args.fp16
    watch = numerics.LossWatch(forward_step_func) if check or machine else None
    schedule = _schedule_for(args, pstate)
    moe_logging.set_aux_loss_scale(model, optimizer.get_loss_scale(),
                                   calculator.num_micro_batches, args.calculate_per_token_loss)
    timers("forward-backward", log_level=1).start()
    context, forward_only = freeze.grad_context(args)
    with context:
        logged = schedule(forward_step_func=watch or forward_step_func,
                          data_iterator=data_iterator, model=model,
                          num_microbatches=calculator.num_micro_batches,
                          forward_only=forward_only, grad_scale_func=optimizer.scale_loss,
                          **schedule_kwargs(model, args, pstate))
    timers("forward-backward", log_level=1).stop()
    training_hooks.empty_unused_memory(args, 1)
    findings = numerics.loss_findings(watch) if check else []
    sumsq = machine is not None and machine.validates_grads
    grad_sumsq = (numerics.local_grad_sumsq(model)
                  if sumsq and not args.overlap_grad_reduce else None)
    # A finite fp64 sum of squares says every gradient is finite: no second pass for it.
    if check_grads and not args.overlap_grad_reduce and not _finite(grad_sumsq):
        findings += numerics.grad_findings(model)
    if forward_only:  # --freeze-all-layers: no gradients to reduce
        losses = [float(v) for v in watch.losses] if machine is not None else []
        return rerun.StepRun(logged, findings, losses, grad_sumsq)
    finalize_model_grads(model, tp_group=pstate.tp_group, embedding_group=pstate.embedding_group,
                         is_first_stage=pstate.is_first_stage(ignore_virtual=True),
                         is_last_stage=pstate.is_last_stage(ignore_virtual=True),
                         pp_size=pstate.pp_size, sequence_parallel=pstate.sequence_parallel,
                         num_tokens=logged.num_tokens if args.calculate_per_token_loss else None,
                         pp_group=pstate.pp_group, dp_group=pstate.dp_cp_group,
                         in_embedding_group=pstate.rank in pstate.embedding_ranks)
    if sumsq and args.overlap_grad_reduce:
        grad_sumsq = numerics.local_grad_sumsq(model)
    if check_grads and args.overlap_grad_reduce and not _finite(grad_sumsq):
        findings += numerics.grad_findings(model)
    losses = [float(v) for v in watch.losses] if machine is not None else []
    return rerun.StepRun(logged, findings, losses, grad_sumsq)


def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, args, pstate,
               calculator: NumMicroBatchesCalculator, iteration: Optional[int] = None,
               timers: Optional[Timers] = None, train_state: Optional[TrainState] = None):
    """One iteration (number ``iteration``, for messages); returns (loss dict, skipped, grad
    norm, loss scale). ``train_state`` holds the losses --skip-iterations-with-loss-spike
    compares with (required with that flag) and the rerun state machine, if any.

    With --check-for-nan-in-loss-and-grad every rank's micro-batch losses and gradients are
    checked before the optimizer step; gradients before the data-parallel reduction, so the rank
    that produced an inf or nan is named (after it with --overlap-grad-reduce, which starts the
    reduction during backward). Gradients are not checked with --fp16: there an inf gradient is
    an overflow, and the optimizer skips the step and the log line counts it. With
    --rerun-mode validate_results / report_stats the passes may run again before the optimizer
    step (:mod:`megatron.training.rerun`), which may raise :class:`~megatron.training.rerun.
    RerunExit`.
    """
    check = args.check_for_nan_in_loss_and_grad
    machine = train_state.rerun if train_state is not None else None
    timers = timers or Timers(0)
    body = functools.partial(_forward_backward, forward_step_func, data_iterator, model,
                             optimizer, args, pstate, calculator, timers, check, machine)

    def stop_plainly(findings):
        numerics.stop_if_not_finite(findings, iteration, args, pstate,
                                    reduced=check and not args.fp16 and args.overlap_grad_reduce)

    dumps = IterationDumps(args, iteration)
    dumps.before_passes(model)
    try:
        if machine is None:
            step = body()
            logged = step.logged
            if check:
                stop_plainly(step.findings)
        else:
            logged = machine.run_step(body, data_iterator, iteration, stop_plainly)
    except BaseException:
        dumps.cancel()
        raise
    dumps.after_passes(model, pstate)
    last_stage = pstate.is_last_stage(ignore_virtual=True)
    losses = training_log.reduce_logged([logged], pstate.dp_cp_group) if last_stage else {}
    if args.skip_iterations_with_loss_spike and numerics.skip_for_loss_spike(
            losses, iteration, args, pstate, train_state.loss_spike_history):
        ok, grad_norm = False, None
    elif args.freeze_all_layers:
        ok, grad_norm = True, None  # nothing to update; the schedule still advances
    else:
        timers("optimizer", log_level=1).start()
        ok, grad_norm, _ = optimizer.step()
        timers("optimizer", log_level=1).stop()
    if args.qk_clip or args.log_max_attention_logit:
        # Also after a skipped step, which resets the maxima without clipping.
        max_logit = qk_clip.finish_step(
            model, optimizer, pstate, clip_weights=args.qk_clip and ok,
            threshold=args.qk_clip_threshold, alpha=args.qk_clip_alpha)
        if train_state is not None:
            train_state.max_attention_logit = max_logit
    dumps.after_step(model, pstate)
    if not args.freeze_all_layers:
        moe_logging.update_expert_biases(model, pstate)
    moe_logging.reset_global_aux_loss(model)
    training_hooks.empty_unused_memory(args, 2)
    # As Megatron logs it: the scale after this step's update (backed off on an overflow).
    loss_scale = training_log.to_float(optimizer.get_loss_scale())
    if ok:
        scheduler.step(increment=calculator.current_running_global_batch_size)
    moe_losses = moe_logging.aux_loss_values(model, pstate, calculator.num_micro_batches,
                                             args.moe_per_layer_logging)
    if last_stage:
        losses.update(moe_losses)
        losses.update(moe_logging.mtp_loss_values(model, pstate, calculator.num_micro_batches))
    indexer_losses = moe_logging.indexer_loss_values(model, pstate, calculator.num_micro_batches)
    if last_stage:
        losses.update(indexer_losses)
    return losses, not ok, grad_norm, loss_scale


def evaluate(forward_step_func, data_iterator, model, args, pstate,
             calculator: NumMicroBatchesCalculator, eval_iters: int, train_state: TrainState,
             full_pass_blocks: Optional[int] = None):
    """Average of each logged loss over ``eval_iters`` global batches, dropout off; the samples
    read count in ``train_state.consumed_valid_samples``. ``full_pass_blocks``
    (--full-validation): read that many micro batch x data-parallel blocks instead, in steps of
    the usual micro-batch count and one shorter last step."""
    for chunk in model:
        chunk.eval()
    batches = []
    schedule = _schedule_for(args, pstate)
    batch = eval_global_batch_size(args, calculator)
    micro = args.eval_micro_batch_size or args.micro_batch_size
    if batch % (micro * pstate.dp_size):
        raise SystemExit(f"evaluation batch {batch} is not divisible by --eval-micro-batch-size "
                         f"or --micro-batch-size ({micro}) x data-parallel size "
                         f"({pstate.dp_size}); set --eval-global-batch-size")
    kwargs = schedule_kwargs(model, args, pstate, micro)
    per_step = batch // (micro * pstate.dp_size)
    steps = ([per_step] * eval_iters if full_pass_blocks is None
             else validation_sets.full_pass_steps(full_pass_blocks, per_step))
    with torch.no_grad():
        for num_microbatches in steps:
            fault_tolerance.current().eval_step_start()
            batches.append(schedule(forward_step_func=forward_step_func,
                                    data_iterator=data_iterator, model=model,
                                    num_microbatches=num_microbatches,
                                    forward_only=True, **kwargs))
            fault_tolerance.current().eval_step_end()
            training_hooks.empty_unused_memory(args, 1)
            train_state.consumed_valid_samples += num_microbatches * micro * pstate.dp_size
    for chunk in model:
        chunk.train()
    return training_log.reduce_logged(batches, pstate.dp_cp_group)


def evaluate_and_print(run: TrainingRun, prefix: str, data_iterator):
    """Evaluate --eval-iters batches of ``data_iterator``, print Megatron's validation line and
    write the scalars; returns the losses. For :class:`validation_sets.ValidationSets`, each
    set in turn, under its own name; returns the first set's losses."""
    if not isinstance(data_iterator, validation_sets.ValidationSets):
        return _evaluate_one(run, prefix, data_iterator, "", None)
    sets = data_iterator
    every = [_evaluate_one(run, prefix, it, suffix, None if sets.blocks is None
                           else sets.blocks[k])
             for k, (it, suffix) in enumerate(zip(sets.iterators, sets.suffixes))]
    run.train_state.valid_losses_per_set = {
        f"validation{suffix}": losses for suffix, losses in zip(sets.suffixes, every)}
    return every[0]


def _evaluate_one(run: TrainingRun, prefix: str, data_iterator, suffix: str,
                  full_pass_blocks: Optional[int]):
    losses = evaluate(run.forward_step_func, data_iterator, run.model, run.args, run.pstate,
                      run.calculator, run.training.eval_iters, run.train_state,
                      full_pass_blocks)
    pstate = run.pstate
    if pstate.is_last_stage(ignore_virtual=True) and pstate.tp_rank == 0 and pstate.dp_rank == 0:
        print(training_log.format_eval_line(prefix, losses, suffix), flush=True)
    training_log.write_eval_scalars(run.writer, run.args, run.train_state, losses, suffix)
    return losses


def load_or_finetune(model, optimizer, scheduler, args, pstate, train_state: TrainState,
                     ckpt: CheckpointConfig) -> int:
    """Resume from --load; or, when --load holds no checkpoint and --pretrained-checkpoint is
    given, start from that checkpoint's weights as --finetune does (iteration 0, fresh optimizer
    and schedule, consumed samples 0), as Megatron does for finetuning runs. Returns the
    iteration to start from; ``train_state`` takes the position the checkpoint records."""
    pretrained = ckpt.pretrained_checkpoint
    if not pretrained or (ckpt.load and checkpointing.read_tracker(ckpt.load) is not None):
        return checkpointing.load_checkpoint(model, optimizer, scheduler, args, pstate,
                                             train_state=train_state, config=ckpt)
    if checkpointing.read_tracker(pretrained) is None:
        raise checkpointing.CheckpointError(
            f"--pretrained-checkpoint {pretrained}: no {checkpointing.TRACKER_FILENAME}; not a "
            "checkpoint directory")
    print_rank_0(f"no checkpoint in --load {ckpt.load}; starting from the weights of "
                 f"--pretrained-checkpoint {pretrained} (as --finetune)")
    return checkpointing.load_checkpoint(
        model, optimizer, scheduler, args, pstate, train_state=train_state,
        config=dataclasses.replace(ckpt, load=pretrained, finetune=True))


def save_upcycled(model, optimizer, scheduler, args, pstate, train_state: TrainState,
                  ckpt: CheckpointConfig) -> None:
    """--moe-use-upcycling: the upcycled model is iteration 1, saved to --save at once (as
    Megatron does); training continues from it."""
    train_state.iteration = 1
    checkpointing.save_checkpoint(train_state.iteration, model, optimizer, scheduler, args,
                                  pstate, train_state=train_state, config=ckpt)
    print_rank_0(f"upcycled checkpoint saved to {ckpt.save}")


def samples_after(iterations: int, calculator: NumMicroBatchesCalculator) -> int:
    """Training samples consumed by ``iterations`` iterations from the start, following the
    batch-size ramp (--rampup-batch-size, --step-batch-size-schedule) when there is one."""
    if calculator.rampup is None and calculator.step_schedule is None:
        calculator.update(0)
        return iterations * calculator.current_running_global_batch_size
    samples = 0
    for _ in range(iterations):
        calculator.update(samples, check=False)
        samples += calculator.current_running_global_batch_size
    return samples


def override_checkpoint_iteration(train_state: TrainState, scheduler,
                                  calculator: NumMicroBatchesCalculator,
                                  ckpt: CheckpointConfig) -> None:
    """--override-ckpt-iteration N: whatever --load held, the run goes on as from iteration N:
    the iteration counter, the consumed training samples (the sampler's position) and the
    learning-rate / weight-decay schedule's position are those of N iterations."""
    n = ckpt.override_ckpt_iteration
    if n is None:
        return
    samples = samples_after(n, calculator)
    train_state.iteration = n
    train_state.consumed_train_samples = samples
    train_state.skipped_train_samples = min(train_state.skipped_train_samples, samples)
    scheduler.num_steps = 0
    scheduler.step(samples)
    calculator.update(samples)
    print_rank_0(f"--override-ckpt-iteration: continuing from iteration {n} ({samples} "
                 "consumed samples, the schedule at the same point)")


def convert_loaded_checkpoint(train_state: TrainState, model, optimizer, scheduler, args, pstate,
                              ckpt: CheckpointConfig) -> None:
    """--ckpt-convert-format / --ckpt-convert-save: write what --load held in that format to
    that folder (model, optimizer, scheduler, RNG states, position), then stop without
    training."""
    target = dataclasses.replace(ckpt, ckpt_format=ckpt.ckpt_convert_format,
                                 save=ckpt.ckpt_convert_save)
    checkpointing.check_save_dir(target.save)
    checkpointing.save_checkpoint(train_state.iteration, model, optimizer, scheduler, args,
                                  pstate, train_state=train_state, config=target)
    print_rank_0(f"converted {ckpt.load} (iteration {train_state.iteration}) to --ckpt-format "
                 f"{ckpt.ckpt_convert_format} in {ckpt.ckpt_convert_save}; exiting")


def _save(run: TrainingRun):
    """Save the current iteration now, or start a background save with ``run.saver``
    (--async-save)."""
    run.timers("save-checkpoint", log_level=0).start()
    fault_tolerance.current().checkpointing_start()
    save = run.saver.save if run.saver is not None else checkpointing.save_checkpoint
    save(run.train_state.iteration, run.model, run.optimizer, run.scheduler, run.args,
         run.pstate, train_state=run.train_state, config=run.ckpt)
    fault_tolerance.current().checkpointing_end()
    run.timers("save-checkpoint", log_level=0).stop()
    _after_save(run)


def _publish_async_save(run: TrainingRun, wait: bool = False) -> None:
    """--async-save: publish the background save once written (``wait``: block until it is);
    a fault-tolerance ``checkpointing`` section while one is in flight."""
    if run.saver.in_flight is None:
        return
    fault_tolerance.current().checkpointing_start()
    if wait:
        run.saver.wait()
    else:
        run.saver.poll()
    fault_tolerance.current().checkpointing_end(finalization=True)


def _save_non_persistent(run: TrainingRun) -> None:
    """--non-persistent-save-interval: a cheap checkpoint (megatron/checkpoint/non_persistent)."""
    run.timers("save-checkpoint", log_level=0).start()
    checkpointing.save_non_persistent(run.train_state.iteration, run.model, run.optimizer,
                                      run.scheduler, run.args, run.pstate,
                                      train_state=run.train_state, config=run.ckpt)
    run.timers("save-checkpoint", log_level=0).stop()


def _after_save(run: TrainingRun) -> None:
    """Rank 0, after a save: --log-progress's line and --save-retain-interval's pruning."""
    args, train_state = run.args, run.train_state
    if args.rank != 0:
        return
    if args.log_progress:
        samples = train_state.consumed_train_samples
        line = save_extras.saved_checkpoint_progress(
            train_state.iteration, training_log.num_floating_point_operations(args, samples),
            samples * args.seq_length)
        save_extras.append_progress(args.save, args.world_size, line)
    if args.save_retain_interval is not None:
        removed = save_extras.prune_checkpoints(args.save, args.save_retain_interval)
        object_storage.delete_iterations(args, removed)


def _should_exit(iteration, training: TrainingConfig, start_time, stop_signal) -> Optional[str]:
    received = stop_signal.any_rank_received() if stop_signal is not None else None
    if received is not None:
        return f"received {received}"
    if training.exit_interval and iteration % training.exit_interval == 0:
        return f"reached --exit-interval {training.exit_interval}"
    transition = phases.exit_reason(iteration, training.phase_transition_iterations)
    if transition is not None:
        return transition
    if training.exit_duration_in_mins:
        minutes = torch.tensor([(time.time() - start_time) / 60.0], dtype=torch.float64,
                               device=device.current_device())
        dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
        if minutes.item() > training.exit_duration_in_mins:
            return f"exceeded --exit-duration-in-mins {training.exit_duration_in_mins}"
    return None


def check_memory_at_startup(args, pstate, calculator: NumMicroBatchesCalculator) -> None:
    """Before the model is built: each pipeline stage's predicted memory (one line per stage,
    from its data-parallel and tensor-parallel rank 0), and a warning when it exceeds what a
    rank has (the GPU's memory, or on CPU the machine's memory shared by its local ranks)."""
    if pstate.dp_rank != 0 or pstate.tp_rank != 0:
        return
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    full_batch = NumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size,
                                           pstate.dp_size, None)
    for line in memory_accounting.startup_memory_check(
            args, pstate, full_batch.num_micro_batches, max(1, ranks_per_node)):
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)


def report_memory(args, pstate, calculator: NumMicroBatchesCalculator) -> None:
    """After the first iteration, each pipeline stage's theoretical memory next to its measured
    peak (one line per stage: data-parallel and tensor-parallel rank 0)."""
    if pstate.dp_rank == 0 and pstate.tp_rank == 0:
        print(memory_accounting.memory_report(args, pstate, calculator.num_micro_batches),
              flush=True)


# The timers of the console timing line and of --log-timers-to-tensorboard (those that exist
# at the configured --timing-log-level).
TIMERS_TO_LOG = ["forward-backward", "batch-generator", "optimizer", "save-checkpoint"]


def _log_iteration(run: TrainingRun, stats, losses, lr, batch, loss_scale,
                   grad_norm) -> training_log.IntervalStats:
    """Scalars, the console line and the timing line after one iteration; returns the stats to
    go on with (fresh ones after a console line).

    Every rank calls it: the params norm is reduced over the model-parallel group and the timers
    over all ranks, at iterations that every rank agrees on.
    """
    args, log = run.args, run.logging
    train_state, timers, writer = run.train_state, run.timers, run.writer
    iteration = train_state.iteration
    console = iteration % log.log_interval == 0
    scalars = bool(log.tensorboard_dir) and iteration % log.tensorboard_log_interval == 0
    params_norm = None
    if log.log_params_norm and (console or scalars):
        params_norm = training_log.calc_params_l2_norm(run.model, run.pstate)
    training_log.write_train_scalars(writer, args, train_state, losses, lr, batch, loss_scale,
                                     grad_norm, params_norm)
    iterations = max(1, stats.advanced + stats.skipped)
    if log.log_timers_to_tensorboard and scalars:
        timers.write(TIMERS_TO_LOG, writer, iteration, normalizer=iterations)
    if not console:
        return stats
    timing = (timers.log_string(TIMERS_TO_LOG, normalizer=iterations)
              if log.timing_log_level > 0 else "")
    if writer is not None:
        per_iter_s = training_log.seconds_per_iteration(stats)
        if log.log_timers_to_tensorboard:
            writer.add_scalar("iteration-time", per_iter_s, iteration)
        if log.log_throughput:
            writer.add_scalar("throughput",
                              training_log.throughput_tflops(args, batch, per_iter_s), iteration)
    if args.rank == args.world_size - 1:
        training_log.emit_line(training_log.format_log_line(
            args, train_state, stats, lr, batch, loss_scale, grad_norm, params_norm))
        if timing:
            print(timing, flush=True)
    return training_log.IntervalStats()


def _learning_rate(optimizer, frozen: bool = False) -> float:
    """The logged learning rate: the first param group's not under --decoupled-lr nor scaled
    by --use-mup; 0 for a --freeze-all-layers run (nothing is updated), as Megatron logs it."""
    if frozen:
        return 0.0
    return next((g["lr"] for g in optimizer.param_groups
                 if not g.get("is_decoupled_lr") and "mup_lr_factor" not in g),
                optimizer.param_groups[0]["lr"])


def _rerun_exit(run: TrainingRun, stop: "rerun.RerunExit") -> None:
    """The rerun state machine stopped the step: save the checkpoint it asks for (the weights
    before the step's optimizer step, with the machine's state), then exit every rank with its
    code (Megatron's 16 or 17)."""
    saved = ""
    if stop.checkpoint and run.ckpt.save:
        run.train_state.rerun_checkpoint = run.train_state.rerun.state_dict()
        if run.saver is not None:
            run.saver.wait()
        _save(run)
        if run.saver is not None:
            run.saver.wait()
        saved = f" (saved: iteration {run.train_state.iteration} in {run.ckpt.save})"
    elif stop.checkpoint:
        saved = " (no --save: nothing was saved)"
    if run.args.rank == 0:
        print(f"{stop}{saved}", file=sys.stderr, flush=True)
    raise SystemExit(stop.code)


def train(run: TrainingRun, train_iterator, valid_iterator) -> int:
    """The training loop from ``run.train_state.iteration`` to --train-iters; advances the train
    state and returns the last iteration run.

    With --async-save (``run.saver``) checkpoints are written in the background; each iteration
    boundary publishes a finished one, and an exit waits for it.
    """
    args, pstate, train_state, ckpt = run.args, run.pstate, run.train_state, run.ckpt
    training = run.training
    for chunk in run.model:
        chunk.train()
    stop_signal = _StopSignal(args.exit_signal) if training.exit_signal_handler else None
    start_time = time.time()
    stats = training_log.IntervalStats()
    start_iteration = train_state.iteration
    profiler = training_hooks.IterationProfiler(args, args.rank, run.timers)
    memory_tools = training_hooks.MemoryTools(args, pstate.dp_rank)
    manual_gc = training_hooks.ManualGC(args)
    routing_trace = training_hooks.RoutingTrace(args, run.model)
    straggler = stragglers.build(args, run.timers, lambda batch: (
        training_log.num_floating_point_operations(args, batch)))
    hang = watchdog.build(args)
    forward_step_func = straggler.timed(run.forward_step_func)
    if train_state.rerun is not None:
        train_iterator = rerun.wrap_iterators(train_iterator)
    try:
        while train_state.iteration < training.train_iters:
            run.calculator.update(train_state.consumed_train_samples)
            if train_state.iteration + 1 in training.iterations_to_skip:
                _skip_iteration(run, train_iterator)
                start_iteration += train_state.iteration == start_iteration + 1
                continue
            profiler.before_iteration()
            hang.phase(train_state.iteration + 1, "train-step")
            fault_tolerance.current().train_step_start()
            try:
                losses, skipped, grad_norm, loss_scale = train_step(
                    forward_step_func, train_iterator, run.model, run.optimizer, run.scheduler,
                    args, pstate, run.calculator, iteration=train_state.iteration + 1,
                    timers=run.timers, train_state=train_state)
            except rerun.RerunExit as stop:
                _rerun_exit(run, stop)
            fault_tolerance.current().train_step_end()
            routing_trace.after_iteration()
            train_state.iteration += 1
            iteration = train_state.iteration
            hash_interval = args.check_weight_hash_across_dp_replicas_interval
            if hash_interval and iteration % hash_interval == 0:
                rerun.check_weight_hashes(run.model, run.optimizer, pstate, iteration)
            hang.phase(iteration, "after-step")
            profiler.after_iteration()
            manual_gc.after_iteration(iteration)
            if iteration == start_iteration + 1:
                report_memory(args, pstate, run.calculator)
            _run_controls(args, pstate, iteration, start_iteration)
            memory_tools.after_iteration(iteration)
            batch = run.calculator.current_running_global_batch_size
            train_state.consumed_train_samples += batch
            stats.add(losses, skipped)
            train_state.train_loss_history.append((iteration, losses.get("lm loss")))
            grad_norm = None if grad_norm is None else training_log.to_float(grad_norm)
            straggler.after_iteration(iteration, batch, run.writer)
            lr = _learning_rate(run.optimizer, run.args.freeze_all_layers)
            stats = _log_iteration(run, stats, losses, lr, batch, loss_scale, grad_norm)
            _evaluate_if_due(run, iteration, valid_iterator, manual_gc)
            if run.saver is not None:
                _publish_async_save(run)
            saved = False
            if ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0:
                _save(run)
                saved = True
            elif (ckpt.non_persistent_save_interval
                  and iteration % ckpt.non_persistent_save_interval == 0):
                _save_non_persistent(run)
            reason = _should_exit(iteration, training, start_time, stop_signal)
            if reason is not None:
                if ckpt.save and not saved:
                    _save(run)
                if run.saver is not None:
                    _publish_async_save(run, wait=True)
                print_rank_0(f"exiting at iteration {iteration}: {reason}")
                train_state.exit_requested = True
                break
    finally:
        profiler.close()
        manual_gc.close()
        routing_trace.close()
        straggler.close()
        hang.close()
        if stop_signal is not None:
            stop_signal.release()
    return train_state.iteration


def _run_controls(args, pstate, iteration: int, start_iteration: int) -> None:
    """After an iteration: the process groups' timeout after start-up and the device
    self-test, when their flags ask for them."""
    distributed_controls.timeout_after_init(args, iteration, start_iteration)
    sniff_test.sniff_test_if_due(args, pstate, iteration)


def _eval_due(training: TrainingConfig, iteration: int, do_valid: bool) -> bool:
    """Evaluate after this iteration: every --eval-interval, from --start-eval-at-iter on."""
    start = training.start_eval_at_iter
    return bool(training.eval_interval and iteration % training.eval_interval == 0
                and do_valid and (training.eval_iters > 0 or training.full_validation)
                and (start is None or iteration >= start))


def _evaluate_if_due(run: TrainingRun, iteration: int, valid_iterator,
                     manual_gc: training_hooks.ManualGC) -> None:
    if _eval_due(run.training, iteration, run.train_state.do_valid):
        manual_gc.before_eval()
        evaluate_and_print(run, f"iteration {iteration}", valid_iterator)
        manual_gc.after_eval()


def _skip_iteration(run: TrainingRun, train_iterator) -> None:
    """--iterations-to-skip: the iteration's micro-batches are read and dropped (no forward,
    no optimizer or LR step, no log line), so the data after it is where it would have been;
    the samples count as consumed and as skipped (Megatron's ``skipped_train_samples``)."""
    state = run.train_state
    iterators = train_iterator if isinstance(train_iterator, list) else [train_iterator]
    for _ in range(run.calculator.num_micro_batches):
        for it in iterators:
            if it is not None:
                next(it)
    state.iteration += 1
    batch = run.calculator.current_running_global_batch_size
    state.consumed_train_samples += batch
    state.skipped_train_samples += batch
    print_rank_0(f"skipped iteration {state.iteration} (--iterations-to-skip): {batch} samples "
                 "read and dropped")


def _train_and_evaluate(run: TrainingRun, iterators) -> None:
    """Train from ``run.train_state`` (unless --skip-train or nothing is left), save the last
    iteration, and evaluate on the validation and test data unless the run was stopped."""
    train_state, ckpt, training = run.train_state, run.ckpt, run.training
    train_it, valid_it, test_it = iterators
    left = train_state.iteration < training.train_iters
    if not training.skip_train and train_state.do_train and left:
        print_rank_0(f"training from iteration {train_state.iteration} to "
                     f"{training.train_iters} ...")
        sniff_test.sniff_test_if_due(run.args, run.pstate)  # the start-up self-test
        train(run, train_it, valid_it)
        if (ckpt.save and train_state.iteration % (ckpt.save_interval or sys.maxsize) != 0
                and not train_state.exit_requested):
            _save(run)
        if run.saver is not None:
            _publish_async_save(run, wait=True)
    if train_state.exit_requested:
        return
    if train_state.do_valid and (training.eval_iters > 0 or training.full_validation):
        train_state.final_valid_losses = evaluate_and_print(
            run, "the end of training for val data", valid_it)
    if train_state.do_test and training.eval_iters > 0:
        train_state.final_test_losses = evaluate_and_print(
            run, "the end of training for test data", test_it)


def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable,
             model_type, forward_step_func: Callable, process_non_loss_data_func=None,
             extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
             argv: Optional[List[str]] = None) -> TrainState:
    """Megatron's entry point: parse flags, build everything, train, evaluate, save.

    Args:
        train_valid_test_dataset_provider: ``provider([train, valid, test] sample counts)`` ->
            three datasets (any may be None). With --full-validation the valid count is None
            (one epoch of the validation data, as Megatron asks); with
            --multiple-validation-sets the valid entry may be a list, one dataset per set.
        model_provider: ``model_provider(pre_process, post_process)`` -> this stage's model.
        model_type: accepted for Megatron compatibility (encoder-or-decoder models only).
        forward_step_func: ``forward_step(data_iterator, model)`` -> (output, loss_func).
        argv: flags to parse instead of ``sys.argv[1:]`` (tests).
    Returns:
        The run's :class:`TrainState` (iteration, consumed samples, losses, final
        evaluations); the flags stay as parsed, in ``global_vars.get_args()``.
    """
    del model_type, process_non_loss_data_func
    args = parse_entry_flags(argv, extra_args_provider, args_defaults)
    pstate = initialize_megatron(args)
    if args.log_progress and args.rank == 0:
        os.makedirs(args.save, exist_ok=True)
        save_extras.append_progress(args.save, args.world_size, "Starting job")
    from megatron.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)
    if args.train_samples is not None:
        args.train_iters = calculator_from_args(args, pstate.dp_size).iterations_for_samples(
            args.train_samples)
    if args.train_iters is None:
        raise SystemExit("pretrain: give --train-iters or --train-samples")
    # Also checks the model shape against the split once more.
    configs = _training_configs(build_configs(args))
    if configs.model.config_logger_dir:
        config_logger.check_config_logger_dir(configs.model.config_logger_dir)
    ckpt = configs.checkpoint
    timers = Timers(configs.logging.timing_log_level, configs.logging.timing_log_option)
    writer = training_log.make_scalar_writer(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer, timers=timers,
                                     tensorboard_writer=writer.tensorboard if writer else None,
                                     parallel_state=pstate)
    lock = checkpointing.lock_save_dir(ckpt.save, args.rank) if ckpt.save else None
    handler = exit_handler.install(args)
    try:
        fault_tolerance.setup(args)
        return _build_and_run(train_valid_test_dataset_provider, model_provider,
                              forward_step_func, args, pstate, configs, timers, writer)
    finally:
        fault_tolerance.shutdown()
        if handler is not None:
            handler.release()
        if lock is not None:
            lock.release()


def _build_and_run(train_valid_test_dataset_provider, model_provider, forward_step_func, args,
                   pstate, configs: Configs, timers, writer) -> TrainState:
    """pretrain() once the flags are checked and --save is locked: build the model, optimizer
    and data, load, then train and evaluate (or convert the loaded checkpoint)."""
    ckpt = configs.checkpoint
    object_storage.fetch_load(args)   # an msc:// --load: into its mirror, once --save is locked
    calculator = calculator_from_args(args, pstate.dp_size)
    check_memory_at_startup(args, pstate, calculator)
    training_hooks.note_cpu_only_flags(args)
    training_hooks.start_memory_history(args)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, args, pstate,
                                                            configs=configs)
    train_state = TrainState()
    if args.freeze_all_layers:
        freeze.freeze_all_model_chunks(model)
    if ckpt.save and ckpt.ckpt_format == "torch_dist":
        checkpointing.check_torch_dist_savable(
            model, pstate, None if args.no_save_optim else optimizer)
    if args.moe_use_upcycling:
        save_upcycled(model, optimizer, scheduler, args, pstate, train_state, ckpt)
    else:
        load_or_finetune(model, optimizer, scheduler, args, pstate, train_state, ckpt)
        fault_tolerance.current().checkpoint_loaded(persistent=train_state.iteration > 0)
        override_checkpoint_iteration(train_state, scheduler, calculator, ckpt)
    train_state.rerun = rerun.build(args, args.rank)
    if train_state.rerun is not None:
        train_state.rerun.load_state_dict(train_state.rerun_checkpoint)
        train_state.rerun.set_step_state(functools.partial(moe_logging.step_state, model),
                                         functools.partial(moe_logging.restore_step_state,
                                                           model))
    train_state.rerun_checkpoint = None
    try:
        calculator.check_reachable(train_state.consumed_train_samples, args.train_samples or 0)
    except ArgumentsError as err:
        raise SystemExit(str(err)) from None
    if ckpt.ckpt_convert_format is not None:
        convert_loaded_checkpoint(train_state, model, optimizer, scheduler, args, pstate, ckpt)
        return train_state
    iterators = build_chunk_data_iterators(train_valid_test_dataset_provider, args, pstate,
                                           train_state, configs.data)
    saver = checkpointing.AsyncCheckpointSaver() if ckpt.async_save and ckpt.save else None
    exit_handler.watch_saver(saver)
    run = TrainingRun(args=args, pstate=pstate, training=configs.training,
                      logging=configs.logging, ckpt=ckpt, calculator=calculator, timers=timers,
                      writer=writer, train_state=train_state,
                      forward_step_func=forward_step_func, model=model, optimizer=optimizer,
                      scheduler=scheduler, saver=saver)
    _train_and_evaluate(run, iterators)
    if writer is not None:
        writer.close()
    return train_state

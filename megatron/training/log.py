"""Megatron's console log line, throughput and FLOP counts, and TensorBoard / wandb scalars."""

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron.core import device
from megatron.training.train_state import TrainState


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one forward + backward pass over ``batch_size`` sequences (Megatron's count).

    Counts the matrix multiplications only: QKV and output projections, attention scores and
    values, the MLP (x 3/2 when gated) and the logits, times 3 for forward + backward. In an
    MoE model only the experts a token is routed to count: an MoE layer's MLP term is
    ``topk x --moe-ffn-hidden-size`` plus the shared expert's size (the router's small matmul
    is not counted, as in Megatron).
    """
    s, h, layers = args.seq_length, args.hidden_size, args.num_layers
    kv_ratio = args.num_query_groups / args.num_attention_heads
    q_proj_ratio = args.kv_channels * args.num_attention_heads / h
    gated = 1.5 if args.swiglu or getattr(args, "quick_geglu", False) else 1.0
    mlp_sizes = args.ffn_hidden_size * layers
    if getattr(args, "num_experts", None) is not None:
        freq = args.moe_layer_freq
        moe_layers = (sum(1 for i in range(layers) if i % freq == 0) if isinstance(freq, int)
                      else sum(freq))
        expert_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
        routed = args.moe_router_topk * expert_size + (
            args.moe_shared_expert_intermediate_size or 0)
        mlp_sizes = args.ffn_hidden_size * (layers - moe_layers) + routed * moe_layers
    per_layer = ((1 + kv_ratio + s / h) * q_proj_ratio
                 + (mlp_sizes / (layers * h)) * gated
                 + args.padded_vocab_size / (2 * layers * h))
    return 12.0 * batch_size * s * layers * h * h * per_layer


@dataclass
class IntervalStats:
    """What the log line averages over one --log-interval."""

    losses: Dict[str, float] = field(default_factory=dict)
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss_dict: Dict[str, float], skipped: bool) -> None:
        if skipped:
            self.skipped += 1
        else:
            self.advanced += 1
        finite = all(math.isfinite(v) for v in loss_dict.values())
        if not finite:
            self.nan += 1
        if not skipped and finite:
            for key, value in loss_dict.items():
                self.losses[key] = self.losses.get(key, 0.0) + value


def emit_line(text: str) -> None:
    """Print one whole line with a single write to stdout.

    Under torchrun every rank shares one stdout pipe. ``print`` hands the text and the newline to
    the buffer separately, and a full buffer can be flushed between them, so another rank's
    output could land inside a log line. Flushing first and writing line and newline together
    makes it one ``write`` (atomic on a pipe up to 4 KiB).
    """
    sys.stdout.flush()
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def throughput_tflops(args, batch_size: int, per_iter_s: float) -> float:
    """Model TFLOP/s per device (Megatron's --log-throughput): FLOPs of one iteration over its
    time, shared by every rank of the run."""
    return num_floating_point_operations(args, batch_size) / (per_iter_s * 1e12 * args.world_size)


def seconds_per_iteration(stats: IntervalStats) -> float:
    return (time.perf_counter() - stats.start) / max(1, stats.advanced + stats.skipped)


def format_log_line(args, train_state: TrainState, stats: IntervalStats, learning_rate: float,
                    batch_size: int, loss_scale: float, grad_norm: Optional[float],
                    params_norm: Optional[float] = None) -> str:
    """Megatron's console line at ``train_state``'s iteration; ``params_norm`` with
    --log-params-norm, the model TFLOP/s field with --log-throughput, and the last step's
    largest attention logit with --qk-clip or --log-max-attention-logit."""
    per_iter_s = seconds_per_iteration(stats)
    tokens_per_s = batch_size * args.seq_length / per_iter_s / args.world_size
    parts = [f" iteration {train_state.iteration:8d}/{args.train_iters:8d}",
             f"consumed samples: {train_state.consumed_train_samples:12d}",
             f"elapsed time per iteration (ms): {per_iter_s * 1000.0:.1f}"]
    if args.log_throughput:
        # Four significant digits: 123.4 on a GPU, still readable for a tiny model on a CPU.
        parts.append("throughput per GPU (TFLOP/s/GPU): "
                     f"{throughput_tflops(args, batch_size, per_iter_s):.4g}")
    parts += [f"tokens per second per device: {tokens_per_s:.1f}",
              f"learning rate: {learning_rate:.6E}",
              f"global batch size: {batch_size:5d}"]
    for key, total in stats.losses.items():
        if key.startswith("moe/"):
            continue  # per-layer MoE values (--moe-per-layer-logging) go to TensorBoard only
        parts.append(f"{key}: {total / max(1, stats.advanced):.6E}")
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    max_logit = getattr(train_state, "max_attention_logit", None)
    if max_logit is not None:
        parts.append(f"max attention logit: {max_logit:.3f}")
    parts.append(f"number of skipped iterations: {stats.skipped:3d}")
    parts.append(f"number of nan iterations: {stats.nan:3d}")
    return " | ".join(parts) + " |"


def write_train_scalars(writer, args, train_state: TrainState, loss_dict: Dict[str, float],
                        learning_rate: float, batch_size: int, loss_scale: float,
                        grad_norm: Optional[float], params_norm: Optional[float] = None) -> None:
    """The scalars of one iteration, by iteration and by consumed samples."""
    iteration, samples = train_state.iteration, train_state.consumed_train_samples
    if writer is None or iteration % args.tensorboard_log_interval != 0:
        return
    if args.log_learning_rate_to_tensorboard:
        writer.add_scalar("learning-rate", learning_rate, iteration)
        writer.add_scalar("learning-rate vs samples", learning_rate, samples)
    if args.log_batch_size_to_tensorboard:
        writer.add_scalar("batch-size", batch_size, iteration)
        writer.add_scalar("batch-size vs samples", batch_size, samples)
    for key, value in loss_dict.items():
        writer.add_scalar(key, value, iteration)
        writer.add_scalar(key + " vs samples", value, samples)
    if args.log_loss_scale_to_tensorboard:
        writer.add_scalar("loss-scale", loss_scale, iteration)
        writer.add_scalar("loss-scale vs samples", loss_scale, samples)
    if grad_norm is not None:
        writer.add_scalar("grad-norm", grad_norm, iteration)
        writer.add_scalar("grad-norm vs samples", grad_norm, samples)
    if params_norm is not None:
        writer.add_scalar("params-norm", params_norm, iteration)
        writer.add_scalar("params-norm vs samples", params_norm, samples)
    if args.log_max_attention_logit and train_state.max_attention_logit is not None:
        writer.add_scalar("max_attention_logit", train_state.max_attention_logit, iteration)
    if args.log_world_size_to_tensorboard:
        writer.add_scalar("world-size", args.world_size, iteration)
    if args.log_memory_to_tensorboard:
        for name, value in memory_stats().items():
            writer.add_scalar(name, value, iteration)


def calc_params_l2_norm(model_chunks, pstate) -> float:
    """L2 norm of every parameter of the whole model (--log-params-norm), each counted once.

    A tensor-parallel shard counts on every TP rank, a parameter replicated over TP ranks on TP
    rank 0 only, and the last stage's copy of a tied word embedding not at all; the squares are
    summed over the model-parallel group (TP x PP). Data-parallel replicas hold the same values,
    so nothing is summed over them. Experts follow their own layout (unless it is the default
    one): the same rule at the expert-TP rank, their squares summed over the expert
    model-parallel group (expert TP x EP x PP) alone. Collective over those groups.
    """
    from megatron.core.collectives import get_group_rank, get_group_size
    from megatron.optimizer.clip_grads import (experts_apart, get_grad_norm_fp32,
                                               is_expert_parallel, param_counts_here)

    mp_group, tp_rank = pstate.model_parallel_group, pstate.tp_rank
    # Stand-in states without expert groups have the default expert layout.
    expert_group = getattr(pstate, "expert_model_parallel_group", mp_group)
    expert_tp_rank = getattr(pstate, "expert_tp_rank", tp_rank)
    # With weight shards a copy on every rank of the weight-shard group counts on its rank 0
    # (experts counted apart are not summed over that group).
    shards = getattr(pstate, "weight_shard_group", None)
    shard_rank = get_group_rank(shards)
    # Expert weight shards: the experts apart, summed over their own weight-shard group first.
    expert_shards = getattr(pstate, "expert_weight_shard_group", None)
    apart = experts_apart(mp_group, expert_group) or get_group_size(expert_shards) > 1
    params = [p for chunk in model_chunks for p in getattr(chunk, "module", chunk).parameters()
              if param_counts_here(p, tp_rank=tp_rank, expert_tp_rank=expert_tp_rank,
                                   weight_shard_rank=(get_group_rank(expert_shards)
                                                      if apart and is_expert_parallel(p)
                                                      else shard_rank))]
    # Parameters sharded by FSDP2: the shards' squares are summed over their group too.
    shard_group = getattr(model_chunks[0], "shard_group", None) if model_chunks else None
    # Under FSDP2 the shard group spans the experts' parallel positions (see
    # FullyShardedOptimizer): experts are summed with the rest.
    if shard_group is not None or not apart:
        return get_grad_norm_fp32([p.detach() for p in params], 2.0,
                                  model_parallel_group=mp_group, shard_group=shard_group,
                                  weight_shard_group=shards)
    return get_grad_norm_fp32([p.detach() for p in params if not is_expert_parallel(p)], 2.0,
                              model_parallel_group=mp_group, weight_shard_group=shards,
                              expert_grads=[p.detach() for p in params if is_expert_parallel(p)],
                              expert_model_parallel_group=expert_group,
                              expert_weight_shard_group=expert_shards)


def memory_stats() -> Dict[str, float]:
    """--log-memory-to-tensorboard's scalars under Megatron's names.

    On CUDA: the caching allocator's reserved and allocated bytes (current), its peak allocated
    bytes and its number of live allocations. On CPU there is no allocator to ask: the process's
    resident set size stands for reserved and allocated bytes, its peak resident set size for
    the peak, and there is no allocation count.
    """
    if device.is_cuda():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}
    import resource

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem-reserved-bytes": rss, "mem-allocated-bytes": rss,
            "mem-max-allocated-bytes": max(peak, rss)}


def format_eval_line(prefix: str, losses: Dict[str, float], suffix: str = "") -> str:
    """Megatron's validation line between dashes; ``suffix`` names one of several validation
    sets (``-0``, ``-NAME``: ``validation-NAME loss at ...``)."""
    parts = [f" validation{suffix} loss at {prefix}"]
    for key, value in losses.items():
        parts.append(f"{key} value: {value:.6E}")
        parts.append(f"{key} PPL: {math.exp(min(20.0, value)):.6E}")
    line = " | ".join(parts) + " |"
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


def write_eval_scalars(writer, args, train_state: TrainState, losses: Dict[str, float],
                       suffix: str = "") -> None:
    """Megatron's validation scalars (``lm loss validation``, or ``lm loss validation-NAME``
    for one of several sets)."""
    if writer is None:
        return
    iteration, samples = train_state.iteration, train_state.consumed_train_samples
    name = f"validation{suffix}"
    for key, value in losses.items():
        writer.add_scalar(f"{key} {name}", value, iteration)
        writer.add_scalar(f"{key} {name} vs samples", value, samples)
        if args.log_validation_ppl_to_tensorboard:
            ppl = math.exp(min(20.0, value))
            writer.add_scalar(f"{key} {name} ppl", ppl, iteration)
            writer.add_scalar(f"{key} {name} ppl vs samples", ppl, samples)


def make_tensorboard_writer(args):
    """A SummaryWriter on the last rank when --tensorboard-dir is given (as Megatron does)."""
    if not args.tensorboard_dir or args.rank != args.world_size - 1:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def make_wandb_run(args):
    """The ``wandb`` module, initialised on the last rank when --wandb-project is given.

    The run is named by --wandb-exp-name, belongs to --wandb-entity (else the user's default
    entity) and writes under --wandb-save-dir (else ``SAVE/wandb`` with --save, else wandb's
    default); its config is the run's arguments. wandb
    is optional: without it, one note says so and training goes on.
    """
    if not args.wandb_project or args.rank != args.world_size - 1:
        return None
    try:
        import wandb
    except ImportError:
        print(f"NOTE: --wandb-project {args.wandb_project} was given but the wandb package is "
              "not installed (pip install wandb); continuing without wandb logging",
              flush=True)
        return None
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    wandb.init(project=args.wandb_project, entity=args.wandb_entity or None,
               name=args.wandb_exp_name or None, dir=save_dir, config=dict(vars(args)))
    return wandb


class ScalarWriter:
    """Sends each scalar to TensorBoard and to wandb, whichever of them this rank has.

    TensorBoard gets every series; wandb gets the per-iteration ones (not the ``... vs samples``
    copies), as Megatron logs them.
    """

    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard = tensorboard
        self.wandb = wandb_run

    def add_scalar(self, name: str, value: float, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None and not name.endswith(" vs samples"):
            self.wandb.log({name: value}, step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def make_scalar_writer(args) -> Optional[ScalarWriter]:
    """TensorBoard (--tensorboard-dir) and wandb (--wandb-project) on the last rank, or None."""
    tensorboard = make_tensorboard_writer(args)
    wandb_run = make_wandb_run(args)
    if tensorboard is None and wandb_run is None:
        return None
    return ScalarWriter(tensorboard, wandb_run)


def to_float(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _is_sum_and_count(value) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 2


def reduce_logged(batches, dp_group) -> Dict[str, float]:
    """One number per logged name from what the schedules returned for one or more global
    batches (``batches``: a list of per-micro-batch lists of logged dicts).

    A value given as a ``[loss sum, token count]`` pair (``--calculate-per-token-loss``) is
    summed over the micro-batches and over ``dp_group`` (the data x context-parallel ranks),
    then divided: the mean over every counted token of the batches, as Megatron logs it. Any
    other value, already averaged over data-parallel ranks by the loss function, is averaged
    over the micro-batches.
    """
    totals: Dict[str, float] = {}
    pairs: Dict[str, torch.Tensor] = {}
    order: Dict[str, None] = {}
    count = 0
    for logged in batches:
        for values in logged:
            for key, value in values.items():
                order.setdefault(key)
                if _is_sum_and_count(value):
                    pair = value.detach().reshape(2).to(torch.float64)
                    pairs[key] = pairs[key] + pair if key in pairs else pair
                else:
                    totals[key] = totals.get(key, 0.0) + to_float(value)
            count += 1
    if pairs:
        names = sorted(pairs)
        stacked = torch.stack([pairs[k] for k in names])        # [names, 2]
        if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
            torch.distributed.all_reduce(stacked, group=dp_group)
        for key, (loss_sum, tokens) in zip(names, stacked.tolist()):
            totals[key] = loss_sum / tokens if tokens > 0 else float("nan")
    return {key: (totals[key] if key in pairs else totals[key] / max(1, count))
            for key in order}

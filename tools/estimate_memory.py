"""Predict each rank's memory for a pretrain_gpt.py run before launching it.

Takes the same flags as pretrain_gpt.py, plus how many ranks the run will have, and prints the
theoretical memory of one rank of every pipeline stage (weights + gradients + optimizer state, and
activations over a step of the pipeline schedule) from megatron/training/memory_accounting.py.
It builds no model, starts no process and forms no process group, so it answers in seconds for any model size.
It warns when a stage's prediction exceeds the memory a rank will have: the GPU's memory on CUDA,
the machine's MemTotal divided by the ranks per node on CPU, or ``--memory-budget-gb``.

The prediction is what the run's tensors need; a process also holds the framework itself (a few
hundred MB on CPU, the CUDA context and allocator slack on GPU), so leave some headroom.

Example::

    python tools/estimate_memory.py --nproc-per-node 8 --nnodes 2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 \\
        --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 256 --bf16 \\
        --lr 3e-4 --train-iters 1000 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt
"""

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

GB = 1024 ** 3  # as memory_accounting's MB: binary units
MB = 1024 ** 2


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GB:.2f} GB" if num_bytes >= 0.1 * GB else f"{num_bytes / MB:.2f} MB"


def add_estimate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="memory estimate")
    group.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                       help="ranks per machine, as given to torchrun (default: $LOCAL_WORLD_SIZE, "
                            "else the world size / --nnodes)")
    group.add_argument("--nnodes", type=int, default=1, help="machines, as given to torchrun")
    group.add_argument("--world-size", type=int, default=None, dest="total_ranks",
                       help="total ranks (default: $WORLD_SIZE, else --nproc-per-node x --nnodes)")
    group.add_argument("--memory-budget-gb", type=float, default=None,
                       help="also warn when a rank's prediction exceeds this many GB (2^30 bytes)")
    return parser


def rank_counts(args) -> None:
    """Set ``args.world_size`` and ``args.nproc_per_node`` from the flags or torchrun's env.

    (``--world-size`` is stored apart: parse_args sets ``args.world_size`` from $WORLD_SIZE.)
    """
    if args.nnodes < 1:
        raise SystemExit(f"estimate_memory.py: error: --nnodes must be >= 1, got {args.nnodes}")
    env_world = os.environ.get("WORLD_SIZE")
    env_local = os.environ.get("LOCAL_WORLD_SIZE")
    if args.total_ranks is not None:
        args.world_size = args.total_ranks
    elif args.nproc_per_node is not None:
        args.world_size = args.nproc_per_node * args.nnodes
    else:
        args.world_size = int(env_world) if env_world else 1
    if args.nproc_per_node is None:
        args.nproc_per_node = (int(env_local) if env_local
                               else max(1, args.world_size // args.nnodes))
    for name in ("world_size", "nproc_per_node"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"estimate_memory.py: error: {flag} must be >= 1, got "
                             f"{getattr(args, name)}")


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    """pretrain_gpt.py's flags validated for the given world size, with the padded vocabulary."""
    from megatron.training import checkpointing
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args
    from megatron.core.config import ConfigError
    from megatron.tokenizer import build_tokenizer

    try:
        args = parse_args(add_estimate_args, argv=argv)
        rank_counts(args)
        if args.use_checkpoint_args:
            checkpointing.load_args_from_checkpoint(args)
        validate_args(args)
    except (ArgumentsError, ConfigError, checkpointing.CheckpointError) as err:
        print(f"estimate_memory.py: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if getattr(args, "padded_vocab_size", None) is None:
        quiet = argparse.Namespace(**vars(args))
        quiet.rank = 1  # no "building tokenizer" lines
        build_tokenizer(quiet)
        args.padded_vocab_size = quiet.padded_vocab_size
    return args


def estimate_stages(args) -> list:
    """One :class:`~megatron.training.memory_accounting.MemoryEstimate` per pipeline stage.

    The micro-batch count is that of the full ``--global-batch-size`` (the most a ramp-up
    reaches), which is when a stage holds the most activations.
    """
    from megatron.training.memory_accounting import estimate_memory

    return [estimate_memory(args, stage, args.num_micro_batches)
            for stage in range(args.pipeline_model_parallel_size)]


def rank_limits(args, meminfo_path: str = "/proc/meminfo") -> list:
    """``(bytes, description)`` of each limit a rank's memory must stay under."""
    import torch

    from megatron.training.memory_accounting import rank_memory_limits

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    return rank_memory_limits(cuda, args.nproc_per_node, args.memory_budget_gb, meminfo_path)


def report(args, estimates, limits) -> List[str]:
    """The table and the warnings, as lines."""
    dtype = str(args.params_dtype).replace("torch.", "")
    lines = [
        f"world size {args.world_size} = tensor-model-parallel {args.tensor_model_parallel_size}"
        f" x pipeline-model-parallel {args.pipeline_model_parallel_size} x data-parallel "
        f"{args.data_parallel_size} ({args.nproc_per_node} ranks per node); "
        f"{args.num_micro_batches} micro-batches of {args.micro_batch_size} per step; {dtype}"
        f"{', distributed optimizer' if args.use_distributed_optimizer else ''}",
        "theoretical memory per rank (MB), by pipeline stage:",
        f"{'stage':>5} | {'parameters':>14} | {'bytes/param':>11} | "
        f"{'weights+grads+optimizer':>23} | {'activations':>12} | {'total':>12}",
    ]
    for stage, est in enumerate(estimates):
        lines.append(f"{stage:>5} | {est.num_parameters:>14} | {est.bytes_per_parameter:>11.2f} | "
                     f"{est.weight_and_optimizer_bytes / MB:>23.2f} | "
                     f"{est.activation_bytes / MB:>12.2f} | {est.total_bytes / MB:>12.2f}")
    for stage, est in enumerate(estimates):
        for limit, description in limits:
            if est.total_bytes > limit:
                lines.append(f"WARNING: pipeline stage {stage} needs {_size(est.total_bytes)} "
                             f"per rank, more than {description}")
    if not limits:
        lines.append("note: no memory limit known for this device; pass --memory-budget-gb")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    from megatron.errors import exit_on_user_error

    with exit_on_user_error("estimate_memory.py"):
        args = parse(argv)
        lines = report(args, estimate_stages(args), rank_limits(args))
    for line in lines:
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

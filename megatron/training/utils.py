"""Printing from one rank, as users' own scripts call it (``megatron.training.print_rank_0``)."""

import torch.distributed as dist


def is_last_rank() -> bool:
    """True on the job's last rank (it holds the last pipeline stage), or without a job."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    """Print on rank 0 only (every process prints when no process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    """Print on the last rank only, where the losses of the last pipeline stage are known."""
    if is_last_rank():
        print(message, flush=True)

"""--moe-use-upcycling: the first run of an MoE model made from a dense checkpoint.

As in Megatron-LM, the run builds the MoE model, builds the dense model it came from (the same
flags without experts, its FFN ``--ffn-hidden-size x --moe-upcycling-granularity``), loads the
dense checkpoint in ``--load`` into it, copies it into the MoE model
(:mod:`megatron.model.moe.upcycling`), saves the MoE model to ``--save`` at iteration 1 and
trains on from there. Later runs drop the flag and resume from ``--save`` like any run; a run
that still sets it while ``--save`` holds a checkpoint is refused, so an upcycled model is never
overwritten by a second conversion.

The saved checkpoint also holds the fresh optimizer and learning-rate schedule (Megatron's
holds the model only), so a restart from it continues bit for bit what the upcycling run did
after its save.
"""

import contextlib
import dataclasses
from typing import Callable, List

import torch

from megatron.checkpoint.layout import CheckpointError, read_tracker
from megatron.model.moe.upcycling import upcycle_model


def check_upcycling_dirs(load: str, save: str) -> None:
    """--load must hold the dense checkpoint; --save must not hold one yet."""
    if read_tracker(save) is not None:
        raise CheckpointError(
            f"--moe-use-upcycling: --save {save} already holds a checkpoint; upcycling is for "
            f"the first run only: drop --moe-use-upcycling and resume with --load {save}")
    if not load or read_tracker(load) is None:
        raise CheckpointError(f"--moe-use-upcycling: --load {load} holds no dense checkpoint "
                              "to upcycle")


@contextlib.contextmanager
def dense_flags(args):
    """``args`` changed in place, for the span of the block, to describe the dense model the
    MoE model is upcycled from (model providers read the run's global flags)."""
    granularity = args.moe_upcycling_granularity
    dense = dict(num_experts=None, expert_model_parallel_size=1,
                 ffn_hidden_size=args.ffn_hidden_size * granularity, moe_ffn_hidden_size=None,
                 moe_shared_expert_intermediate_size=None, moe_layer_freq=1)
    saved = {name: getattr(args, name) for name in dense}
    try:
        for name, value in dense.items():
            setattr(args, name, value)
        yield args
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


def _without_experts(pstate):
    """``pstate`` as the dense checkpoint's reader sees it: no expert parallelism (the dense
    files carry no expert rank)."""
    return dataclasses.replace(pstate, ep_group=None)


def upcycle_from_dense(modules: List[torch.nn.Module], build: Callable, args, pstate) -> None:
    """Fill this rank's MoE model chunks ``modules`` from the dense checkpoint in ``args.load``.

    Args:
        modules: the MoE model's chunks (unwrapped), already on their device.
        build: builds this rank's model chunks from the global flags.
    """
    from megatron.checkpoint.load import load_model_weights
    from megatron.core import device
    from megatron.training.utils import print_rank_0

    check_upcycling_dirs(args.load, args.save)
    with dense_flags(args):
        dense = [m.to(device.current_device()) for m in build()]
        load_model_weights(dense, args, _without_experts(pstate))
    layers = sum(upcycle_model(moe, d, args.moe_upcycling_granularity)
                 for moe, d in zip(modules, dense))
    del dense
    shared = " (shared experts keep their initialisation)" if (
        args.moe_shared_expert_intermediate_size is not None) else ""
    print_rank_0(f"upcycled {layers} MoE layer(s) on this rank from the dense checkpoint in "
                 f"{args.load} (granularity {args.moe_upcycling_granularity}){shared}")

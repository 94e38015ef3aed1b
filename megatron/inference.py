"""Start-up shared by the tools that run a trained model (generation server, evaluation).

They take the training flags (so a run's script can be reused with ``--load`` added), build the
same model, and load only its weights.

Context parallelism is a training layout: a generation step of one new token cannot be split
over the sequence, so these tools run whole sequences on every rank. With
``--context-parallel-size N`` the job keeps its ranks, and the N context-parallel ranks of each
model copy become data-parallel replicas. Tensor and pipeline ranks stay where they were (the
rank order is tp-cp-dp-pp, and cp sits inside dp), so each rank loads the same checkpoint files.
"""

from typing import Callable, List, Optional, Tuple

import torch

from megatron.checkpoint import object_storage
from megatron.core import device
from megatron.training import checkpointing, global_vars
from megatron.training.arguments import build_configs
from megatron.training.initialize import initialize_megatron
from megatron.training.timers import Timers
from megatron.training.training import build_model_chunks, parse_entry_flags
from megatron.training.utils import print_rank_0

# Flags a tool does not need from the user: one sequence at a time, no training schedule.
INFERENCE_DEFAULTS = {"micro_batch_size": 1, "no_load_optim": True, "no_load_rng": True}


def initialize_for_inference(extra_args_provider: Optional[Callable] = None,
                             argv: Optional[List[str]] = None,
                             args_defaults: Optional[dict] = None):
    """Parse and validate the flags, start the process group; returns ``(args, pstate,
    tokenizer)`` and sets the global args, tokenizer and parallel state."""
    defaults = dict(INFERENCE_DEFAULTS)
    defaults.update(args_defaults or {})
    args = parse_entry_flags(argv, extra_args_provider, defaults,
                              before_validation=_context_parallel_ranks_as_replicas)
    pstate = initialize_megatron(args)
    from megatron.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)
    build_configs(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer,
                                     timers=Timers(args.timing_log_level,
                                                   args.timing_log_option),
                                     tensorboard_writer=None, parallel_state=pstate)
    return args, pstate, tokenizer


def _context_parallel_ranks_as_replicas(args) -> None:
    """--context-parallel-size N: run without it (see the module docstring), and say so."""
    cp = args.context_parallel_size
    if cp > 1:
        if args.rank == 0:
            print(f"NOTE: --context-parallel-size {cp} is for training: generation and "
                  f"evaluation run whole sequences on every rank, so the {cp} context-parallel "
                  "ranks serve as data-parallel replicas", flush=True)
        args.context_parallel_size = 1


def load_model_for_inference(model_provider: Callable, args,
                             pstate) -> Tuple[List[torch.nn.Module], int]:
    """This rank's model chunks in eval mode with the weights of ``--load``, and the iteration."""
    chunks = [m.to(device.current_device()) for m in build_model_chunks(model_provider, pstate)]
    if args.fp16 or args.bf16:
        dtype = torch.float16 if args.fp16 else torch.bfloat16
        chunks = [m.to(dtype) for m in chunks]
    object_storage.fetch_load(args)  # an msc:// --load: its tracked checkpoint into the mirror
    iteration = checkpointing.load_model_weights(chunks, args, pstate)
    for chunk in chunks:
        chunk.eval()
    print_rank_0(f"> model ready for inference (iteration {iteration})")
    return chunks, iteration

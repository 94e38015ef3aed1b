"""Process start-up: device, process group from torchrun's environment, parallel groups, seeds."""

import atexit
import datetime
import logging
import os
import random
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import device, host_memory, node_layout, parallel_state
from megatron.training.determinism import configure_deterministic_mode
from megatron.training.distributed_controls import apply_flight_recorder_environment

# Every rank's place (node, host, addresses), read by the report on a lost peer.
_PLACES = None


def _check_socket_ifname(backend: str) -> None:
    """Fail early, naming the variable, when ``GLOO_SOCKET_IFNAME`` names a missing interface.

    gloo binds to exactly the interfaces listed there. ``NCCL_SOCKET_IFNAME`` also takes
    prefixes and exclusions (``eth``, ``^docker``), so NCCL itself judges that one.
    """
    if backend != "gloo":
        return
    missing = node_layout.missing_interfaces("GLOO_SOCKET_IFNAME")
    if missing:
        present = ", ".join(name for _, name in socket.if_nameindex())
        raise RuntimeError(
            f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} names interface(s) "
            f"{', '.join(missing)} that this host ({socket.gethostname()}) does not have; "
            f"expected one of: {present}")


def _init_process_group(args) -> None:
    """Join the job torchrun started, or form a one-rank group when run without torchrun."""
    if dist.is_initialized():
        return
    backend = device.backend()
    _check_socket_ifname(backend)
    if args.distributed_backend != backend and args.rank == 0:
        print(f"NOTE: using the {backend} backend on {device.current_device().type} "
              f"(--distributed-backend {args.distributed_backend} was given)", flush=True)
    args.distributed_backend = backend
    apply_flight_recorder_environment(args)  # read by torch when the group is created
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, rank=args.rank, world_size=args.world_size,
                                timeout=timeout)
    else:
        if args.world_size != 1:
            raise RuntimeError(f"WORLD_SIZE={args.world_size} but MASTER_ADDR is not set; "
                               "launch with torchrun")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    """Close the process group before the interpreter tears down.

    A gloo rank whose group is still open when Python finalises can abort in its destructor
    ("terminate called without an active exception"), turning a finished run into exit code
    -6. Every entry point that joined through here leaves through here, whether or not its
    script remembers to.
    """
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # noqa: BLE001 - already exiting; a failed close must not mask rc
            pass


def set_random_seeds(seed: int, pstate: parallel_state.ParallelState,
                     data_parallel_random_init: bool = False) -> int:
    """Seed python, numpy and torch, and the tensor-parallel RNG streams.

    As in Megatron, each pipeline stage gets its own seed (``seed + 100 * pp_rank``) so dropout
    differs between stages; model weights do not depend on it (they are initialised from
    ``--seed`` per layer, whatever the split).
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if seed <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed}")
    seed = seed + 100 * pstate.pp_rank
    if data_parallel_random_init:
        seed += 10 * pstate.dp_rank
    random.seed(seed)
    np.random.seed(seed)
    device.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, pstate.tp_rank)
    return seed


def _install_fused_kernels(args) -> None:
    """Route the model's fusable ops to the compiled kernels (references when unavailable).

    The --no-*-fusion flags still select the plain torch compositions inside the model.
    """
    from megatron.fused_kernels import loader, ops

    loaded = ops.install()
    if args.rank == 0:
        what = f"compiled (CPU clone {loader.cpu_isa()})" if loaded else "pure-torch references"
        print(f"> fused kernels: {what}", flush=True)


def _error_text(exc: BaseException) -> str:
    """The exception's message and those of its causes, first to last."""
    texts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts.append(f"{exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(texts)


def _report_lost_peer(exc_type, exc, tb, previous) -> None:
    """``sys.excepthook``: the usual traceback, then which node a failed collective lost."""
    previous(exc_type, exc, tb)
    if _PLACES is None or not dist.is_initialized():
        return
    try:
        message = node_layout.lost_peer_message(
            _error_text(exc), _PLACES, dist.get_rank(),
            communication_error=isinstance(exc, getattr(dist, "DistError", ())))
    except Exception:  # noqa: BLE001 - the report must never hide the original error
        message = None
    if message:
        print(message, file=sys.stderr, flush=True)


def _install_lost_peer_report() -> None:
    if getattr(sys.excepthook, "_names_lost_peer", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        _report_lost_peer(exc_type, exc, tb, previous)

    hook._names_lost_peer = True
    sys.excepthook = hook


def check_node_layout(pstate: parallel_state.ParallelState) -> list:
    """Learn every rank's node; on rank 0 list the nodes and warn once if a TP group spans two.

    Also arms the report that names the lost node when a collective fails later on.

    Returns:
        Every rank's :class:`node_layout.RankPlace`, indexed by global rank.
    """
    global _PLACES
    places = node_layout.gather_places()
    _PLACES = places
    _install_lost_peer_report()
    if pstate.rank == 0:
        node_of = node_layout.node_of_ranks(places)
        if len(set(node_of)) > 1:
            print(f"> {len(set(node_of))} nodes: {node_layout.describe_nodes(places)}",
                  flush=True)
        warning = node_layout.tp_locality_warning(pstate.layout.tp_groups, pstate.tp_size,
                                                  node_of)
        if warning:
            print(warning, flush=True)
    return places


def apply_process_settings(args) -> None:
    """Process-wide settings some flags ask for, as Megatron applies them at start-up.

    --logging-level sets the root logger's level; --disable-bf16-reduced-precision-matmul
    stops cuBLAS from accumulating bf16 matmuls in reduced precision (a no-op without CUDA, as
    the flag only concerns cuBLAS).
    """
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    if args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def initialize_megatron(args) -> parallel_state.ParallelState:
    """Device, process group, parallel groups and seeds for validated ``args``."""
    apply_process_settings(args)
    # Before the device and the process group: cuBLAS and NCCL read their settings at start.
    determinism_notes = configure_deterministic_mode(args.deterministic_mode)
    device.configure(args.device, args.local_rank)
    if device.current_device().type == "cpu":
        host_memory.keep_freed_memory()
    _init_process_group(args)
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks but WORLD_SIZE "
                           f"was {args.world_size}")
    pstate = parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        sequence_parallel=args.sequence_parallel,
        order=(parallel_state.TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping
               else parallel_state.DEFAULT_ORDER),
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        num_weight_shards=getattr(args, "tensor_parallel_num_weight_shards", None),
        expert_num_weight_shards=getattr(args, "expert_tensor_parallel_num_weight_shards",
                                         None),
        embedding_stages=_embedding_stages(args))
    check_node_layout(pstate)
    set_random_seeds(args.seed, pstate, args.data_parallel_random_init)
    _install_fused_kernels(args)
    if args.rank == 0:
        print(f"> initialized on {device.current_device()} with {args.distributed_backend}: "
              f"world size {args.world_size} = tensor-model-parallel "
              f"{pstate.tp_size} x " +
              (f"context-parallel {pstate.cp_size} x " if pstate.cp_size > 1 else "") +
              f"pipeline-model-parallel {pstate.pp_size} x "
              f"data-parallel {pstate.dp_size}", flush=True)
        for note in determinism_notes:
            print(f"> --deterministic-mode: {note}", flush=True)
    return pstate


def _embedding_stages(args):
    """The stages of the embedding groups: with a standalone MTP stage (--mtp-standalone) its
    copy of the word embedding joins them (:func:`mtp_embedding_stages`)."""
    if not getattr(args, "mtp_standalone", False):
        return None
    from megatron.core.pipeline_parallel.layer_layout import mtp_embedding_stages

    return mtp_embedding_stages(args.pipeline_model_parallel_layout,
                                args.pipeline_model_parallel_size,
                                not args.untie_embeddings_and_output_weights)

"""The ``torch`` format's writer: one ``model_optim_rng.pt`` per model-parallel rank.

:func:`collect_state` gathers a rank's checkpoint (model chunks, optimizer, scheduler, the
data-parallel ranks' RNG states) and says which ranks write; :func:`write_state` writes and
fsyncs one file into the staging folder; :func:`save_torch_checkpoint` does both and publishes
(:mod:`megatron.checkpoint.publish`); :class:`TorchWriteJob` is the background writer of
``--async-save``.
"""

import os
import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron.checkpoint.layout import (CHECKPOINT_VERSION, checkpoint_dir_name, expert_ranks,
                                        my_file)
from megatron.checkpoint.publish import (KillMidFile, begin_save, crash_armed_count, crash_point,
                                         finish_save)
from megatron.checkpoint.saved_args import plain_args, refuse_torch_save
from megatron.checkpoint.state import rng_state_snapshot


def model_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": m.state_dict_for_save_checkpoint() for i, m in enumerate(model_chunks)}


def collect_state(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                   pstate) -> Optional[dict]:
    """This rank's checkpoint (None on data- or context-parallel ranks > 0, with expert
    parallelism on expert-data-parallel ranks > 0: they write no file).

    Every rank takes part: the data-parallel ranks' RNG states are gathered, a distributed
    optimizer gathers its shards to DP rank 0 and finishes any parameter all-gather still
    overlapping, so the model is whole, and a model and optimizer sharded by FSDP2 gather their
    whole tensors. The tensors returned are the live ones, not copies.
    """
    rng_states = None
    if not args.no_save_rng:
        rng_states = [None] * pstate.dp_size
        dist.all_gather_object(rng_states, rng_state_snapshot(), group=pstate.dp_group)
    finish_param_sync = getattr(optimizer, "finish_param_sync", None)
    if finish_param_sync is not None:
        finish_param_sync()
    optimizer_state = None if args.no_save_optim else optimizer.state_dict()
    # On every rank: a model sharded by FSDP2 gathers its whole tensors here (a collective).
    models = model_state(model_chunks)
    _, ep_size, expert_dp_rank = expert_ranks(pstate)
    if ep_size > 1:
        # Megatron-LM: the expert-data-parallel rank 0 of each expert-parallel rank writes.
        if expert_dp_rank != 0:
            return None
    elif pstate.dp_rank != 0 or pstate.cp_rank != 0:  # context-parallel ranks hold copies too
        return None
    state = {"args": plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    # Megatron's top-level key; it travels here inside args (TrainState.saved_args_fields).
    rerun_entry = vars(state["args"]).pop("rerun_state_machine", None)
    if rerun_entry is not None:
        state["rerun_state_machine"] = rerun_entry
    state.update(models)
    if not args.no_save_optim:
        state["optimizer"] = optimizer_state
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    return state


def write_state(state: dict, path: str) -> str:
    """Write one rank's file and fsync it; returns "" or what went wrong, naming the file."""
    crash_point("before_files")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(state, KillMidFile(f) if crash_armed_count("during_file") else f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return f"{path}: {err.strerror}"
    except Exception as err:  # noqa: BLE001 - reported on every rank, not only this one
        return f"{path}: {type(err).__name__}: {err}"
    crash_point("after_file")
    return ""


def save_torch_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler,
                          args, pstate) -> str:
    """Collective: write ``iteration`` in the torch format under ``args.save`` (``args`` as
    :func:`megatron.checkpoint.saved_args.checkpoint_args` returns them); returns its folder."""
    refuse_torch_save(args, pstate)
    tmp_root = begin_save(args.save, iteration)
    state = collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
    error = ""
    if state is not None:
        error = write_state(state, my_file(tmp_root, iteration, pstate))
    finish_save(args.save, iteration, error, getattr(args, "verify_integrity", False))
    return os.path.join(args.save, checkpoint_dir_name(iteration))


class TorchWriteJob:
    """One background save: its iteration, where it goes, its writer thread and its error."""

    def __init__(self, iteration: int, save_dir: str):
        self.iteration = iteration
        self.save_dir = save_dir
        self.thread: Optional[threading.Thread] = None
        self.error = ""
        self.integrity = False  # --verify-integrity: a manifest is written before publishing

    def write(self, state: dict, path: str) -> None:
        try:
            self.error = write_state(state, path)
        except BaseException as err:  # noqa: BLE001 - raised on the main thread at a boundary
            self.error = f"{path}: {type(err).__name__}: {err}"

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

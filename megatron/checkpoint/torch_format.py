"""The ``torch`` format's writer: one ``model_optim_rng.pt`` per model-parallel rank.

:func:`collect_state` gathers a rank's checkpoint (model chunks, optimizer, scheduler, the
data-parallel ranks' RNG states) and says which ranks write; with the distributed optimizer the
optimizer's tensors go to a ``distrib_optim.pt`` beside it, as Megatron-LM writes them
(:mod:`megatron.checkpoint.distrib_optim_file`). :func:`write_state` writes and fsyncs a rank's
files into the staging folder; :func:`save_torch_checkpoint` does both and publishes
(:mod:`megatron.checkpoint.publish`); :class:`TorchWriteJob` is the background writer of
``--async-save``.
"""

import os
import threading
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint import distrib_optim_file
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


_told_why_no_distrib_optim = set()


def _split_optimizer(optimizer_state: dict, model_chunks, optimizer, args):
    """``(model file's optimizer entry, distrib_optim.pt content or None)``: Megatron-LM's
    layout for a distributed optimizer's unsharded state, where it can hold it."""
    if not isinstance(optimizer_state, dict) or optimizer_state.get("param_state") is None:
        return optimizer_state, None
    why = distrib_optim_file.megatron_layout_refusal(model_chunks, optimizer)
    if why:
        if why not in _told_why_no_distrib_optim and dist.get_rank() == 0:
            print(f"  {distrib_optim_file.FILE_NAME} not written: {why}; the distributed "
                  "optimizer state stays in model_optim_rng.pt", flush=True)
        _told_why_no_distrib_optim.add(why)
        return optimizer_state, None
    return distrib_optim_file.split_for_save(optimizer_state, model_chunks, optimizer, args)


def collect_state(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                   pstate) -> Optional[Tuple[dict, Optional[dict]]]:
    """This rank's checkpoint and, with the distributed optimizer, the content of its
    ``distrib_optim.pt`` (else None); None on data- or context-parallel ranks > 0, with
    expert parallelism on expert-data-parallel ranks > 0: they write no file.

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
    optim_file = None
    if not args.no_save_optim:
        state["optimizer"], optim_file = _split_optimizer(optimizer_state, model_chunks,
                                                          optimizer, args)
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    return state, optim_file


def _write_file(content, path: str) -> str:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(content, KillMidFile(f) if crash_armed_count("during_file") else f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return f"{path}: {err.strerror}"
    except Exception as err:  # noqa: BLE001 - reported on every rank, not only this one
        return f"{path}: {type(err).__name__}: {err}"
    return ""


def write_state(state: dict, path: str, optim_file: Optional[dict] = None) -> str:
    """Write one rank's file (and the ``distrib_optim.pt`` beside it when ``optim_file`` is
    given) and fsync them; returns "" or what went wrong, naming the file."""
    crash_point("before_files")
    error = ""
    if optim_file is not None:
        error = _write_file(optim_file, distrib_optim_file.file_beside(path))
    error = error or _write_file(state, path)
    if error:
        return error
    crash_point("after_file")
    return ""


def save_torch_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler,
                          args, pstate) -> str:
    """Collective: write ``iteration`` in the torch format under ``args.save`` (``args`` as
    :func:`megatron.checkpoint.saved_args.checkpoint_args` returns them); returns its folder."""
    refuse_torch_save(args, pstate)
    tmp_root = begin_save(args.save, iteration)
    files = collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
    error = ""
    if files is not None:
        error = write_state(files[0], my_file(tmp_root, iteration, pstate), files[1])
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

    def write(self, state: dict, path: str, optim_file: Optional[dict] = None) -> None:
        try:
            self.error = write_state(state, path, optim_file)
        except BaseException as err:  # noqa: BLE001 - raised on the main thread at a boundary
            self.error = f"{path}: {type(err).__name__}: {err}"

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

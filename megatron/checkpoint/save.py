"""Save a checkpoint in either format, in the foreground or in the background.

:func:`save_checkpoint` writes ``--ckpt-format torch`` (:mod:`megatron.checkpoint.torch_format`),
``torch_dist`` (:mod:`megatron.checkpoint.torch_dist`), ``fsdp_dtensor`` or ``torch_dcp``
(:mod:`megatron.checkpoint.fsdp_dtensor`, :mod:`megatron.checkpoint.torch_dcp`); all stage the files and publish them
atomically (:mod:`megatron.checkpoint.publish`).

``--async-save`` (:class:`AsyncCheckpointSaver`): at the iteration boundary every rank copies its
state to CPU memory (collectives run here, on the main thread), then a background thread writes
the copy into the staging folder with the same protocol while training goes on. The ranks agree
that every file is complete at a later iteration boundary, with one all-reduce per iteration while
a save is in flight (a background thread never runs a collective); only then does rank 0 rename
the folder and replace the tracker. At most one save is in flight: the next save, the end of
training and every exit wait for it. An error of a writer is raised on every rank at that
boundary, naming the file.
"""

import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron.checkpoint import fsdp_dtensor, torch_dcp, torch_dist
from megatron.checkpoint.config import CheckpointConfig
from megatron.checkpoint.layout import my_file
from megatron.checkpoint.publish import begin_save, finish_save
from megatron.checkpoint.saved_args import checkpoint_args, refuse_torch_save
from megatron.checkpoint.state import copy_to_cpu
from megatron.checkpoint.torch_format import TorchWriteJob, collect_state, save_torch_checkpoint
from megatron.core import device
from megatron.training.train_state import TrainState


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate, *, train_state: Optional[TrainState] = None,
                    config: Optional[CheckpointConfig] = None) -> str:
    """Write the checkpoint of ``iteration`` under ``--save``; returns its folder.

    Collective. The files go to the staging folder; once every rank's file is written and
    fsynced, rank 0 renames the folder into place and then replaces the tracker.

    Args:
        train_state: the run's position, saved in the checkpoint's ``args`` under Megatron's
            keys; None saves none (a checkpoint of weights made outside training).
        config: checkpoint options to use instead of the flags of the same names in ``args``.
    """
    args = checkpoint_args(args, config, train_state)
    if getattr(args, "ckpt_format", "torch") == torch_dcp.FORMAT:
        return torch_dcp.save_checkpoint(iteration, model_chunks, optimizer,
                                         opt_param_scheduler, args, pstate)
    if getattr(args, "ckpt_format", "torch") == fsdp_dtensor.FORMAT:
        return fsdp_dtensor.save_checkpoint(iteration, model_chunks, optimizer,
                                            opt_param_scheduler, args, pstate)
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        return torch_dist.save_checkpoint(iteration, model_chunks, optimizer,
                                          opt_param_scheduler, args, pstate)
    return save_torch_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                                 pstate)


class AsyncCheckpointSaver:
    """``--async-save``: checkpoints written by a background thread while training goes on.

    :meth:`save` copies this rank's state to CPU at the iteration boundary and starts the
    writer; :meth:`poll`, at every later boundary, publishes the save once every rank's file is
    complete; :meth:`wait` blocks until it is (the next save, the end of training and every exit
    call it). All three are collective: every rank calls them at the same iterations, so the
    ranks agree by an all-reduce on the main thread; writer threads run no collective.
    """

    def __init__(self):
        self._in_flight: Optional[TorchWriteJob] = None

    @property
    def in_flight(self) -> Optional[int]:
        """The iteration whose save is being written, or None."""
        return None if self._in_flight is None else self._in_flight.iteration

    def save(self, iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
             pstate, *, train_state: Optional[TrainState] = None,
             config: Optional[CheckpointConfig] = None) -> None:
        """Start the save of ``iteration``, as :func:`save_checkpoint` takes its arguments."""
        self.wait()
        args = checkpoint_args(args, config, train_state)
        if getattr(args, "ckpt_format", "torch") in (fsdp_dtensor.FORMAT, torch_dcp.FORMAT):
            # Written in the foreground: each rank's shards are its own, nothing to gather.
            save_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                            pstate)
            return
        if getattr(args, "ckpt_format", "torch") == "torch_dist":
            self._in_flight = torch_dist.start_async(
                iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
            self._in_flight.integrity = getattr(args, "verify_integrity", False)
            if dist.get_rank() == 0:
                print(f"  saving checkpoint at iteration {iteration:7d} to {args.save} in the "
                      "background (torch_dist)", flush=True)
            return
        refuse_torch_save(args, pstate)
        tmp_root = begin_save(args.save, iteration)
        files = collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                               pstate)
        job = TorchWriteJob(iteration, args.save)
        job.integrity = getattr(args, "verify_integrity", False)
        if files is not None:
            path = my_file(tmp_root, iteration, pstate)
            copies = (copy_to_cpu(files[0]), path, files[1])  # files[1]: new CPU tensors
            # Daemon: a process that dies leaves a staging folder, which the next start removes.
            job.thread = threading.Thread(target=job.write, args=copies,
                                          name=f"checkpoint-writer-{iteration}", daemon=True)
            job.thread.start()
        self._in_flight = job
        if dist.get_rank() == 0:
            print(f"  saving checkpoint at iteration {iteration:7d} to {args.save} in the "
                  "background", flush=True)

    def poll(self) -> None:
        """At an iteration boundary: publish the save in flight if every rank has written."""
        if self._in_flight is None:
            return
        busy = torch.tensor([int(self._in_flight.busy())], dtype=torch.int32,
                            device=device.current_device())
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            self._finish()

    def wait(self) -> None:
        """Block until the save in flight is written on every rank, then publish it."""
        if self._in_flight is None:
            return
        if getattr(self._in_flight, "thread", None) is not None:
            self._in_flight.thread.join()
        self._finish()

    def _finish(self) -> None:
        job, self._in_flight = self._in_flight, None
        if hasattr(job, "finish"):  # a torch_dist save gathers its records, then publishes
            job.finish()
            return
        finish_save(job.save_dir, job.iteration, job.error, job.integrity)

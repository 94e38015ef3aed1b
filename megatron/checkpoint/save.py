"""Write torch-format checkpoints atomically, in the foreground or in the background.

Writing: every file of an iteration goes into a staging folder (``.tmp_iter_XXXXXXX/``) and is
fsynced; once every rank has reported success, rank 0 renames the folder into place and only then
replaces the tracker file (also through a rename). A crash at any point leaves the previous
checkpoint and tracker intact.

What survives what: a process killed at any point of a save (the test hook
``MEGATRON_TEST_CRASH_AT``, below, kills it at each named point) leaves the tracker naming a
complete checkpoint. The next start with the same ``--save`` removes the unfinished staging folder
and tracker temporary file, and puts back an iteration folder that was being replaced (see
:func:`clean_interrupted_saves`); ``--load`` ignores such leftovers.

``--async-save`` (:class:`AsyncCheckpointSaver`): at the iteration boundary every rank copies its
state to CPU memory (collectives run here, on the main thread), then a background thread writes
the copy into the staging folder with the same protocol while training goes on. The ranks agree
that every file is complete at a later iteration boundary, with one all-reduce per iteration while
a save is in flight (a background thread never runs a collective); only then does rank 0 rename
the folder and replace the tracker. At most one save is in flight: the next save, the end of
training and every exit wait for it. An error of a writer is raised on every rank at that
boundary, naming the file.

The RNG states a checkpoint records are taken and restored here too (:func:`_rng_state`,
:func:`_set_rng_state`). :mod:`megatron.checkpoint.torch_dist` reuses the staging protocol for
``--ckpt-format torch_dist``; :mod:`megatron.checkpoint.load` re-exports every name.
"""

import argparse
import copy
import os
import random
import re
import shutil
import signal
import threading
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint.config import CheckpointConfig
from megatron.checkpoint.saved_args import _plain_args, _refuse_torch_save, checkpoint_args
from megatron.checkpoint.layout import (CHECKPOINT_VERSION, REPLACED_SUFFIX, STAGING_PREFIX,
                                           TRACKER_FILENAME, CheckpointError, _my_file,
                                           checkpoint_dir_name, expert_ranks)
from megatron.core import device
from megatron.training.train_state import TrainState

CRASH_ENV = "MEGATRON_TEST_CRASH_AT"
# The points of a save at which MEGATRON_TEST_CRASH_AT can kill the process, in order.
CRASH_POINTS = ("before_files", "during_file", "after_file", "before_rename", "replacing_old",
                "after_rename", "before_tracker", "after_tracker")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        # numpy's key array is stored as a tensor so the file loads with weights_only=True.
        "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state.get("cuda_rng_state"))
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


_crash_counts: Dict[str, int] = {}
_crash_lock = threading.Lock()


def _crash_spec(name: str) -> Optional[int]:
    """The COUNT of ``MEGATRON_TEST_CRASH_AT`` when it names point ``name`` on this rank."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    m = re.fullmatch(r"([a-z_]+)(?::(\d+))?(?:@(\d+))?", spec.strip())
    if m is None or m.group(1) not in CRASH_POINTS:
        raise CheckpointError(f"{CRASH_ENV}={spec!r}: expected POINT[:COUNT][@RANK] with POINT "
                              f"one of {', '.join(CRASH_POINTS)}")
    if m.group(1) != name or (m.group(3) is not None and int(m.group(3)) != _global_rank()):
        return None
    return int(m.group(2) or 1)


def crash_point(name: str) -> None:
    """Test hook: SIGKILL this process the COUNT-th time it reaches save point ``name``.

    ``MEGATRON_TEST_CRASH_AT=POINT[:COUNT][@RANK]`` names one of :data:`CRASH_POINTS`; COUNT
    (default 1) counts the times this process reached the point; with ``@RANK`` only that global
    rank dies. The tests use it to prove that a process killed anywhere inside a save loses
    nothing. Unset, it costs one environment lookup per point.
    """
    count = _crash_spec(name)
    if count is None:
        return
    with _crash_lock:
        _crash_counts[name] = _crash_counts.get(name, 0) + 1
        hit = _crash_counts[name] == count
    if hit:
        print(f"{CRASH_ENV}: killing rank {_global_rank()} at {name}:{count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class _KillMidFile:
    """A file that reaches the ``during_file`` crash point after its first write: the process
    then dies with part of the checkpoint file on disk."""

    def __init__(self, f):
        self._f = f
        self._writes = 0

    def write(self, data):
        self._writes += 1
        if self._writes == 2:
            self._f.flush()
            crash_point("during_file")
        return self._f.write(data)

    def flush(self):
        self._f.flush()


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device.current_device())
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def check_save_dir(save_dir: str) -> None:
    """Fail at start-up, not after hours of training, when --save cannot be written."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"--save {save_dir} is not writable: {err.strerror}") from None


def clean_interrupted_saves(save_dir: str) -> List[str]:
    """Tidy what a save killed midway left in ``save_dir``; returns one line per change.

    Rank 0 calls it at start-up, before anything is loaded or saved. Staging folders
    (``.tmp_iter_*``), the tracker's temporary file and write probes are deleted. An
    ``iter_*.old`` folder (the previous copy of an iteration being saved again) is deleted when
    its replacement is in place, else renamed back, since the tracker may name it.
    """
    if not os.path.isdir(save_dir):
        return []
    done = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        base = name[:-len(REPLACED_SUFFIX)] if name.endswith(REPLACED_SUFFIX) else None
        if name.startswith(STAGING_PREFIX + "iter_") or name.startswith(".write_test_") \
                or name == TRACKER_FILENAME + ".tmp":
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            done.append(f"removed {name}, left by an interrupted save")
        elif base is not None and re.fullmatch(r"iter_\d{7}", base):
            if os.path.isdir(os.path.join(save_dir, base)):
                shutil.rmtree(path, ignore_errors=True)
                done.append(f"removed {name}, already replaced by {base}")
            else:
                os.replace(path, os.path.join(save_dir, base))
                done.append(f"restored {base} from {name} (the save replacing it was "
                            "interrupted)")
    if done:
        _fsync_dir(save_dir)
    return done


def _model_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": m.state_dict_for_save_checkpoint() for i, m in enumerate(model_chunks)}


def _staging_root(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, STAGING_PREFIX + checkpoint_dir_name(iteration))


def _begin_save(save_dir: str, iteration: int) -> str:
    """Rank 0 empties the staging folder of ``iteration``; every rank waits for it."""
    tmp_root = _staging_root(save_dir, iteration)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_root, ignore_errors=True)
        os.makedirs(tmp_root, exist_ok=True)
    dist.barrier()
    return tmp_root


def _collect_state(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                   pstate) -> Optional[dict]:
    """This rank's checkpoint (None on data- or context-parallel ranks > 0, with expert
    parallelism on expert-data-parallel ranks > 0: they write no file).

    Every rank takes part: the data-parallel ranks' RNG states are gathered, and a distributed
    optimizer gathers its shards to DP rank 0 and finishes any parameter all-gather still
    overlapping, so the model is whole. The tensors returned are the live ones, not copies.
    """
    rng_states = None
    if not args.no_save_rng:
        rng_states = [None] * pstate.dp_size
        dist.all_gather_object(rng_states, _rng_state(), group=pstate.dp_group)
    finish_param_sync = getattr(optimizer, "finish_param_sync", None)
    if finish_param_sync is not None:
        finish_param_sync()
    optimizer_state = None if args.no_save_optim else optimizer.state_dict()
    _, ep_size, expert_dp_rank = expert_ranks(pstate)
    if ep_size > 1:
        # Megatron-LM: the expert-data-parallel rank 0 of each expert-parallel rank writes.
        if expert_dp_rank != 0:
            return None
    elif pstate.dp_rank != 0 or pstate.cp_rank != 0:  # context-parallel ranks hold copies too
        return None
    state = {"args": _plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    state.update(_model_state(model_chunks))
    if not args.no_save_optim:
        state["optimizer"] = optimizer_state
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    return state


def _write_state(state: dict, path: str) -> str:
    """Write one rank's file and fsync it; returns "" or what went wrong, naming the file."""
    crash_point("before_files")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(state, _KillMidFile(f) if _crash_spec("during_file") else f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return f"{path}: {err.strerror}"
    except Exception as err:  # noqa: BLE001 - reported on every rank, not only this one
        return f"{path}: {type(err).__name__}: {err}"
    crash_point("after_file")
    return ""


def _publish(save_dir: str, iteration: int) -> None:
    """Rank 0: move the staged folder into place, then point the tracker at it (renames)."""
    name = checkpoint_dir_name(iteration)
    tmp_root = _staging_root(save_dir, iteration)
    final_dir = os.path.join(save_dir, name)
    old = final_dir + REPLACED_SUFFIX
    crash_point("before_rename")
    if os.path.exists(final_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        crash_point("replacing_old")
    os.replace(os.path.join(tmp_root, name), final_dir)
    crash_point("after_rename")
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp_root, ignore_errors=True)
    _fsync_dir(save_dir)
    tracker = os.path.join(save_dir, TRACKER_FILENAME)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    crash_point("before_tracker")
    os.replace(tracker + ".tmp", tracker)
    _fsync_dir(save_dir)
    crash_point("after_tracker")
    print(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}",
          flush=True)


def _raise_if_failed(error: str, what: str) -> None:
    """Collective: every rank raises, naming each failing rank's file, if any rank failed."""
    if _all_ok(not error):
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    raise CheckpointError(f"{what} failed: {detail}")


def _finish_save(save_dir: str, iteration: int, error: str) -> None:
    """Collective: publish the staged save if every rank's file was written, else raise."""
    try:
        _raise_if_failed(error, f"saving iteration {iteration} to {save_dir}")
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(_staging_root(save_dir, iteration), ignore_errors=True)
        raise
    publish_error = ""
    if dist.get_rank() == 0:
        try:
            _publish(save_dir, iteration)
        except OSError as err:
            publish_error = f"{err.filename}: {err.strerror}"
    _raise_if_failed(publish_error, f"publishing iteration {iteration} in {save_dir}")


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate, *, train_state: Optional[TrainState] = None,
                    config: Optional[CheckpointConfig] = None) -> str:
    """Write the checkpoint of ``iteration`` under ``--save``; returns its folder.

    Collective. The files go to the staging folder; once every rank's file is written and
    fsynced, rank 0 renames the folder into place and then replaces the tracker. With
    ``--ckpt-format torch_dist`` see :mod:`megatron.checkpoint.torch_dist`.

    Args:
        train_state: the run's position, saved in the checkpoint's ``args`` under Megatron's
            keys; None saves none (a checkpoint of weights made outside training).
        config: checkpoint options to use instead of the flags of the same names in ``args``.
    """
    args = checkpoint_args(args, config, train_state)
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        from megatron.checkpoint import torch_dist as checkpointing_dist

        return checkpointing_dist.save_checkpoint(iteration, model_chunks, optimizer,
                                                  opt_param_scheduler, args, pstate)
    _refuse_torch_save(args, pstate)
    tmp_root = _begin_save(args.save, iteration)
    state = _collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
    error = ""
    if state is not None:
        error = _write_state(state, _my_file(tmp_root, iteration, pstate))
    _finish_save(args.save, iteration, error)
    return os.path.join(args.save, checkpoint_dir_name(iteration))


def _copy_to_cpu(obj, memo: Optional[dict] = None):
    """A deep copy of a checkpoint state with every tensor copied to CPU memory (a tensor that
    appears twice is copied once), so training may change the originals while it is written."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            copied = obj.detach().to("cpu", copy=True)
            if isinstance(obj, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
            memo[id(obj)] = copied
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # same type and attributes (a state dict's ``_metadata``)
        for key, value in obj.items():
            out[key] = _copy_to_cpu(value, memo)
        return out
    if isinstance(obj, list):
        return [_copy_to_cpu(v, memo) for v in obj]
    if type(obj) is tuple:  # noqa: E721 - named tuples are deep-copied below
        return tuple(_copy_to_cpu(v, memo) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: _copy_to_cpu(v, memo) for k, v in vars(obj).items()})
    return copy.deepcopy(obj)


class _InFlight:
    """One background save: its iteration, where it goes, its writer thread and its error."""

    def __init__(self, iteration: int, save_dir: str):
        self.iteration = iteration
        self.save_dir = save_dir
        self.thread: Optional[threading.Thread] = None
        self.error = ""

    def write(self, state: dict, path: str) -> None:
        try:
            self.error = _write_state(state, path)
        except BaseException as err:  # noqa: BLE001 - raised on the main thread at a boundary
            self.error = f"{path}: {type(err).__name__}: {err}"

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class AsyncCheckpointSaver:
    """``--async-save``: checkpoints written by a background thread while training goes on.

    :meth:`save` copies this rank's state to CPU at the iteration boundary and starts the
    writer; :meth:`poll`, at every later boundary, publishes the save once every rank's file is
    complete; :meth:`wait` blocks until it is (the next save, the end of training and every exit
    call it). All three are collective: every rank calls them at the same iterations, so the
    ranks agree by an all-reduce on the main thread; writer threads run no collective.
    """

    def __init__(self):
        self._in_flight: Optional[_InFlight] = None

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
        if getattr(args, "ckpt_format", "torch") == "torch_dist":
            from megatron.checkpoint import torch_dist as checkpointing_dist

            self._in_flight = checkpointing_dist.start_async(
                iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
            if dist.get_rank() == 0:
                print(f"  saving checkpoint at iteration {iteration:7d} to {args.save} in the "
                      "background (torch_dist)", flush=True)
            return
        _refuse_torch_save(args, pstate)
        tmp_root = _begin_save(args.save, iteration)
        state = _collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                               pstate)
        job = _InFlight(iteration, args.save)
        if state is not None:
            path = _my_file(tmp_root, iteration, pstate)
            # Daemon: a process that dies leaves a staging folder, which the next start removes.
            job.thread = threading.Thread(target=job.write, args=(_copy_to_cpu(state), path),
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
        _finish_save(job.save_dir, job.iteration, job.error)

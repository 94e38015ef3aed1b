"""Non-persistent checkpoints: frequent cheap saves between the persistent ones.

``--non-persistent-save-interval N`` saves every N iterations (except where a persistent save
falls) with ``--non-persistent-ckpt-type``:

- ``global``: an ordinary checkpoint (either format) in ``--non-persistent-global-ckpt-dir``,
  by default ``SAVE/non_persistent`` (``LOAD/non_persistent`` when resuming), staged and
  published atomically as persistent ones are (:mod:`megatron.checkpoint.publish`); once a new
  one is in place the older ones are removed.
- ``local``: every rank writes its own whole state (model chunks, optimizer, scheduler, its RNG
  states, the run's position) to node-local storage::

      LOCAL_DIR/<holder rank>/iter_0000006/rank_00003.pt

  the file of rank 3 held by ``<holder rank>``. Without ``--replication`` each rank holds only
  its own file. With it, the ranks form cliques of ``--replication-factor`` ranks spaced
  ``--replication-jump`` apart (by default the processes per node, so a clique spans nodes) and
  every rank also holds the files of its clique's other ranks, sent to it at the save: one lost
  node is recovered from the copies on the others. Each file is written under a temporary name,
  fsynced and renamed; the older iterations go once every rank has written the new one.

Resume (``--load`` with ``--non-persistent-ckpt-type``): the persistent checkpoint the tracker
of ``--load`` names and the newest complete non-persistent one are compared, and the newer is
taken (the non-persistent one on a tie, as Megatron-LM does); the choice is printed. A local
iteration is complete when every rank's file is held by some rank; all ranks decide from one
gathered inventory, so they agree; a rank without its own file receives the copy from a peer
(and keeps it in its folder again). ``--ckpt-step`` loads the persistent checkpoint alone.
"""

import io
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint.layout import (CHECKPOINT_VERSION, CheckpointError, checkpoint_dir_name,
                                        load_state_file, read_tracker)
from megatron.checkpoint.publish import (KillMidFile, clean_interrupted_saves,
                                         crash_armed_count, crash_point, fsync_path,
                                         raise_if_failed)
from megatron.checkpoint.saved_args import plain_args
from megatron.checkpoint.state import rng_state_snapshot
from megatron.checkpoint.torch_format import model_state

GLOBAL_SUBDIR = "non_persistent"
_ITER_DIR = re.compile(r"iter_(\d{7})")
_RANK_FILE = re.compile(r"rank_(\d{5})\.pt")


# -- where the checkpoints go ---------------------------------------------------------------------

def global_dir(args, base: Optional[str]) -> Optional[str]:
    """The global non-persistent folder: the flag's, else ``base/non_persistent``."""
    if args.non_persistent_global_ckpt_dir:
        return args.non_persistent_global_ckpt_dir
    return os.path.join(base, GLOBAL_SUBDIR) if base else None


def replication_error(world_size: int, replication: bool, jump: Optional[int],
                      factor: int) -> str:
    """Why the ranks cannot form replication cliques ("" when they can)."""
    if not replication:
        return ""
    jump = default_jump(world_size) if jump is None else jump
    if factor < 2:
        return f"--replication needs --replication-factor >= 2 (got {factor})"
    if world_size % (jump * factor):
        return (f"--replication: the world size {world_size} must be a multiple of "
                f"--replication-jump {jump} x --replication-factor {factor}; with one node, "
                "pass --replication-jump (the processes per node) to place the copies")
    return ""


def default_jump(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def clique(rank: int, world_size: int, replication: bool, jump: Optional[int],
           factor: int) -> List[int]:
    """The ranks holding ``rank``'s local file, ``rank`` first.

    Ranks are cut into blocks of ``jump x factor``; inside a block the ranks equal modulo
    ``jump`` form a clique. Four ranks on two nodes of two (jump 2, factor 2)::

        rank:    0  1  2  3
        clique: [0, 2] [1, 3]        each rank's copy sits on the other node
    """
    if not replication:
        return [rank]
    jump = default_jump(world_size) if jump is None else jump
    span = jump * factor
    base = (rank // span) * span + rank % jump
    members = [base + k * jump for k in range(factor)]
    return [rank] + [m for m in members if m != rank]


def _holder_dir(local_dir: str, holder: int, iteration: int) -> str:
    return os.path.join(local_dir, str(holder), checkpoint_dir_name(iteration))


def _rank_file(local_dir: str, holder: int, iteration: int, src: int) -> str:
    return os.path.join(_holder_dir(local_dir, holder, iteration), f"rank_{src:05d}.pt")


# -- saving ---------------------------------------------------------------------------------------

def local_state(iteration: int, model_chunks, optimizer, opt_param_scheduler, args) -> dict:
    """This rank's whole state, in the keys of a torch-format rank file (its own RNG states)."""
    state = {"args": plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    state.update(model_state(model_chunks))
    if not args.no_save_optim:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = [rng_state_snapshot()]
    return state


def _write_file(path: str, payload: bytes) -> str:
    """Write ``payload`` to ``path`` by a fsynced temporary file and a rename; "" or the error."""
    tmp = os.path.join(os.path.dirname(path), ".tmp_" + os.path.basename(path))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            out = KillMidFile(f) if crash_armed_count("during_file") else f
            half = len(payload) // 2
            out.write(payload[:half])
            out.write(payload[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(path))
    except OSError as err:
        return f"{path}: {err.strerror}"
    return ""


def _exchange(payload: bytes, peers: List[int], holders_of: Dict[int, List[int]],
              rank: int) -> Dict[int, bytes]:
    """Send ``payload`` to ``peers`` and receive the payload of every rank this one holds."""
    sources = [s for s, holders in holders_of.items() if rank in holders[1:]]
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
        torch.zeros(0, dtype=torch.uint8)
    sizes = {s: torch.zeros(1, dtype=torch.int64) for s in sources}
    my_size = torch.tensor([mine.numel()], dtype=torch.int64)
    reqs = [dist.isend(my_size, p) for p in peers]
    reqs += [dist.irecv(sizes[s], s) for s in sources]
    for r in reqs:
        r.wait()
    bufs = {s: torch.empty(int(sizes[s].item()), dtype=torch.uint8) for s in sources}
    reqs = [dist.isend(mine, p) for p in peers] + [dist.irecv(bufs[s], s) for s in sources]
    for r in reqs:
        r.wait()
    return {s: bufs[s].numpy().tobytes() for s in sources}


def save_local(iteration: int, state: dict, args) -> None:
    """Collective: write this rank's file and the copies it holds, then drop older ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_dir = args.non_persistent_local_ckpt_dir
    _remove_iterations(os.path.join(local_dir, str(rank)), lambda it: it >= iteration)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    holders_of = {s: clique(s, world, args.replication, args.replication_jump,
                            args.replication_factor) for s in range(world)}
    received = _exchange(payload, holders_of[rank][1:], holders_of, rank)
    crash_point("before_files")
    error = _write_file(_rank_file(local_dir, rank, iteration, rank), payload)
    for src, data in sorted(received.items()):
        error = error or _write_file(_rank_file(local_dir, rank, iteration, src), data)
    crash_point("after_file")
    raise_if_failed(error, f"saving the local checkpoint of iteration {iteration} to "
                    f"{local_dir}")
    _remove_iterations(os.path.join(local_dir, str(rank)), lambda it: it < iteration)
    if rank == 0:
        print(f"  saved local non-persistent checkpoint at iteration {iteration:7d} to "
              f"{local_dir}", flush=True)


def _remove_iterations(folder: str, which) -> None:
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        m = _ITER_DIR.fullmatch(name)
        if m and which(int(m.group(1))):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def prune_global(folder: str) -> List[str]:
    """Rank 0, after a global save: remove every iteration older than the tracked one."""
    tracked = read_tracker(folder)
    if tracked is None or tracked[1]:
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        m = _ITER_DIR.fullmatch(name)
        if m and int(m.group(1)) < tracked[0]:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(name)
    return removed


def tidy_global(folder: str) -> None:
    """Rank 0, before a global save: what an interrupted save left there goes."""
    for line in clean_interrupted_saves(folder):
        print(f"NOTE: {folder}: {line}", flush=True)


def save_non_persistent(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                        pstate, *, train_state=None, config=None) -> None:
    """Collective: the non-persistent checkpoint of ``iteration`` (``args`` and ``config`` as
    :func:`megatron.checkpoint.save.save_checkpoint` takes them)."""
    import dataclasses

    from megatron.checkpoint.save import save_checkpoint
    from megatron.checkpoint.saved_args import checkpoint_args

    args = checkpoint_args(args, config, train_state)
    if args.non_persistent_ckpt_type == "local":
        state = local_state(iteration, model_chunks, optimizer, opt_param_scheduler, args)
        save_local(iteration, state, args)
        return
    folder = global_dir(args, args.save)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        tidy_global(folder)
    target = dataclasses.replace(config, save=folder) if config is not None else None
    if target is None:
        args.save = folder
    save_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate,
                    train_state=train_state, config=target)
    if dist.get_rank() == 0:
        prune_global(folder)


# -- resuming -------------------------------------------------------------------------------------

def _inventory(local_dir: str, rank: int) -> Dict[int, List[int]]:
    """Iteration -> the ranks whose (complete, renamed) files this rank holds."""
    folder = os.path.join(local_dir, str(rank))
    found: Dict[int, List[int]] = {}
    if not os.path.isdir(folder):
        return found
    for name in os.listdir(folder):
        m = _ITER_DIR.fullmatch(name)
        if not m:
            continue
        srcs = [int(f.group(1)) for f in map(_RANK_FILE.fullmatch,
                                              os.listdir(os.path.join(folder, name))) if f]
        found[int(m.group(1))] = sorted(srcs)
    return found


def newest_local(local_dir: str) -> Tuple[int, Dict[int, int]]:
    """Collective: the newest iteration every rank's file is held for (-1: none), and for each
    rank the lowest rank holding its file then."""
    inventories = [None] * dist.get_world_size()
    dist.all_gather_object(inventories, _inventory(local_dir, dist.get_rank()))
    return newest_complete(inventories)


def newest_complete(inventories: List[Dict[int, List[int]]]) -> Tuple[int, Dict[int, int]]:
    """:func:`newest_local` on the gathered inventories (rank -> iteration -> the ranks whose
    files it holds): a rank's own file is preferred, else the lowest rank holding a copy."""
    world = len(inventories)
    for iteration in sorted({it for inv in inventories for it in inv}, reverse=True):
        holder = {}
        for h, inv in enumerate(inventories):
            for src in inv.get(iteration, []):
                holder.setdefault(src, h)
                if src == h:
                    holder[src] = h
        if set(holder) == set(range(world)):
            return iteration, holder
    return -1, {}


def fetch_local(local_dir: str, iteration: int, holder: Dict[int, int]) -> Tuple[dict, str]:
    """Collective: this rank's local state of ``iteration`` and its file; a rank without its
    own file receives the copy from its holder, writes it back in place, then reads it."""
    rank = dist.get_rank()
    path = _rank_file(local_dir, rank, iteration, rank)
    for src in sorted(s for s, h in holder.items() if h != s):
        h = holder[src]
        if rank == h:
            with open(_rank_file(local_dir, h, iteration, src), "rb") as f:
                data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), src)
            dist.send(data, src)
        elif rank == src:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, h)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, h)
            error = _write_file(path, data.numpy().tobytes())
            if error:
                raise CheckpointError(f"restoring the copy held by rank {h}: {error}")
            print(f"NOTE: rank {rank}: no local checkpoint file of iteration {iteration}; "
                  f"restored it from the copy held by rank {h}", flush=True)
    return load_state_file(path), path

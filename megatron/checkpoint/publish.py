"""Atomic publishing of checkpoints: staging folders, renames, the tracker, crash points.

Every checkpoint writer (training's ``torch`` and ``torch_dist`` formats, the converter) writes
an iteration into a staging folder (``SAVE/.tmp_iter_XXXXXXX/``) and fsyncs it; then one process
renames the folder into place and only then replaces the tracker file, also by a rename
(:func:`publish`). A crash at any point leaves the previous checkpoint and tracker intact.

What survives what: a process killed at any point of a save (the test hook
``MEGATRON_TEST_CRASH_AT``, below, kills it at each named point) leaves the tracker naming a
complete checkpoint. The next start with the same ``--save`` removes the unfinished staging
folder and tracker temporary file, and puts back an iteration folder that was being replaced
(:func:`clean_interrupted_saves`); ``--load`` ignores such leftovers.
"""

import os
import re
import shutil
import signal
import threading
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.checkpoint import object_storage
from megatron.checkpoint.integrity import write_manifest
from megatron.checkpoint.layout import (REPLACED_SUFFIX, STAGING_PREFIX, TRACKER_FILENAME,
                                        CheckpointError, checkpoint_dir_name)
from megatron.core import device
from megatron.core.msc import ObjectStorageError

CRASH_ENV = "MEGATRON_TEST_CRASH_AT"


# The points of a save at which MEGATRON_TEST_CRASH_AT can kill the process, in order.
CRASH_POINTS = ("before_files", "during_file", "after_file", "before_rename", "replacing_old",
                "after_rename", "before_tracker", "after_tracker")


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's entries: what a rename changed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


_crash_counts: Dict[str, int] = {}
_crash_lock = threading.Lock()


def crash_armed_count(name: str) -> Optional[int]:
    """The COUNT of ``MEGATRON_TEST_CRASH_AT`` when it names point ``name`` on this rank."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    m = re.fullmatch(r"([a-z_]+)(?::(\d+))?(?:@(\d+))?", spec.strip())
    if m is None or m.group(1) not in CRASH_POINTS:
        raise CheckpointError(f"{CRASH_ENV}={spec!r}: expected POINT[:COUNT][@RANK] with POINT "
                              f"one of {', '.join(CRASH_POINTS)}")
    if m.group(1) != name or (m.group(3) is not None and int(m.group(3)) != global_rank()):
        return None
    return int(m.group(2) or 1)


def crash_point(name: str) -> None:
    """Test hook: SIGKILL this process the COUNT-th time it reaches save point ``name``.

    ``MEGATRON_TEST_CRASH_AT=POINT[:COUNT][@RANK]`` names one of :data:`CRASH_POINTS`; COUNT
    (default 1) counts the times this process reached the point; with ``@RANK`` only that global
    rank dies. The tests use it to prove that a process killed anywhere inside a save loses
    nothing. Unset, it costs one environment lookup per point.
    """
    count = crash_armed_count(name)
    if count is None:
        return
    with _crash_lock:
        _crash_counts[name] = _crash_counts.get(name, 0) + 1
        hit = _crash_counts[name] == count
    if hit:
        print(f"{CRASH_ENV}: killing rank {global_rank()} at {name}:{count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class KillMidFile:
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


def all_ok(ok: bool) -> bool:
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
        fsync_path(save_dir)
    return done


def staging_root(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, STAGING_PREFIX + checkpoint_dir_name(iteration))


def begin_save(save_dir: str, iteration: int) -> str:
    """Rank 0 empties the staging folder of ``iteration``; every rank waits for it."""
    tmp_root = staging_root(save_dir, iteration)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_root, ignore_errors=True)
        os.makedirs(tmp_root, exist_ok=True)
    dist.barrier()
    return tmp_root


def write_tracker(save_dir: str, label: str) -> None:
    """Point ``save_dir``'s tracker at ``label`` (an iteration or ``release``) by a rename."""
    tracker = os.path.join(save_dir, TRACKER_FILENAME)
    with open(tracker + ".tmp", "w") as f:
        f.write(label)
        f.flush()
        os.fsync(f.fileno())
    crash_point("before_tracker")
    os.replace(tracker + ".tmp", tracker)
    fsync_path(save_dir)
    crash_point("after_tracker")


def publish(staging: str, save_dir: str, name: str, label: str) -> str:
    """Move the finished folder ``staging/name`` to ``save_dir/name``, then the tracker.

    The one atomic publish of every checkpoint writer (training's two formats and the
    converter): the folder is renamed into place (an existing one of that name is first moved
    aside to ``name.old`` and removed after), the staging folder goes, and only then does the
    tracker, itself replaced by a rename, name ``label``; each step is fsynced. A crash at any
    point leaves the tracker naming a complete checkpoint (:func:`clean_interrupted_saves`
    tidies the rest at the next start). Returns the published folder.
    """
    final_dir = os.path.join(save_dir, name)
    old = final_dir + REPLACED_SUFFIX
    fsync_path(os.path.join(staging, name))
    crash_point("before_rename")
    if os.path.exists(final_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        crash_point("replacing_old")
    os.replace(os.path.join(staging, name), final_dir)
    crash_point("after_rename")
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    fsync_path(save_dir)
    write_tracker(save_dir, label)
    return final_dir


def publish_iteration(save_dir: str, iteration: int, integrity: bool = False) -> None:
    """Rank 0: publish the staged save of ``iteration`` (:func:`publish`) and say so; with
    ``integrity`` (--verify-integrity) first write its manifest into the staged folder."""
    staging = staging_root(save_dir, iteration)
    if integrity:
        write_manifest(os.path.join(staging, checkpoint_dir_name(iteration)))
    publish(staging, save_dir, checkpoint_dir_name(iteration), str(iteration))
    print(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}",
          flush=True)


def raise_if_failed(error: str, what: str) -> None:
    """Collective: every rank raises, naming each failing rank's file, if any rank failed."""
    if all_ok(not error):
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    raise CheckpointError(f"{what} failed: {detail}")


def finish_save(save_dir: str, iteration: int, error: str, integrity: bool = False,
                upload_url: Optional[str] = None) -> None:
    """Collective: publish the staged save if every rank's file was written, else raise;
    ``integrity``: write the --verify-integrity manifest first; ``upload_url`` (an msc://
    --save, ``save_dir`` its mirror): rank 0 then uploads the published iteration, tracker
    last, and no rank returns before it is there."""
    try:
        raise_if_failed(error, f"saving iteration {iteration} to {save_dir}")
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(staging_root(save_dir, iteration), ignore_errors=True)
        raise
    publish_error = ""
    if dist.get_rank() == 0:
        try:
            publish_iteration(save_dir, iteration, integrity)
            if upload_url is not None:
                object_storage.upload_iteration(save_dir, upload_url, iteration)
        except OSError as err:
            publish_error = f"{err.filename}: {err.strerror}"
        except ObjectStorageError as err:
            publish_error = str(err)
    raise_if_failed(publish_error, f"publishing iteration {iteration} in {save_dir}")

"""An exclusive lock on a --save folder: one training run writes into it at a time.

Two runs saving into one folder would both report success while each replaces the other's
checkpoints and tracker. So rank 0 takes the lock at start-up, before anything is written in the
folder: the file ``SAVE/.save_lock``, created with ``O_CREAT | O_EXCL`` (atomic: of two runs
starting together exactly one creates it), holding the owner's host name and pid as JSON. The
run removes it when it ends, by returning, by an error, or by a signal the harness handles
(SIGTERM / SIGINT under --exit-signal-handler, Ctrl-C's KeyboardInterrupt).

A run killed outright (SIGKILL, the OOM killer, a lost node) leaves the file behind. A later
start on the same host sees that no process has that pid, says so in one NOTE line and takes the
lock over. A lock written on another host is never taken over: this host cannot tell whether that
run still lives, so the start stops, naming the host, the pid and the file to remove.
:func:`megatron.checkpoint.publish.clean_interrupted_saves` leaves the file alone.
"""

import json
import os
import socket
import time
from typing import List, Optional, Set, Tuple

import torch.distributed as dist

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.publish import check_save_dir, clean_interrupted_saves

LOCK_FILENAME = ".save_lock"

# Locks this process holds (their paths): a second acquire of one of them is another run.
_held: Set[str] = set()


class SaveDirLockedError(CheckpointError):
    """--save is locked by another run, or by a file no run can be shown to own; exit with 2,
    before training, like a bad flag."""

    exit_code = 2


class SaveLock:
    """A lock taken by :func:`acquire`; :meth:`release` removes its file."""

    def __init__(self, path: str, content: str):
        self.path, self.content = path, content

    def release(self) -> None:
        """Remove the lock file if it is still this lock's (never another run's)."""
        if self.path not in _held:
            return
        _held.discard(self.path)
        try:
            with open(self.path, encoding="utf-8") as f:
                if f.read() != self.content:
                    return
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _create(path: str) -> SaveLock:
    """Create ``path`` atomically with this process's host and pid; FileExistsError if taken."""
    content = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                          "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, content.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    _held.add(path)
    return SaveLock(path, content)


def _read(path: str) -> Tuple[str, Optional[dict]]:
    """``(text, owner)`` of a lock file; owner is None when the text names no host and pid.

    A file just created by another run may not hold its text yet, so an empty one is read again
    for up to a second. Raises FileNotFoundError when the file is gone.
    """
    for _ in range(20):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text:
            break
        time.sleep(0.05)
    try:
        owner = json.loads(text)
    except ValueError:
        return text, None
    if not (isinstance(owner, dict) and isinstance(owner.get("host"), str)
            and isinstance(owner.get("pid"), int) and owner["pid"] > 0):
        return text, None
    return text, owner


def _alive(pid: int) -> bool:
    """Whether a process with ``pid`` runs on this host (another user's counts as alive)."""
    if pid == os.getpid():
        # This process does not hold the lock (checked before): an earlier process had this
        # pid (pids are reused, e.g. by each new container).
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refuse_unless_stale(save_dir: str, path: str, text: str, owner: Optional[dict]) -> None:
    """Raise SaveDirLockedError unless ``owner`` is a process of this host that is gone."""
    if owner is None:
        raise SaveDirLockedError(
            f"--save {save_dir} is locked by {path}, which names no run (it holds "
            f"{text.strip()[:80]!r}); if no run is saving into {save_dir}, remove {path} and "
            "start again")
    host, pid = owner["host"], owner["pid"]
    if host != socket.gethostname():
        raise SaveDirLockedError(
            f"--save {save_dir} is locked by a run on host {host} (pid {pid}), which this host "
            f"({socket.gethostname()}) cannot check: if that run is gone, remove {path} and "
            "start again; else choose another --save")
    if path in _held or _alive(pid):
        raise SaveDirLockedError(
            f"--save {save_dir} is in use by another run (host {host}, pid {pid}; lock {path}): "
            "two runs saving into one folder overwrite each other's checkpoints; stop that run "
            "or choose another --save")


def _remove_stale(save_dir: str, path: str, text: str) -> bool:
    """Remove the stale lock holding ``text``; False if it went meanwhile (a racing start).

    The file is first renamed aside: of two starts that both found it stale, only one rename
    succeeds. Should the renamed file hold other text (a racing start removed the stale lock
    and made its own in between), it is put back and this start gives up.
    """
    aside = f"{path}.stale-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    with open(aside, encoding="utf-8", errors="replace") as f:
        moved = f.read()
    if moved != text:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        os.remove(aside)
        raise SaveDirLockedError(f"--save {save_dir}: another run took the lock {path} while "
                                 f"this one was starting; it holds {moved.strip()}")
    os.remove(aside)
    return True


def acquire(save_dir: str) -> Tuple[SaveLock, List[str]]:
    """Lock ``save_dir`` (created if needed) for this run; returns the lock and the NOTE lines
    to print (a stale lock taken over).

    Raises:
        SaveDirLockedError: another run on this host holds the lock, the lock comes from another
            host, or it names no run; the message names the host, the pid and the file.
        CheckpointError: ``save_dir`` cannot be created or written.
    """
    path = os.path.join(save_dir, LOCK_FILENAME)
    notes = []
    try:
        os.makedirs(save_dir, exist_ok=True)
        for _ in range(3):
            try:
                return _create(path), notes
            except FileExistsError:
                pass
            try:
                text, owner = _read(path)
            except FileNotFoundError:
                continue
            _refuse_unless_stale(save_dir, path, text, owner)
            if _remove_stale(save_dir, path, text):
                notes.append(f"took over {LOCK_FILENAME}, left by a run that is gone (host "
                             f"{owner['host']}, pid {owner['pid']}, started {owner.get('started')}"
                             "; killed, or its node lost)")
    except OSError as err:
        raise CheckpointError(f"--save {save_dir} is not writable: {err.strerror}") from None
    raise SaveDirLockedError(f"--save {save_dir}: other runs keep taking the lock {path}; "
                             "start one run at a time")


def lock_save_dir(save_dir: str, rank: int) -> Optional[SaveLock]:
    """Collective, at a run's start: rank 0 locks ``save_dir`` (:func:`acquire`), checks that it
    is writable and tidies what an interrupted save left (:func:`clean_interrupted_saves`), each
    change in one NOTE line; returns rank 0's lock (None on the other ranks).

    Rank 0's verdict is broadcast, so when it refuses (another run saves there, the folder is not
    writable) every rank raises the same error before anything is built. The error carries
    ``every_rank_raises``, so the entry point prints it once, from rank 0.
    """
    lock, error = None, None
    if rank == 0:
        try:
            lock, notes = acquire(save_dir)
            check_save_dir(save_dir)
            notes += clean_interrupted_saves(save_dir)
            for note in notes:
                print(f"NOTE: --save {save_dir}: {note}", flush=True)
        except (CheckpointError, OSError) as err:
            if lock is not None:
                lock.release()
            error = err if isinstance(err, CheckpointError) else CheckpointError(
                f"--save {save_dir}: {err}")
    verdict = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        verdict[0].every_rank_raises = True
        raise verdict[0]
    return lock

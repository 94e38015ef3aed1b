"""--verify-integrity: a SHA-256 manifest written with each checkpoint, checked when it loads.

Megatron-Core's format (``megatron/core/dist_checkpointing/integrity.py`` there): the
checkpoint folder holds ``integrity.json`` = ``{"algorithm": "sha256", "files": {name: hex
digest}}`` listing every file of the folder but itself. Megatron-Core lists the files at the top
of a ``torch_dist`` folder; a ``torch``-format folder keeps its files in ``mp_rank_*``
sub-folders, so names here are paths relative to the folder (``mp_rank_00/model_optim_rng.pt``),
which reads the same for a flat folder.

Rank 0 writes the manifest into the staged folder once every rank's files are complete, before
the folder is published; on load rank 0 re-hashes and every rank raises the same one-line error,
naming each file that differs or is missing.
"""

import hashlib
import json
import os
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron.checkpoint.layout import CheckpointError

INTEGRITY_FNAME = "integrity.json"
HASH_ALGORITHM = "sha256"
_CHUNK = 1 << 20


def file_digest(path: str) -> str:
    """The SHA-256 hex digest of the file at ``path``, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _files_under(folder: str) -> List[str]:
    names = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != INTEGRITY_FNAME:
                names.append(rel)
    return names


def write_manifest(folder: str) -> str:
    """Hash every file under ``folder`` and write ``folder/integrity.json`` (one process only,
    after every file is complete); returns the manifest's path."""
    files = {name: file_digest(os.path.join(folder, name)) for name in _files_under(folder)}
    path = os.path.join(folder, INTEGRITY_FNAME)
    with open(path, "w") as f:
        json.dump({"algorithm": HASH_ALGORITHM, "files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return path


def _read_manifest(folder: str) -> Dict[str, str]:
    path = os.path.join(folder, INTEGRITY_FNAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; --verify-integrity needs a checkpoint saved with "
                              "--verify-integrity")
    try:
        with open(path) as f:
            manifest = json.load(f)
        algorithm = manifest.get("algorithm", HASH_ALGORITHM)
        files = manifest["files"]
    except (ValueError, KeyError, AttributeError, TypeError) as err:
        raise CheckpointError(f"{path}: not an integrity manifest ({err})") from None
    if algorithm != HASH_ALGORITHM:
        raise CheckpointError(f"{path}: hash algorithm {algorithm!r}, expected "
                              f"{HASH_ALGORITHM!r}")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' is a {type(files).__name__}, not a mapping")
    return files


def mismatches(folder: str) -> List[str]:
    """One ``name: what is wrong`` entry per listed file that is missing or whose digest
    differs from the manifest's."""
    found = []
    for name, expected in sorted(_read_manifest(folder).items()):
        try:
            actual = file_digest(os.path.join(folder, name))
        except OSError as err:
            found.append(f"{name}: missing or unreadable ({err.strerror})")
            continue
        if actual != expected:
            found.append(f"{name}: sha256 mismatch (expected {str(expected)[:16]}..., got "
                         f"{actual[:16]}...)")
    return found


def _check(folder: str) -> Optional[str]:
    try:
        bad = mismatches(folder)
    except CheckpointError as err:
        return str(err)
    if not bad:
        return None
    return (f"{folder}: checkpoint integrity check failed (--verify-integrity) for "
            f"{len(bad)} file(s): " + "; ".join(bad))


_VERIFIED = set()  # folders this process has verified (flag checks read a folder before loading)


def verify(folder: str) -> None:
    """Collective when a process group exists: rank 0 re-hashes the files ``folder``'s manifest
    lists and every rank raises :class:`CheckpointError` with the same one line if any differ.
    A folder is checked once per process."""
    folder = os.path.abspath(folder)
    if folder in _VERIFIED:
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        result = [_check(folder) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(result, src=0)
        error = result[0]
    else:
        error = _check(folder)
    if error is not None:
        raise CheckpointError(error)
    _VERIFIED.add(folder)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  checkpoint integrity verified: {folder}", flush=True)

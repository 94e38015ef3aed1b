"""Megatron-LM's torch-format checkpoint on disk: folder and file names, the tracker, reading.

Layout (FORMATS.md section 6)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt            (PP = 1)
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (PP > 1)
    SAVE/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/...       (EP > 1, Megatron-LM's)

With expert parallelism the ranks whose expert-data-parallel rank is 0 write, each its dense
parameters and its expert-parallel rank's experts under local numbers (Megatron-LM's legacy
rule); a checkpoint saved at another EP loads through :mod:`megatron.checkpoint.experts`.

This module names the folders and files of that layout, reads the tracker, tells the sizes a
folder was saved at from its ``mp_rank_*`` names, and reads one rank's file safely
(``torch.load(weights_only=True)`` through :mod:`megatron.checkpoint.safe_unpickle`, after
checking the zip members' CRC-32). It needs no model.
"""

import argparse
import os
import re
import zipfile
from typing import Optional, Tuple

from megatron.checkpoint import safe_unpickle

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# A tracker holds an iteration number; anything longer is not one (and int() refuses
# > 4300 digits).
_MAX_TRACKER_BYTES = 1024
STAGING_PREFIX = ".tmp_"     # SAVE/.tmp_iter_0000100/iter_0000100/...: a save being written
REPLACED_SUFFIX = ".old"     # SAVE/iter_0000100.old: the folder a new save of 100 replaces


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and the problem."""


def checkpoint_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    """Megatron-LM's rank folder: ``mp_rank_{tp:02d}``, ``_{pp:03d}`` appended when PP > 1 and
    ``_{ep:03d}`` when EP > 1 (so ``mp_rank_00_001`` is pipeline stage 1 or expert rank 1;
    :func:`saved_sizes` tells them apart)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def rank_file_in(iter_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    return os.path.join(iter_dir, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        "model_optim_rng.pt")


def checkpoint_file(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False, ep_rank: int = 0, ep_size: int = 1) -> str:
    return rank_file_in(os.path.join(root, checkpoint_dir_name(iteration, release)), tp_rank,
                         pp_rank, pp_size, ep_rank, ep_size)


def expert_ranks(pstate) -> Tuple[int, int, int]:
    """``(ep_rank, ep_size, expert_dp_rank)`` of this rank (``(0, 1, dp x cp rank)`` without
    expert parallelism)."""
    from megatron.core.collectives import get_group_rank, get_group_size

    ep_group = getattr(pstate, "ep_group", None)
    edp_group = getattr(pstate, "expert_dp_group", None)
    if ep_group is None:
        return 0, 1, pstate.dp_cp_rank
    return get_group_rank(ep_group), get_group_size(ep_group), get_group_rank(edp_group)


def my_file(root: str, iteration: int, pstate) -> str:
    """This rank's file under ``root`` (a staging or a checkpoint folder)."""
    ep_rank, ep_size, _ = expert_ranks(pstate)
    return checkpoint_file(root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                           ep_rank=ep_rank, ep_size=ep_size)


def iteration_dir(load_dir: str, iteration: int, release: bool) -> str:
    """The folder of ``iteration``; its ``.old`` copy when a save replacing it was interrupted
    (the next start with this folder as --save puts it back; see clean_interrupted_saves)."""
    iter_dir = os.path.join(load_dir, checkpoint_dir_name(iteration, release))
    if not os.path.isdir(iter_dir) and os.path.isdir(iter_dir + REPLACED_SUFFIX):
        return iter_dir + REPLACED_SUFFIX
    return iter_dir


def read_tracker(load_dir: str) -> Optional[Tuple[int, bool]]:
    """``(iteration, release)`` from the tracker file, or None if there is none."""
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: exists but is not a regular file")
    with open(path, "rb") as f:
        raw = f.read(_MAX_TRACKER_BYTES + 1)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text (starts {raw[:20]!r})") from None
    if text == "release":
        return 0, True
    if len(raw) > _MAX_TRACKER_BYTES or not re.fullmatch(r"\d+", text):
        raise CheckpointError(f"{path}: expected an iteration number or 'release', "
                              f"found {text[:40]!r}")
    return int(text), False


def saved_layout(iter_dir: str) -> Tuple[int, int]:
    """(TP, PP) sizes a checkpoint folder was saved with, from its ``mp_rank_*`` folders."""
    tp, pp, _ = saved_sizes(iter_dir)
    return tp, pp


def saved_sizes(iter_dir: str) -> Tuple[int, int, int]:
    """(TP, PP, EP) sizes a checkpoint folder was saved with, from its ``mp_rank_*`` folders.

    ``mp_rank_XX_YYY_ZZZ`` is (tp, pp, ep) and ``mp_rank_XX`` tp alone, but Megatron-LM names
    pipeline stage and expert-parallel rank alike when only one of them is > 1:
    ``mp_rank_00_001`` is stage 1 (PP > 1) or expert rank 1 (EP > 1). The saved ``args`` of
    the first rank's file decide (``pipeline_model_parallel_size`` /
    ``expert_model_parallel_size``); a file without them is read as pipeline stages, as before
    expert parallelism.
    """
    parts = []
    for name in os.listdir(iter_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?", name)
        if m:
            parts.append(tuple(int(g) if g is not None else None for g in m.groups()))
    if not parts:
        raise CheckpointError(f"{iter_dir}: no mp_rank_* folders; not a checkpoint")
    lengths = {sum(g is not None for g in p) for p in parts}
    if len(lengths) > 1:
        raise CheckpointError(f"{iter_dir}: mixes mp_rank_* folder names of different forms "
                              f"({sorted(_rank_dir_name_of(p) for p in parts)[:4]}...)")
    tp = max(p[0] for p in parts) + 1
    if lengths == {1}:
        return tp, 1, 1
    if lengths == {3}:
        return tp, max(p[1] for p in parts) + 1, max(p[2] for p in parts) + 1
    second = max(p[1] for p in parts) + 1
    first_file = os.path.join(iter_dir, "mp_rank_00_000", "model_optim_rng.pt")
    saved = peek_args(first_file)
    saved_ep = getattr(saved, "expert_model_parallel_size", 1) or 1
    saved_pp = getattr(saved, "pipeline_model_parallel_size", None)
    if saved_ep > 1 and (saved_pp or 1) == 1:
        return tp, 1, saved_ep   # a missing expert rank's file is named when it is read
    return tp, second, 1


def _rank_dir_name_of(parts) -> str:
    return "mp_rank_" + "_".join(f"{g:02d}" if i == 0 else f"{g:03d}"
                                 for i, g in enumerate(parts) if g is not None)


def peek_args(path: str) -> Optional[argparse.Namespace]:
    """The saved ``args`` of a rank file, memory-mapped (the tensors are not read)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (it tells pipeline stages from expert ranks)")
    try:
        try:
            state = safe_unpickle.torch_load(path, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = safe_unpickle.torch_load(path)  # legacy (non-zip) file
    except safe_unpickle.UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__})") from None
    return state.get("args") if isinstance(state, dict) else None


def verify_zip_checksums(path: str) -> None:
    """Check the CRC-32 of every member of a zip-format checkpoint.

    torch writes them but its reader does not check them, so a flipped bit on disk would load as
    a silently different weight. Costs one extra read of the file; legacy (non-zip) files have
    no checksums to check.
    """
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
        raise CheckpointError(f"{path}: corrupt zip archive ({err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt: member {bad!r} fails its CRC-32 check "
                              "(the file changed after it was written)")


def load_state_file(path: str) -> dict:
    """``torch.load`` one rank's file safely; errors name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    verify_zip_checksums(path)
    try:
        state = safe_unpickle.torch_load(path)
    except safe_unpickle.UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise CheckpointError(f"{path}: not a model_optim_rng checkpoint (no 'iteration' key)")
    return state


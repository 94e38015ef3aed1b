"""Where a conversion writes: never over its source, never over content it was not told to
replace, and never half.

Every saver (Hugging Face, Megatron ``torch``, ``torch_dist``) writes through
:func:`staged_target`: a fresh folder next to ``--save-dir`` that is renamed into place only
once the conversion is complete, so a conversion that fails (or is killed) midway leaves the
target as it was. A non-empty target is refused unless ``--overwrite`` is given; then its old
content is replaced only after the new one is completely written. :func:`check_source_and_target`
refuses a target that is the source, lies inside it or contains it, whatever the flags: writing
there would replace what is being read.
"""

import contextlib
import os
import secrets
import shutil
from typing import Iterator

from megatron.checkpoint.publish import fsync_path
from megatron.convert.schema import ConversionError


class TargetRefusedError(ConversionError):
    """A --save-dir that a conversion must not write to; exits with 2, like a bad flag."""

    exit_code = 2


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _shown(path: str) -> str:
    """The path as given, with what it resolves to when that differs (a symlink, ``..``)."""
    real = _real(path)
    return path if os.path.abspath(path) == real else f"{path} (= {real})"


def check_source_and_target(load_dir: str, save_dir: str) -> None:
    """Refuse a ``save_dir`` that is ``load_dir``, inside it, or contains it (real paths)."""
    source, target = _real(load_dir), _real(save_dir)
    if source == target:
        relation = "is the source"
    elif os.path.commonpath([source, target]) == source:
        relation = "is inside the source"
    elif os.path.commonpath([source, target]) == target:
        relation = "contains the source"
    else:
        return
    raise TargetRefusedError(
        f"--save-dir {_shown(save_dir)} {relation} --load-dir {_shown(load_dir)}: a conversion "
        "never writes where it reads; choose a --save-dir outside --load-dir")


def check_target(save_dir: str, overwrite: bool) -> None:
    """Refuse a ``save_dir`` that is not a folder, or holds anything when not ``overwrite``."""
    if not os.path.lexists(save_dir):
        return
    if not os.path.isdir(save_dir):
        raise TargetRefusedError(f"--save-dir {save_dir}: exists and is not a folder")
    present = sorted(os.listdir(save_dir))
    if present and not overwrite:
        raise TargetRefusedError(
            f"--save-dir {save_dir}: not empty (holds {', '.join(present[:3])}"
            f"{' ...' if len(present) > 3 else ''}); choose a new or empty folder, or pass "
            "--overwrite to replace its content once the conversion is complete")


def _sibling(final: str, what: str) -> str:
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root``, so the rename publishes complete files."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def _put_in_place(staging: str, final: str, save_dir: str, overwrite: bool) -> None:
    """Rename the finished ``staging`` folder to ``final``; an old non-empty ``final`` (only
    with ``overwrite``) is first moved aside and removed once the new one is in place."""
    old = None
    if os.path.isdir(final) and os.listdir(final):
        if not overwrite:
            raise TargetRefusedError(f"--save-dir {save_dir}: filled by someone else while "
                                     f"converting; the conversion is discarded")
        old = _sibling(final, "replaced")
        os.rename(final, old)
    try:
        os.rename(staging, final)   # over an absent or empty folder: one atomic step
    except OSError as err:
        if old is not None:
            os.rename(old, final)
        raise TargetRefusedError(f"--save-dir {save_dir}: cannot put the conversion in place "
                                 f"({err.strerror}); the target is unchanged") from None
    fsync_path(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_target(save_dir: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a new empty folder next to ``save_dir`` to write the conversion into.

    When the body returns, the folder's files are fsynced and it is renamed to ``save_dir``
    (replacing an empty folder, or with ``overwrite`` a non-empty one, which is removed only
    then); when it raises, the folder is removed and ``save_dir`` is left untouched. A process
    killed midway leaves only the hidden ``.NAME.converting-*`` folder next to the target.

    Raises:
        TargetRefusedError: ``save_dir`` is a file, or is not empty and ``overwrite`` is False.
        ConversionError: the folder next to ``save_dir`` cannot be created.
    """
    check_target(save_dir, overwrite)
    final = _real(save_dir)
    staging = _sibling(final, "converting")
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.mkdir(staging)
    except OSError as err:
        raise ConversionError(f"--save-dir {save_dir}: cannot create a folder next to it in "
                              f"{os.path.dirname(final)} ({err.strerror})") from None
    try:
        yield staging
        _fsync_tree(staging)
        _put_in_place(staging, final, save_dir, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

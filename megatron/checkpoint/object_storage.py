"""``--save`` / ``--load`` as ``msc://PROFILE/PATH`` (``--enable-msc``): a local mirror.

Megatron-LM streams a torch_dist checkpoint to and from object storage through the
Multi-Storage Client. Here the checkpoint code keeps writing and reading local files, in a
mirror of the URL under ``--object-storage-cache-path`` (``CACHE/checkpoints/PROFILE/PATH``):

* validation (:func:`resolve_urls`) keeps the URLs as ``args.save_msc_url`` /
  ``args.load_msc_url`` and points ``args.save`` / ``args.load`` at their mirrors, so locks,
  staging, atomic publishing, async saves, retention and non-persistent saves run unchanged;
* a save, once published in the mirror, is uploaded by global rank 0 (:func:`upload_iteration`,
  called where every format publishes: ``publish.finish_save``): the iteration's files first,
  the tracker last, so the remote tracker only ever names a complete checkpoint;
* before anything reads ``--load``, :func:`fetch_load` brings the remote tracker and the
  iteration it (or ``--ckpt-step``) names into the mirror, one process per node.

Records and prints: the checkpoint's saved ``args`` hold the URLs as ``save`` / ``load``
(what the user passed, as in Megatron), never the mirror paths.
"""

import os
import shutil
from typing import Iterable, Optional

import torch.distributed as dist

from megatron.checkpoint.layout import (TRACKER_FILENAME, CheckpointError, checkpoint_dir_name,
                                        read_tracker)
from megatron.core import msc

MIRROR_SUBDIR = "checkpoints"
# The flags that may be msc:// URLs, and the args attribute each keeps its URL in.
URL_FLAGS = (("--save", "save", "save_msc_url"), ("--load", "load", "load_msc_url"))
# Checkpoint folders that must stay local paths here.
LOCAL_ONLY_FLAGS = (("--pretrained-checkpoint", "pretrained_checkpoint"),
                    ("--ckpt-convert-save", "ckpt_convert_save"),
                    ("--non-persistent-global-ckpt-dir", "non_persistent_global_ckpt_dir"),
                    ("--non-persistent-local-ckpt-dir", "non_persistent_local_ckpt_dir"))


def mirror_dir(cache_path: str, url: str) -> str:
    """The local folder that mirrors checkpoint folder ``url``."""
    profile, path = msc.split_url(url)
    return os.path.join(os.path.abspath(cache_path), MIRROR_SUBDIR, profile, path.strip("/"))


def resolve_urls(args) -> None:
    """Check msc:// ``--save`` / ``--load`` and point them at their local mirrors.

    Raises :class:`~megatron.core.msc.ObjectStorageError` with one line naming the flag. Runs
    before any process group; a second call (the flags already resolved) changes nothing.
    """
    for flag, dest in LOCAL_ONLY_FLAGS:
        if msc.is_msc_url(getattr(args, dest, None)):
            raise msc.ObjectStorageError(
                f"{flag} {getattr(args, dest)}: msc:// URLs are supported for --save and --load "
                "only here; give a local folder")
    urls = [(flag, dest, attr, getattr(args, dest)) for flag, dest, attr in URL_FLAGS
            if msc.is_msc_url(getattr(args, dest, None))]
    if not urls:
        return
    for flag, _, _, url in urls:
        if not getattr(args, "enable_msc", False):
            raise msc.ObjectStorageError(
                f"{flag} {url}: msc:// URLs need --enable-msc (the Multi-Storage Client)")
        msc.split_url(url)
        if args.ckpt_format != "torch_dist":
            raise msc.ObjectStorageError(
                f"{flag} {url} with --ckpt-format {args.ckpt_format}: Megatron supports only "
                "--ckpt-format torch_dist for msc:// checkpoint URLs")
    msc.client()
    if not getattr(args, "object_storage_cache_path", None):
        flag, _, _, url = urls[0]
        raise msc.ObjectStorageError(
            f"{flag} {url}: msc:// checkpoints need --object-storage-cache-path (this project "
            "keeps a local mirror of the checkpoint there; Megatron streams it)")
    for flag, dest, attr, url in urls:
        setattr(args, attr, url)
        setattr(args, dest, mirror_dir(args.object_storage_cache_path, url))


def recorded_paths(saved_args) -> None:
    """In the ``args`` a checkpoint records: the URLs as ``save`` / ``load``, no mirror paths."""
    fields = vars(saved_args)
    for _, dest, attr in URL_FLAGS:
        url = fields.pop(attr, None)
        if url is not None and _remote_url(saved_args, dest, attr, url) is not None:
            fields[dest] = url


def _remote_url(args, dest: str, attr: str, url: Optional[str] = None) -> Optional[str]:
    """The URL ``args.<dest>`` mirrors (``args.<attr>``, or ``url``), or None when it is not
    that mirror (a local folder, or a non-persistent or conversion folder put in its place)."""
    url = url or getattr(args, attr, None)
    if url is None or not getattr(args, dest, None):
        return None
    same = os.path.abspath(getattr(args, dest)) == mirror_dir(args.object_storage_cache_path,
                                                               url)
    return url if same else None


def save_url(args) -> Optional[str]:
    """The URL a save into ``args.save`` is uploaded to, or None."""
    return _remote_url(args, "save", "save_msc_url")


def _local_files(folder: str) -> list:
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def _remote_files(url: str) -> list:
    """Keys under folder ``url``, relative to it (the listing is recursive)."""
    prefix = url.rstrip("/") + "/"
    return sorted(o.key[len(prefix):] for o in msc.client().list(prefix)
                  if o.key.startswith(prefix))


def _transfer_error(url: str, err: Exception) -> msc.ObjectStorageError:
    return msc.ObjectStorageError(f"{url}: the Multi-Storage Client failed: "
                                  f"{type(err).__name__}: {err}")


def upload_iteration(save_dir: str, url: str, iteration: int) -> None:
    """Global rank 0, after ``iteration`` is published in the mirror ``save_dir``: its files
    to ``URL/iter_XXXXXXX/``, remote files the new copy lacks removed, then the tracker."""
    client = msc.client()
    name = checkpoint_dir_name(iteration)
    local, remote = os.path.join(save_dir, name), msc.join(url, name)
    try:
        files = _local_files(local)
        for rel in files:
            client.upload_file(msc.join(remote, rel), os.path.join(local, rel))
        for rel in set(_remote_files(remote)) - set(files):
            client.delete(msc.join(remote, rel))
        client.upload_file(msc.join(url, TRACKER_FILENAME),
                           os.path.join(save_dir, TRACKER_FILENAME))
    except msc.ObjectStorageError:
        raise
    except Exception as err:  # profile, credentials, network: name the URL
        raise _transfer_error(remote, err) from None
    print(f"  uploaded checkpoint at iteration {iteration:7d} to {url}", flush=True)


def delete_iterations(args, names: Iterable[str]) -> None:
    """Global rank 0: remove the iteration folders ``names`` (pruned from the mirror by
    --save-retain-interval) from the remote checkpoint too."""
    url = save_url(args)
    if url is None:
        return
    client = msc.client()
    for name in names:
        folder = msc.join(url, name)
        try:
            for rel in _remote_files(folder):
                client.delete(msc.join(folder, rel))
        except Exception as err:
            raise _transfer_error(folder, err) from None


def _download_tree(url: str, local: str) -> None:
    client = msc.client()
    files = _remote_files(url)
    if not files:
        raise msc.ObjectStorageError(f"{url}: the tracker names this checkpoint, but it holds "
                                     "no files")
    for rel in files:
        target = os.path.join(local, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        client.download_file(msc.join(url, rel), target)


def fetch_common_files(url: str, tmp: str) -> Optional[str]:
    """Copy into the folder ``tmp`` what reading the args of ``url``'s tracked checkpoint needs:
    the tracker, the iteration's metadata and global rank 0's file (which holds the common
    state); the other ranks' tensor files stay remote. Returns the local iteration folder, or
    None without a tracker.

    Any process may call it before the process groups exist (each with its own ``tmp``). Only
    NullTokenizer runs need it (:func:`megatron.checkpoint.load.null_tokenizer_eod_from_checkpoint`).
    """
    tracker_url = msc.join(url, TRACKER_FILENAME)
    if msc.size(tracker_url) is None:
        return None
    client = msc.client()
    try:
        client.download_file(tracker_url, os.path.join(tmp, TRACKER_FILENAME))
        tracked = read_tracker(tmp)
        if tracked is None:
            return None
        iteration, release = tracked
        name = "release" if release else checkpoint_dir_name(iteration)
        os.makedirs(os.path.join(tmp, name))
        for rel in _remote_files(msc.join(url, name)):
            if "/" not in rel and (not rel.endswith(".distcp") or rel == "__0_0.distcp"):
                client.download_file(msc.join(url, name, rel), os.path.join(tmp, name, rel))
    except msc.ObjectStorageError:
        raise
    except Exception as err:
        raise _transfer_error(url, err) from None
    return os.path.join(tmp, name)


def _fetch(url: str, mirror: str, ckpt_step: Optional[int]) -> str:
    """Make ``mirror`` hold the remote tracker and the iteration to load; returns what it did."""
    tracker_url = msc.join(url, TRACKER_FILENAME)
    local_tracker = os.path.join(mirror, TRACKER_FILENAME)
    os.makedirs(mirror, exist_ok=True)
    if msc.size(tracker_url) is None:
        if os.path.exists(local_tracker):  # a stale mirror must not resume what is not remote
            os.remove(local_tracker)
        return f"no {TRACKER_FILENAME} at {url}: nothing to load"
    client = msc.client()
    try:
        client.download_file(tracker_url, local_tracker + ".download")
        os.replace(local_tracker + ".download", local_tracker)
        tracked = read_tracker(mirror)
        if tracked is None:
            return f"{tracker_url}: empty tracker"
        iteration, release = tracked
        name = "release" if release and ckpt_step is None else checkpoint_dir_name(
            ckpt_step if ckpt_step is not None else iteration)
        shutil.rmtree(os.path.join(mirror, name), ignore_errors=True)
        _download_tree(msc.join(url, name), os.path.join(mirror, name))
    except msc.ObjectStorageError:
        raise
    except Exception as err:
        raise _transfer_error(url, err) from None
    return f"downloaded {url}/{name} into {mirror}"


def fetch_load(args) -> None:
    """Collective: with an msc:// ``--load``, bring its tracker and the checkpoint to load
    into the local mirror. LOCAL_RANK 0 of each node downloads (removing a stale local copy
    first, so the mirror equals the remote); the others wait at a barrier. An error is raised
    on every rank."""
    url = _remote_url(args, "load", "load_msc_url")
    if url is None:
        return
    error, note = "", None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            note = _fetch(url, args.load, getattr(args, "ckpt_step", None))
        except (msc.ObjectStorageError, CheckpointError) as err:
            error = str(err)
        except OSError as err:
            error = f"{err.filename}: {err.strerror}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)   # also the barrier: no rank reads the mirror early
    failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    if failed:
        raise CheckpointError(f"--load {url}: fetching the checkpoint failed: {failed}")
    if note and dist.get_rank() == 0:
        print(f"  --load: {note}", flush=True)

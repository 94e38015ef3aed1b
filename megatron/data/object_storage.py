"""Data prefixes in object storage: ``msc://PROFILE/PATH`` with ``--enable-msc``.

A prefix given as a Multi-Storage Client URL is read as Megatron reads one: its ``.idx`` is copied
whole into ``--object-storage-cache-path`` (the index is read everywhere and checked when opened),
and its ``.bin`` is read in byte ranges from the storage service, one request per sample (hence
``--no-mmap-bin-files``). The dataset caches go to ``--data-cache-path``: nothing is written next
to the data.

The cached index of ``msc://PROFILE/A/B`` is ``CACHE/PROFILE/A/B.idx``. A cached file whose size
differs from the object's is copied again; each process copies to a private temporary name and
renames it into place, so ranks and data-loader workers sharing the cache never read a partial
index.
"""

import os
import secrets
from typing import Optional

from megatron.core import msc


def index_cache_path(prefix: str, cache_dir: str) -> str:
    """Where the ``.idx`` of the msc:// ``prefix`` is kept under ``cache_dir``."""
    profile, path = msc.split_url(prefix)
    return os.path.join(cache_dir, profile, *[p for p in path.split("/") if p]) + ".idx"


def fetch_index(prefix: str, cache_dir: str) -> str:
    """Copy ``PREFIX.idx`` into the cache unless an equal-sized copy is there; its local path."""
    url = prefix + ".idx"
    remote = msc.size(url)
    if remote is None:
        raise FileNotFoundError(f"{url}: index file does not exist in object storage")
    local = index_cache_path(prefix, cache_dir)
    if os.path.isfile(local) and os.path.getsize(local) == remote:
        return local
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.tmp{os.getpid()}.{secrets.token_hex(4)}"
    try:
        msc.client().download_file(url, tmp)
        got = os.path.getsize(tmp)
        if got != remote:
            raise msc.ObjectStorageError(f"{url}: copied {got} of its {remote} bytes into {tmp}")
        os.replace(tmp, local)
    except msc.ObjectStorageError:
        raise
    except Exception as err:
        raise msc.ObjectStorageError(f"{url}: copying it to {local} failed: "
                                     f"{type(err).__name__}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return local


class RemoteBin:
    """Byte ranges of one ``.bin`` object, read through the Multi-Storage Client.

    The open handle belongs to the process that opened it; a data-loader worker (a fork or a
    fresh process) opens its own on first read.
    """

    def __init__(self, url: str, nbytes: int):
        self.url = url
        self.nbytes = nbytes
        self._handle = None
        self._pid = None

    def read(self, offset: int, nbytes: int) -> bytes:
        if self._handle is None or self._pid != os.getpid():
            try:
                self._handle = msc.client().open(self.url, "rb")
            except Exception as err:
                raise msc.ObjectStorageError(f"{self.url}: opening it failed: "
                                             f"{type(err).__name__}: {err}") from None
            self._pid = os.getpid()
        self._handle.seek(offset)
        data = self._handle.read(nbytes)
        if len(data) != nbytes:
            raise msc.ObjectStorageError(
                f"{self.url}: read {len(data)} bytes at offset {offset}, expected {nbytes} (the "
                f"object is {self.nbytes} bytes by its index); it changed or is truncated")
        return data

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None

    def __getstate__(self):
        return {"url": self.url, "nbytes": self.nbytes}

    def __setstate__(self, state):
        self.__init__(state["url"], state["nbytes"])


def check_enabled(prefix: str, flag: str, enabled: bool) -> None:
    """An msc:// prefix is read only with ``--enable-msc`` (Megatron's opt-in)."""
    if msc.is_msc_url(prefix) and not enabled:
        raise msc.ObjectStorageError(f"{flag}: data prefix {prefix!r} is a Multi-Storage "
                                     "Client URL; pass --enable-msc to read it")


def prefix_exists(prefix: str) -> list:
    """The missing files of an msc:// prefix (``.bin`` and ``.idx`` objects), as URLs."""
    return [u for u in (prefix + ".bin", prefix + ".idx") if msc.size(u) is None]


def bin_size(prefix: str) -> Optional[int]:
    return msc.size(prefix + ".bin")

"""Host memory of CPU training: freed blocks stay in the process from one step to the next.

A CPU step allocates and frees the same activations every iteration. With glibc's default
policy, freed memory above a moving threshold goes back to the kernel (blocks over the mmap
threshold are unmapped on free, the heap's free top is trimmed), so the next step takes it again
one page fault at a time: on the project VM 8-50 thousand faults a step for the benchmark GPT of
``benchmarks/bench_peers.py``, 50-210 ms of system time, and over 1 ms for every fresh 16 MiB
activation (RESULTS.md, "Host memory kept between steps"). :func:`keep_freed_memory` sets glibc's
trim threshold beyond reach and its mmap threshold to 32 MiB (glibc's highest), as the CUDA
caching allocator keeps device memory: the process's resident size stays at its peak, which the
peak was anyway, and steps after the first reuse pages the kernel already gave.

It applies to runs on CPU (:func:`megatron.training.initialize.initialize_megatron`), on Linux
with glibc only; ``MEGATRON_KEEP_FREED_HOST_MEMORY=0`` in the environment leaves glibc's default
policy; :func:`release_freed_memory` (``--empty-unused-memory-level`` on CPU) hands the free
memory back at once.
"""

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

ENV = "MEGATRON_KEEP_FREED_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit builds (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 * 2 ** 20
TRIM_THRESHOLD = 2 ** 31 - 1

_KEPT = False


def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # mallopt with these parameters is glibc's.
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Keep freed host memory in the process (see the module); True when glibc took both
    settings now or before, False where the platform has no glibc or the environment said no."""
    global _KEPT
    if _KEPT:
        return True
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("1", "true", "yes", "on", ""):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 (keep freed host memory in the "
                         "process, the default) or 0 (glibc's default policy)")
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    _KEPT = bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _KEPT


def release_freed_memory() -> bool:
    """Hand the process's free heap memory back to the kernel now (glibc's ``malloc_trim``);
    True when some was released, False when none was or the platform has no glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))

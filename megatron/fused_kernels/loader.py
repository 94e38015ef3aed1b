"""Find or build the compiled fused kernels (``torch.ops.megatron_fused``).

Order of attempts, once per process (:func:`load`):

1. the prebuilt module ``megatron.fused_kernels._C`` (``python setup.py build_ext --inplace``);
2. a just-in-time build of ``csrc/fused`` with ninja (``torch.utils.cpp_extension.load``) into
   ``~/.cache/megatron_fused/<torch version>-<hash of sources and flags>`` (or
   ``$MEGATRON_FUSED_CACHE/...``), so a changed source or torch never reuses a stale library;
3. nothing: :func:`load` returns None and warns once, saying why; every op then runs its
   pure-torch reference.

Concurrent builds (several ranks starting at once) serialise on an ``fcntl.flock`` of a lock
file next to the build folder. The kernel releases such a lock when its holder dies, so a
crashed or killed build never blocks the next one; the lock-file torch itself leaves in the
build folder is removed while we hold ours, for the same reason.

Environment: ``MEGATRON_FUSED_KERNELS=0`` disables the compiled kernels;
``MEGATRON_FUSED_PREBUILT=0`` skips step 1 and ``MEGATRON_FUSED_JIT=0`` step 2;
``MEGATRON_FUSED_CACHE`` moves the cache; ``MEGATRON_FUSED_CPU_ISA`` (``baseline``,
``x86-64-v3`` or ``x86-64-v4``) caps the SIMD clone the CPU bodies run (:func:`cpu_isa`).
Loading is not trusting: each op's compiled body is
checked against its reference at its first use on a device type and dtype (:mod:`.selfcheck`);
``MEGATRON_KERNEL_SELFCHECK=0`` skips that check.

This module imports nothing from ``megatron`` so that ``setup.py`` can load it by file path to
share the source list and compiler flags.
"""

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import warnings
from typing import Iterator, List, Optional

# Must equal kVersion in csrc/fused/registration.cpp.
EXPECTED_VERSION = 2

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC_DIR = os.path.join(_ROOT, "csrc", "fused")

# -fno-trapping-math / -fno-math-errno change no finite result; GCC needs them to vectorise the
# float selects. -ffp-contract=off keeps the AVX-512, AVX2 and baseline clones bit-identical.
CPU_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off"]
CPU_LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3", "-lineinfo"]

_STATE = {"tried": False, "ops": None, "error": None, "warned": False}


def cpu_sources(relative: bool = False) -> List[str]:
    """The C++ sources of the CPU bodies and the op registration, sorted."""
    files = sorted(glob.glob(os.path.join(CSRC_DIR, "**", "*.cpp"), recursive=True))
    return [os.path.relpath(f, _ROOT) for f in files] if relative else files


def cuda_sources(relative: bool = False) -> List[str]:
    """The CUDA sources (thin torch bindings; kernel code lives in ``*.cuh`` headers)."""
    files = sorted(glob.glob(os.path.join(CSRC_DIR, "**", "*.cu"), recursive=True))
    return [os.path.relpath(f, _ROOT) for f in files] if relative else files


def kernel_headers() -> List[str]:
    """The torch-free CUDA kernel headers (what tests compile with nvcc)."""
    return sorted(glob.glob(os.path.join(CSRC_DIR, "**", "*_kernels.cuh"), recursive=True))


def find_nvcc() -> Optional[str]:
    """Path of nvcc from ``$CUDA_HOME/bin`` or ``PATH``, else None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_build_available() -> bool:
    """True when torch is a CUDA build and nvcc exists, i.e. the CUDA bodies can be built."""
    import torch

    return bool(torch.version.cuda) and find_nvcc() is not None


def source_hash(with_cuda: bool) -> str:
    """Hash of every source and header under csrc/fused plus the flags: the cache key."""
    h = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(CSRC_DIR, "**", "*"), recursive=True))
    for path in files:
        if os.path.isfile(path):
            h.update(os.path.relpath(path, CSRC_DIR).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    h.update(repr((CPU_CFLAGS, CPU_LDFLAGS, CUDA_CFLAGS, with_cuda)).encode())
    return h.hexdigest()[:16]


def cache_dir(with_cuda: bool) -> str:
    """The versioned build folder for this torch and these sources."""
    import torch

    base = os.environ.get("MEGATRON_FUSED_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_fused")
    return os.path.join(base, f"{torch.__version__}-{source_hash(with_cuda)}")


@contextlib.contextmanager
def build_lock(lock_path: str) -> Iterator[None]:
    """Exclusive ``flock`` on ``lock_path``, released on exit or when this process dies."""
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _ops_namespace():
    import torch

    return torch.ops.megatron_fused


def _registered_version() -> Optional[int]:
    """kVersion of the library already loaded in this process, else None."""
    try:
        return int(_ops_namespace().version())
    except (AttributeError, RuntimeError):
        return None


def _import_prebuilt() -> Optional[str]:
    """Import ``megatron.fused_kernels._C``; returns why not, or None on success."""
    try:
        import importlib

        importlib.import_module("megatron.fused_kernels._C")
        return None
    except ImportError as exc:  # not built, or built against another torch
        return f"prebuilt megatron.fused_kernels._C not importable ({exc})"


def jit_build(verbose: bool = False) -> None:
    """Build csrc/fused into the versioned cache folder and load it (raises on failure)."""
    from torch.utils import cpp_extension

    with_cuda = cuda_build_available()
    build_dir = cache_dir(with_cuda)
    os.makedirs(build_dir, exist_ok=True)
    with build_lock(build_dir + ".lock"):
        # torch's own lock file in the build folder; a crashed build may have left it, and
        # nobody else can be building here while we hold our lock.
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        sources = cpu_sources() + (cuda_sources() if with_cuda else [])
        cpp_extension.load(
            name="megatron_fused_" + os.path.basename(build_dir).rsplit("-", 1)[-1],
            sources=sources,
            extra_cflags=CPU_CFLAGS,
            extra_cuda_cflags=CUDA_CFLAGS,
            extra_ldflags=CPU_LDFLAGS,
            build_directory=build_dir,
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=verbose,
        )


CPU_ISA_LEVELS = ("baseline", "x86-64-v3", "x86-64-v4")


def requested_cpu_isa() -> Optional[str]:
    """``MEGATRON_FUSED_CPU_ISA`` if set (checked: a typo must not silently run another clone)."""
    value = os.environ.get("MEGATRON_FUSED_CPU_ISA")
    if value is None or value == "":
        return None
    if value not in CPU_ISA_LEVELS:
        raise ValueError(f"MEGATRON_FUSED_CPU_ISA={value!r} is not one of "
                         f"{', '.join(CPU_ISA_LEVELS)}")
    return value


def cpu_isa() -> Optional[str]:
    """The SIMD clone the loaded CPU bodies run (one of CPU_ISA_LEVELS), None if not loaded."""
    if load() is None:
        return None
    return CPU_ISA_LEVELS[int(_ops_namespace().cpu_isa_level())]


def _try_load() -> Optional[str]:
    """Make the ops available; returns the reason for failure, or None."""
    requested_cpu_isa()
    if os.environ.get("MEGATRON_FUSED_KERNELS", "1") == "0":
        return "disabled by MEGATRON_FUSED_KERNELS=0"
    if _registered_version() is None:
        why_not_prebuilt = ("prebuilt module skipped (MEGATRON_FUSED_PREBUILT=0)"
                            if os.environ.get("MEGATRON_FUSED_PREBUILT", "1") == "0"
                            else _import_prebuilt())
        if why_not_prebuilt is not None:
            if os.environ.get("MEGATRON_FUSED_JIT", "1") == "0":
                return why_not_prebuilt + "; JIT build disabled by MEGATRON_FUSED_JIT=0"
            try:
                jit_build()
            except Exception as exc:  # compiler missing, compile error, ...
                first = str(exc).strip().splitlines()[:3]
                return (f"{why_not_prebuilt}; JIT build failed: {type(exc).__name__}: "
                        + " | ".join(first))
    found = _registered_version()
    if found != EXPECTED_VERSION:
        return (f"the loaded fused-kernel library has version {found}, this code expects "
                f"{EXPECTED_VERSION}; rebuild with `python setup.py build_ext --inplace`")
    return None


def load():
    """``torch.ops.megatron_fused`` when the compiled kernels are usable, else None.

    Tries once per process; on failure warns once (with the reason; silently when disabled by
    ``MEGATRON_FUSED_KERNELS=0``) and returns None from then on, so callers fall back to the
    pure-torch references.
    """
    if not _STATE["tried"]:
        _STATE["tried"] = True
        error = _try_load()
        _STATE["error"] = error
        _STATE["ops"] = None if error else _ops_namespace()
        disabled = os.environ.get("MEGATRON_FUSED_KERNELS", "1") == "0"  # asked for: no warning
        if error and not disabled and not _STATE["warned"]:
            _STATE["warned"] = True
            warnings.warn(f"megatron fused kernels unavailable: {error}. Using the pure-torch "
                          f"reference implementations instead (slower).", stacklevel=2)
    return _STATE["ops"]


def load_error() -> Optional[str]:
    """Why :func:`load` returned None (None when it succeeded or was not called)."""
    return _STATE["error"]


def has_device_kernels(device_type: str) -> bool:
    """Whether the loaded library has bodies for ``device_type`` ("cpu" or "cuda")."""
    if load() is None:
        return False
    if device_type == "cpu":
        return True
    import torch

    key = {"cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "megatron_fused::bias_gelu_fwd", key)

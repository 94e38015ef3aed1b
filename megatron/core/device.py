"""The one place that knows whether we run on CUDA with NCCL or on CPU with gloo.

Everything else asks this module for the device and the backend; no other module calls
``.cuda()``. The choice is made once per process by :func:`configure` (``--device``), or lazily
on first use (CUDA when available, else CPU).
"""

import contextlib
import os
from typing import Optional

import torch

_DEVICE: Optional[torch.device] = None
_PLACEMENT: list = []   # stack of devices model tensors are placed on (placing_tensors_on)

VALID_CHOICES = ("auto", "cpu", "cuda")


def resolves_to_cpu(choice: str) -> bool:
    """Whether ``--device choice`` runs on the CPU (``auto`` without a CUDA device)."""
    return choice == "cpu" or (choice == "auto" and not torch.cuda.is_available())


def configure(choice: str = "auto", local_rank: Optional[int] = None) -> torch.device:
    """Fix this process's device.

    Args:
        choice: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``.
        local_rank: index of this process on its node; defaults to ``$LOCAL_RANK`` or 0.
    """
    global _DEVICE
    if choice not in VALID_CHOICES:
        raise ValueError(f"--device must be one of {VALID_CHOICES}, got {choice!r}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but torch sees no CUDA device")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible on this node"
            )
        torch.cuda.set_device(local_rank)
        _DEVICE = torch.device("cuda", local_rank)
    else:
        _DEVICE = torch.device("cpu")
    return _DEVICE


def current_device() -> torch.device:
    """The device model tensors and communication buffers live on (the meta device while a
    model is built there: :func:`placing_tensors_on`)."""
    if _PLACEMENT:
        return _PLACEMENT[-1]
    return _run_device()


def _run_device() -> torch.device:
    if _DEVICE is None:
        configure("auto")
    return _DEVICE


@contextlib.contextmanager
def placing_tensors_on(place: Optional[torch.device]):
    """Inside, :func:`current_device` answers ``place`` (None: the run's device), so a model
    built here puts its tensors there; the RNG and backend stay the run's device's."""
    _PLACEMENT.append(place if place is not None else _run_device())
    try:
        yield
    finally:
        _PLACEMENT.pop()


def is_cuda() -> bool:
    return _run_device().type == "cuda"


def backend() -> str:
    """Collective backend for this device: ``nccl`` on CUDA, ``gloo`` on CPU."""
    return "nccl" if is_cuda() else "gloo"


def reset() -> None:
    """Forget the choice (tests)."""
    global _DEVICE
    _DEVICE = None


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def empty_cache() -> None:
    """Return the caching allocator's unused blocks to the GPU (nothing to do on CPU)."""
    if is_cuda():
        torch.cuda.empty_cache()


def rng_state() -> Optional[torch.Tensor]:
    """The accelerator's RNG state, or None on CPU."""
    return torch.cuda.get_rng_state() if is_cuda() else None


def set_rng_state(state: Optional[torch.Tensor]) -> None:
    if state is not None and is_cuda():
        torch.cuda.set_rng_state(state)


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if is_cuda():
        torch.cuda.manual_seed(seed)

"""``--deterministic-mode``: the same seed and flags give bit-identical runs on GPUs too.

On CPU every kernel the framework uses is already deterministic for a fixed thread count (the
suite checks that repeated runs give equal losses), so the flag changes no number there. On
GPUs three things vary between runs unless pinned:

- cuBLAS may pick split-K reductions whose order depends on a workspace race; fixed by
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which must be in the environment before the first cuBLAS
  handle is created (so this runs before the device is touched);
- some CUDA kernels (scatter/index-add style backward passes, cuDNN autotuning) use atomics or
  pick algorithms by timing; ``torch.use_deterministic_algorithms(True)`` makes PyTorch use a
  deterministic implementation where one exists and raise, naming the operation, where none
  does (so a run never silently loses reproducibility), and cuDNN benchmarking is turned off;
- NCCL chooses its reduction algorithm (ring, tree, ...) per call from message size and
  topology, which changes the summation order; ``NCCL_ALGO`` pins it (Ring unless the user
  already set it).

The framework's own CUDA kernels need nothing extra: none accumulates with atomics (the layer
norm's parameter gradients are reduced over blocks in a fixed order).
"""

import os
from typing import List

import torch

# cuBLAS's documented setting for reproducible results (2 workspaces of 4 MiB would also do).
CUBLAS_WORKSPACE = ":4096:8"
DEFAULT_NCCL_ALGO = "Ring"


def configure_deterministic_mode(enabled: bool) -> List[str]:
    """Pin every source of run-to-run variation listed in the module docstring.

    Call before the device is configured and the process group formed: the two environment
    variables are read when cuBLAS and NCCL start.

    Returns:
        What was set, one line each, for the start-up log (empty when ``enabled`` is False).
    """
    if not enabled:
        return []
    notes = []
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace not in (":4096:8", ":16:8"):
        if workspace is not None:
            notes.append(f"CUBLAS_WORKSPACE_CONFIG was {workspace!r}, which cuBLAS does not "
                         f"treat as deterministic; replaced")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    notes.append(f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")
    os.environ.setdefault("NCCL_ALGO", DEFAULT_NCCL_ALGO)
    notes.append(f"NCCL_ALGO={os.environ['NCCL_ALGO']}")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    notes.append("torch.use_deterministic_algorithms(True), cudnn.deterministic, "
                 "no cudnn.benchmark")
    return notes

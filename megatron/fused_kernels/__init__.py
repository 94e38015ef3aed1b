"""Fusable operations: one contract per op, a pure-torch reference body, compiled bodies later.

Each module here defines what one fusable op computes, as plain torch code that tests compare
against float64 formulas:

- :mod:`.softmax`: scaled masked softmax, scaled upper-triangular (causal) masked softmax and the
  :class:`~.softmax.FusedScaleMaskSoftmax` module attention uses;
- :mod:`.layer_norm`: layer norm and RMS norm with float32 statistics
  (:class:`~.layer_norm.FusedLayerNorm`, :class:`~.layer_norm.MixedFusedRMSNorm`);
- :mod:`.bias_gelu`: bias + GeLU (tanh approximation) with a hand-written backward;
- :mod:`.bias_dropout_add`: bias + dropout + residual add, training and inference variants;
- :mod:`.swiglu`: bias + SwiGLU.

A compiled body (the C++/CUDA extension) plugs in behind the same call by registering itself
under the op's name with :func:`register_kernel`; until one is registered, :func:`get_kernel`
hands back the reference, so the model code never changes when kernels arrive.
"""

from typing import Callable, Dict

_KERNELS: Dict[str, Callable] = {}


def register_kernel(name: str, fn: Callable) -> None:
    """Use ``fn`` instead of the pure-torch reference for op ``name`` from now on."""
    _KERNELS[name] = fn


def unregister_kernel(name: str) -> None:
    """Go back to the pure-torch reference for op ``name`` (no-op when none is registered)."""
    _KERNELS.pop(name, None)


def get_kernel(name: str, reference: Callable) -> Callable:
    """The compiled body registered for ``name``, else ``reference``."""
    return _KERNELS.get(name, reference)

"""The base class of this project's torch optimizers: ``torch.optim.Optimizer`` without the
start-up cost of ``torch._dynamo`` in a run that never compiles.

``torch.optim.Optimizer`` wraps ``add_param_group``, ``state_dict``, ``load_state_dict`` and
``zero_grad`` so that ``torch.compile`` does not trace into them. The wrapper imports
``torch._dynamo`` the first time one of them is called (from ``__init__``, for every optimizer),
and that import costs each process about 1.7 s of CPU (sympy, torch.fx, DTensor and FSDP among
it): as much again as ``import torch``, in every rank of every run. Nothing can be compiling
before ``torch._dynamo`` has been imported, so until then :class:`OptimizerBase` calls the
wrapped methods themselves; once it is imported (a run that compiles, or a library that imported
it), the wrappers are called as usual. Same code either way, so the same numbers.
"""

import sys

import torch


def _method(name: str):
    """``torch.optim.Optimizer.<name>``, or the function it wraps while torch._dynamo is not
    imported."""
    wrapped = getattr(torch.optim.Optimizer, name)
    if "torch._dynamo" in sys.modules:
        return wrapped
    return getattr(wrapped, "__wrapped__", wrapped)


class OptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose wrapped methods leave ``torch._dynamo`` unimported."""

    def add_param_group(self, param_group: dict) -> None:
        _method("add_param_group")(self, param_group)

    def state_dict(self) -> dict:
        return _method("state_dict")(self)

    def load_state_dict(self, state_dict: dict) -> None:
        _method("load_state_dict")(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _method("zero_grad")(self, set_to_none)

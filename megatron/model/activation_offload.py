"""Activation CPU offload (``--cpu-offloading-num-layers N``): the tensors the first N
transformer layers save for backward wait in host memory between forward and backward.

:class:`HostActivationStash` is a pair of saved-tensor hooks: when autograd saves a tensor
inside the layer's forward, *pack* copies it to the host (into a pinned buffer on an
accelerator) and the device copy can be freed; when backward needs it, *unpack* copies it back.
The gradients are those of the plain run bit for bit (the values make a round trip unchanged).

A tensor already on the host (a CPU run) is kept as it is: there is no device memory to save,
which a note says at start-up. ``--cpu-offloading-retain-pinned-cpu-buffers`` keeps the pinned
host buffers for the next iteration instead of allocating new ones.
"""

from collections import defaultdict
from typing import Dict, List, Tuple

import torch


def _ALIGN_OFFSET(tensor: torch.Tensor) -> int:
    """Elements between the tensor's start and the last 64-byte boundary of its storage."""
    return tensor.storage_offset() % max(1, 64 // tensor.element_size())


def _like(tensor: torch.Tensor, device, pin: bool) -> torch.Tensor:
    """An empty tensor on ``device`` with ``tensor``'s shape, strides and start alignment: the
    kernels that read it back (vectorised sums) then round as they did on the original."""
    offset = _ALIGN_OFFSET(tensor)
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    if tensor.numel() == 0:
        span = 0
    flat = torch.empty(offset + span, dtype=tensor.dtype, device=device, pin_memory=pin)
    return flat.as_strided(tensor.shape, tensor.stride(), offset)


class HostActivationStash(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks moving what a forward saves to ``host`` and back.

    Args:
        host: the host device.
        retain_buffers: keep pinned buffers for reuse (``--cpu-offloading-retain-pinned-cpu-
            buffers``).
        copy_host_tensors: copy tensors that are already on the host too (for tests of the
            path on a machine without an accelerator; a run never needs it).
    """

    def __init__(self, host: str = "cpu", retain_buffers: bool = False,
                 copy_host_tensors: bool = False):
        self.host = torch.device(host)
        self.retain_buffers = retain_buffers
        self.copy_host_tensors = copy_host_tensors
        self.packed = 0  # tensors moved to the host
        self._pool: Dict[Tuple, List[torch.Tensor]] = defaultdict(list)
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def _key(tensor: torch.Tensor) -> Tuple:
        return (tuple(tensor.shape), tuple(tensor.stride()), _ALIGN_OFFSET(tensor), tensor.dtype)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        key = self._key(tensor)
        if self.retain_buffers and self._pool[key]:
            return self._pool[key].pop()
        return _like(tensor, self.host, pin=tensor.device.type == "cuda")

    def _pack(self, tensor: torch.Tensor):
        on_host = tensor.device == self.host
        expanded = any(s == 0 and n > 1 for n, s in zip(tensor.shape, tensor.stride()))
        if ((on_host and not self.copy_host_tensors) or tensor.layout != torch.strided
                or expanded):  # an expanded tensor is small and its copy would overlap
            return ("kept", tensor)
        buffer = self._buffer(tensor)
        buffer.copy_(tensor)
        self.packed += 1
        return (tensor.device, buffer)

    def _unpack(self, packed):
        where, value = packed
        if where == "kept":
            return value
        out = _like(value, where, pin=False)
        out.copy_(value, non_blocking=value.is_pinned())
        if self.retain_buffers:
            self._pool[self._key(value)].append(value)
        return out

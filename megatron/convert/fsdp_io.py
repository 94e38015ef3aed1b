"""Megatron-LM's ``fsdp_dtensor`` checkpoints (``--ckpt-format fsdp_dtensor``) as a source of
the canonical stream of :mod:`megatron.convert.schema`.

The folder is read with the restricted reader of
:mod:`megatron.checkpoint.fsdp_dtensor` (no pickled code runs). :class:`FsdpView` shows its
weights as a ``torch_dist`` reader would see them under per-layer keys: the ``model.module.``
prefix dropped and a SwiGLU fc1's halves ``weight_w`` / ``weight_v`` (and the bias's) joined
back into one tensor, so :func:`megatron.convert.dist_io.load_dist` streams it as it streams a
``torch_dist`` folder. The model comes from the ``args`` byte entry; the optimizer and RNG
states are not carried (the target starts a fresh optimizer), and a mixture of experts, which
the format does not hold, is refused.

A ``torch_dcp`` folder (``--ckpt-format torch_dcp``) is read the same way with its own prefix
``model.`` (its fc1 is stored whole, so nothing is joined).
"""

from typing import List, Optional, Sequence

import torch

from megatron.checkpoint import fsdp_dtensor
from megatron.checkpoint.dist.reader import DistCheckpointError, DistCheckpointReader
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError
from megatron.convert.schema import ConversionError

_HALVES = ("_w", "_v")


class FsdpView:
    """The model weights of an fsdp_dtensor (or, with ``prefix`` ``model.``, torch_dcp) folder
    under Megatron-Core's per-layer keys."""

    per_layer = True

    def __init__(self, reader: DistCheckpointReader, prefix: str = fsdp_dtensor.MODEL_PREFIX):
        self.reader = reader
        self.path = reader.path
        self.prefix = prefix
        stored = [k[len(prefix):] for k in reader.tensor_keys() if k.startswith(prefix)]
        joined = {k[:-2] for k in stored if k.endswith(_HALVES)
                  and k[:-2] + _HALVES[0] in stored and k[:-2] + _HALVES[1] in stored}
        self._split = joined
        self._keys = sorted(joined | {k for k in stored if k[:-2] not in joined})

    def tensor_keys(self) -> List[str]:
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def _stored(self, key: str) -> List[str]:
        if key not in self._keys:
            raise DistCheckpointError(f"{self.path}: no {self.prefix}{key!r}")
        halves = _HALVES if key in self._split else ("",)
        return [self.prefix + key + half for half in halves]

    def shape(self, key: str):
        shapes = [tuple(self.reader.shape(k)) for k in self._stored(key)]
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def read(self, key: str, offset: Optional[Sequence[int]] = None,
             size: Optional[Sequence[int]] = None) -> torch.Tensor:
        whole = torch.cat([self.reader.read(k) for k in self._stored(key)])
        if offset is None:
            return whole
        index = tuple(slice(o, o + z) for o, z in zip(offset, size or whole.shape))
        return whole[index].clone()

    def clear_cache(self) -> None:
        self.reader.clear_cache()


def open_fsdp(iter_dir: str, fmt: str = fsdp_dtensor.FORMAT):
    """The view of ``iter_dir`` (``fmt``: ``fsdp_dtensor`` or ``torch_dcp``) and its saved
    state as a ``common_state`` dict (``args``, ``iteration``, ``opt_param_scheduler``)."""
    try:
        reader = DistCheckpointReader(iter_dir)
        common = {"args": fsdp_dtensor.saved_args(iter_dir)}
        for key in ("iteration", "opt_param_scheduler"):
            common[key] = fsdp_dtensor.read_tree(reader, key)
    except (DistCheckpointError, UnsafeCheckpointError, OSError) as err:
        raise ConversionError(str(err)) from None
    if common["args"] is None:
        raise ConversionError(f"{iter_dir}: an {fmt} folder without its 'args' entry")
    if getattr(common["args"], "num_experts", None):
        raise ConversionError(f"{iter_dir}: a mixture of experts (--num-experts "
                              f"{common['args'].num_experts}); the {fmt} format does not "
                              "hold expert tensors, so it cannot be converted")
    prefix = "model." if fmt == "torch_dcp" else fsdp_dtensor.MODEL_PREFIX
    return FsdpView(reader, prefix), {k: v for k, v in common.items() if v is not None}

"""``--init-model-with-meta-device``: the model is built on the meta device, sharded by FSDP2,
and each rank materialises only its shards, with the weights an ordinary build gives.

:func:`build_on_meta` builds the model chunks with no memory behind their tensors and notes the
pieces they are built from (:mod:`megatron.core.meta_init`); after FSDP2 has sharded them,
:func:`materialise` allocates each rank's shards and fills them piece by piece: the model is
built again with one piece on the real device (from the RNG state of the first build), each rank
copies its rows of that piece's tensors into its shards, and the piece is dropped. Every
parameter and buffer must be filled exactly once, or it stops naming the tensor.
"""

import contextlib
from typing import Callable, Dict, List, Tuple

import torch

from megatron.core import device, meta_init
from megatron.core.distributed.torch_fsdp2 import PARAM_ATTRIBUTES, is_dtensor


def _rng_snapshot() -> dict:
    return {"cpu": torch.get_rng_state(), "accelerator": device.rng_state()}


@contextlib.contextmanager
def _rng_at(snapshot: dict):
    """Run the body from the RNG state ``snapshot``; restore the current state afterwards."""
    devices = [torch.cuda.current_device()] if device.is_cuda() else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(snapshot["cpu"])
        device.set_rng_state(snapshot["accelerator"])
        yield


def build_on_meta(build: Callable[[], List[torch.nn.Module]]) -> Tuple[list, List[str], dict]:
    """``build()``'s model chunks on the meta device, the pieces they were built from, and the
    RNG state the build started from."""
    snapshot = _rng_snapshot()
    with meta_init.building(real=None) as pieces:
        chunks = build()
    return chunks, list(pieces), snapshot


def _tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    found = dict(module.named_parameters())
    found.update(module.named_buffers())
    return found


def _copy_rows(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target`` (a DTensor shard, or a whole tensor) takes its part of the whole ``source``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        if not is_dtensor(target):
            target.copy_(source)
            return
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements)
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        target.to_local().copy_(source[box])


def _allocate(modules: List[torch.nn.Module]) -> None:
    """Give each rank's shards (and every buffer) memory on the run's device, keeping the
    parameters' tensor-parallel attributes."""
    for module in modules:
        kept = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)}
                for name, p in module.named_parameters()}
        module.to_empty(device=device.current_device())
        for name, param in module.named_parameters():
            for attr, value in kept.get(name, {}).items():
                setattr(param, attr, value)


def materialise(modules: List[torch.nn.Module], build: Callable[[], List[torch.nn.Module]],
                pieces: List[str], snapshot: dict) -> None:
    """Fill ``modules`` (the meta-built chunks, sharded by FSDP2) piece by piece; see the
    module's docstring."""
    _allocate(modules)
    filled = [set() for _ in modules]
    for piece in [meta_init.OUTSIDE] + pieces:
        with _rng_at(snapshot), meta_init.building(real=piece):
            built = build()
        for target, source, done in zip(modules, built, filled):
            targets = _tensors(target)
            for name, tensor in _tensors(source).items():
                if tensor.is_meta:
                    continue
                if name not in targets or name in done:
                    raise RuntimeError(f"--init-model-with-meta-device: {name} of piece {piece} "
                                       "has no single place in the sharded model")
                _copy_rows(tensor, targets[name])
                done.add(name)
        del built
    for target, done in zip(modules, filled):
        missing = sorted(set(_tensors(target)) - done)
        if missing:
            raise RuntimeError(f"--init-model-with-meta-device: {', '.join(missing[:5])} were "
                               "built outside the pieces the model is initialised from")

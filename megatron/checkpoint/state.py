"""What a checkpoint captures besides the model: the RNG states, and CPU copies to write later.

:func:`rng_state_snapshot` and :func:`set_rng_state_snapshot` take and restore every generator a
run draws from (Python, numpy, torch, the device and the tensor-parallel tracker);
:func:`copy_to_cpu` copies a checkpoint state so a background writer may save it while training
changes the originals. Both checkpoint formats use them.
"""

import argparse
import copy
import random
from typing import Dict, List, Optional

import numpy as np
import torch

from megatron.core import device
from megatron.model.module import flatten_state_dict


def rng_state_snapshot() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        # numpy's key array is stored as a tensor so the file loads with weights_only=True.
        "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state_snapshot(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state.get("cuda_rng_state"))
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def copy_to_cpu(obj, memo: Optional[dict] = None):
    """A deep copy of a checkpoint state with every tensor copied to CPU memory (a tensor that
    appears twice is copied once), so training may change the originals while it is written."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            copied = obj.detach().to("cpu", copy=True)
            if isinstance(obj, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
            memo[id(obj)] = copied
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # same type and attributes (a state dict's ``_metadata``)
        for key, value in obj.items():
            out[key] = copy_to_cpu(value, memo)
        return out
    if isinstance(obj, list):
        return [copy_to_cpu(v, memo) for v in obj]
    if type(obj) is tuple:  # noqa: E721 - named tuples are deep-copied below
        return tuple(copy_to_cpu(v, memo) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: copy_to_cpu(v, memo) for k, v in vars(obj).items()})
    return copy.deepcopy(obj)


def main_values_of(model_chunks, trees: List[dict]) -> Dict[int, torch.Tensor]:
    """--load-main-params-from-ckpt: each model parameter's tensor in the checkpoint's model
    ``trees`` (one per chunk, nested as saved), keyed by ``id(parameter)``, at the precision
    the checkpoint holds it."""
    values = {}
    for chunk, tree in zip(model_chunks, trees):
        params = flatten_state_dict(chunk.state_dict_for_save_checkpoint(keep_vars=True))
        saved = flatten_state_dict(tree)
        for name, param in params.items():
            if isinstance(param, torch.nn.Parameter) and isinstance(saved.get(name),
                                                                    torch.Tensor):
                values[id(param)] = saved[name]
    return values

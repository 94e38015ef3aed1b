"""Checkpoints from before MoE layers with linear biases carried a router bias.

With ``--add-bias-linear`` an MoE layer's router has a trained bias ``[num_experts]``
(``...mlp.router.bias``, Megatron-Core's ``decoder.layers.mlp.router.bias``). Checkpoints written
before that (by this project, or by Megatron-Core versions whose router had no bias) lack the key;
their router computed ``x W^T`` alone, which is ``x W^T + 0``. Loading one fills the bias with
zeros, so the loaded model computes exactly what the saved one did, and says so once, naming the
key. Every other missing tensor still stops the load.
"""

from typing import List

import torch
import torch.distributed as dist

ROUTER_BIAS = "mlp.router.bias"


def is_router_bias(name: str) -> bool:
    """Whether the dotted (or checkpoint) name ``name`` is an MoE router's bias."""
    return name == ROUTER_BIAS or name.endswith("." + ROUTER_BIAS)


def note_zero_router_bias(where: str, names: List[str]) -> None:
    """The one note of a load that filled router biases with zeros (rank 0 only)."""
    if not names or (dist.is_initialized() and dist.get_rank() != 0):
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    print(f"NOTE: {where}: no {shown} in the checkpoint (saved before MoE layers with "
          "--add-bias-linear carried a router bias); filled with zeros, which is what the "
          "router computed then", flush=True)


def fill_zero_router_bias(template: dict, tree: dict, prefix: str = "") -> List[str]:
    """Put zeros in ``tree`` (a saved model state, nested like ``template``, the model's own)
    for every router bias of ``template`` that ``tree`` lacks; returns their dotted names."""
    filled = []
    for key, value in template.items():
        if isinstance(value, dict):
            child = tree.get(key)
            if isinstance(child, dict):
                filled += fill_zero_router_bias(value, child, f"{prefix}{key}.")
        elif (isinstance(value, torch.Tensor) and key not in tree
              and is_router_bias(prefix + key)):
            tree[key] = torch.zeros(value.shape, dtype=value.dtype)
            filled.append(prefix + key)
    return filled


def optimizer_refusal(where: str, names: List[str]) -> str:
    """Why a filled router bias stops an optimizer-state load: the state has no entry for it."""
    return (f"{where}: its optimizer state has no entry for {names[0]} (the checkpoint predates "
            "the router bias); pass --no-load-optim (fresh optimizer state) or --finetune")


_NOTED = set()


def note_zero_router_bias_once(where: str, key: str) -> None:
    """The converter's note: once per checkpoint (``where``), naming the first absent key."""
    if where not in _NOTED:
        _NOTED.add(where)
        note_zero_router_bias(where, [key])

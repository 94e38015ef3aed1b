"""Muon's optimizer state (``--optimizer muon`` / ``dist_muon``, and the AdamW part and main
copies of ``soap`` / ``adaptive_muon``, whose matrix state :mod:`megatron.checkpoint.
emerging_state` lays out) in ``torch_dist`` checkpoints.

Keys follow Megatron-Core's non-distributed optimizer layout with its chained optimizers'
prefix avoided (``chained_optim_avoid_prefix``, recorded in the content metadata):
``optimizer.state.momentum_buffer.<model key>`` for a weight Muon updates,
``optimizer.state.exp_avg.<key>`` / ``exp_avg_sq.<key>`` for one its AdamW part updates, and
``optimizer.state.fp32_param.<key>`` for a half-precision model's main copy. Each tensor is
per element, so it is split and placed exactly like its parameter: a checkpoint saved at one
(TP, PP, DP) layout loads at any other. AdamW's step count travels as ``common_step``.

Which parameter a state belongs to is found by identity (the optimizer's parameter, or the
model parameter behind a main copy, shares storage with the tensor in the model's state tree),
not by counting positions, since Muon splits each of Megatron's groups in two.
"""

from typing import Dict, List, Tuple

import torch

from megatron.checkpoint.dist.keys import OPTIMIZER_STATE_PREFIX
from megatron.checkpoint.names import dotted_names, lookup_dotted

MUON_FIELDS = ("momentum_buffer",)
ADAM_FIELDS = ("exp_avg", "exp_avg_sq")
Member = Tuple[int, str, Tuple[int, ...]]


def is_muon(optimizer) -> bool:
    """Whether ``optimizer`` (a Megatron optimizer wrapper) runs Muon."""
    return any(group.get("use_muon") for group in optimizer.param_groups)


def _model_param_of(optimizer) -> Dict[int, torch.Tensor]:
    """``id(main copy) -> model parameter`` of a half-precision wrapper (empty for fp32)."""
    out = {}
    for models, mains in zip(getattr(optimizer, "float16_groups", []),
                             getattr(optimizer, "fp32_from_float16_groups", [])):
        out.update({id(main): model for model, main in zip(models, mains)})
    return out


def param_members(optimizer, trees: List[dict]) -> List[List[Member]]:
    """``(chunk, dotted name, shape)`` of every parameter of each of ``optimizer``'s groups,
    in the groups' order."""
    where = {}
    for chunk, tree in enumerate(trees):
        for name in dotted_names(tree):
            tensor = lookup_dotted(tree, name)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                where[(tensor.data_ptr(), tuple(tensor.shape))] = (chunk, name,
                                                                   tuple(tensor.shape))
    behind = _model_param_of(optimizer)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            model = behind.get(id(p), p)
            found = where.get((model.data_ptr(), tuple(model.shape)))
            if found is None:
                raise ValueError(f"param group {g}: a parameter of shape {tuple(p.shape)} is "
                                 "not in the model's state")
            row.append(found)
        groups.append(row)
    return groups


def fields_of(group: dict) -> Tuple[str, ...]:
    return MUON_FIELDS if group.get("use_muon") else ADAM_FIELDS


def saved_entries(optimizer, trees: List[dict]):
    """(``{(chunk, name): {field: tensor}}``, AdamW's step) of the state dict, which a
    ``dist_muon`` optimizer gathers whole (a collective: call it on every rank)."""
    from megatron.checkpoint import emerging_state

    state_dict = optimizer.state_dict()
    inner = state_dict.get("optimizer", state_dict)
    members = param_members(optimizer, trees)
    matrices = (emerging_state.matrices(optimizer, members)
                if emerging_state.is_emerging(optimizer) else {})
    entries, step = {}, 0
    for group, saved_group, row in zip(optimizer.param_groups, inner["param_groups"], members):
        for index, (chunk, name, shape) in zip(saved_group["params"], row):
            state = inner["state"].get(index) or {}
            # A parameter that has not stepped yet: zeros, its state's starting value.
            matrix = matrices.get((chunk, name))
            if matrix is not None:
                kinds = emerging_state.field_kinds(optimizer, matrix)
                zeros = emerging_state.zero_fields(kinds, matrix)
                entries[(chunk, name)] = {f: state.get(f, zeros[f]) for f in kinds}
            else:
                entries[(chunk, name)] = {f: state[f] if f in state else torch.zeros(shape)
                                          for f in fields_of(group)}
            if "step" in state:
                step = max(step, int(float(state["step"])))
    return entries, step, state_dict


def main_members(optimizer, trees: List[dict]) -> List[List[Tuple[int, str]]]:
    """``(chunk, name)`` of each group's fp32 main copies, in the wrapper's order
    (``fp32_from_fp16_params``); empty rows for an fp32 model."""
    behind = _model_param_of(optimizer)
    return [[(chunk, name) for p, (chunk, name, _) in zip(group["params"], row)
             if id(p) in behind]
            for group, row in zip(optimizer.param_groups, param_members(optimizer, trees))]


def main_copies(optimizer, trees: List[dict]) -> Dict[Tuple[int, str], torch.Tensor]:
    """The fp32 main copy of every half-precision parameter, by ``(chunk, name)``."""
    out = {}
    for mains, row in zip(getattr(optimizer, "fp32_from_float16_groups", []),
                          main_members(optimizer, trees)):
        out.update(zip(row, mains))
    return out


def load_inner_state(optimizer, trees, read, step: int, hparams: List[dict],
                     read_matrix=None) -> dict:
    """The torch state dict of ``optimizer``'s inner Muon, every tensor read by
    ``read(chunk, name, prefix)`` (the parameter's local piece, any saved layout);
    ``read_matrix(chunk, name)``, when given, reads a matrix weight's whole state (SOAP's,
    adaptive Muon's: :mod:`megatron.checkpoint.emerging_state`), None for none."""
    state, param_groups, index = {}, [], 0
    for group, row, extra in zip(optimizer.param_groups, param_members(optimizer, trees),
                                 hparams):
        ids = []
        for chunk, name, _ in row:
            if group.get("use_muon") and read_matrix is not None:
                entry = read_matrix(chunk, name)
            else:
                entry = {f: read(chunk, name, f"{OPTIMIZER_STATE_PREFIX}{f}.")
                         for f in fields_of(group)}
            if not group.get("use_muon"):
                entry["step"] = torch.tensor(float(step))
            if entry is not None:
                state[index] = entry
            ids.append(index)
            index += 1
        param_groups.append(dict(extra, params=ids))
    return {"state": state, "param_groups": param_groups}

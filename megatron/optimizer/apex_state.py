"""Optimizer state saved by Megatron-LM runs on apex's ``FusedAdam``, in torch's AdamW layout.

apex's ``FusedAdam`` (``adam_w_mode=True``, Megatron's default) computes AdamW's update but keeps
a different ``state_dict``: each param group holds an integer ``step`` and ``bias_correction``
(and Megatron's ``lr_mult`` / ``wd_mult``), and has none of torch's ``amsgrad``, ``maximize``,
``foreach``, ``capturable``, ``differentiable``, ``fused``; the per-parameter state holds only
``exp_avg`` and ``exp_avg_sq``, no ``step`` (FORMATS.md section 6a). :func:`to_torch_adam`
rewrites such a state so that ``torch.optim.AdamW`` and this project's ``FusedAdamW`` load it:
the group's step count moves into every parameter's state, torch's flags take this run's
values, and the moments are kept bit for bit.
"""

from typing import Dict, List, Sequence

import torch

# Keys of apex's param groups that torch's AdamW has no use for.
_APEX_ONLY_KEYS = ("bias_correction",)


def is_apex_adam_state(state_dict: dict) -> bool:
    """Whether ``state_dict`` (a torch optimizer's) is in apex FusedAdam's layout."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not groups:
        return False
    if any("bias_correction" in g for g in groups):
        return True
    per_param = state_dict.get("state") or {}
    return (any("step" in g for g in groups) and "amsgrad" not in groups[0]
            and all("step" not in s for s in per_param.values()))


def to_torch_adam(state_dict: dict, current_groups: Sequence[dict], where: str) -> dict:
    """apex FusedAdam's ``state_dict`` in torch AdamW's layout, for ``current_groups``.

    Args:
        state_dict: ``{"state": {index: {"exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``.
        current_groups: the loading optimizer's param groups; they supply torch's own group
            flags (``amsgrad``, ``maximize``, ...) and the parameters whose shapes are checked.
        where: how errors name the checkpoint.

    Raises:
        ValueError: a layout that cannot be this model's (group or parameter counts, shapes),
            or ``bias_correction`` off (apex's Adam without bias correction is another rule).
    """
    groups = state_dict["param_groups"]
    if len(groups) != len(current_groups):
        raise ValueError(f"{where}: the optimizer state has {len(groups)} param groups, this "
                         f"model's optimizer {len(current_groups)}")
    saved_state: Dict = state_dict.get("state", {})
    new_groups: List[dict] = []
    new_state: Dict = {}
    for g, (saved, current) in enumerate(zip(groups, current_groups)):
        if not saved.get("bias_correction", True):
            raise ValueError(f"{where}: param group {g} was stepped by apex FusedAdam with "
                             "bias_correction=False, which this project's Adam does not compute")
        if len(saved["params"]) != len(current["params"]):
            raise ValueError(f"{where}: param group {g} holds {len(saved['params'])} parameters, "
                             f"this model's {len(current['params'])}")
        group = {k: v for k, v in current.items() if k not in ("params", "model_params")}
        group.update({k: v for k, v in saved.items() if k not in _APEX_ONLY_KEYS})
        step = float(saved.get("step", 0))
        group.pop("step", None)
        new_groups.append(group)
        for index, param in zip(saved["params"], current["params"]):
            entry = saved_state.get(index)
            if entry is None:
                continue
            for name in ("exp_avg", "exp_avg_sq"):
                if name not in entry:
                    raise ValueError(f"{where}: optimizer state of parameter {index} has no "
                                     f"{name} (found {sorted(entry)})")
                if tuple(entry[name].shape) != tuple(param.shape):
                    raise ValueError(f"{where}: optimizer state of parameter {index} (group "
                                     f"{g}) has {name} of shape {tuple(entry[name].shape)}, "
                                     f"this model's parameter is {tuple(param.shape)}")
            new_state[index] = {"step": torch.tensor(step, dtype=torch.float32),
                                "exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
    return {"state": new_state, "param_groups": new_groups}

"""Adam state through a conversion: the moments are resharded exactly like the parameters.

Adam's ``exp_avg`` and ``exp_avg_sq`` (and the fp32 main copy of a half-precision parameter)
are per element, so a tensor-parallel or pipeline split that moves a parameter's elements moves
its moments the same way. The loader reads them as *views* of the source: a model tree of the
same keys and shapes whose tensors are one optimizer field (:func:`view_tree`), and streams each
view with the same code that streams the weights; the saver writes each view's stream into the
target's optimizer state instead of its model (:func:`target_skeleton`, :func:`target_index`).

Where a parameter's state sits: a torch optimizer numbers parameters group by group, in the order
of its param groups; Megatron's groups are weight-decayed parameters, then biases and 1-D
parameters (``wd_mult`` 0), each in the model's parameter order, which is the order of the saved
model tree's keys. Saved groups carry ``wd_mult`` / ``lr_mult``, so either group order is read.
Source layouts read: torch's AdamW (this project), apex FusedAdam (Megatron-LM), either inside
the fp16/bf16 wrapper (``optimizer`` + ``fp32_from_fp16_params``), the distributed optimizer's
``distrib_optim.pt`` beside the file (Megatron-LM, and this project since it writes that layout)
and this project's earlier distributed layout (``param_state`` inside the file). The target is
written in the non-distributed layout, which every optimizer here (distributed or not) and
Megatron-LM's load.
"""

from typing import Dict, List, Optional, Tuple

import torch

from megatron.checkpoint import distrib_optim_file
from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.names import dotted_names, lookup_dotted

MOMENTS = ("exp_avg", "exp_avg_sq")
# The per-element state each optimizer keeps, by --optimizer (Lion keeps Adam's first moment).
STATE_FIELDS = {"adam": MOMENTS, "lion": ("exp_avg",)}
MAIN = "main"          # view: the fp32 main copy of each parameter
# Set by a reader on a Megatron-Core model's torch-format state whose Adam state it cannot map.
MCORE_ORDER_KEY = "mcore_parameter_order"
GroupKey = Tuple[float, float]
# Megatron's order of its param groups, by (wd_mult, lr_mult): decayed first.
GROUP_ORDER: Tuple[GroupKey, ...] = ((1.0, 1.0), (0.0, 1.0))
# Keys of a torch AdamW group besides the hyper-parameters a source carries.
_TORCH_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False}


def group_key(name: str, shape) -> GroupKey:
    """The (wd_mult, lr_mult) group of parameter ``name``: no weight decay for biases and 1-D
    parameters (norm weights), Megatron's rule."""
    no_wd = name.endswith(".bias") or len(shape) == 1
    return (0.0 if no_wd else 1.0, 1.0)


# Model state entries that are buffers, not parameters: the optimizer holds nothing for them.
BUFFER_SUFFIXES = (".expert_bias", ".qb_beta")


def is_buffer_name(name: str) -> bool:
    """Whether the dotted state name ``name`` is a buffer (a router's expert or quantile
    bias)."""
    return name.endswith(BUFFER_SUFFIXES)


def param_order(chunk_trees: List[dict]) -> List[Tuple[int, str, Tuple[int, ...]]]:
    """``(chunk, dotted name, shape)`` of every parameter of one rank, in the model's order."""
    out = []
    for chunk, tree in enumerate(chunk_trees):
        for name in dotted_names(tree):
            tensor = lookup_dotted(tree, name)
            if isinstance(tensor, torch.Tensor) and not is_buffer_name(name):
                out.append((chunk, name, tuple(tensor.shape)))
    return out


def _grouped(order, keys: List[GroupKey]) -> List[list]:
    return [[entry for entry in order if group_key(entry[1], entry[2]) == key] for key in keys]


def group_signature(group: dict) -> tuple:
    """What tells one param group of a run from another: ``wd_mult``, ``lr_mult``, whether it
    follows ``--decoupled-lr`` and the muP factors of its lr and eps (``mup_lr_factor``,
    ``mup_eps_factor``). A field a group does not record has its default, so the groups of a
    checkpoint that records only ``wd_mult`` / ``lr_mult`` match the plain groups of a run."""
    return (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)),
            bool(group.get("is_decoupled_lr", False)),
            float(group.get("mup_lr_factor", 1.0)), float(group.get("mup_eps_factor", 1.0)))


def members_by_identity(param_groups: List[list], chunk_trees: List[dict]) -> Optional[List[list]]:
    """``(chunk, dotted name, shape)`` of each parameter of ``param_groups`` (lists of the
    model's own parameter tensors, in the optimizer's order), found by the storage the saved
    model tree shares with it; None where a parameter is not found or two names share it (the
    caller then groups by Megatron's rule, :func:`group_key`)."""
    where: Dict[tuple, Optional[tuple]] = {}
    for chunk, name, shape in param_order(chunk_trees):
        tensor = lookup_dotted(chunk_trees[chunk], name)
        key = (tensor.data_ptr(), shape, str(tensor.dtype))
        where[key] = None if key in where else (chunk, name, shape)
    out = []
    for params in param_groups:
        row = []
        for param in params:
            found = where.get((param.data_ptr(), tuple(param.shape), str(param.dtype)))
            if found is None:
                return None
            row.append(found)
        out.append(row)
    return out


def megatron_core_group(group: dict, args) -> dict:
    """``group`` (a param group's hyper-parameters) completed with the fields Megatron-Core
    matches groups by when it loads a torch_dist checkpoint (``wd_mult``, ``lr_mult``,
    ``is_expert_parallel``, ``is_decoupled_lr``) and its schedule's bounds (``max_lr``,
    ``min_lr``), from the run's ``args`` where the group does not say."""
    decoupled = bool(group.get("is_decoupled_lr", False))
    group.setdefault("is_expert_parallel", False)
    group.setdefault("is_decoupled_lr", decoupled)
    max_lr = getattr(args, "lr", None)
    min_lr = getattr(args, "min_lr", None)
    if decoupled:
        max_lr = getattr(args, "decoupled_lr", None) or max_lr
        if getattr(args, "decoupled_min_lr", None) is not None:
            min_lr = args.decoupled_min_lr
    if max_lr is not None:
        group.setdefault("max_lr", max_lr)
    if min_lr is not None:
        group.setdefault("min_lr", min_lr)
    return group


class SourceOptimizer:
    """One source rank file's optimizer state, per parameter: ``entries[(chunk, name)]`` =
    ``{"exp_avg": t, "exp_avg_sq": t, "main": t?}``; ``step``; ``hparams[group key]``."""

    def __init__(self, entries: Dict, step: int, hparams: Dict[GroupKey, dict],
                 grad_scaler: Optional[dict]):
        self.entries, self.step, self.hparams, self.grad_scaler = entries, step, hparams, \
            grad_scaler

    @property
    def has_main(self) -> bool:
        return any(MAIN in e for e in self.entries.values())

    @classmethod
    def read(cls, state: dict, chunk_trees: List[dict], model_file: str = "",
             members: Optional[List[list]] = None) -> Tuple[Optional["SourceOptimizer"], str]:
        """The state of ``state["optimizer"]`` (and of the ``distrib_optim.pt`` beside
        ``model_file``), or ``(None, why it cannot be carried)``. ``members``: the
        ``(chunk, name, shape)`` of each group's parameters where the caller knows them (a run
        saving its own optimizer, :func:`members_by_identity`); the groups are then keyed by
        :func:`group_signature` and may scale their learning rates. Else each group holds the
        parameters of its kind by Megatron's rule, in model order."""
        if state.get(MCORE_ORDER_KEY):
            return None, ("its Adam state lists a Megatron-Core model's parameters in "
                          "Megatron-Core's module order, which is not mapped")
        opt = state.get("optimizer")
        if isinstance(opt, list) and len(opt) == 1:
            opt = opt[0]
        if not isinstance(opt, dict):
            return None, "the source has no optimizer state"
        if distrib_optim_file.is_megatron_layout(opt):
            try:
                opt = _inline_distrib_optim(opt, state, chunk_trees, model_file)
            except CheckpointError as err:
                return None, str(err)
        grad_scaler = opt.get("grad_scaler")
        if "param_state" in opt:
            groups = opt.get("optimizer", {}).get("param_groups")
            per_group = opt["param_state"]
            if groups is None or per_group is None:
                return None, "the distributed optimizer state is incomplete"
            values = [[dict(e) for e in group] for group in per_group]
            for group in values:
                for e in group:
                    e[MAIN] = e.pop("param")
            steps = [int(g.get("step", 0)) for g in groups]
        else:
            inner = opt.get("optimizer", opt) if "state" not in opt else opt
            mains = opt.get("fp32_from_fp16_params")
            groups = inner.get("param_groups") if isinstance(inner, dict) else None
            if groups is None:
                return None, "the optimizer state has no param groups"
            values, steps = [], []
            for g, group in enumerate(groups):
                row = []
                for j, index in enumerate(group["params"]):
                    entry = dict(inner.get("state", {}).get(index, {}))
                    if "step" in entry:
                        steps.append(int(float(entry.pop("step"))))
                    if mains is not None:
                        entry[MAIN] = mains[g][j]
                    row.append(entry)
                values.append(row)
                if "step" in group:
                    steps.append(int(group["step"]))
        if any(group.get("use_muon") for group in groups):
            return None, "the optimizer state is Muon's (--optimizer muon), not Adam's"
        keys = []
        for g, group in enumerate(groups):
            if members is not None:
                keys.append(group_signature(group))
                continue
            if "wd_mult" not in group:
                return None, "its param groups do not record wd_mult"
            key = (float(group["wd_mult"]), float(group.get("lr_mult", 1.0)))
            if key[1] != 1.0:
                return None, f"param group {g} scales its learning rate (lr_mult {key[1]})"
            keys.append(key)
        if members is not None and len(set(keys)) != len(keys):
            return None, "two of its param groups have the same hyper-parameter multipliers"
        order = members if members is not None else _grouped(param_order(chunk_trees), keys)
        entries = {}
        for g, (params, row) in enumerate(zip(order, values)):
            if len(params) != len(row):
                return None, (f"param group {g} holds {len(row)} parameters where the model "
                              f"has {len(params)} of its kind")
            for (chunk, name, shape), entry in zip(params, row):
                for field, tensor in entry.items():
                    if field in MOMENTS + (MAIN,) and tuple(tensor.shape) != shape:
                        return None, (f"the state of {name} has {field} of shape "
                                      f"{tuple(tensor.shape)}, the parameter {shape}")
                entries[(chunk, name)] = {k: v for k, v in entry.items()
                                          if k in MOMENTS + (MAIN,)}
        hparams = {key: {k: v for k, v in group.items()
                         if k not in ("params", "step", "bias_correction")}
                   for key, group in zip(keys, groups)}
        return cls(entries, max(steps, default=0), hparams, grad_scaler), ""


def _inline_distrib_optim(opt: dict, state: dict, chunk_trees: List[dict],
                          model_file: str) -> dict:
    """``opt`` (Megatron-LM's distributed optimizer entry) with ``param_state`` read from the
    ``distrib_optim.pt`` beside ``model_file``, grouped like the saved param groups."""
    if not model_file:
        raise CheckpointError(f"the optimizer state lies in a {distrib_optim_file.FILE_NAME} "
                              "beside the file, which this reader was not given")
    order = [(c, n, s) for c, n, s in param_order(chunk_trees) if not n.endswith("_extra_state")]
    dtypes = [lookup_dotted(chunk_trees[c], n).dtype for c, n, _ in order]
    values = distrib_optim_file.tree_param_state(model_file, order, dtypes,
                                                 state.get("args"))
    by_entry = {(c, n): v for (c, n, _), v in zip(order, values)}
    groups = opt["optimizer"]["param_groups"]
    keys = [(float(g.get("wd_mult", 1.0)), float(g.get("lr_mult", 1.0))) for g in groups]
    per_group = [[by_entry[(c, n)] for c, n, _ in members]
                 for members in _grouped(order, keys)]
    return {**opt, "param_state": per_group}


def view_tree(tree, chunk: int, entries: Dict, field: str, fallback=None, prefix: str = ""):
    """``tree`` (one chunk's model tree) with every tensor replaced by its ``field`` of the
    optimizer state: zeros where a parameter has none, or the parameter itself for ``main``
    when the source has no main copies (an fp32 model is its own main copy)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = view_tree(value, chunk, entries, field, fallback, name + ".")
        elif isinstance(value, torch.Tensor):
            found = entries.get((chunk, name), {}).get(field)
            if found is None:
                found = value.float() if field == MAIN else torch.zeros(value.shape)
            out[key] = found
        else:
            out[key] = value
    return out


def target_index(model_tree: dict) -> Tuple[Dict[str, int], List[Tuple[GroupKey, List[int]]]]:
    """``{dotted name: optimizer index}`` of a target rank and its groups in Megatron's order."""
    order = param_order([model_tree])
    index, groups, next_index = {}, [], 0
    for key in GROUP_ORDER:
        members = [name for _, name, shape in order if group_key(name, shape) == key]
        if not members:
            continue
        ids = list(range(next_index, next_index + len(members)))
        next_index += len(members)
        index.update(zip(members, ids))
        groups.append((key, ids))
    return index, groups


def target_skeleton(model_tree: dict, info: dict, half: bool) -> dict:
    """The target rank's ``optimizer`` entry with empty (to be filled) fp32 tensors.

    ``info`` is ``ModelMeta.optimizer``: ``step``, ``hparams`` by group key, ``grad_scaler``.
    """
    index, groups = target_index(model_tree)
    shapes = {name: shape for _, name, shape in param_order([model_tree])}
    state = {}
    for name, i in index.items():
        state[i] = {"step": torch.tensor(float(info["step"]), dtype=torch.float32)}
        for field in MOMENTS:
            state[i][field] = torch.empty(shapes[name], dtype=torch.float32)
    param_groups = []
    for key, ids in groups:
        hparams = dict(_TORCH_GROUP_DEFAULTS)
        hparams.update(info["hparams"].get(key) or next(iter(info["hparams"].values())))
        hparams.update(wd_mult=key[0], lr_mult=key[1], params=ids)
        param_groups.append(hparams)
    inner = {"state": state, "param_groups": param_groups}
    if not half:
        return inner
    mains = [[torch.empty(shapes[name], dtype=torch.float32)
              for name in sorted(index, key=index.get) if index[name] in ids]
             for _, ids in groups]
    out = {"optimizer": inner, "fp32_from_fp16_params": mains}
    if info.get("grad_scaler") is not None:
        out["grad_scaler"] = info["grad_scaler"]
    return out


def target_keys(model_tree: dict, field: str, half: bool, dotted: str) -> tuple:
    """Where ``field`` of parameter ``dotted`` sits in a target file (keys from the top)."""
    index, groups = target_index(model_tree)
    i = index[dotted]
    inner = ("optimizer", "optimizer") if half else ("optimizer",)
    if field in MOMENTS:
        return inner + ("state", i, field)
    for g, (_, ids) in enumerate(groups):
        if i in ids:
            return ("optimizer", "fp32_from_fp16_params", g, ids.index(i))
    raise KeyError(dotted)

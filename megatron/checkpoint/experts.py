"""Load a torch-format checkpoint saved at another expert-parallel size (``--ckpt-format torch``).

Megatron-LM's legacy layout at EP > 1 (:func:`megatron.checkpoint.load.rank_dir_name`): the file
of tensor rank t, stage p and expert rank e, ``mp_rank_{t:02d}[_{p:03d}]_{e:03d}``, holds the
dense parameters (the same on every expert rank) and the E / EP experts ``e * E / EP ...`` under
local numbers ``mlp.experts.local_experts.<i>``. A rank of a run at another EP needs the dense
state of any one file of its (t, p) and each of its experts from the file that holds it; this
module reads those files and assembles the state the rank would have saved itself:

* model: the keys and order of the rank's own model, expert ``i`` taken from global expert
  ``ep_rank * E / ep + i`` of the saved files;
* optimizer: each parameter's state (Adam's moments and step, and the fp32 main copy of a
  half-precision run) moved with it. A torch optimizer numbers parameters group by group, each
  group in the model's parameter order (the order of the saved model tree; groups by
  ``wd_mult`` / ``lr_mult`` as :mod:`megatron.checkpoint.optimizer_state` reads them); the
  distributed optimizer's files (``param_state``, unsharded, in the same order) give a
  distributed optimizer's state;
* the rest (``args``, scheduler, RNG states, iteration) from the first file read: every
  expert rank saved the same scheduler and the RNG states of every data-parallel rank.

Anything missing is a :class:`~megatron.checkpoint.load.CheckpointError` naming the file.
"""

import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.checkpoint.layout import CheckpointError, expert_ranks, load_state_file, rank_file_in

_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)(\.|$)")


def _leaves(tree, prefix: Tuple = ()) -> Dict[str, Tuple[tuple, object]]:
    """``{dotted name: (key path, value)}`` of every leaf of a nested dict, in order."""
    out = {}
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            out.update(_leaves(value, path))
        else:
            out[".".join(str(k) for k in path)] = (path, value)
    return out


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def local_expert(name: str) -> Optional[int]:
    """The local expert number in a parameter's dotted name; None for a dense parameter."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(2))


def renumber(name: str, number: int) -> str:
    """``name`` with its local expert number replaced by ``number``."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}local_experts.{number}{m.group(3)}", name, 1)


class _SavedFiles:
    """The saved files of one (tp, pp), read on first use."""

    def __init__(self, iter_dir: str, pstate, saved_ep: int):
        self.iter_dir, self.pstate, self.saved_ep = iter_dir, pstate, saved_ep
        self._states: Dict[int, dict] = {}

    def path(self, ep_rank: int) -> str:
        return rank_file_in(self.iter_dir, self.pstate.tp_rank,
                                           self.pstate.pp_rank, self.pstate.pp_size, ep_rank,
                                           self.saved_ep)

    def state(self, ep_rank: int) -> dict:
        if ep_rank not in self._states:
            self._states[ep_rank] = load_state_file(self.path(ep_rank))
        return self._states[ep_rank]


def _model_keys(num_chunks: int) -> List[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


class _ExpertMap:
    """Which saved file and name hold each parameter of this rank."""

    def __init__(self, num_experts: int, saved_ep: int, ep_rank: int, ep_size: int):
        self.saved_local = num_experts // saved_ep
        self.first = ep_rank * (num_experts // ep_size)
        self.base = self.first // self.saved_local   # the saved rank the dense state comes from

    def source(self, name: str) -> Tuple[int, str, Optional[int]]:
        """``(saved ep rank, saved name, global expert or None)`` of parameter ``name``."""
        i = local_expert(name)
        if i is None:
            return self.base, name, None
        expert = self.first + i
        return expert // self.saved_local, renumber(name, expert % self.saved_local), expert


def _model_trees(files: _SavedFiles, experts: _ExpertMap, targets: List[dict]) -> List[dict]:
    """This rank's model trees (the keys and order of ``targets``) from the saved files."""
    out = []
    for key, target in zip(_model_keys(len(targets)), targets):
        tree: dict = {}
        saved_leaves: Dict[int, dict] = {}
        for name, (path, _) in _leaves(target).items():
            rank, saved_name, expert = experts.source(name)
            if rank not in saved_leaves:
                saved_tree = files.state(rank).get(key)
                if not isinstance(saved_tree, dict):
                    raise CheckpointError(f"{files.path(rank)}: no model state {key!r}")
                saved_leaves[rank] = _leaves(saved_tree)
            found = saved_leaves[rank].get(saved_name)
            if found is None:
                what = "" if expert is None else f" (global expert {expert})"
                raise CheckpointError(f"{files.path(rank)}: missing {key}.{saved_name}{what}")
            _set(tree, path, found[1])
        out.append(tree)
    return out


def _group_key(group: dict, path: str, g: int) -> Tuple[float, float]:
    if "wd_mult" not in group:
        raise CheckpointError(f"{path}: optimizer param group {g} records no wd_mult; it cannot "
                              "be moved to another --expert-model-parallel-size")
    return float(group["wd_mult"]), float(group.get("lr_mult", 1.0))


def _movable_group_keys(groups: List[dict], path: str) -> List[Tuple[float, float]]:
    """Each param group's key; a group that scales its learning rate cannot be re-dealt."""
    keys = [_group_key(group, path, g) for g, group in enumerate(groups)]
    for g, key in enumerate(keys):
        if key[1] != 1.0:
            raise CheckpointError(f"{path}: optimizer param group {g} scales its learning rate "
                                  f"(lr_mult {key[1]}); it cannot be moved to another "
                                  "--expert-model-parallel-size")
    return keys


def _grouped_names(trees: List[dict], keys: List[Tuple[float, float]]) -> List[List[Tuple]]:
    """Each group's ``(chunk, name)`` of parameters, in the model's order."""
    from megatron.checkpoint.optimizer_state import group_key, is_buffer_name

    order = [(c, name, value) for c, tree in enumerate(trees)
             for name, (_, value) in _leaves(tree).items()
             if isinstance(value, torch.Tensor) and not is_buffer_name(name)]
    return [[(c, name) for c, name, value in order
             if group_key(name, tuple(value.shape)) == key] for key in keys]


def _per_parameter(optimizer: dict, trees: List[dict], path: str) -> Tuple[dict, list, dict]:
    """``({(chunk, name): (state entry, fp32 main or None)}, groups, inner)`` of one file."""
    inner = optimizer.get("optimizer", optimizer) if "state" not in optimizer else optimizer
    if "param_state" in optimizer or not isinstance(inner, dict) or "param_groups" not in inner:
        raise CheckpointError(f"{path}: the optimizer state is not in the torch layout (a "
                              "distributed optimizer's?); it cannot be moved to another "
                              "--expert-model-parallel-size (pass --no-load-optim)")
    groups = inner["param_groups"]
    mains = optimizer.get("fp32_from_fp16_params") if inner is not optimizer else None
    keys = _movable_group_keys(groups, path)
    entries = {}
    for g, (group, names) in enumerate(zip(groups, _grouped_names(trees, keys))):
        if len(names) != len(group["params"]):
            raise CheckpointError(f"{path}: optimizer param group {g} holds "
                                  f"{len(group['params'])} parameters where the model has "
                                  f"{len(names)} of its kind")
        for j, (name, index) in enumerate(zip(names, group["params"])):
            main = mains[g][j] if mains is not None else None
            entries[name] = (inner.get("state", {}).get(index), main)
    return entries, keys, inner


def _distributed_per_parameter(optimizer: dict, trees: List[dict], path: str
                               ) -> Tuple[dict, list]:
    """``({(chunk, name): param_state entry}, group keys)`` of a distributed optimizer's file
    (``{"optimizer": {"param_groups"}, "param_state": [[entry, ...], ...]}``, unsharded)."""
    groups = optimizer.get("optimizer", {}).get("param_groups")
    param_state = optimizer.get("param_state")
    if not isinstance(groups, list) or not isinstance(param_state, list) or \
            len(groups) != len(param_state):
        raise CheckpointError(f"{path}: the distributed optimizer's state has no param groups "
                              "matching its param_state")
    keys = _movable_group_keys(groups, path)
    entries = {}
    for g, (row, names) in enumerate(zip(param_state, _grouped_names(trees, keys))):
        if len(names) != len(row):
            raise CheckpointError(f"{path}: optimizer param group {g} holds {len(row)} "
                                  f"parameters where the model has {len(names)} of its kind")
        entries.update(zip(names, row))
    return entries, keys


def _distributed_optimizer(files: _SavedFiles, experts: _ExpertMap,
                           saved_trees: Dict[int, List[dict]], targets: List[dict]) -> dict:
    """This rank's distributed-optimizer state (unsharded, per parameter in group order, the
    layout its ``load_state_dict`` cuts its pieces from) from the saved files'."""
    per_rank = {rank: _distributed_per_parameter(files.state(rank)["optimizer"], trees,
                                                 files.path(rank))
                for rank, trees in saved_trees.items()}
    base = files.state(experts.base)["optimizer"]
    _, keys = per_rank[experts.base]
    groups, param_state = [], []
    for key, group, names in zip(keys, base["optimizer"]["param_groups"],
                                 _grouped_names(targets, keys)):
        row = []
        for chunk, name in names:
            rank, saved_name, _ = experts.source(name)
            row.append(per_rank[rank][0][(chunk, saved_name)])
        param_state.append(row)
        groups.append(dict(group, params=list(range(len(row)))))
    return dict(base, optimizer=dict(base["optimizer"], param_groups=groups),
                param_state=param_state)


def _optimizer(files: _SavedFiles, experts: _ExpertMap, saved_trees: Dict[int, List[dict]],
               targets: List[dict]) -> dict:
    """This rank's optimizer state (the saved optimizer's layout) from the saved files'
    per-parameter state."""
    for rank in saved_trees:
        if not isinstance(files.state(rank).get("optimizer"), dict):
            raise CheckpointError(f"{files.path(rank)}: has no optimizer state (saved with "
                                  "--no-save-optim?); pass --no-load-optim or --finetune")
    if "param_state" in files.state(experts.base)["optimizer"]:
        return _distributed_optimizer(files, experts, saved_trees, targets)
    per_rank = {}
    for rank, trees in saved_trees.items():
        state = files.state(rank)
        if not isinstance(state.get("optimizer"), dict):
            raise CheckpointError(f"{files.path(rank)}: has no optimizer state (saved with "
                                  "--no-save-optim?); pass --no-load-optim or --finetune")
        per_rank[rank] = _per_parameter(state["optimizer"], trees, files.path(rank))
    _, keys, base_inner = per_rank[experts.base]
    base = files.state(experts.base)["optimizer"]
    state, groups, mains, index = {}, [], [], 0
    for key, group, names in zip(keys, base_inner["param_groups"],
                                 _grouped_names(targets, keys)):
        ids, group_mains = [], []
        for chunk, name in names:
            rank, saved_name, _ = experts.source(name)
            entry, main = per_rank[rank][0][(chunk, saved_name)]
            if entry is not None:
                state[index] = entry
            group_mains.append(main)
            ids.append(index)
            index += 1
        groups.append(dict(group, params=ids))
        mains.append(group_mains)
    inner = {"state": state, "param_groups": groups}
    if base_inner is base:
        return inner
    out = dict(base, optimizer=inner)
    if "fp32_from_fp16_params" in base:
        out["fp32_from_fp16_params"] = mains
    return out


_GROUPED = re.compile(r"(^|\.)mlp\.experts\.linear_fc[12]\.(weight|bias)\d*$")


def _refuse_grouped_layout(trees, what: str, iter_dir: str, saved_ep: int, ep_size: int):
    """Experts in Megatron-Core's grouped-linear layout (--moe-single-grouped-weight / -bias)
    hold all local experts in one tensor or number them per GEMM: not re-dealt here."""
    for tree in trees:
        names = _leaves(tree) if isinstance(tree, dict) else {}
        grouped = next((n for n in names if _GROUPED.search(n)), None)
        if grouped is not None:
            raise CheckpointError(
                f"{iter_dir}: saved at --expert-model-parallel-size {saved_ep}, loaded at "
                f"{ep_size}: {what} holds {grouped} (--moe-single-grouped-weight / "
                "--moe-single-grouped-bias layout), which --ckpt-format torch does not re-deal "
                "over another EP size; save with --ckpt-format torch_dist (any EP size loads "
                "it) or load at the saved EP size")


def load_resharded(iter_dir: str, saved_ep: int, model_chunks, args, pstate
                   ) -> Tuple[dict, str]:
    """This rank's state from a torch-format checkpoint saved at expert-parallel size
    ``saved_ep`` (the same TP and PP); returns it and the folder errors name."""
    ep_rank, ep_size, _ = expert_ranks(pstate)
    num_experts = getattr(args, "num_experts", None)
    if not num_experts or num_experts % saved_ep:
        raise CheckpointError(f"{iter_dir}: saved with {saved_ep} expert-parallel ranks, which "
                              f"do not divide --num-experts {num_experts}")
    files = _SavedFiles(iter_dir, pstate, saved_ep)
    experts = _ExpertMap(num_experts, saved_ep, ep_rank, ep_size)
    targets = [chunk.state_dict_for_save_checkpoint() for chunk in model_chunks]
    base = files.state(experts.base)
    for what, tree in (("this run's model", targets),
                       (files.path(experts.base), [base.get(k) for k in
                                                   _model_keys(len(targets))])):
        _refuse_grouped_layout(tree, what, iter_dir, saved_ep, ep_size)
    trees = _model_trees(files, experts, targets)
    state = {k: v for k, v in base.items()
             if k not in ("optimizer",) + tuple(_model_keys(len(targets)))}
    state.update(zip(_model_keys(len(targets)), trees))
    if "optimizer" in base and not args.no_load_optim and not args.finetune:
        saved_trees = {rank: [files.state(rank)[k] for k in _model_keys(len(targets))]
                       for rank in sorted(files._states)}
        state["optimizer"] = _optimizer(files, experts, saved_trees, targets)
    if pstate.rank == 0:
        print(f"  loading {iter_dir} (saved at --expert-model-parallel-size {saved_ep}) at "
              f"expert-parallel size {ep_size}: experts re-dealt", flush=True)
    return state, iter_dir

"""How a torch_dist save names the state of each optimizer parameter
(megatron.checkpoint.optimizer_state.members_by_identity, torch_dist._current_order)."""

import pytest
import torch

from megatron.checkpoint import optimizer_state, torch_dist
from megatron.checkpoint.layout import CheckpointError


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.out = torch.nn.Linear(3, 2, bias=False)


def _optimizer(groups):
    return torch.optim.AdamW([dict(g) for g in groups], lr=1e-3)


def test_members_follow_the_optimizer_groups_not_the_naming_rule():
    model = _Model()
    tree = {"model": model.state_dict(keep_vars=True)}
    # muP-like grouping: the out weight in a group of its own, the norm weight decayed.
    groups = [{"params": [model.dense.weight, model.norm.weight], "wd_mult": 1.0},
              {"params": [model.out.weight], "wd_mult": 1.0, "mup_lr_factor": 0.5},
              {"params": [model.dense.bias, model.norm.bias], "wd_mult": 0.0}]
    found = torch_dist._current_order(_optimizer(groups), [tree])
    assert [[name for _, name, _ in row] for row in found] == [
        ["model.dense.weight", "model.norm.weight"], ["model.out.weight"],
        ["model.dense.bias", "model.norm.bias"]]
    assert found[1][0] == (0, "model.out.weight", (2, 3))


def test_a_parameter_the_tree_does_not_hold_is_not_found():
    model = _Model()
    tree = {"model": model.state_dict()}   # detached copies of the same storage still match
    outside = torch.nn.Parameter(torch.zeros(3))
    assert optimizer_state.members_by_identity([[model.dense.weight]], [tree]) is not None
    assert optimizer_state.members_by_identity([[model.dense.weight, outside]], [tree]) is None
    # Two names of one storage are ambiguous.
    tree["model"]["alias.weight"] = model.dense.weight.detach()
    assert optimizer_state.members_by_identity([[model.dense.weight]], [tree]) is None


def test_unnamed_parameters_in_groups_the_rule_cannot_tell_apart_are_refused():
    model = _Model()
    cloned = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    # Found by the rule when its groups are Megatron's.
    rule = [{"params": [model.dense.weight, model.out.weight], "wd_mult": 1.0},
            {"params": [model.dense.bias, model.norm.weight, model.norm.bias], "wd_mult": 0.0}]
    found = torch_dist._current_order(_optimizer(rule), [cloned])
    assert [len(row) for row in found] == [2, 3]
    # Two groups of the same multipliers (say --decoupled-lr) cannot be told apart by it.
    split = [{"params": [model.dense.weight], "wd_mult": 1.0},
             {"params": [model.out.weight], "wd_mult": 1.0, "is_decoupled_lr": True},
             {"params": [model.dense.bias, model.norm.weight, model.norm.bias], "wd_mult": 0.0}]
    with pytest.raises(CheckpointError, match="same wd_mult and lr_mult"):
        torch_dist._current_order(_optimizer(split), [cloned])


def test_group_signature_defaults_match_plain_groups():
    assert optimizer_state.group_signature({"wd_mult": 0.0}) == (0.0, 1.0, False, 1.0, 1.0)
    assert optimizer_state.group_signature(
        {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False,
         "max_lr": 3e-4}) == optimizer_state.group_signature({"wd_mult": 1.0})
    assert optimizer_state.group_signature({"wd_mult": 1.0, "mup_eps_factor": 0.5}) != \
        optimizer_state.group_signature({"wd_mult": 1.0})

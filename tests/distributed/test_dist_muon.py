"""``--optimizer dist_muon`` on two data-parallel ranks against ``--optimizer muon``.

Both ranks hold the same gradients (as after the data-parallel all-reduce); dist_muon deals
whole weights over the ranks, steps each on its owner and broadcasts it, so the weights must
equal Muon's bit for bit, each rank must keep only its own share of the state, and the state
dict (gathered) must equal Muon's.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.optimizer import get_megatron_optimizer
from tests.unit.test_muon import build, grad_sets, muon_config, run, tiny_gpt


def _body():
    grads = grad_sets(tiny_gpt(), 3)
    model = tiny_gpt()
    optimizer = get_megatron_optimizer(muon_config(optimizer="dist_muon", muon_nesterov=True),
                                       [model], mp_group=None, tp_group=None,
                                       dp_group=dist.group.WORLD)
    weights = run(model, optimizer, grads)
    own = [len(optimizer.optimizer.state[p]) > 0 for g in optimizer.param_groups
           for p in g["params"]]
    saved = optimizer.state_dict()
    kept = sum(1 for g in optimizer.param_groups for p in g["params"]
               if optimizer.optimizer.state.get(p))
    return weights, own, saved, kept


@pytest.mark.slow
def test_dist_muon_steps_like_muon_and_deals_its_state():
    from tests.multiprocess import run_on_ranks

    results = run_on_ranks(_body, 2)
    grads = grad_sets(tiny_gpt(), 3)
    model = tiny_gpt()
    optimizer = build(model, muon_config(muon_nesterov=True))
    want = run(model, optimizer, grads)
    want_state = optimizer.state_dict()
    for weights, own, saved, kept in results:
        for name in want:
            assert torch.equal(weights[name], want[name]), name
        assert saved["param_groups"] == want_state["param_groups"]
        assert saved["state"].keys() == want_state["state"].keys()
        for index, entry in want_state["state"].items():
            for field, value in entry.items():
                assert torch.equal(saved["state"][index][field], value), (index, field)
        assert kept == sum(own)   # the gathered state was dropped again after the save
    owned = [a + b for a, b in zip(results[0][1], results[1][1])]
    assert owned == [1] * len(owned)   # every parameter stepped by exactly one rank
    assert 0 < sum(results[0][1]) < len(owned)

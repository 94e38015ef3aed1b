"""Routing replay against Megatron-Core's own router (slow: the ``megatron-core`` release from
PyPI in its own virtual environment, under torchrun on the CPU; see ``test_megatron_core.py``).

The same router weight goes through Megatron-Core's ``TopKRouter`` with
``moe_enable_routing_replay`` (``megatron_core_replay_harness.py``) and this project's: both
record the experts chosen for one batch (which must be the same), then replay a given set of
expert ids (not the routers' own top-k) on another batch, whose probabilities, routing map and
gradients (of the hidden states and of the router weight, through ``(probs * upstream).sum()``)
must agree. fp32 on both sides, the same formulas: 1e-6.

(``--moe-latent-size`` is not compared with Megatron-Core's module here: megatron-core 0.16.1
builds its latent projections only with TransformerEngine, which does not run on the CPU;
``--moe-mlp-glu-interleave-size`` is not in that release.)
"""

import json
import pathlib
import subprocess

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model.moe import MoEConfig, TopKRouter
from megatron.model.moe.router_replay import (RouterReplayAction, get_recorded_data,
                                              set_replay_data, set_router_replay_action)
from tests.interop.test_megatron_core import _env, mcore_python  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

HARNESS = pathlib.Path(__file__).with_name("megatron_core_replay_harness.py")
SEQ, BATCH, HIDDEN, EXPERTS = 6, 2, 16, 6
CASES = [{"score": "softmax", "pre_softmax": False, "scaling": None},
         {"score": "softmax", "pre_softmax": True, "scaling": 2.0},
         {"score": "sigmoid", "pre_softmax": False, "scaling": 1.5}]


def _inputs() -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(SEQ * BATCH)])
    return {"weight": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
            "record_hidden": torch.randn(SEQ, BATCH, HIDDEN, generator=g),
            "hidden": torch.randn(SEQ, BATCH, HIDDEN, generator=g),
            "upstream": torch.randn(SEQ * BATCH, EXPERTS, generator=g),
            "replay_ids": ids}


def _ours(case: dict, ref: dict) -> dict:
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                               padded_vocab_size=16, max_position_embeddings=SEQ,
                               seq_length=SEQ, params_dtype=torch.float32,
                               add_bias_linear=False)
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2,
                    moe_router_score_function=case["score"],
                    moe_router_pre_softmax=case["pre_softmax"],
                    moe_router_topk_scaling_factor=case["scaling"],
                    moe_router_load_balancing_type="none", moe_enable_routing_replay=True)
    router = TopKRouter(config, moe, layer_number=1).train()
    with torch.no_grad():
        router.weight.copy_(ref["weight"])
    set_router_replay_action([router], RouterReplayAction.RECORD)
    with torch.no_grad():
        router(ref["record_hidden"])
    recorded = get_recorded_data([router])[0]
    set_replay_data([router], [ref["replay_ids"]])
    set_router_replay_action([router], RouterReplayAction.REPLAY_FORWARD)
    hidden = ref["hidden"].clone().requires_grad_()
    probs, routing_map = router(hidden)
    (probs * ref["upstream"]).sum().backward()
    return {"recorded": recorded, "probs": probs.detach(), "routing_map": routing_map,
            "hidden_grad": hidden.grad, "weight_grad": router.weight.grad.clone()}


def test_routing_replay_matches_megatron_core(mcore_python, tmp_path):  # noqa: F811
    ref = _inputs()
    inputs, cases, out = tmp_path / "inputs.pt", tmp_path / "cases.json", tmp_path / "out.pt"
    torch.save(ref, inputs)
    cases.write_text(json.dumps(CASES))
    torchrun = pathlib.Path(mcore_python).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "1",
                             str(HARNESS), str(cases), str(inputs), str(out)],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    theirs = torch.load(out, weights_only=True)
    for case, want in zip(CASES, theirs):
        got = _ours(case, ref)
        assert torch.equal(got["recorded"], want["recorded"]), case
        assert torch.equal(got["routing_map"], want["routing_map"]), case
        # the replayed experts, not the router's own choice
        assert torch.equal(got["routing_map"].nonzero()[:, 1].view(-1, 2),
                           ref["replay_ids"].sort(dim=-1).values)
        for key in ("probs", "hidden_grad", "weight_grad"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{case} {key}: {m}")

"""Several balancing losses at once against Megatron-Core's own router (slow: the
``megatron-core`` release from PyPI in its own virtual environment, under torchrun on the CPU;
see ``test_megatron_core.py`` for the environment).

The same router weight, the same two micro-batches of hidden states and the same upstream
gradient go through Megatron-Core's ``TopKRouter`` (``megatron_core_router_harness.py``) and
this project's, in training mode, with a list of balancing types and one coefficient each:
the values logged under each name (summed over the micro-batches; ``global_aux_loss`` runs its
average over both) and the gradients of the hidden states and of the router weight must agree.
fp32 on both sides, the sums in other orders: 1e-5 relative, where a loss with another
coefficient or a missing one moves them by orders of magnitude more.
"""

import json
import pathlib
import subprocess

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model.moe import MoEConfig, MoELossTracker, TopKRouter
from tests.interop.test_megatron_core import _env, mcore_python  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

HARNESS = pathlib.Path(__file__).with_name("megatron_core_router_harness.py")
SEQ, BATCH, HIDDEN, EXPERTS = 8, 3, 16, 6
CASES = [
    {"types": ["aux_loss", "seq_aux_loss", "global_aux_loss"], "coeffs": [0.1, 0.2, 0.3],
     "score": "softmax"},
    {"types": ["seq_aux_loss", "global_aux_loss"], "coeffs": [0.05, 0.4], "score": "sigmoid"},
    # --calculate-per-token-loss: each loss attached times the tokens it was counted over
    # (seq_aux_loss: the sequence length), the z loss too.
    {"types": ["aux_loss", "seq_aux_loss", "global_aux_loss"], "coeffs": [0.1, 0.2, 0.3],
     "score": "softmax", "z": 0.01, "per_token": True},
    {"types": ["seq_aux_loss"], "coeffs": [0.05], "score": "sigmoid", "z": 0.02,
     "per_token": True},
]


def _inputs() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"weight": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
            "hidden": torch.randn(2, SEQ, BATCH, HIDDEN, generator=g),
            "upstream": torch.randn(2, SEQ * BATCH, EXPERTS, generator=g)}


def _ours(case: dict, ref: dict) -> dict:
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                               padded_vocab_size=16, max_position_embeddings=SEQ,
                               seq_length=SEQ, params_dtype=torch.float32,
                               add_bias_linear=False,
                               calculate_per_token_loss=case.get("per_token", False))
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2,
                    moe_router_score_function=case["score"],
                    moe_router_load_balancing_type=case["types"],
                    moe_aux_loss_coeff=case["coeffs"], moe_z_loss_coeff=case.get("z"))
    tracker = MoELossTracker(num_layers=1)
    router = TopKRouter(config, moe, layer_number=1, tracker=tracker).train()
    with torch.no_grad():
        router.weight.copy_(ref["weight"])
    grads = []
    for hidden, upstream in zip(ref["hidden"], ref["upstream"]):
        hidden = hidden.clone().requires_grad_()
        probs, _ = router(hidden)
        (probs * upstream).sum().backward()
        grads.append(hidden.grad)
    logged = {name: float(values[0]) for name, values in tracker.values.items()}
    return {"logged": logged, "hidden_grad": torch.stack(grads),
            "weight_grad": router.weight.grad.clone()}


def test_listed_balancing_losses_match_megatron_core(mcore_python, tmp_path):  # noqa: F811
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
        names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}
        named = {names[kind] for kind in case["types"]} | ({"z_loss"} if "z" in case else set())
        assert set(want["logged"]) == named, want["logged"]
        assert set(got["logged"]) == set(want["logged"]), (got["logged"], want["logged"])
        for name, value in want["logged"].items():
            assert got["logged"][name] == pytest.approx(value, rel=1e-5), (case, name)
        for key in ("hidden_grad", "weight_grad"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} {key}: {m}")

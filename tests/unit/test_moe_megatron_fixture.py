"""The MoE layer against what Megatron-Core recorded for its own MoE model
(``tests/data/megatron_written/mcore_dist_moe_ep1``: 4 layers, 4 experts, top-2, aux_loss with
coefficient 0.01, allgather dispatcher, exact GeLU experts, no bias).

The project's GPT model is built with its MoE layers (``moe_config``) and loaded from the file
through the ``torch_dist`` key mapping (router and experts included). One forward on the recorded tokens must give Megatron's logits, its
top-k expert ids, routing probabilities, tokens per expert, and its logged
``load_balancing_loss`` per layer and averaged.

``router_probs`` in the fixture are the routing probabilities (k non-zeros per token), not the
softmax over all experts that the load-balancing loss averages, so the loss cannot be recomputed
from them alone: the test takes each layer's router logits from the forward and recomputes the
logged value from them and the recorded ``tokens_per_expert``. The normalisation that matches
Megatron's numbers: ``E / (k T^2) * sum_e n_e * sum_t softmax(logits_t)_e`` (= ``E sum_e f_e P_e``
with ``f_e = n_e / (k T)``, ``P_e`` the mean softmax), T = 64 tokens of the micro-batch.
"""

import os
import types

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.checkpoint.dist import ChunkLayout, DistCheckpointReader, load_model_state
from megatron.model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.moe import MoEConfig, MoELayer, MoELossTracker

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "megatron_written", "mcore_dist_moe_ep1")
LAYERS, EXPERTS, TOPK = 4, 4, 2
# fp32 forward of the same weights with differently ordered reductions (as for dense models).
LOGITS_ATOL = 1e-5


def _reference():
    return torch.load(os.path.join(FIXTURE, "reference.pt"), weights_only=True)


def _model(tracker):
    """The GPT model with MoE layers, built as the model provider builds it, and loaded from the
    file through the torch_dist key mapping."""
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, padded_vocab_size=256,
        max_position_embeddings=64, seq_length=32, ffn_hidden_size=256, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_gelu_fusion=False)
    moe_config = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                           moe_token_dispatcher_type="allgather", moe_per_layer_logging=True)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(config, pstate, moe_config=moe_config)
    model.moe_tracker = tracker
    for layer in model.language_model.encoder.layers:
        assert isinstance(layer.mlp, MoELayer)
        layer.mlp.router.tracker = tracker
    reader = DistCheckpointReader(os.path.join(FIXTURE, "iter_0000010"))
    state = model.state_dict_for_save_checkpoint()
    loaded = load_model_state(reader, state, ChunkLayout(num_layers=LAYERS, num_experts=EXPERTS))
    names = sorted(flatten_state_dict(loaded))
    assert "language_model.encoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight" in names
    model.load_state_dict(loaded)
    return model


@pytest.fixture(scope="module")
def megatron_run():
    torch.manual_seed(0)
    tracker = MoELossTracker(LAYERS)
    model = _model(tracker)
    model.train()  # the auxiliary loss is computed (and logged) in training only
    captured = []

    def keep(router, inputs, outputs):
        captured.append((router.gating(inputs[0]).detach(), outputs[0].detach(),
                         outputs[1].detach()))

    for layer in model.language_model.encoder.layers:
        layer.mlp.router.register_forward_hook(keep)
    ref = _reference()
    logits = model(ref["tokens"], ref["position_ids"], ref["attention_mask"])
    return ref, logits.detach(), captured, tracker.report(per_layer=True)


def test_logits_expert_choices_and_probabilities_are_megatrons(megatron_run):
    ref, logits, captured, _ = megatron_run
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=LOGITS_ATOL)
    for layer, (router_logits, probs, routing_map) in enumerate(captured):
        s, b = router_logits.shape[:2]
        top = torch.topk(router_logits, TOPK, dim=-1).indices.transpose(0, 1)      # [b, s, k]
        assert torch.equal(top, ref["router_topk_indices"][layer]), layer
        torch.testing.assert_close(probs.view(s, b, EXPERTS).transpose(0, 1),
                                   ref["router_probs"][layer], rtol=0, atol=1e-6)
        assert routing_map.sum(0).tolist() == ref["tokens_per_expert"][layer].tolist()


def test_logged_load_balancing_loss_is_megatrons(megatron_run):
    ref, _, captured, logged = megatron_run
    want = ref["moe_load_balancing_loss_per_layer"].double()
    got = torch.tensor([logged[f"load_balancing_loss_layer_{n}"] for n in range(1, LAYERS + 1)],
                       dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert logged["load_balancing_loss"] == pytest.approx(float(ref["moe_load_balancing_loss"]),
                                                          abs=1e-6)
    assert float(ref["moe_load_balancing_loss"]) == pytest.approx(1.093857, abs=1e-6)
    torch.testing.assert_close(want * ref["moe_aux_loss_coeff"],
                               ref["moe_aux_loss_per_layer"].double(), rtol=0, atol=1e-8)
    # The same numbers from an fp64 formula written here, from the router logits of the forward
    # and the recorded tokens per expert.
    for layer, (router_logits, _, _) in enumerate(captured):
        softmax = torch.softmax(router_logits.double().reshape(-1, EXPERTS), dim=-1)
        tokens = softmax.size(0)
        counts = ref["tokens_per_expert"][layer].double()
        value = EXPERTS / (TOPK * tokens * tokens) * (counts * softmax.sum(0)).sum()
        assert float(value) == pytest.approx(float(want[layer]), abs=1e-6), layer


def test_recorded_router_probs_are_routing_probabilities_not_the_full_softmax():
    ref = _reference()
    probs = ref["router_probs"]                                                 # [L, b, s, E]
    assert ((probs > 0).sum(-1) == TOPK).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), rtol=0, atol=1e-6)
    # Used in place of the full softmax they give another value: P_e must be the full softmax.
    layer0 = probs[0].reshape(-1, EXPERTS).double()
    counts = ref["tokens_per_expert"][0].double()
    wrong = EXPERTS / (TOPK * 64 * 64) * (counts * layer0.sum(0)).sum()
    assert abs(float(wrong) - float(ref["moe_load_balancing_loss_per_layer"][0])) > 0.01

"""DeepSeek-V3's router and multi-token prediction against what Megatron-Core recorded for its
own model (``tests/data/megatron_written/mcore_dist_dsv3_mtp``: 4 layers, 8 experts in 4 groups,
each token limited to its best 2 groups, sigmoid top-2 plus expert bias, scaled by 2.5, one MTP
layer with its own MoE transformer layer).

The project's GPT model is built with the MoE and MTP settings and loaded through the
``torch_dist`` key mapping. One forward on the recorded tokens must give Megatron's logits,
per-token loss and ``lm_loss``; the routers must choose Megatron's experts with its
probabilities; the load-balancing loss must be Megatron's for all five MoE layers, the fifth
being the MTP layer's, whose input is the MTP block's (so it checks the embedding shift, the
norms, the concatenation order and the projection).

The fixture's router entry for layer 1 is the MTP layer's router (the recorder keyed routers by
a layer number the MTP layer shares with decoder layer 1): the test says so explicitly, and
checks that decoder layer 1's own choices differ from it.
"""

import os
import types

import pytest
import torch

from megatron.checkpoint.dist import ChunkLayout, DistCheckpointReader, load_model_state
from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.moe import MoEConfig

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "megatron_written", "mcore_dist_dsv3_mtp")
LAYERS, EXPERTS, TOPK = 4, 8, 2
# As for the other Megatron fixtures: an fp32 forward with differently ordered reductions.
LOGITS_ATOL = 1e-5


def _reference():
    return torch.load(os.path.join(FIXTURE, "reference.pt"), weights_only=True)


def _model():
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, padded_vocab_size=256,
        max_position_embeddings=64, seq_length=32, ffn_hidden_size=128, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.1, moe_router_num_groups=4,
                    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                    moe_aux_loss_coeff=0.01, moe_per_layer_logging=True)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(config, pstate, moe_config=moe, mtp_num_layers=1)
    reader = DistCheckpointReader(os.path.join(FIXTURE, "iter_0000010"))
    state = model.state_dict_for_save_checkpoint()
    names = set(flatten_state_dict(state))
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in names
    assert "language_model.encoder.layers.3.mlp.router.expert_bias" in names
    loaded = load_model_state(reader, state, ChunkLayout(num_layers=LAYERS, num_experts=EXPERTS,
                                                         swiglu=True))
    model.load_state_dict(loaded)
    return model


@pytest.fixture(scope="module")
def megatron_run():
    torch.manual_seed(0)
    model = _model()
    ref = _reference()
    model.eval()
    with torch.no_grad():
        logits = model(ref["tokens"], ref["position_ids"], ref["attention_mask"])
    model.train()  # the auxiliary losses are computed (and logged) in training only
    routers = [layer.mlp.router for layer in model.language_model.encoder.layers]
    routers.append(model.mtp.layers[0].transformer_layer.mlp.router)
    captured = {}
    for number, router in enumerate(routers, start=1):
        router.register_forward_hook(
            lambda m, i, o, n=number: captured.__setitem__(n, (o[0].detach(), o[1].detach())))
    loss = model(ref["tokens"], ref["position_ids"], ref["attention_mask"],
                 labels=ref["labels"], loss_mask=ref["loss_mask"])
    return (ref, logits, loss.detach(), captured, model.moe_tracker.report(per_layer=True),
            model.mtp_tracker.report())


def test_logits_and_loss_are_megatrons(megatron_run):
    ref, logits, loss, _, _, _ = megatron_run
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(loss, ref["per_token_loss"], rtol=0, atol=LOGITS_ATOL)
    mask = ref["loss_mask"]
    lm_loss = (loss * mask).sum() / mask.sum()
    torch.testing.assert_close(lm_loss, ref["lm_loss"], rtol=0, atol=1e-5)


def _as_recorded(probs):
    return probs.view(32, 2, EXPERTS).transpose(0, 1)                      # [b, s, E]


def test_routers_choose_megatrons_experts_with_its_probabilities(megatron_run):
    ref, _, _, captured, _, _ = megatron_run
    # Recorded entry 0 is the MTP layer's router (number 5 here); 1..3 decoder layers 2..4.
    for entry, number in enumerate((5, 2, 3, 4)):
        probs, routing_map = captured[number]
        probs = _as_recorded(probs)
        torch.testing.assert_close(probs, ref["router_probs"][entry], rtol=0, atol=1e-5)
        top = torch.topk(probs, TOPK, dim=-1).indices                      # by probability
        assert torch.equal(top, ref["router_topk_indices"][entry]), number
        assert routing_map.sum(0).tolist() == ref["tokens_per_expert"][entry].tolist()
    decoder_layer_1 = _as_recorded(captured[1][0])
    assert not torch.allclose(decoder_layer_1, ref["router_probs"][0], atol=1e-3)


def test_every_token_keeps_to_its_best_two_of_four_groups(megatron_run):
    _, _, _, captured, _, _ = megatron_run
    for number, (probs, _) in captured.items():
        groups = (probs.view(-1, 4, 2) > 0).any(-1).sum(-1)                 # groups used
        assert int(groups.max()) <= 2, number
        torch.testing.assert_close(probs.sum(-1), torch.full((64,), 2.5), rtol=0, atol=1e-5)


def test_load_balancing_losses_of_all_five_layers_are_megatrons(megatron_run):
    ref, _, _, _, logged, mtp = megatron_run
    want = ref["moe_load_balancing_loss_per_layer"].double()
    got = torch.tensor([logged[f"load_balancing_loss_layer_{n}"] for n in range(1, 6)],
                       dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert logged["load_balancing_loss"] == pytest.approx(
        float(ref["moe_load_balancing_loss"]), abs=1e-5)
    assert float(want.sum() / LAYERS) == pytest.approx(float(ref["moe_load_balancing_loss"]),
                                                       abs=1e-5)
    assert set(mtp) == {"mtp_1 loss"} and 0 < mtp["mtp_1 loss"] < 10

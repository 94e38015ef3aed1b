"""Multi-token prediction's loss against a reference written here without the shifting code:
depth 1 predicts token t + 2 from the main model's hidden state at t and the embedding of token
t + 1, so on the first s - 1 positions (causal attention never sees the vacated last one) it is
the MTP layer run on ``tokens[:, 1:]`` against ``labels[:, 1:]``. The value logged, the
gradients (main loss plus 0.1 times the MTP loss), and what the model returns (the main
head's per-token loss only) are checked; and an MTP model's keys are Megatron-Core's."""

import types

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.multi_token_prediction import roll_left

SEQ, BATCH, VOCAB = 8, 2, 64


def _model(depths=1, untie=True):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                               seq_length=SEQ, ffn_hidden_size=32, hidden_dropout=0.0,
                               attention_dropout=0.0,
                               normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                               position_embedding_type="rope",
                               untie_embeddings_and_output_weights=untie)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    return GPTModel(config, pstate, mtp_num_layers=depths, mtp_loss_scaling_factor=0.1)


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.2).float()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, labels, mask, positions


def _reference_loss(model, tokens, labels, mask, positions):
    """Main masked mean + 0.1 * depth 1's masked mean, built from truncated sequences."""
    lm = model.language_model
    hidden = lm(tokens, positions, None)                                    # [s, b, h]
    main = torch.nn.functional.cross_entropy(
        model._head(hidden).float().reshape(-1, VOCAB),
        labels.t().reshape(-1), reduction="none").view(SEQ, BATCH).t()      # [b, s]
    main_mean = (main * mask).sum() / mask.sum()
    layer = model.mtp.layers[0]
    embedded = lm.embedding(tokens[:, 1:], positions[:, 1:])                # [s-1, b, h]
    rotary = lm.rotary_pos_emb(SEQ - 1)
    out = layer(hidden[:-1], embedded, None, rotary)                        # [s-1, b, h]
    mtp = torch.nn.functional.cross_entropy(
        model._head(out).float().reshape(-1, VOCAB),
        labels[:, 1:].t().reshape(-1), reduction="none").view(SEQ - 1, BATCH).t()
    mtp_mask = mask[:, 1:]
    mtp_mean = (mtp * mtp_mask).sum() / mtp_mask.sum()
    return main, main_mean, mtp_mean


@pytest.mark.parametrize("untie", [True, False])
def test_mtp_loss_and_gradients_match_the_truncated_reference(untie):
    torch.manual_seed(0)
    model = _model(untie=untie)
    model.train()
    tokens, labels, mask, positions = _batch()
    loss = model(tokens, positions, None, labels=labels, loss_mask=mask)    # [b, s]
    logged = model.mtp_tracker.report()
    (((loss * mask).sum()) / mask.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    main, main_mean, mtp_mean = _reference_loss(model, tokens, labels, mask, positions)
    torch.testing.assert_close(loss.detach(), main.detach(), rtol=0, atol=1e-5)
    assert logged == {"mtp_1 loss": pytest.approx(float(mtp_mean.detach()), abs=1e-5)}
    (main_mean + 0.1 * mtp_mean).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_eval_and_no_grad_forwards_leave_the_mtp_out():
    model = _model()
    tokens, labels, mask, positions = _batch()
    model.eval()
    model(tokens, positions, None, labels=labels, loss_mask=mask)
    model.train()
    with torch.no_grad():
        model(tokens, positions, None, labels=labels, loss_mask=mask)
    assert model.mtp_tracker.report() == {}


def test_two_depths_shift_twice_and_average():
    model = _model(depths=2)
    model.train()
    tokens, labels, mask, positions = _batch()
    model(tokens, positions, None, labels=labels)                           # no mask: all
    logged = model.mtp_tracker.report()
    assert set(logged) == {"mtp_1 loss", "mtp_2 loss"}
    assert roll_left(roll_left(labels))[:, :SEQ - 2].equal(labels[:, 2:])
    assert roll_left(roll_left(labels))[:, SEQ - 2:].eq(0).all()


def test_state_names_map_to_megatron_core_keys():
    from megatron.checkpoint.dist import ChunkLayout
    from megatron.checkpoint.dist.keys import mtp_extra_state_keys, placements

    model = _model()
    layout = ChunkLayout(num_layers=2, swiglu=True)
    keys = {}
    for name, tensor in flatten_state_dict(model.state_dict_for_save_checkpoint()).items():
        for place in placements(name, tuple(tensor.shape), layout):
            keys[place.key] = place.global_shape
    assert keys["mtp.layers.0.eh_proj.weight"] == (16, 32)
    assert keys["mtp.layers.0.enorm.weight"] == (16,)
    assert keys["mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"] == (48, 16)
    assert keys["mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight"] == (16,)
    assert keys["decoder.layers.self_attention.linear_qkv.weight"] == (2, 48, 16)
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in mtp_extra_state_keys(0)


def test_mtp_extra_state_entries_are_those_megatron_core_writes_with_a_shared_expert():
    """An MTP layer with 8 routed experts and a shared expert: the byte entries are exactly
    those megatron-core 0.16.1 wrote for its own such model (the file of
    ``tests/interop/test_megatron_core_dsv3.py``); the shared expert's two were once missing,
    and Megatron-Core refused the file ("Missing key in checkpoint state_dict")."""
    from megatron.checkpoint.dist import ChunkLayout, extra_state_objects

    layer = "mtp.layers.0.transformer_layer."
    names = [f"{layer}mlp.router.weight", f"{layer}mlp.shared_experts.linear_fc1.weight",
             f"{layer}mlp.shared_experts.linear_fc2.weight", f"{layer}input_layernorm.weight"]
    names += [f"{layer}mlp.experts.local_experts.{e}.linear_fc{i}.weight"
              for e in range(8) for i in (1, 2)]
    layout = ChunkLayout(num_layers=3, swiglu=True, num_experts=8, per_layer=True)
    got = {item.fqn for item in extra_state_objects(layout, 0, names)}
    written = {"mtp.layers.0.eh_proj._extra_state/shard_0_1",
               f"{layer}mlp.shared_experts.linear_fc1._extra_state/shard_0_1",
               f"{layer}mlp.shared_experts.linear_fc2._extra_state/shard_0_1",
               f"{layer}self_attention.linear_proj._extra_state/shard_0_1",
               f"{layer}self_attention.linear_qkv._extra_state/shard_0_1"}
    written |= {f"{layer}mlp.experts.experts.linear_fc{i}._extra_state/shard_{e}_8"
                for e in range(8) for i in (1, 2)}
    assert got == written

"""``--mlp-chunks-for-training``: the MLP / MoE block on pieces of the sequence in turn must be
the same function as on the whole sequence.

Dense MLP, float32: every token's row goes through the same matmuls, so the forward (the loss)
is bit-identical (asserted exactly); the MLP weights' gradients are sums over tokens that the
pieces split and accumulate, so they agree to float32 rounding (rtol 1e-5; a wrong piece or a
missing one moves them by far more). MoE (routing by top-k without balancing losses or capacity,
both per-token), float64: the experts see their rows in other groupings, which reorders the
weight-gradient sums, so 1e-12. Evaluation is never chunked; the flag only takes effect in
training, as in Megatron-Core.
"""

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.model import GPTModel
from megatron.model.moe import MoEConfig
from tests.unit.test_gpt_model import loss_and_grads, make_batch, make_config, \
    single_process_state


def _run(chunks, dtype, moe=None, seed=0):
    model = GPTModel(make_config(mlp_chunks_for_training=chunks, params_dtype=dtype),
                     single_process_state(), moe_config=moe)
    calls = []
    for layer in model.modules():
        if hasattr(layer, "_run_mlp"):
            layer.mlp.register_forward_hook(lambda m, i, o: calls.append(i[0].size(0)))
    return loss_and_grads(model, make_batch(seed)), calls


def test_dense_chunks_same_loss_bits_and_gradients():
    (loss1, grads1), calls1 = _run(1, torch.float32)
    (loss3, grads3), calls3 = _run(3, torch.float32)
    assert len(calls3) == 3 * len(calls1)            # the MLP really ran in three pieces
    assert torch.equal(loss1, loss3)
    for name in grads1:
        torch.testing.assert_close(grads1[name], grads3[name], rtol=1e-5, atol=1e-7)


def test_moe_chunks_match_within_float64_tolerance():
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="none")
    (loss1, grads1), _ = _run(1, torch.float64, moe)
    (loss2, grads2), calls = _run(2, torch.float64, moe)
    assert len(calls) == 2 * 2
    torch.testing.assert_close(loss1, loss2, rtol=0, atol=1e-12)
    for name in grads1:
        torch.testing.assert_close(grads1[name], grads2[name], rtol=0, atol=1e-12)


def test_more_chunks_than_tokens_and_eval():
    model = GPTModel(make_config(mlp_chunks_for_training=1000), single_process_state())
    ids, pos, labels = make_batch()
    calls = []
    model.language_model.encoder.layers[0].mlp.register_forward_hook(
        lambda m, i, o: calls.append(i[0].size(0)))
    model(ids, pos, None, labels=labels)
    assert calls == [1] * ids.size(1)                # at most one piece per position
    calls.clear()
    model.eval()
    model(ids, pos, None, labels=labels)
    assert calls == [ids.size(1)]
    with pytest.raises(ConfigError, match="--mlp-chunks-for-training"):
        make_config(mlp_chunks_for_training=0)

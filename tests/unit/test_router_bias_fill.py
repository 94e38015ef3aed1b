"""megatron.checkpoint.router_bias: which tensors an older checkpoint may lack, and the zeros
put in their place (the training runs are tests/functional/test_router_bias_compat.py)."""

import pytest
import torch

from megatron.checkpoint.router_bias import fill_zero_router_bias, is_router_bias
from megatron.convert.megatron_io import _layer_tensor
from megatron.convert.schema import ConversionError

LAYER = "layers.0.mlp.router."


def _model_state():
    return {"language_model": {"encoder": {
        LAYER + "weight": torch.randn(4, 8), LAYER + "bias": torch.randn(4),
        "layers.0.mlp.experts.local_experts.0.linear_fc1.bias": torch.randn(16)}}}


def test_only_router_biases_the_checkpoint_lacks_become_zeros():
    template = _model_state()
    saved = _model_state()
    del saved["language_model"]["encoder"][LAYER + "bias"]
    del saved["language_model"]["encoder"]["layers.0.mlp.experts.local_experts.0.linear_fc1.bias"]
    kept = saved["language_model"]["encoder"][LAYER + "weight"]
    filled = fill_zero_router_bias(template, saved)
    assert filled == ["language_model.encoder." + LAYER + "bias"]
    encoder = saved["language_model"]["encoder"]
    assert torch.equal(encoder[LAYER + "bias"], torch.zeros(4))
    assert encoder[LAYER + "weight"] is kept
    # any other missing tensor stays missing: the load still names it
    assert "layers.0.mlp.experts.local_experts.0.linear_fc1.bias" not in encoder
    assert fill_zero_router_bias(template, _model_state()) == []   # nothing absent


def test_router_bias_names():
    assert is_router_bias("decoder.layers.mlp.router.bias")
    assert is_router_bias("language_model.encoder.layers.3.mlp.router.bias")
    assert not is_router_bias("language_model.encoder.layers.3.mlp.router.expert_bias")
    assert not is_router_bias("language_model.encoder.layers.3.mlp.router.weight")


def test_converter_reads_an_absent_router_bias_as_zeros(capsys):
    encoder = _model_state()["language_model"]["encoder"]
    del encoder[LAYER + "bias"]
    got = _layer_tensor(encoder, LAYER + "bias", "some/file.pt")
    assert torch.equal(got, torch.zeros(4)) and got.dtype == encoder[LAYER + "weight"].dtype
    assert "no layers.0.mlp.router.bias in the checkpoint" in capsys.readouterr().out
    assert _layer_tensor(encoder, LAYER + "weight", "some/file.pt") is encoder[LAYER + "weight"]
    with pytest.raises(ConversionError, match=r"some/file.pt: no layers.0.mlp.router.weight"):
        del encoder[LAYER + "weight"]
        _layer_tensor(encoder, LAYER + "weight", "some/file.pt")

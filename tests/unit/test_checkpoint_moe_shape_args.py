"""A checkpoint's mixture-of-experts shape (how many experts, of what size, in which layers)
is checked against the flags on load, in the forms Megatron saves it: ``--moe-layer-freq`` as
an integer, a list or the flag's text, all compared as the layers that hold experts."""

import argparse

import pytest

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.saved_args import check_args


def _args(**overrides):
    values = dict(num_layers=4, hidden_size=8, ffn_hidden_size=16, num_experts=4,
                  moe_layer_freq=1, moe_ffn_hidden_size=None,
                  moe_shared_expert_intermediate_size=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("saved,flags", [
    (dict(moe_layer_freq=[1, 1, 1, 1]), dict(moe_layer_freq=1)),
    (dict(moe_layer_freq="([1,0]*2)"), dict(moe_layer_freq=2)),
    (dict(moe_layer_freq=(1, 0, 1, 0)), dict(moe_layer_freq=2)),
    (dict(moe_ffn_hidden_size=16), dict(moe_ffn_hidden_size=None)),   # Megatron's default
    (dict(num_experts=None, moe_layer_freq=2), dict(num_experts=None)),  # dense: no MoE shape
])
def test_same_moe_shape_in_other_spellings_loads(saved, flags):
    check_args(_args(**saved), _args(**flags), "ckpt")


@pytest.mark.parametrize("saved,flags,message", [
    (dict(moe_layer_freq=2), {}, r"--moe-layer-freq \(checkpoint '1010', flags '1111'\)"),
    (dict(num_experts=8), {}, r"--num-experts \(checkpoint 8, flags 4\)"),
    (dict(moe_ffn_hidden_size=32), {}, r"--moe-ffn-hidden-size \(checkpoint 32, flags 16\)"),
    (dict(moe_shared_expert_intermediate_size=8), {},
     r"--moe-shared-expert-intermediate-size \(checkpoint 8, flags None\)"),
])
def test_other_moe_shape_is_refused_naming_the_flag(saved, flags, message):
    with pytest.raises(CheckpointError, match=r"ckpt: the model shape differs from the flags: "
                       + message):
        check_args(_args(**saved), _args(**flags), "ckpt")

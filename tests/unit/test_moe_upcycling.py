"""Dense-to-MoE upcycling in one process, in float64.

* The experts' weights equal the dense MLP's, cut by hand here (granularity 2: row and column
  slices, a gated unit's gate and value halves sliced separately) and scaled by Megatron's
  factor; the router rows of the pieces of one copy are equal.
* An upcycled MoE layer computes what the dense MLP computes wherever the construction implies
  it: granularity 1 with top-k then softmax (the chosen weights sum to one, every expert is the
  dense MLP), any activation the dense MLP and the experts compute alike (GeLU with biases and
  the bias-GeLU fusion: both tanh-GeLU; SwiGLU; squared ReLU); granularity 2 with squared ReLU (homogeneous of degree 2, so the
  cube-root weight scale is exact); softmax before top-k with a router that scores all experts
  alike (each chosen expert weighs 1 / E, the scale E / k puts it back). fp64, the same sums in
  another order: tolerance 1e-12.
* Refused flag combinations are named in one line.
"""

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.utils import get_init_method, get_output_layer_init_method
from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe.upcycling import (upcycle_expert_weights, upcycle_moe_layer,
                                          upcycle_router_weight)
from megatron.model.transformer import ParallelMLP
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN, FFN = 6, 3, 8, 12


def _config(ffn, **overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=16,
              max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=ffn,
              params_dtype=torch.float64, add_bias_linear=True, bias_gelu_fusion=False,
              bias_swiglu_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _dense_mlp(config, seed=3):
    torch.manual_seed(seed)
    mlp = ParallelMLP(config, None, False, get_init_method(config),
                      get_output_layer_init_method(config))
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            if name.endswith("bias"):   # biases start at zero; make them count
                param.copy_(torch.randn(param.shape, dtype=param.dtype))
    return mlp


def _dense_forward(mlp, x):
    out, bias = mlp(x)
    return out if bias is None else out + bias


def _upcycled(dense_config, granularity, num_experts=4, topk=2, pre_softmax=False):
    moe_config = MoEConfig(num_moe_experts=num_experts, moe_router_topk=topk,
                           moe_router_pre_softmax=pre_softmax,
                           moe_ffn_hidden_size=dense_config.ffn_hidden_size // granularity)
    config = _config(dense_config.ffn_hidden_size // granularity,
                     swiglu=dense_config.swiglu, squared_relu=dense_config.squared_relu,
                     bias_gelu_fusion=dense_config.bias_gelu_fusion,
                     add_bias_linear=dense_config.add_bias_linear)
    dense = _dense_mlp(dense_config)
    layer = MoELayer(config, moe_config, layer_number=1, init_seed=11)
    upcycle_moe_layer(layer, dense, granularity)
    return dense, layer


def test_granularity2_experts_are_the_hand_cut_dense_mlp():
    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(2 * FFN, HIDDEN, generator=gen, dtype=torch.float64)   # [gate; value]
    b1 = torch.randn(2 * FFN, generator=gen, dtype=torch.float64)
    fc2 = torch.randn(HIDDEN, FFN, generator=gen, dtype=torch.float64)
    b2 = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    scale = 2.0 ** (1 / 3)
    experts = upcycle_expert_weights(
        {"fc1_weight": fc1, "fc1_bias": b1, "fc2_weight": fc2, "fc2_bias": b2},
        num_experts=4, granularity=2, scale=scale, gated=True)
    half = FFN // 2
    for e, expert in enumerate(experts):
        lo = (e % 2) * half
        gate_rows, value_rows = slice(lo, lo + half), slice(FFN + lo, FFN + lo + half)
        torch.testing.assert_close(expert["fc1_weight"],
                                   torch.cat([fc1[gate_rows], fc1[value_rows]]) * scale, **TOL)
        torch.testing.assert_close(expert["fc1_bias"],
                                   torch.cat([b1[gate_rows], b1[value_rows]]) * scale, **TOL)
        torch.testing.assert_close(expert["fc2_weight"], fc2[:, lo:lo + half] * scale, **TOL)
        torch.testing.assert_close(expert["fc2_bias"], b2, **TOL)


def test_router_pieces_of_one_copy_share_a_row():
    weight = torch.arange(6 * 2, dtype=torch.float64).view(6, 2)
    grouped = upcycle_router_weight(weight, 3)
    assert grouped.tolist() == [weight[0].tolist()] * 3 + [weight[1].tolist()] * 3
    assert torch.equal(upcycle_router_weight(weight, 1), weight)


@pytest.mark.parametrize("act,granularity,topk,pre_softmax", [
    ({"bias_gelu_fusion": True}, 1, 2, False),
    ({"swiglu": True}, 1, 2, False),
    ({"squared_relu": True}, 1, 1, False),
    ({"squared_relu": True}, 2, 2, False),
    ({"squared_relu": True}, 2, 4, False),
], ids=["gelu-g1", "swiglu-g1", "sqrelu-g1-top1", "sqrelu-g2", "sqrelu-g2-top4"])
def test_upcycled_layer_computes_the_dense_mlp(act, granularity, topk, pre_softmax):
    dense, layer = _upcycled(_config(FFN, **act), granularity, num_experts=4, topk=topk,
                             pre_softmax=pre_softmax)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    out, _ = layer(x)
    torch.testing.assert_close(out, _dense_forward(dense, x), **TOL)


def test_pre_softmax_scale_restores_the_dense_output():
    """Softmax over all E experts, then top-k: with equal scores each chosen copy weighs 1 / E;
    the weights' scale (E / k)^(1/3) (squared ReLU) makes the sum the dense output again.
    Without biases: Megatron copies ``linear_fc2``'s bias unscaled, so there it would count
    k / E times."""
    dense, layer = _upcycled(_config(FFN, squared_relu=True, add_bias_linear=False), 1,
                             num_experts=4, topk=2, pre_softmax=True)
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(layer(x)[0], _dense_forward(dense, x), **TOL)


def test_granularity2_gelu_is_only_approximate():
    """GeLU is not homogeneous: Megatron's square-root scale is an approximation there, and
    the layer says so by differing from the dense MLP (this guards the exact cases above
    against passing for a reason other than the construction)."""
    dense, layer = _upcycled(_config(FFN), 2)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    assert not torch.allclose(layer(x)[0], _dense_forward(dense, x), rtol=0, atol=1e-6)


BASE = """--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8
--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 --lr 1e-3
--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 16 --mock-data --device cpu
--ffn-hidden-size 16""".split()
UPCYCLE = ["--num-experts", "4", "--moe-use-upcycling", "--load", "dense", "--save", "moe"]


def _validate(argv):
    args = parse_args(argv=BASE + argv)
    args.world_size = 1
    return validate_args(args)


def test_upcycling_flags_parse():
    args = _validate(UPCYCLE + ["--moe-upcycling-granularity", "2"])
    assert args.moe_use_upcycling and args.moe_upcycling_granularity == 2
    assert _validate([]).moe_upcycling_granularity == 1 and not _validate([]).moe_use_upcycling


@pytest.mark.parametrize("argv,message", [
    (["--moe-use-upcycling", "--load", "d", "--save", "m"],
     "--moe-use-upcycling needs --num-experts"),
    (["--num-experts", "4", "--moe-use-upcycling", "--load", "d"],
     "--moe-use-upcycling needs --save"),
    (["--num-experts", "4", "--moe-use-upcycling", "--save", "m"],
     "--moe-use-upcycling needs --load"),
    (UPCYCLE + ["--moe-upcycling-granularity", "3"],
     r"--num-experts \(4\) must be a multiple of --moe-upcycling-granularity \(3\)"),
    (UPCYCLE + ["--moe-upcycling-granularity", "0"],
     "--moe-upcycling-granularity must be >= 1, got 0"),
    (UPCYCLE + ["--moe-ffn-hidden-size", "8"],
     r"--moe-ffn-hidden-size \(8\) must equal --ffn-hidden-size \(16\)"),
    (UPCYCLE + ["--moe-upcycling-granularity", "2", "--moe-layer-freq", "2"],
     "--moe-upcycling-granularity 2 with dense layers in --moe-layer-freq"),
    (UPCYCLE + ["--use-torch-fsdp2"], "--moe-use-upcycling with FSDP2"),
    (UPCYCLE + ["--moe-latent-size", "8"], "--moe-use-upcycling with --moe-latent-size"),
])
def test_refused_combinations_are_named_in_one_line(argv, message):
    with pytest.raises(ArgumentsError, match=message) as err:
        _validate(argv)
    assert "\n" not in str(err.value)

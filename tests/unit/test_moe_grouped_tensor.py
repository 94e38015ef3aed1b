"""Megatron-Core's grouped-linear expert layouts (--moe-use-grouped-tensor,
--moe-single-grouped-weight, --moe-single-grouped-bias) and the fused grouped MLP flags.

The references are independent of the module under test: the loop over experts
(:class:`SequentialMLP`, itself checked against a naive fp64 reference in test_moe_layer.py)
with the same weights, and the torch_dist placements of the loop's per-expert names. All
float64; the same sums in another order agree to ~1e-15, the tolerance is 1e-12. Placements
move bytes only, so those comparisons are exact.
"""

import os
import types

import pytest
import torch

from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointReader, load_model_state,
                                      model_shards, placements)
from megatron.checkpoint.dist.keys import KeyMappingError, expert_names
from megatron.core.config import ConfigError, TransformerConfig
from megatron.model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.moe import MoEConfig, MoELayer, SequentialMLP
from megatron.model.moe.grouped_tensor import TEGroupedMLP
from megatron.model.moe.upcycling import upcycle_moe_layer
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.unit.test_moe_megatron_fixture import FIXTURE, LOGITS_ATOL, _reference
from tests.unit.test_moe_upcycling import _dense_mlp

TOL = dict(rtol=0, atol=1e-12)
HIDDEN, FFN = 8, 12
LAYOUTS = {"single-weight-and-bias": (True, True), "single-weight": (True, False),
           "single-bias": (False, True)}


def _config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=16,
              max_position_embeddings=4, seq_length=4, ffn_hidden_size=FFN,
              params_dtype=torch.float64, add_bias_linear=True, swiglu=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _moe(weight=True, bias=True, **kw):
    return MoEConfig(num_moe_experts=4, moe_grouped_gemm=True, moe_use_grouped_tensor=True,
                     moe_single_grouped_weight=weight, moe_single_grouped_bias=bias, **kw)


def _perturbed_loop(config, seed=7):
    loop = SequentialMLP(config, MoEConfig(num_moe_experts=4), 1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in loop.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return loop


def test_parameter_names_and_shapes_are_te_grouped_mlps():
    shapes = {n: tuple(q.shape) for n, q in TEGroupedMLP(_config(), _moe(), 1).named_parameters()}
    assert shapes == {"linear_fc1.weight": (4, 2 * FFN, HIDDEN), "linear_fc1.bias": (4, 2 * FFN),
                      "linear_fc2.weight": (4, HIDDEN, FFN), "linear_fc2.bias": (4, HIDDEN)}
    per_gemm_bias = TEGroupedMLP(_config(), _moe(bias=False), 1)
    names = [n for n, _ in per_gemm_bias.named_parameters()]
    assert names[:5] == ["linear_fc1.weight", "linear_fc1.bias0", "linear_fc1.bias1",
                         "linear_fc1.bias2", "linear_fc1.bias3"]
    per_gemm_weight = TEGroupedMLP(_config(), _moe(weight=False), 1)
    assert "linear_fc2.weight3" in dict(per_gemm_weight.named_parameters())
    assert all(q.allreduce is False for q in per_gemm_weight.parameters())


def test_initial_values_are_the_loops():
    """Each expert from its own seed, as the loop: a model with the flag starts the same."""
    config = _config()
    loop, grouped = SequentialMLP(config, MoEConfig(num_moe_experts=4), 1), \
        TEGroupedMLP(config, _moe(), 1)
    for j, expert in enumerate(loop.local_experts):
        assert torch.equal(grouped.linear_fc1.weight[j], expert.linear_fc1.weight)
        assert torch.equal(grouped.linear_fc2.weight[j], expert.linear_fc2.weight)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("swiglu", [False, True])
def test_forward_and_backward_equal_the_loop_over_experts(layout, swiglu):
    config = _config(swiglu=swiglu, bias_gelu_fusion=False)
    loop = _perturbed_loop(config)
    grouped = TEGroupedMLP(config, _moe(*LAYOUTS[layout]), 1)
    grouped.load_state_dict(loop.state_dict())      # the loop's spelling converts on load
    counts = [3, 0, 5, 2]                            # an expert without rows
    rows = torch.randn(sum(counts), HIDDEN, dtype=torch.float64)
    grad = torch.randn(sum(counts), HIDDEN, dtype=torch.float64)
    results = []
    for module in (loop, grouped):
        x = rows.clone().requires_grad_()
        out = module(x, counts)
        (out * grad).sum().backward()
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)
    torch.testing.assert_close(results[0][1], results[1][1], **TOL)
    for name in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias"):
            stacked_grad = _stacked_grad(getattr(grouped, name), kind)
            for j, expert in enumerate(loop.local_experts):
                want = getattr(getattr(expert, name), kind).grad
                torch.testing.assert_close(stacked_grad[j], want, **TOL, msg=f"{name}.{kind}")
    assert not _stacked_grad(grouped.linear_fc1, "weight")[1].any()   # no rows, no gradient


def _stacked_grad(linear, kind):
    single = linear.single_weight if kind == "weight" else linear.single_bias
    if single:
        return getattr(linear, kind).grad
    return torch.stack([getattr(linear, f"{kind}{j}").grad for j in range(linear.num_gemms)])


def test_state_converts_between_single_and_per_gemm_spellings():
    config = _config()
    loop = _perturbed_loop(config)
    single = TEGroupedMLP(config, _moe(True, True), 1)
    single.load_state_dict(loop.state_dict())
    per_gemm = TEGroupedMLP(config, _moe(False, True), 1)
    per_gemm.load_state_dict(single.state_dict())       # stacked -> weight0..3
    back = TEGroupedMLP(config, _moe(True, True), 1)
    back.load_state_dict(per_gemm.state_dict())         # weight0..3 -> stacked
    for name, tensor in single.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert torch.equal(per_gemm.linear_fc2.weight2, loop.local_experts[2].linear_fc2.weight)
    with pytest.raises(RuntimeError, match="holds \\(3, 24, 8\\), expected 4 local experts"):
        bad = dict(single.state_dict())
        bad["linear_fc1.weight"] = bad["linear_fc1.weight"][:3]
        per_gemm.load_state_dict(bad)


def _layer_state(grouped: bool, swiglu: bool, experts: range):
    """A one-layer chunk's expert tensors (global expert e holds the value e everywhere), in
    the stacked or the loop's spelling."""
    rows = (2 if swiglu else 1) * FFN
    fc1 = [torch.arange(rows * HIDDEN, dtype=torch.float64).view(rows, HIDDEN) + 1000 * e
           for e in experts]
    fc2 = [torch.full((HIDDEN, FFN), float(e)) for e in experts]
    prefix = "language_model.encoder.layers.0.mlp.experts."
    if grouped:
        return {f"{prefix}linear_fc1.weight": torch.stack(fc1),
                f"{prefix}linear_fc2.weight": torch.stack(fc2)}
    state = {}
    for j, (a, b) in enumerate(zip(fc1, fc2)):
        state[f"{prefix}local_experts.{j}.linear_fc1.weight"] = a
        state[f"{prefix}local_experts.{j}.linear_fc2.weight"] = b
    return state


def _written(state, layout):
    """The global tensors the chunk's pieces make (unwritten elements NaN)."""
    out = {}
    for shard in model_shards(state, layout):
        whole = out.setdefault(shard.key, torch.full(shard.global_shape, float("nan"),
                                                     dtype=torch.float64))
        box = tuple(slice(o, o + s) for o, s in zip(shard.global_offset, shard.tensor.shape))
        whole[box] = shard.tensor
    return out


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("per_layer", [False, True])
def test_stacked_experts_land_where_the_loops_do(swiglu, per_layer):
    """torch_dist keys and global shapes do not depend on the layout: EP rank 1 of 2 writes
    the same pieces from the stacked tensors as from the loop's per-expert ones."""
    layout = ChunkLayout(num_layers=3, layer_offset=1, swiglu=swiglu, num_experts=4,
                         expert_offset=2, per_layer=per_layer)
    ours = _written(_layer_state(True, swiglu, range(2, 4)), layout)
    theirs = _written(_layer_state(False, swiglu, range(2, 4)), layout)
    assert ours.keys() == theirs.keys() and len(ours) == 2
    for key in ours:
        assert torch.equal(ours[key].nan_to_num(-1), theirs[key].nan_to_num(-1)), key
    key = "decoder.layers.1." if per_layer else "decoder.layers."
    assert f"{key}mlp.experts.experts.linear_fc1.weight" in ours


def test_per_gemm_names_land_where_the_loops_do_and_expert_names_count_them():
    layout = ChunkLayout(num_layers=1, num_experts=4, expert_offset=2)
    name = "language_model.encoder.layers.0.mlp.experts.linear_fc2.bias1"
    loop = "language_model.encoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"
    assert placements(name, (HIDDEN,), layout) == placements(loop, (HIDDEN,), layout)
    tree = {"language_model": {"encoder": {"layers": {"0": {"mlp": {"experts": {
        "linear_fc1": {"weight": torch.zeros(2, FFN, HIDDEN)},
        "linear_fc2": {"bias0": torch.zeros(HIDDEN), "bias1": torch.zeros(HIDDEN)}}}}}}}}
    assert sorted(n.split("mlp.experts.")[-1] for n in expert_names(tree)) == [
        "local_experts.0.linear_fc1.weight", "local_experts.0.linear_fc2.bias",
        "local_experts.1.linear_fc1.weight", "local_experts.1.linear_fc2.bias"]


def test_stacked_swiglu_fc1_split_over_expert_tp_is_refused_by_name():
    layout = ChunkLayout(num_layers=1, swiglu=True, num_experts=4, tp_size=2, tp_rank=1)
    name = "language_model.encoder.layers.0.mlp.experts.linear_fc1.weight"
    with pytest.raises(KeyMappingError, match="expert-tensor-parallel-size 2 is not stored"):
        placements(name, (4, FFN, HIDDEN), layout)


def test_the_layer_uses_the_grouped_layout_and_checks_megatrons_chain():
    names = [n for n, _ in MoELayer(_config(), _moe()).named_parameters()]
    assert "experts.linear_fc1.weight" in names and "experts.linear_fc2.bias" in names
    with pytest.raises(ConfigError, match="--moe-single-grouped-weight needs "
                                          "--moe-use-grouped-tensor"):
        MoEConfig(num_moe_experts=4, moe_grouped_gemm=True, moe_single_grouped_weight=True)
    with pytest.raises(ConfigError, match="--moe-use-grouped-tensor needs --moe-grouped-gemm"):
        MoEConfig(num_moe_experts=4, moe_use_grouped_tensor=True)
    with pytest.raises(ValueError, match="--moe-single-grouped-bias needs biases"):
        TEGroupedMLP(_config(add_bias_linear=False), _moe(False, True), 1)


@pytest.mark.parametrize("variant", [{"moe_latent_size": 8}, {"moe_mlp_glu_interleave_size": 2}])
def test_grouped_linear_layout_with_latent_or_interleaved_experts_is_refused(variant):
    with pytest.raises(ConfigError, match="--moe-single-grouped-weight with --moe-"):
        MoEConfig(num_moe_experts=4, moe_grouped_gemm=True, moe_use_grouped_tensor=True,
                  moe_single_grouped_weight=True, **variant)
    MoEConfig(num_moe_experts=4, moe_grouped_gemm=True, moe_use_grouped_tensor=True, **variant)


# -- the flags ---------------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
        "--ffn-hidden-size", "16",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--device", "cpu"]
MOE = ["--num-experts", "4", "--moe-grouped-gemm", "--no-bias-gelu-fusion"]


def _validate(extra, world_size=1):
    args = parse_args(argv=BASE + extra)
    args.world_size = world_size
    return validate_args(args)


def test_stacked_swiglu_fc1_under_expert_tp_is_refused_before_training_for_torch_dist():
    flags = MOE + ["--moe-use-grouped-tensor", "--moe-single-grouped-weight", "--swiglu",
                   "--expert-tensor-parallel-size", "2", "--global-batch-size", "2"]
    with pytest.raises(ArgumentsError, match="a stacked fc1 split \\[gate_r; value_r\\] is "
                                             "not written to or read from torch_dist"):
        _validate(flags + ["--ckpt-format", "torch_dist", "--save", "x"], world_size=2)
    flags.remove("--moe-single-grouped-weight")
    assert _validate(flags + ["--ckpt-format", "torch_dist", "--save", "x"], world_size=2).swiglu


@pytest.mark.parametrize("extra,pattern", [
    (["--moe-use-grouped-tensor"], "--moe-use-grouped-tensor needs --moe-grouped-gemm"),
    (MOE + ["--moe-single-grouped-weight"],
     "--moe-single-grouped-weight needs --moe-use-grouped-tensor"),
    (MOE + ["--moe-use-grouped-tensor", "--moe-single-grouped-bias", "--disable-bias-linear"],
     "--moe-single-grouped-bias needs biases"),
    (MOE + ["--moe-shared-expert-intermediate-size", "8", "--disable-bias-linear", "--swiglu",
            "--use-grouped-gemm-for-shared-expert"],
     "FusedSharedExpertMLP needs --moe-shared-expert-glu-interleave-size"),
    (MOE + ["--moe-shared-expert-intermediate-size", "8", "--disable-bias-linear",
            "--use-grouped-gemm-for-shared-expert"], "FusedSharedExpertMLP needs the SwiGLU"),
    (["--use-grouped-gemm-for-dense-mlp", "--use-transformer-engine-op-fuser",
      "--transformer-impl", "transformer_engine", "--swiglu", "--disable-bias-linear"],
     "TEFusedDenseMLP computes in MXFP8"),
    (["--use-grouped-gemm-for-dense-mlp", "--use-transformer-engine-op-fuser",
      "--transformer-impl", "transformer_engine", "--swiglu"], "TEFusedDenseMLP has no biases"),
])
def test_refused_where_megatron_refuses_or_computes_in_mxfp8(extra, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validate(extra)


@pytest.mark.parametrize("extra", [
    MOE + ["--moe-use-grouped-tensor", "--moe-single-grouped-weight",
           "--moe-single-grouped-bias"],
    MOE + ["--use-grouped-gemm-for-shared-expert"],                 # no shared expert
    ["--use-grouped-gemm-for-dense-mlp", "--swiglu"],               # no TE op fuser
    ["--use-grouped-gemm-for-dense-mlp", "--use-transformer-engine-op-fuser"],  # local impl
    MOE + ["--use-grouped-gemm-for-dense-mlp", "--use-transformer-engine-op-fuser",
           "--transformer-impl", "transformer_engine"],             # every layer MoE
])
def test_accepted_where_megatron_runs_the_same_model(extra):
    args = _validate(extra)
    assert args.moe_single_grouped_weight == ("--moe-single-grouped-weight" in extra)


# -- a file Megatron-Core wrote ----------------------------------------------------------------

def test_megatron_cores_moe_file_loads_into_the_single_grouped_weight_layout():
    """tests/data/megatron_written/mcore_dist_moe_ep1 (4 layers, 4 experts, top 2, no bias):
    loaded through torch_dist into stacked expert weights, one forward gives Megatron's
    logits (the fp32 tolerance of test_moe_megatron_fixture.py)."""
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, padded_vocab_size=256,
        max_position_embeddings=64, seq_length=32, ffn_hidden_size=256, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_gelu_fusion=False)
    moe_config = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                           moe_grouped_gemm=True, moe_use_grouped_tensor=True,
                           moe_single_grouped_weight=True)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    torch.manual_seed(0)
    model = GPTModel(config, pstate, moe_config=moe_config)
    state = model.state_dict_for_save_checkpoint()
    reader = DistCheckpointReader(os.path.join(FIXTURE, "iter_0000010"))
    loaded = load_model_state(reader, state, ChunkLayout(num_layers=4, num_experts=4))
    flat = flatten_state_dict(loaded)
    at = "language_model.encoder.layers.3.mlp.experts."
    assert tuple(flat[at + "linear_fc1.weight"].shape) == (4, 256, 64)
    torch.testing.assert_close(
        flat[at + "linear_fc2.weight"][2],
        reader.read("decoder.layers.mlp.experts.experts.linear_fc2.weight")[3, 2], rtol=0, atol=0)
    model.load_state_dict(loaded)
    ref = _reference()
    logits = model(ref["tokens"], ref["position_ids"], ref["attention_mask"])
    torch.testing.assert_close(logits.detach(), ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_upcycling_fills_the_grouped_layout_as_the_loop(layout):
    """--moe-use-upcycling writes each expert in place: the grouped layout gets the loop's
    numbers (which test_moe_upcycling.py checks against the dense MLP)."""
    config = _config(swiglu=True, bias_swiglu_fusion=False)
    dense = _dense_mlp(_config(swiglu=True, ffn_hidden_size=2 * FFN, bias_swiglu_fusion=False))
    loop = MoELayer(config, MoEConfig(num_moe_experts=4), layer_number=1, init_seed=11)
    grouped = MoELayer(config, _moe(*LAYOUTS[layout]), layer_number=1, init_seed=11)
    for layer in (loop, grouped):
        upcycle_moe_layer(layer, dense, 2)
    for j, expert in enumerate(loop.experts.local_experts):
        view = grouped.experts.expert_views()[j]
        for name in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                assert torch.equal(getattr(getattr(view, name), kind),
                                   getattr(getattr(expert, name), kind)), (j, name, kind)
    assert not torch.equal(grouped.experts.linear_fc1.stacked("weight")[0],
                           TEGroupedMLP(config, _moe(*LAYOUTS[layout]), 1,
                                        init_seed=11).linear_fc1.stacked("weight")[0])

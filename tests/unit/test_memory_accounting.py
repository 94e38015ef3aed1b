"""Theoretical memory against hand computation, Megatron's closed forms and real models.

Parameter counts are checked twice: against numbers worked out by hand for a tiny GPT, and against
``sum(p.numel())`` of the real GPTModel chunks for many variants (an independent count, from the
modules themselves). Activation bytes are checked against Korthikanti et al.'s per-layer table
(the numbers written out) and, for the first pipeline stage, against Megatron's closed form
``L sbh (18 + 4f/h) + p (8sb + sbh)`` (times ``1 + (p - 1)/(pv)`` with interleaving).
"""

import resource
import types

import pytest
import torch

from megatron.training import memory_accounting as ma
from megatron.training.arguments import parse_args, validate_args
from megatron.core.config import TransformerConfig
from megatron.model import GPTModel

S, B, H, A, V = 16, 2, 32, 4, 256
SBH = S * B * H


def config(**overrides) -> TransformerConfig:
    kw = dict(num_layers=4, hidden_size=H, num_attention_heads=A, padded_vocab_size=V,
              max_position_embeddings=S, seq_length=S, hidden_dropout=0.0,
              attention_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(**kw)


# ------------------------------------------------------------------------- parameters

def test_parameter_counts_by_hand():
    cfg = config()
    # One layer: 2 LayerNorms (2 x 64) + QKV (96 x 32 + 96) + dense (32 x 32 + 32)
    # + h->4h (128 x 32 + 128) + 4h->h (32 x 128 + 32) = 128 + 3168 + 1056 + 4224 + 4128.
    assert ma.layer_parameters(cfg, 1) == 12704
    # TP 2: 128 + (1536 + 48) + (512 + 32) + (2048 + 64) + (2048 + 32).
    assert ma.layer_parameters(cfg, 2) == 6448
    # Whole model, tied: 4 layers + word (256 x 32) + position (16 x 32) + final norm (64).
    assert ma.num_parameters_on_rank(cfg) == 4 * 12704 + 8192 + 512 + 64
    # TP 2 x PP 2: first stage 2 layers + word/2 + position; last 2 layers + norm + head copy.
    assert ma.num_parameters_on_rank(cfg, 2, 2, 0) == 2 * 6448 + 4096 + 512
    assert ma.num_parameters_on_rank(cfg, 2, 2, 1) == 2 * 6448 + 64 + 4096
    # Untied on one stage: the output layer is one more V x h table.
    assert ma.num_parameters_on_rank(config(untie_embeddings_and_output_weights=True)) == \
        4 * 12704 + 8192 + 512 + 64 + 8192


def _state(pp_size, pp_rank, vp_size=None, vp_rank=None):
    return types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=pp_size,
                                 pp_rank=pp_rank, virtual_pp_size=vp_size,
                                 virtual_pp_rank=vp_rank)


@pytest.mark.parametrize("overrides", [
    {}, {"untie_embeddings_and_output_weights": True}, {"swiglu": True, "ffn_hidden_size": 48},
    {"normalization": "RMSNorm", "add_bias_linear": False},
    {"num_query_groups": 2, "add_qkv_bias": True, "add_bias_linear": False},
    {"position_embedding_type": "rope"},
])
@pytest.mark.parametrize("pp,vp", [(1, None), (2, None), (4, None), (2, 2)])
def test_parameter_counts_match_real_model_chunks(overrides, pp, vp):
    cfg = config(**overrides)
    for rank in range(pp):
        real = 0
        for chunk in range(vp or 1):
            st = _state(pp, rank, vp, chunk if vp else None)
            pre = rank == 0 and chunk == 0
            post = rank == pp - 1 and chunk == (vp or 1) - 1
            model = GPTModel(cfg, st, pre_process=pre, post_process=post)
            real += sum(p.numel() for p in model.parameters())
        assert ma.num_parameters_on_rank(cfg, 1, pp, rank, vp) == real, (rank, overrides)


def test_bytes_per_parameter():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    # Megatron's 18 bytes: bf16 weight 2 + fp32 grad 4 + fp32 master 4 + Adam moments 8.
    assert ma.bytes_per_parameter(bf16, f32) == 18
    for dp in (1, 2, 4, 8):
        assert ma.bytes_per_parameter(bf16, f32, use_distributed_optimizer=True,
                                      dp_size=dp) == pytest.approx(6 + 12 / dp)
    assert ma.bytes_per_parameter(f32, f32) == 16           # no master copy in fp32
    assert ma.bytes_per_parameter(f16, f16) == 16           # fp16 gradients
    assert ma.bytes_per_parameter(f32, f32, "sgd", 0.9) == 12
    assert ma.bytes_per_parameter(f32, f32, "sgd", 0.0) == 8
    # Muon: one fp32 buffer per matrix, Adam's two for the rest; bounded by Adam's 8.
    assert ma.bytes_per_parameter(bf16, f32, "muon") == 18
    # soap / adaptive_muon: two fp32 moments; the layer-wise deal splits them over DP, not the
    # bf16 run's fp32 main copy.
    assert ma.bytes_per_parameter(bf16, f32, "soap") == 18
    assert ma.bytes_per_parameter(bf16, f32, "adaptive_muon", use_distributed_optimizer=True,
                                  dp_size=4) == 2 + 4 + 4 + 8 / 4
    with pytest.raises(ValueError, match="--optimizer must be adam, sgd, lion, muon, dist_muon, "
                                         "soap or adaptive_muon, got 'lamb'"):
        ma.bytes_per_parameter(f32, f32, "lamb")
    # --use-torch-fsdp2: fp32 weight 4 + fp32 grad 4 + Adam 8, all sharded (bf16 is only the
    # compute dtype); accumulating over micro-batches keeps the whole fp32 gradient too.
    for dp in (1, 2, 4):
        for dtype in (f32, bf16):
            assert ma.bytes_per_parameter(dtype, f32, dp_size=dp,
                                          fully_sharded=True) == pytest.approx(16 / dp)
            assert ma.bytes_per_parameter(dtype, f32, dp_size=dp, fully_sharded=True,
                                          accumulates=True) == pytest.approx(16 / dp + 4)


# ------------------------------------------------------------------------- activations

def test_layer_activations_match_the_paper_table():
    cfg = config()
    scores = 5 * A * S * S * B                               # 5as^2b, e = 2
    assert ma.layer_activation_bytes(cfg, B) == 34 * SBH + scores
    assert ma.layer_activation_bytes(cfg, B, 2) == SBH * (10 + 24 / 2) + scores / 2
    assert ma.layer_activation_bytes(cfg, B, 2, True) == SBH * 34 / 2 + scores / 2
    selective = config(recompute_granularity="selective")
    assert ma.layer_activation_bytes(selective, B, 2, True) == SBH * 34 / 2
    assert ma.layer_activation_bytes(selective, B, 4) == SBH * (10 + 24 / 4)
    # fp32 activations: sbh(8e + 2) + 2e sbf + as^2b(2e + 1) with e = 4, f = 4h.
    assert ma.layer_activation_bytes(cfg, B, element_bytes=4) == \
        34 * SBH + 8 * S * B * 4 * H + 9 * A * S * S * B
    # SwiGLU keeps 3 f-wide tensors instead of 2.
    swiglu = config(swiglu=True, ffn_hidden_size=64, recompute_granularity="selective")
    assert ma.layer_activation_bytes(swiglu, B) == 18 * SBH + 6 * S * B * 64


def _megatron_first_stage(cfg, L, p, m, v=None, vocab_term=False):
    """Megatron's closed form (t = 1, selective recomputation), written out."""
    f = cfg.ffn_hidden_size
    act = SBH * (18 + 4 * f / H) * L + 8 * S * B * p + SBH * p
    if v is not None:
        act *= 1 + (p - 1) / (p * v)
    elif p > 1:
        act *= min(1, m / p)
    if vocab_term:
        act += 4 * SBH * (1 + V / H)
    return act


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (2, 3), (8, 8)])
def test_first_stage_activations_equal_megatrons_formula(p, m):
    cfg = config(num_layers=8, recompute_granularity="selective")
    got = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=m, pp_size=p)
    assert got == pytest.approx(_megatron_first_stage(cfg, 8, p, m))


def test_single_stage_activations_equal_megatrons_formula():
    cfg = config(num_layers=8, recompute_granularity="selective")
    got = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=4)
    assert got == pytest.approx(_megatron_first_stage(cfg, 8, 1, 4, vocab_term=True))


def test_interleaved_first_stage_layers_equal_megatrons_factor():
    cfg = config(num_layers=8, recompute_granularity="selective")
    p, v, m = 2, 2, 4
    got = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=m, pp_size=p,
                                      vp_size=v)
    # Layers: Megatron's L sbh 34 (1 + (p-1)/(pv)) = 5 chunks of 2 layers alive at the peak
    # (4 warm-up forwards + 1). Order: F0.0 F0.1 F1.0 F1.1 | F0.2 B1.0 F0.3 B1.1 ...; after F0.3
    # the 5 alive are chunk 0's micro-batches 0-3 and chunk 1's 1, so 4 carry the embedding.
    layers = 8 * SBH * 34 * (1 + (p - 1) / (p * v))
    assert got == pytest.approx(layers + 4 * (8 * S * B + SBH))


def test_later_stages_and_full_recomputation():
    cfg = config(num_layers=8, recompute_granularity="selective")
    per_layer = 34 * SBH
    # 1F1B, p = 4, m = 8: stage r keeps p - r micro-batches of 2 layers; the last stage adds
    # the output layer's 4sbh + 4sbV.
    for r in range(4):
        got = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=8,
                                          pp_size=4, pp_rank=r)
        want = (4 - r) * 2 * per_layer
        want += 4 * (8 * S * B + SBH) if r == 0 else 0
        want += 4 * SBH + 4 * S * B * V if r == 3 else 0
        assert got == pytest.approx(want), r
    full = config(num_layers=8, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    layer = ma.layer_activation_bytes(full, B)
    got = ma.activation_bytes_on_rank(full, micro_batch_size=B, num_microbatches=8, pp_size=4,
                                      pp_rank=1)
    assert got == pytest.approx(3 * 2 * 2 * SBH + layer)     # 3 in flight x 2 inputs, + 1 layer
    block = config(num_layers=8, recompute_granularity="full", recompute_method="block",
                   recompute_num_layers=1)
    layer = ma.layer_activation_bytes(block, B)
    got = ma.activation_bytes_on_rank(block, micro_batch_size=B, num_microbatches=8, pp_size=4,
                                      pp_rank=1)
    assert got == pytest.approx(3 * (2 * SBH + layer) + layer)


# ------------------------------------------------------------------------- from the flags

def test_estimate_from_flags_by_hand():
    argv = """--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
    --use-distributed-optimizer --bf16 --recompute-activations --num-layers 4 --hidden-size 64
    --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2
    --global-batch-size 16 --lr 1e-3 --train-iters 10 --tokenizer-type NullTokenizer
    --vocab-size 100 --mock-data""".split()
    args = parse_args(argv=argv)
    args.world_size = 8
    args = validate_args(args)
    assert args.data_parallel_size == 2
    args.padded_vocab_size = 256
    m = 16 // (2 * 2)
    est0 = ma.estimate_memory(args, 0, m)
    est1 = ma.estimate_memory(args, 1, m)
    # Layer, TP 2, h 64: 256 + (192*64/2 + 96) + (64*64/2 + 64) + (256*64/2 + 128)
    # + (64*256/2 + 64) = 256 + 6240 + 2112 + 8320 + 8256 = 25184.
    assert est0.num_parameters == 2 * 25184 + 128 * 64 + 32 * 64
    assert est1.num_parameters == 2 * 25184 + 128 + 128 * 64
    assert est0.bytes_per_parameter == pytest.approx(6 + 12 / 2)
    sbh = 32 * 2 * 64
    # Stage 0: 2 micro-batches of 2 layers at sbh 34/2 (SP + selective, bf16), plus ids and
    # the embedding dropout mask (sbh/2).
    assert est0.activation_bytes == pytest.approx(2 * (2 * sbh * 17 + 8 * 32 * 2 + sbh / 2))
    assert est1.activation_bytes == pytest.approx(2 * sbh * 17 + 2 * 2 * sbh / 2
                                                  + 4 * 32 * 2 * 256 / 2)
    assert est0.total_bytes == pytest.approx(est0.num_parameters * 12 + est0.activation_bytes)
    pstate = types.SimpleNamespace(rank=6, tp_rank=0, pp_rank=1)
    line = ma.memory_report(args, pstate, m)
    assert line.startswith(f"[Rank 6] (tensor, pipeline) rank (0, 1) theoretical memory (MB): "
                           f"weights+grads+optimizer {est1.weight_and_optimizer_bytes / 2**20:.2f}"
                           f" ({est1.num_parameters} parameters x 12.00 bytes) | activations "
                           f"{est1.activation_bytes / 2**20:.2f} | total")
    assert line.endswith("(max resident set size)")


def test_measured_peak_on_cpu_is_the_resident_set():
    peak, source = ma.measured_peak_bytes()
    assert source == "max resident set size"
    assert peak == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > 0


# ------------------------------------------------------------------------- mixture of experts

def _saved_activation_bytes(module, x) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one training forward,
    parameters (and views of them) excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("swiglu,topk,experts,losses,shared", [
    (False, 2, 4, False, None), (True, 2, 4, True, None), (False, 1, 8, True, None),
    (True, 2, 4, False, 64)])
def test_moe_activation_bytes_match_a_census_of_the_real_layer(swiglu, topk, experts, losses,
                                                               shared):
    """The accounting of an MoE MLP against what autograd actually keeps (balanced routing is
    approximated by a random router; 5% covers the small index tensors and the imbalance)."""
    from megatron.model.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    seq = 64
    cfg = config(seq_length=seq, max_position_embeddings=seq, ffn_hidden_size=48,
                 swiglu=swiglu, add_bias_linear=False, bias_gelu_fusion=False)
    moe = MoEConfig(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=48,
                    moe_aux_loss_coeff=0.01 if losses else 0.0,
                    moe_z_loss_coeff=1e-3 if losses else None,
                    moe_shared_expert_intermediate_size=shared)
    layer = MoELayer(cfg, moe, 1)
    measured = _saved_activation_bytes(layer, torch.randn(seq, B, H, requires_grad=True))
    accounted = ma.moe_mlp_activation_bytes(cfg, moe, B, element_bytes=4)
    assert accounted == pytest.approx(measured, rel=0.05)


def test_moe_layers_replace_the_dense_mlp_in_the_stage_total():
    from megatron.model.moe import MoEConfig

    cfg = config(recompute_granularity="selective")
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=2)
    dense_layer = ma.layer_activation_bytes(cfg, B)
    dense_mlp = 2 * SBH + 2 * 2 * S * B * cfg.ffn_hidden_size   # fc1 input, inner (e = 2)
    moe_layer = dense_layer - dense_mlp + ma.moe_mlp_activation_bytes(cfg, moe, B)
    total = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=1, moe=moe)
    dense_total = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=1)
    # Layers 1 and 3 of 4 are MoE layers (--moe-layer-freq 2).
    assert total == pytest.approx(dense_total + 2 * (moe_layer - dense_layer), rel=1e-12)
    assert total != dense_total


def test_interleaved_groups_of_all_micro_batches_keep_more_alive():
    cfg = config(num_layers=8, recompute_granularity="selective")
    got = ma.activation_bytes_on_rank(cfg, micro_batch_size=B, num_microbatches=4, pp_size=2,
                                      vp_size=2, microbatch_group_size=4)
    # --microbatch-group-size-per-virtual-pipeline-stage 4: stage 0 warms up with
    # 2 (p - 1) + (v - 1) 4 = 6 forwards, F0.0 F0.1 F0.2 F0.3 F1.0 F1.1, then F1.2 before B1.0:
    # 7 chunks of 2 layers alive, chunk 0's 4 micro-batches with the embedding's inputs.
    assert got == pytest.approx(7 * 2 * 34 * SBH + 4 * (8 * S * B + SBH))

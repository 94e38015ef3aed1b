"""Multi-latent attention (--multi-latent-attention) against a naive fp64 MLA written here:
explicit projections, a per-head loop, rotation of neighbouring pairs written out with cos and
sin, RMS norms by hand, and DeepSeek's softmax scale (YaRN's all-dim mscale squared over
sqrt(qk_head_dim + qk_pos_emb_head_dim))."""

import math

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.utils import init_method_normal
from megatron.model.multi_latent_attention import MultiLatentAttention
from megatron.model.rotary_pos_embedding import build_rotary_embedding, yarn_inv_freq, \
    YarnSettings
from megatron.training.arguments import build_parser

H, HEADS, D, R, DV, C = 32, 4, 8, 4, 6, 16


def _config(**kw):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, padded_vocab_size=64,
                max_position_embeddings=64, seq_length=16, attention_dropout=0.0,
                hidden_dropout=0.0, params_dtype=torch.float64, normalization="RMSNorm",
                layernorm_epsilon=1e-6, qk_layernorm=True, add_bias_linear=False,
                position_embedding_type="rope", multi_latent_attention=True,
                kv_lora_rank=C, qk_head_dim=D, qk_pos_emb_head_dim=R, v_head_dim=DV)
    base.update(kw)
    return TransformerConfig(**base)


def _module(config):
    torch.manual_seed(3)
    init = init_method_normal(0.2)
    module = MultiLatentAttention(config, 1, None, 1, False, init, init)
    with torch.no_grad():   # norms away from 1, so a missing norm weight would show
        for name, param in module.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    return module.eval()


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate_pairs(x, pos, inv_freq, mscale):
    """Channel pair (2i, 2i+1) of x [r] at position pos turned by pos * inv_freq[i]."""
    out = torch.empty_like(x)
    for i in range(x.numel() // 2):
        c, s = math.cos(pos * inv_freq[i]) * mscale, math.sin(pos * inv_freq[i]) * mscale
        a, b = x[2 * i].item(), x[2 * i + 1].item()
        out[2 * i], out[2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def _naive_mla(module, x, inv_freq, scale, concentration=1.0):
    """fp64 MLA of x [s, b, h] from the module's weights, one head and token at a time."""
    p = {k: v.detach().double() for k, v in module.state_dict().items()}
    s, b, _ = x.shape
    if "linear_q_proj.weight" in p:
        q_all = x @ p["linear_q_proj.weight"].T
    else:
        q_lat = _rms(x @ p["linear_q_down_proj.weight"].T, p["q_layernorm.weight"])
        q_all = q_lat @ p["linear_q_up_proj.weight"].T                     # [s, b, H*(d+r)]
    kv = x @ p["linear_kv_down_proj.weight"].T
    latent = _rms(kv[..., :C], p["kv_layernorm.weight"])
    k_rope = kv[..., C:]                                                    # [s, b, r]
    kv_up = latent @ p["linear_kv_up_proj.weight"].T                       # [s, b, H*(d+dv)]
    out = torch.zeros(s, b, HEADS * DV, dtype=torch.float64)
    for bi in range(b):
        for h in range(HEADS):
            q = q_all[:, bi, h * (D + R):(h + 1) * (D + R)]
            kvh = kv_up[:, bi, h * (D + DV):(h + 1) * (D + DV)]
            qs = [torch.cat([q[t, :D], _rotate_pairs(q[t, D:], t, inv_freq, concentration)])
                  for t in range(s)]
            ks = [torch.cat([kvh[t, :D], _rotate_pairs(k_rope[t, bi], t, inv_freq,
                                                        concentration)]) for t in range(s)]
            for i in range(s):
                scores = torch.tensor([float(qs[i] @ ks[j]) * scale for j in range(i + 1)],
                                      dtype=torch.float64)
                probs = torch.softmax(scores, 0)
                out[i, bi, h * DV:(h + 1) * DV] = sum(probs[j] * kvh[j, D:] for j in range(i + 1))
    return out @ p["linear_proj.weight"].T


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("flash", [False, True])
def test_mla_matches_naive_fp64(q_lora_rank, flash):
    config = _config(q_lora_rank=q_lora_rank, use_flash_attn=flash)
    module = _module(config)
    assert (q_lora_rank is None) == hasattr(module, "linear_q_proj")
    x = torch.randn(6, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rotary = build_rotary_embedding(config)(6)                            # [s, 1, 1, r]
    out, bias = module(x, None, rotary)
    assert bias is None
    inv_freq = [10000 ** (-2 * i / R) for i in range(R // 2)]
    want = _naive_mla(module, x, inv_freq, 1 / math.sqrt(D + R))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_mla_yarn_scales_rotation_and_softmax():
    kw = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_mscale=0.9,
              yarn_mscale_all_dim=0.7, yarn_original_max_position_embeddings=8,
              q_lora_rank=12)
    config = _config(**kw)
    module = _module(config)
    x = torch.randn(5, 1, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, _ = module(x, None, build_rotary_embedding(config)(5))

    def m(k):
        return 0.1 * k * math.log(4.0) + 1

    yarn = YarnSettings(scaling_factor=4.0, original_max_position_embeddings=8, mscale=0.9,
                        mscale_all_dim=0.7)
    inv_freq = yarn_inv_freq(R, 10000, yarn).tolist()
    want = _naive_mla(module, x, inv_freq, m(0.7) ** 2 / math.sqrt(D + R),
                      concentration=m(0.9) / m(0.7))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_mla_interleaved_rotary_gives_the_same_scores():
    x = torch.randn(5, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    outs = []
    for interleaved in (False, True):
        config = _config(rotary_interleaved=interleaved)
        outs.append(_module(config)(x, None, build_rotary_embedding(config)(5))[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


def test_mla_flags_parse_and_bad_values_are_refused():
    args = build_parser().parse_args([])
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim) == (False, None, 32, 128, 64, 128)
    args = build_parser().parse_args(["--multi-latent-attention", "--q-lora-rank", "24"])
    assert args.multi_latent_attention and args.q_lora_rank == 24
    with pytest.raises(ConfigError, match="--position-embedding-type rope or yarn"):
        _config(position_embedding_type="learned_absolute")
    with pytest.raises(ConfigError, match="--qk-pos-emb-head-dim must be even"):
        _config(qk_pos_emb_head_dim=3)
    with pytest.raises(ConfigError, match="--group-query-attention"):
        _config(num_query_groups=2)
    with pytest.raises(ConfigError, match="--kv-lora-rank"):
        _config(kv_lora_rank=0)


# -- torch_dist keys ----------------------------------------------------------------------------

def _mla_gpt(q_lora_rank):
    import types

    from megatron.checkpoint.dist import chunk_layout
    from megatron.model.gpt_model import GPTModel

    config = _config(q_lora_rank=q_lora_rank, num_layers=2, params_dtype=torch.float32)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
    torch.manual_seed(0)
    model = GPTModel(config, pstate)
    return model, chunk_layout(config, pstate)


def test_mla_placements_split_up_projections_by_heads_and_replicate_down_projections():
    from megatron.checkpoint.dist import ChunkLayout, placements

    rank1 = ChunkLayout(num_layers=2, tp_rank=1, tp_size=2, mla=True)
    prefix = "language_model.encoder.layers.1."
    up, = placements(prefix + "self_attention.linear_kv_up_proj.weight", (28, 16), rank1)
    assert (up.key, up.global_shape, up.global_offset, up.written) == (
        "decoder.layers.self_attention.linear_kv_up_proj.weight", (2, 56, 16), (1, 28, 0), True)
    proj, = placements(prefix + "self_attention.linear_proj.weight", (32, 12), rank1)
    assert (proj.global_shape, proj.global_offset) == ((2, 32, 24), (1, 0, 12))
    down, = placements(prefix + "self_attention.linear_kv_down_proj.weight", (20, 32), rank1)
    assert (down.global_shape, down.global_offset, down.written) == ((2, 20, 32), (1, 0, 0),
                                                                     False)
    norm, = placements(prefix + "input_layernorm.weight", (32,), rank1)
    assert norm.key == "decoder.layers.input_layernorm.weight"
    kv_norm, = placements(prefix + "self_attention.kv_layernorm.weight", (16,), rank1)
    assert kv_norm.key == "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight"


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_model_saves_megatron_core_keys_and_loads_both_spellings(tmp_path, q_lora_rank):
    from megatron.checkpoint.dist import (DistCheckpointReader, extra_state_objects,
                                          load_model_state, model_shards, save_shards)
    from megatron.model.module import flatten_state_dict

    model, layout = _mla_gpt(q_lora_rank)
    state = model.state_dict_for_save_checkpoint()
    save_shards(str(tmp_path / "te"), model_shards(state, layout))
    reader = DistCheckpointReader(str(tmp_path / "te"))
    attn = "decoder.layers.self_attention."
    q_keys = ({attn + "linear_q_proj.weight": (2, HEADS * (D + R), H)} if q_lora_rank is None
              else {attn + "linear_q_down_proj.weight": (2, 12, H),
                    attn + "linear_q_up_proj.layer_norm_weight": (2, 12),
                    attn + "linear_q_up_proj.weight": (2, HEADS * (D + R), 12)})
    want = {**q_keys, "decoder.layers.input_layernorm.weight": (2, H),
            attn + "linear_kv_down_proj.weight": (2, C + R, H),
            attn + "linear_kv_up_proj.layer_norm_weight": (2, C),
            attn + "linear_kv_up_proj.weight": (2, HEADS * (D + DV), C),
            attn + "linear_proj.weight": (2, H, HEADS * DV)}
    layer_keys = {k: v for k, v in ((k, s) for k, (s, _) in reader.summary().items())
                  if k.startswith("decoder.layers.") and not k.startswith("decoder.layers.mlp")}
    assert layer_keys == want
    extra = {o.fqn.split("/")[0] for o in extra_state_objects(
        layout, 2, list(flatten_state_dict(state)))}
    modules = ["linear_proj", "linear_kv_down_proj", "linear_kv_up_proj"] + (
        ["linear_q_proj"] if q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"])
    assert {attn + m + "._extra_state" for m in modules} <= extra
    assert attn + "linear_qkv._extra_state" not in extra
    # Megatron-Core's local spec spells the latent norms q_layernorm / kv_layernorm.
    renamed = [s for s in model_shards(state, layout)]
    for shard in renamed:
        for te, local in (("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"),
                          ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight")):
            shard.key = shard.key.replace(te, local)
    save_shards(str(tmp_path / "local"), renamed)
    for folder in ("te", "local"):
        other, _ = _mla_gpt(q_lora_rank)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        loaded = load_model_state(DistCheckpointReader(str(tmp_path / folder)),
                                  other.state_dict_for_save_checkpoint(), layout)
        flat, saved = flatten_state_dict(loaded), flatten_state_dict(state)
        assert [k for k in saved if not torch.equal(flat[k], saved[k])] == [], folder


def test_converter_reads_mla_sizes_and_yarn_from_saved_args():
    """The converter's view of an MLA checkpoint's args: its sizes, and YaRN under rope as the
    training runs it."""
    import types

    from megatron.convert import megatron_io

    args = build_parser().parse_args([
        "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
        "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
        "--position-embedding-type", "rope", "--rotary-scaling-factor", "4",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"])
    args.padded_vocab_size, args.seq_length = 64, 16
    source = types.SimpleNamespace(args=args, file=lambda *_: "ckpt/iter_0000001",
                                   scheduler=None, release=True, bert=False, num_tokentypes=0,
                                   binary_head=False)
    meta = megatron_io._meta_from_args(source, 64)
    assert (meta.multi_latent_attention, meta.q_lora_rank, meta.kv_lora_rank, meta.qk_head_dim,
            meta.qk_pos_emb_head_dim, meta.v_head_dim) == (True, 12, 16, 8, 4, 6)
    assert (meta.position_embedding_type, meta.rotary_scaling_factor) == ("yarn", 4.0)


def test_mla_under_rope_takes_yarn_as_megatron_core_does():
    """DeepSeek-V3's recipe: --position-embedding-type rope with --rotary-scaling-factor 40
    --mscale 1 --mscale-all-dim 1 runs YaRN (MLA's rope type when --rope-type is unset)."""
    from megatron.model.multi_latent_attention import mla_softmax_scale
    from megatron.training.configs import _position_embedding_type

    words = ["--multi-latent-attention", "--position-embedding-type", "rope",
             "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"]
    args = build_parser().parse_args(words)
    assert _position_embedding_type(args) == "yarn"
    assert _position_embedding_type(build_parser().parse_args(words[1:])) == "rope"
    config = _config(position_embedding_type="yarn", yarn_rotary_scaling_factor=40.0,
                     yarn_mscale=1.0, yarn_mscale_all_dim=1.0, qk_head_dim=128,
                     qk_pos_emb_head_dim=64)
    m = 0.1 * math.log(40.0) + 1
    assert mla_softmax_scale(config) == pytest.approx(m * m / math.sqrt(192), rel=1e-15)


def test_mla_rope_type_rope_rotates_plainly_and_keeps_the_yarn_softmax_scale():
    """--rope-type rope: MLA's rotary channels turn by plain rope frequencies, no cos/sin
    concentration, while the softmax scale keeps YaRN's all-dim mscale of
    --rotary-scaling-factor and --mscale-all-dim squared (as Megatron-Core computes it)."""
    from megatron.training.configs import _position_embedding_type

    words = ["--multi-latent-attention", "--position-embedding-type", "rope",
             "--rotary-scaling-factor", "4", "--mscale", "0.9", "--mscale-all-dim", "0.7"]
    assert _position_embedding_type(build_parser().parse_args(words + ["--rope-type", "rope"])) \
        == "rope"
    assert _position_embedding_type(build_parser().parse_args(words + ["--rope-type", "yarn"])) \
        == "yarn"
    config = _config(position_embedding_type="rope", rope_type="rope",
                     yarn_rotary_scaling_factor=4.0, yarn_mscale=0.9, yarn_mscale_all_dim=0.7,
                     q_lora_rank=12)
    module = _module(config)
    x = torch.randn(5, 1, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out, _ = module(x, None, build_rotary_embedding(config)(5))
    m = 0.1 * 0.7 * math.log(4.0) + 1
    inv_freq = [10000 ** (-2 * i / R) for i in range(R // 2)]
    want = _naive_mla(module, x, inv_freq, m * m / math.sqrt(D + R))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_rope_type_is_refused_where_megatron_core_refuses_it():
    with pytest.raises(ConfigError, match="--rope-type yarn applies to --multi-latent-attention"):
        _config(multi_latent_attention=False, rope_type="yarn", qk_layernorm=False)
    _config(multi_latent_attention=False, rope_type="rope", qk_layernorm=False)
    with pytest.raises(ConfigError, match="--use-rope-scaling does not apply"):
        _config(use_rope_scaling=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rope-type", "llama3"])


def test_converter_takes_mla_rope_type_and_refuses_what_deepseek_v3_cannot_hold():
    import types

    from megatron.convert import hf, megatron_io
    from megatron.convert.schema import ConversionError

    base = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--rope-type", "rope"]

    def meta(*extra):
        args = build_parser().parse_args(base + list(extra))
        args.padded_vocab_size, args.seq_length = 64, 16
        source = types.SimpleNamespace(args=args, file=lambda *_: "ckpt/iter_0000001",
                                       scheduler=None, release=True, bert=False,
                                       num_tokentypes=0, binary_head=False)
        return megatron_io._meta_from_args(source, 64)

    assert meta().position_embedding_type == "rope"
    assert hf.family_for_meta(meta()).ARCHITECTURE == "DeepseekV3ForCausalLM"
    with pytest.raises(ConversionError, match="--rope-type rope with --rotary-scaling-factor"):
        hf.family_for_meta(meta("--rotary-scaling-factor", "4", "--mscale-all-dim", "1"))


def _cp_args(*extra, cp=4):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=["--multi-latent-attention", "--context-parallel-size", str(cp),
                            "--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "16",
                            "--max-position-embeddings", "16", "--micro-batch-size", "1",
                            "--position-embedding-type", "rope", *extra])
    args.world_size = cp
    return validate_args(args) or args


def test_mla_with_context_parallelism_validates_and_bad_cp_flags_name_themselves():
    from megatron.training.arguments import ArgumentsError

    assert _cp_args("--cp-comm-type", "all_gather").cp_comm_type == "all_gather"
    args = _cp_args("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                    "2", "2")
    assert (args.cp_comm_type, args.hierarchical_context_parallel_sizes) == ("a2a+p2p", [2, 2])
    assert _cp_args("--cp-comm-type", "p2p", "allgather").cp_comm_type == ["p2p", "all_gather"]
    with pytest.raises(ArgumentsError, match="^--cp-comm-type a2a\\+p2p needs "
                                             "--hierarchical-context-parallel-sizes"):
        _cp_args("--cp-comm-type", "a2a+p2p")
    with pytest.raises(ArgumentsError, match="^--hierarchical-context-parallel-sizes 2 4: "
                                             "expected two sizes .* --context-parallel-size 4"):
        _cp_args("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4")
    with pytest.raises(ArgumentsError, match="^--cp-comm-type p2p a2a p2p: give one type for "
                                             "every layer, or one per layer \\(--num-layers 2"):
        _cp_args("--cp-comm-type", "p2p", "a2a", "p2p")
    with pytest.raises(ArgumentsError, match="a2a\\+p2p splits the 4 attention heads .* over "
                                             "the first --hierarchical-context-parallel-sizes 8"):
        _cp_args("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "8", "1",
                 cp=8)


def test_mla_selective_recompute_gives_the_same_gradients():
    x = torch.randn(6, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for granularity in (None, "selective"):
        config = _config(q_lora_rank=12, recompute_granularity=granularity)
        module = _module(config).train()
        out, _ = module(x, None, build_rotary_embedding(config)(6))
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-12, msg=name)

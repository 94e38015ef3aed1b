"""The gated delta net layer (--experimental-attention-variant gdn) against transformers' own
Qwen3-Next linear attention (built here from a tiny config, never downloaded) with the same
weights, and against a per-token fp64 recurrence written out below in its matrix form."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.utils import get_init_method, get_output_layer_init_method
from megatron.model.gated_delta_net import GatedDeltaNet, is_gdn, linear_attention_pattern

H, NK, NV, DK, DV, KERNEL = 32, 2, 4, 8, 6, 4


def _config(dtype=torch.float32, **kw):
    return TransformerConfig(
        num_layers=4, hidden_size=H, num_attention_heads=4, padded_vocab_size=64,
        max_position_embeddings=32, seq_length=16, normalization="RMSNorm",
        layernorm_epsilon=1e-6, swiglu=True, add_bias_linear=False, params_dtype=dtype,
        experimental_attention_variant="gdn", linear_attention_freq=2,
        linear_conv_kernel_dim=KERNEL, linear_key_head_dim=DK, linear_value_head_dim=DV,
        linear_num_key_heads=NK, linear_num_value_heads=NV, **kw)


def _layer(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = _config(dtype)
    layer = GatedDeltaNet(config, 1, None, 1, False, get_init_method(config),
                          get_output_layer_init_method(config))
    with torch.no_grad():   # away from the small init and the ones, so every weight counts
        layer.in_proj.weight.normal_(0, 0.3)
        layer.out_proj.weight.normal_(0, 0.3)
        layer.out_norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1, 1)
    return layer


def _hf_layer(ours):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    config = transformers.Qwen3NextConfig(
        hidden_size=H, linear_num_key_heads=NK, linear_num_value_heads=NV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL,
        hidden_act="silu", rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["linear_attention"])
    hf = Qwen3NextGatedDeltaNet(config, 0).eval()
    kd, vd, r = NK * DK, NV * DV, NV // NK
    q, k, v, z, b, a = torch.split(ours.in_proj.weight.detach(), [kd, kd, vd, vd, NV, NV])
    # transformers groups the rows by key head: [q_g, k_g, v_g (r heads), z_g (r heads)].
    qkvz = torch.cat([q.view(NK, DK, H), k.view(NK, DK, H), v.view(NK, r * DV, H),
                      z.view(NK, r * DV, H)], dim=1).reshape(-1, H)
    ba = torch.cat([b.view(NK, r, H), a.view(NK, r, H)], dim=1).reshape(-1, H)
    with torch.no_grad():
        hf.in_proj_qkvz.weight.copy_(qkvz)
        hf.in_proj_ba.weight.copy_(ba)
        hf.conv1d.weight.copy_(ours.conv1d.weight)
        hf.A_log.copy_(ours.A_log)
        hf.dt_bias.copy_(ours.dt_bias)
        hf.norm.weight.copy_(ours.out_norm.weight)
        hf.out_proj.weight.copy_(ours.out_proj.weight)
    return hf


def test_layer_matches_transformers_qwen3_next():
    ours = _layer()
    hf = _hf_layer(ours)
    x = torch.randn(2, 70, H)                      # [b, s, h]; over one 64-token chunk
    with torch.no_grad():
        expected = hf(x)
        got, bias = ours(x.transpose(0, 1))
    assert bias is None
    # transformers' chunked fp32 form (a triangular solve per 64 tokens) rounds differently
    # from the per-token loop: 1e-5 of the output's scale.
    scale = expected.abs().max().item()
    assert scale > 1
    torch.testing.assert_close(got.transpose(0, 1), expected, rtol=0, atol=1e-5 * scale)


def _naive_fp64(layer, x):
    """Every step written out for one sequence and one head at a time, in fp64: the state
    update in its matrix form S = exp(g) (I - beta k k^T) S + beta k v^T, o = S^T q / sqrt(dk)."""
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    s_len, batch, _ = x.shape
    kd, vd = NK * DK, NV * DV
    proj = x.double() @ w["in_proj.weight"].T                       # [s, b, rows]
    qkv, z, b, a = torch.split(proj, [2 * kd + vd, vd, NV, NV], dim=-1)
    conv = torch.zeros_like(qkv)
    for t in range(s_len):
        for j in range(KERNEL):                                     # tap j sees token t-K+1+j
            src = t - KERNEL + 1 + j
            if src >= 0:
                conv[t] += qkv[src] * w["conv1d.weight"][:, 0, j]
    conv = F.silu(conv)
    out = torch.zeros(s_len, batch, NV, DV, dtype=torch.float64)
    for n in range(batch):
        for head in range(NV):
            kh = head // (NV // NK)
            state = torch.zeros(DK, DV, dtype=torch.float64)
            for t in range(s_len):
                q = conv[t, n, kh * DK:(kh + 1) * DK]
                k = conv[t, n, kd + kh * DK:kd + (kh + 1) * DK]
                v = conv[t, n, 2 * kd + head * DV:2 * kd + (head + 1) * DV]
                q, k = (u / torch.sqrt(u.dot(u) + 1e-6) for u in (q, k))
                decay = torch.exp(-torch.exp(w["A_log"][head])
                                  * F.softplus(a[t, n, head] + w["dt_bias"][head]))
                beta = torch.sigmoid(b[t, n, head])
                eye = torch.eye(DK, dtype=torch.float64)
                state = decay * (eye - beta * torch.outer(k, k)) @ state + beta * torch.outer(k, v)
                out[t, n, head] = state.T @ q / DK ** 0.5
    rms = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * w["out_norm.weight"]
    gated = rms * F.silu(z.view(s_len, batch, NV, DV))
    return gated.reshape(s_len, batch, vd) @ w["out_proj.weight"].T


def test_layer_matches_fp64_naive_recurrence():
    layer = _layer(torch.float64, seed=1)
    x = torch.randn(9, 2, H, dtype=torch.float64)
    with torch.no_grad():
        got, _ = layer(x)
    expected = _naive_fp64(layer, x)
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_linear_attention_pattern_follows_megatron_rule():
    assert is_gdn("gdn") and is_gdn("gated_delta_net") and not is_gdn("gdn2")
    assert linear_attention_pattern(4, 8) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert linear_attention_pattern(1, 3) == [0, 0, 0]
    assert linear_attention_pattern((1, 0, 1), 3) == [1, 0, 1]
    with pytest.raises(ConfigError, match="--linear-attention-freq"):
        linear_attention_pattern((1, 0), 3)


@pytest.mark.parametrize("kw, match", [
    (dict(experimental_attention_variant="gdn2"), "gdn2: not built yet"),
    (dict(linear_num_value_heads=3), "multiple of --linear-num-key-heads"),
    (dict(linear_attention_freq=None), "needs --linear-attention-freq"),
    (dict(linear_attention_freq=(1, 0)), "one 1 \\(linear\\) or 0 per layer"),
])
def test_bad_settings_name_the_flag(kw, match):
    base = dict(experimental_attention_variant="gdn", linear_attention_freq=2,
                linear_num_key_heads=NK, linear_num_value_heads=NV)
    base.update(kw)
    with pytest.raises(ConfigError, match=match):
        TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=4,
                          padded_vocab_size=64, max_position_embeddings=32, seq_length=16,
                          swiglu=True, **base)


def test_conversion_refuses_gdn_checkpoints():
    """A converter would join in_proj's sectioned TP shards as replicated tensors: refused."""
    import argparse
    import types

    from megatron.convert.megatron_io import ConversionError, _meta_from_args

    args = argparse.Namespace(experimental_attention_variant="gdn", num_layers=4)
    src = types.SimpleNamespace(args=args, file=lambda *ranks: "mp_rank_00/model_optim_rng.pt")
    with pytest.raises(ConversionError, match="--experimental-attention-variant: this"):
        _meta_from_args(src, None)

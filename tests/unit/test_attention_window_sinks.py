"""Sliding-window attention (--window-size, --window-attn-skip-freq) and softmax offsets
(--softmax-type off-by-one / learnable, attention sinks) in CoreAttention, against a naive fp64
attention that builds its banded mask and its extra softmax column element by element.
"""

import argparse

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.fused_kernels.softmax import (FusedScaleMaskSoftmax, attention_mask_func,
                                            sliding_window_mask, softmax_with_offset_reference)
from megatron.model.attention import CoreAttention
from megatron.model.enums import AttnMaskType
from megatron.training.arguments import build_parser, parse_window_size


def _config(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                max_position_embeddings=64, seq_length=16, attention_dropout=0.0,
                hidden_dropout=0.0, params_dtype=torch.float64)
    base.update(kw)
    return TransformerConfig(**base)


def _naive_mask(sq, sk, window, causal=True):
    """True = masked, one element at a time: query i is at position i + sk - sq."""
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        pos = i + sk - sq
        for j in range(sk):
            hidden = causal and j > pos
            if window is not None:
                left, right = window
                hidden |= (left >= 0 and j < pos - left) or (right >= 0 and j > pos + right)
            mask[i, j] = hidden
    return mask


def _naive_attention(q, k, v, mask, offset=None):
    """fp64 softmax(q k^T / sqrt(d)) v with masked scores dropped; ``offset`` [np] is one more
    column of the softmax per head whose probability is thrown away. q/k/v [s, b, np, hn]."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.size(-1) ** 0.5
    scores = scores.masked_fill(mask, float("-inf"))
    if offset is not None:
        b, h, sq, _ = scores.shape
        column = offset.double().view(1, h, 1, 1).expand(b, h, sq, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if offset is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(q.size(0), q.size(1), -1)


def _qkv(sq, sk=None, b=2, heads=4, hn=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sk = sk or sq
    return (torch.randn(sq, b, heads, hn, generator=gen, dtype=dtype),
            torch.randn(sk, b, heads, hn, generator=gen, dtype=dtype),
            torch.randn(sk, b, heads, hn, generator=gen, dtype=dtype))


def test_window_flags_parse_as_megatron_and_refuse_bad_values():
    parser = build_parser()
    args = parser.parse_args(["--window-size", "128,0", "--window-attn-skip-freq", "[1,1,0]*2",
                              "--softmax-type", "learnable"])
    assert args.window_size == (128, 0)
    assert args.window_attn_skip_freq == (1, 1, 0, 1, 1, 0)
    assert args.softmax_type == "learnable"
    assert parse_window_size("(-1,0)") == (-1, 0)
    defaults = parser.parse_args([])
    assert (defaults.window_size, defaults.window_attn_skip_freq, defaults.softmax_type) == (
        None, None, "vanilla")
    for bad in ("128", "a,b", "-2,0", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="--window-size"):
            parse_window_size(bad)
    with pytest.raises(ConfigError, match="--window-attn-skip-freq: a list needs one"):
        _config(window_size=(4, 0), window_attn_skip_freq=(1, 0))
    with pytest.raises(ConfigError, match="--window-attn-skip-freq needs --window-size"):
        _config(window_attn_skip_freq=2)
    with pytest.raises(ConfigError, match="--softmax-type"):
        _config(softmax_type="sigmoid")


def test_layer_pattern_follows_megatron():
    every_second = _config(window_size=(3, 0), window_attn_skip_freq=2)
    assert [every_second.layer_window(n) for n in (1, 2, 3, 4)] == [(3, 0), None, (3, 0), None]
    listed = _config(window_size=(3, 0), window_attn_skip_freq=(0, 1, 1, 0))
    assert [listed.layer_window(n) for n in (1, 2, 3, 4)] == [None, (3, 0), (3, 0), None]
    assert _config(window_size=(3, 0)).layer_window(4) == (3, 0)
    assert _config().layer_window(1) is None


@pytest.mark.parametrize("sq,sk,window", [(7, 7, (2, 0)), (7, 7, (0, 0)), (3, 9, (4, 0)),
                                          (6, 6, (-1, 0)), (6, 6, (1, 2)), (5, 5, (-1, -1))])
def test_sliding_window_mask_is_the_band(sq, sk, window):
    assert torch.equal(sliding_window_mask(sq, sk, window), _naive_mask(sq, sk, window, False))


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("freq", [None, 2, (0, 1, 1, 0)])
def test_windowed_layers_match_naive_banded_attention(fusion, flash, freq):
    """Each layer of a 4-layer pattern against the naive band (or plain causal for the layers
    the pattern leaves full); a sequence of 12 is much longer than the window of 3 keys."""
    config = _config(window_size=(2, 0), window_attn_skip_freq=freq,
                     masked_softmax_fusion=fusion, use_flash_attn=flash)
    q, k, v = _qkv(12)
    full = _naive_attention(q, k, v, _naive_mask(12, 12, None))
    for layer in (1, 2, 3, 4):
        window = config.layer_window(layer)
        out = CoreAttention(config, layer, 4).eval()(q, k, v, None)
        want = _naive_attention(q, k, v, _naive_mask(12, 12, window))
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        assert (window is None) == torch.allclose(out, full)


def test_window_adds_to_an_explicit_mask_and_a_kv_cache_offset():
    """A padding mask given with the window is kept; queries at the end of a longer key
    sequence (decoding with a cache) see the window ending at their own position."""
    config = _config(window_size=(3, 0))
    q, k, v = _qkv(4, 10)
    pad = torch.zeros(2, 1, 4, 10, dtype=torch.bool)
    pad[1, :, :, 8] = True
    causal = _naive_mask(4, 10, None)
    out = CoreAttention(config, 1, 4).eval()(q, k, v, pad | causal)
    want = _naive_attention(q, k, v, pad | _naive_mask(4, 10, (3, 0)))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_attention_runs_the_compiled_masked_softmax(dtype, monkeypatch):
    """With the compiled kernels installed, the band reaches the fused masked softmax (its
    body is called, forward and backward) and the result stays within the kernel tolerance
    of fp64."""
    from megatron.fused_kernels import ops

    if not ops.install():
        pytest.skip("compiled kernels unavailable")
    calls = []
    apply = ops.ScaledMaskedSoftmax.apply
    monkeypatch.setattr(ops.ScaledMaskedSoftmax, "apply",
                        lambda *a: calls.append(a[1].shape) or apply(*a))
    try:
        config = _config(window_size=(4, 0), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                         attention_softmax_in_fp32=True)
        q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(16))
        out = CoreAttention(config, 1, 4).eval()(q, k, v, None)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        out.backward(grad.to(dtype))
    finally:
        ops.uninstall()
    assert calls and calls[-1] == (1, 1, 16, 16)     # (a first call may be the self-check)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _naive_attention(q64, k64, v64, _naive_mask(16, 16, (4, 0)))
    want.backward(grad.double())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=tol, atol=tol)


def test_causal_window_with_a_right_side_is_refused():
    with pytest.raises(ConfigError, match="--window-size 4,2: causal attention"):
        CoreAttention(_config(window_size=(4, 2)), 1, 4)
    bidirectional = CoreAttention(_config(window_size=(2, 1)), 1, 4, AttnMaskType.padding).eval()
    q, k, v = _qkv(8)
    torch.testing.assert_close(bidirectional(q, k, v, None),
                               _naive_attention(q, k, v, _naive_mask(8, 8, (2, 1), False)),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("flash", [False, True])
def test_softmax_offset_matches_the_extra_column(softmax_type, fusion, flash):
    config = _config(softmax_type=softmax_type, masked_softmax_fusion=fusion,
                     use_flash_attn=flash, window_size=(3, 0), window_attn_skip_freq=2)
    q, k, v = _qkv(10)
    for layer in (1, 2):
        core = CoreAttention(config, layer, 4).eval()
        offset = core.softmax_offset
        if softmax_type == "off-by-one":
            assert torch.equal(offset, torch.zeros(4, dtype=torch.float64))
            assert "softmax_offset" not in core.state_dict()
        else:
            assert isinstance(offset, torch.nn.Parameter) and offset.abs().sum() > 0
            with torch.no_grad():
                offset.copy_(torch.tensor([2.0, -1.0, 0.5, 8.0]))
            assert list(core.state_dict()) == ["softmax_offset"]
        out = core(q, k, v, None)
        want = _naive_attention(q, k, v, _naive_mask(10, 10, config.layer_window(layer)),
                                offset.detach())
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        # a sink takes probability away: the output differs from plain attention
        plain = _naive_attention(q, k, v, _naive_mask(10, 10, config.layer_window(layer)))
        assert not torch.allclose(out, plain, atol=1e-3)


def test_learnable_offset_gradient_matches_finite_differences():
    """The module's parameter gets d(loss)/d(offset) of the naive fp64 attention, taken by
    central differences one head at a time."""
    core = CoreAttention(_config(softmax_type="learnable", window_size=(2, 0)), 1, 4).eval()
    offset = torch.tensor([0.3, -0.2, 1.5, 0.0], dtype=torch.float64)
    with torch.no_grad():
        core.softmax_offset.copy_(offset)
    q, k, v = _qkv(6, b=1)
    grad_out = torch.randn(6, 1, 32, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
    (core(q, k, v, None) * grad_out).sum().backward()

    def loss_of(off):
        return (_naive_attention(q, k, v, _naive_mask(6, 6, (2, 0)), off) * grad_out).sum()

    eps, numeric = 1e-6, torch.zeros(4, dtype=torch.float64)
    for h in range(4):
        step = torch.zeros(4, dtype=torch.float64)
        step[h] = eps
        numeric[h] = (loss_of(offset + step) - loss_of(offset - step)) / (2 * eps)
    torch.testing.assert_close(core.softmax_offset.grad, numeric, rtol=1e-6, atol=1e-9)
    assert numeric.abs().min() > 1e-4          # every head's offset matters


def test_softmax_offset_reference_passes_gradcheck():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    offset = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = _naive_mask(4, 5, (2, 0))[None, None]
    assert torch.autograd.gradcheck(
        lambda a, o: softmax_with_offset_reference(a, mask, 0.7, o), (x, offset))


def test_fused_module_takes_the_reference_for_an_offset_with_half_scores():
    """Half-precision scores with an offset: computed in fp32 on either path, same numbers."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 8, 8, generator=gen).to(torch.bfloat16)
    offset = torch.randn(4, generator=gen)
    outs = [FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, fused, attention_mask_func,
                                  True, None)(x, None, offset) for fused in (True, False)]
    want = softmax_with_offset_reference(x.double(), _naive_mask(8, 8, None)[None, None], 1.0,
                                         offset.double())
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), want, rtol=1e-2, atol=1e-2)


def test_learnable_offset_is_drawn_for_all_heads_with_the_init_std():
    """The same seed gives the same offsets whatever the weight initialiser (xavier has no
    meaning for a vector), of the --init-method-std spread."""
    offsets = []
    for xavier in (False, True):
        torch.manual_seed(11)
        config = _config(softmax_type="learnable", num_attention_heads=64, hidden_size=256,
                         init_method_std=0.5, init_method_xavier_uniform=xavier)
        offsets.append(CoreAttention(config, 1, 64).softmax_offset.detach())
    assert torch.equal(offsets[0], offsets[1])
    assert 0.3 < offsets[0].std() < 0.7 and offsets[0].abs().max() > 0


def test_validation_names_the_window_flags():
    from megatron.training.arguments import ArgumentsError, build_configs, parse_args, \
        validate_args

    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--vocab-size", "64", "--tokenizer-type", "NullTokenizer"]

    def validated(*extra):
        args = parse_args(argv=base + list(extra))
        args.world_size = 1
        return validate_args(args)

    args = validated("--window-size", "3,0", "--window-attn-skip-freq", "[1,1,0]+[1]",
                     "--softmax-type", "off-by-one")
    args.padded_vocab_size = 128
    model = build_configs(args).model
    assert [model.layer_window(n) for n in (1, 2, 3, 4)] == [(3, 0), (3, 0), None, (3, 0)]
    assert model.softmax_type == "off-by-one"
    with pytest.raises(ArgumentsError, match=r"--window-attn-skip-freq: a list needs one 0 "
                                             r"\(full\) or 1 \(window\) per layer"):
        validated("--window-size", "3,0", "--window-attn-skip-freq", "[1,0]")
    with pytest.raises(ArgumentsError, match="--window-attn-skip-freq needs --window-size"):
        validated("--window-attn-skip-freq", "2")

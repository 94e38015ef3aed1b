"""``--attention-backend``: every backend computes what a float64 naive attention computes
(outputs and gradients), with windows and softmax offsets, or refuses the combination in one
line; the flag maps onto the switches the attention reads without moving any default."""

import math

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model.attention import CoreAttention
from megatron.model.attention_backend import AUTO_BLOCKS_MAX_SEQ, AUTO_FLASH_MIN_SEQ, resolve
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1 --tokenizer-type NullTokenizer "
           "--vocab-size 64 --train-iters 1 --lr 1e-3").split()
BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Against float64: fp32 rounding over a few dozen terms; bf16 holds 8 bits of mantissa, and
# the inputs themselves are rounded to it (the reference sees the same rounded inputs).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
HEADS, HEAD_DIM, SEQ, BATCH = 4, 8, 12, 2


def _args(*flags):
    return validate_args(parse_args(argv=MINIMAL + list(flags)))


def _core_attention(backend, dtype, softmax_type="vanilla", window=None, impl="local"):
    _, flash, fusion = resolve(backend, transformer_impl=impl, seq_length=SEQ,
                               softmax_type=softmax_type)
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        padded_vocab_size=64, max_position_embeddings=SEQ, seq_length=SEQ,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_flash_attn=flash, masked_softmax_fusion=fusion, softmax_type=softmax_type,
        window_size=window)
    torch.manual_seed(7)
    return CoreAttention(config, 1, HEADS)


def _naive(q, k, v, window=None, offset=None):
    """float64 ``softmax(q k^T / sqrt(d) + causal/window mask) v`` from ``[s, b, np, hn]``;
    ``offset`` ``[np]`` adds exp(offset) to each head's softmax denominator."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))      # [b, np, s, hn]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))            # [b, np, sq, sk]
    i = torch.arange(SEQ)[:, None]
    j = torch.arange(SEQ)[None, :]
    masked = j > i
    if window is not None:
        masked |= j < i - window[0]
    scores = scores.masked_fill(masked, float("-inf"))
    if offset is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        extra = offset.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
    context = probs @ v                                                  # [b, np, sq, hn]
    return context.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * HEAD_DIM)


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
            for _ in range(3)]


def _check(module, dtype, window=None):
    q, k, v = _inputs(dtype)
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM,
                           generator=torch.Generator().manual_seed(1))
    out = module(q, k, v, None)
    out.backward(grad_out.to(dtype))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    offset = getattr(module, "softmax_offset", None)
    ref = _naive(qd, kd, vd, window, None if offset is None else offset.detach())
    ref.backward(grad_out.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, **tol)
    for got, want in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_matches_float64_attention(backend, dtype):
    _check(_core_attention(backend, dtype), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_a_window(backend):
    window = (3, 0)
    _check(_core_attention(backend, torch.float32, window=window), torch.float32, window)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("backend", ["fused", "unfused", "local", "auto"])
def test_softmax_offsets_work_with_the_explicit_backends(backend, softmax_type):
    module = _core_attention(backend, torch.float32, softmax_type, impl="transformer_engine")
    assert not module.use_flash_attn
    _check(module, torch.float32)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_flash_with_a_softmax_offset_is_refused_in_one_line(softmax_type):
    with pytest.raises(ArgumentsError) as err:
        _args("--attention-backend", "flash", "--softmax-type", softmax_type)
    assert "--attention-backend flash" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("flags, named", [
    (["--attention-backend", "fused", "--use-flash-attn"], "--use-flash-attn"),
    (["--attention-backend", "unfused", "--use-flash-attn"], "--use-flash-attn"),
    (["--attention-backend", "fused", "--no-masked-softmax-fusion"],
     "--no-masked-softmax-fusion")])
def test_contradicting_flags_are_refused_in_one_line(flags, named):
    with pytest.raises(ArgumentsError) as err:
        _args(*flags)
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("flags, flash, fusion", [
    ([], False, True),                                   # the default: unchanged
    (["--use-flash-attn"], True, True),
    (["--no-masked-softmax-fusion"], False, False),
    (["--attention-backend", "flash"], True, True),
    (["--attention-backend", "fused"], False, True),
    (["--attention-backend", "unfused"], False, False),
    (["--attention-backend", "local"], False, False),
    (["--attention-backend", "auto", "--transformer-impl", "transformer_engine"], False, True),
    # From AUTO_FLASH_MIN_SEQ tokens: flash in half precision on CPU; in float32 on CPU the
    # explicit body (in blocks, tests/unit/test_block_causal.py) up to AUTO_BLOCKS_MAX_SEQ.
    (["--attention-backend", "auto", "--transformer-impl", "transformer_engine",
      "--seq-length", str(AUTO_FLASH_MIN_SEQ), "--max-position-embeddings",
      str(AUTO_FLASH_MIN_SEQ), "--device", "cpu", "--bf16"], True, True),
    (["--transformer-impl", "local", "--seq-length", str(AUTO_FLASH_MIN_SEQ),
      "--max-position-embeddings", str(AUTO_FLASH_MIN_SEQ), "--device", "cpu", "--bf16"],
     True, True),
    (["--seq-length", str(AUTO_FLASH_MIN_SEQ), "--max-position-embeddings",
      str(AUTO_FLASH_MIN_SEQ), "--device", "cpu"], False, True),
    (["--seq-length", str(AUTO_BLOCKS_MAX_SEQ + 1), "--max-position-embeddings",
      str(AUTO_BLOCKS_MAX_SEQ + 1), "--device", "cpu"], True, True),
    (["--seq-length", str(AUTO_FLASH_MIN_SEQ - 1), "--max-position-embeddings",
      str(AUTO_FLASH_MIN_SEQ)], False, True),
    (["--attention-backend", "fused", "--seq-length", str(AUTO_FLASH_MIN_SEQ),
      "--max-position-embeddings", str(AUTO_FLASH_MIN_SEQ)], False, True),
])
def test_the_backend_sets_the_switches_the_attention_reads(flags, flash, fusion):
    args = _args(*flags)
    assert (args.use_flash_attn, args.masked_softmax_fusion) == (flash, fusion)


def test_auto_keeps_explicit_bodies_for_offsets_at_long_sequences():
    assert resolve("auto", transformer_impl="transformer_engine", seq_length=4096,
                   softmax_type="learnable") == ("fused", False, True)
    assert resolve("auto", transformer_impl="transformer_engine", seq_length=4096,
                   masked_softmax_fusion=False, softmax_type="off-by-one") == (
        "unfused", False, False)

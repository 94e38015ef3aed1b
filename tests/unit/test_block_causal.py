"""Causal attention in blocks of query rows (megatron/model/block_causal.py): the same outputs
and gradients as a float64 naive attention, for any block size (a partial last block
included); the explicit attention bodies take it exactly when nothing needs the full
probability matrix, and ``--attention-backend auto`` picks it by the rule written down in
megatron/model/attention_backend.py."""

import math

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import block_causal
from megatron.model.attention import CoreAttention
from megatron.model.attention_backend import (AUTO_BLOCKS_MAX_SEQ, AUTO_FLASH_MIN_SEQ,
                                              resolve)


def _naive(q, k, v, scale):
    """float64 causal attention of ``[batch, s, d]`` tensors."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q.size(1)
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("s, rows", [(23, 5), (24, 8), (7, 16), (40, 39)])
@pytest.mark.parametrize("dv", [6, 9])
def test_blocks_match_float64_naive_attention(s, rows, dv):
    gen = torch.Generator().manual_seed(s * rows)
    q, k = (torch.randn(3, s, 6, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    v = torch.randn(3, s, dv, generator=gen, dtype=torch.float64).requires_grad_()
    grad = torch.randn(3, s, dv, generator=gen, dtype=torch.float64)
    scale = 0.37
    out = block_causal.block_causal_attention(q, k, v, scale, rows)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = _naive(q, k, v, scale)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_strided_inputs_give_the_same_result():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(20, 4, 8, generator=gen, dtype=torch.float64)      # [s, batch, d]
    q = base.transpose(0, 1)                                              # strided [batch, s, d]
    out = block_causal.block_causal_attention(q, q, q, 0.5, 6)
    torch.testing.assert_close(out, _naive(q, q, q, 0.5), atol=1e-12, rtol=1e-10)


HEADS, HEAD_DIM, BATCH = 2, 8, 2
SEQ = block_causal.MIN_SEQ + 45          # a partial last block


def _core_attention(fusion=True, dropout=0.0, dtype=torch.float32, layer=1, **extra):
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        padded_vocab_size=64, max_position_embeddings=SEQ, seq_length=SEQ,
        attention_dropout=dropout, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_flash_attn=False, masked_softmax_fusion=fusion, **extra)
    return CoreAttention(config, layer, HEADS)


@pytest.fixture
def block_calls(monkeypatch):
    calls = []
    real = block_causal.block_causal_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(block_causal, "block_causal_attention", spy)
    return calls


def _run(module, seq=SEQ, dtype=torch.float32, mask=None):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(seq, BATCH, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    qx, kx, vx = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = module(qx, kx, vx, mask)
    out.backward(grad.to(dtype))
    heads = [t.permute(1, 2, 0, 3).reshape(BATCH * HEADS, seq, HEAD_DIM) for t in (q, k, v)]
    ref = _naive(*heads, 1 / math.sqrt(HEAD_DIM))
    ref = ref.view(BATCH, HEADS, seq, HEAD_DIM).permute(2, 0, 1, 3).reshape(seq, BATCH, -1)
    ref.backward(grad)
    return out, ref, (qx, kx, vx), (q, k, v)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_explicit_bodies_run_long_causal_attention_in_blocks(block_calls, fusion):
    out, ref, got, want = _run(_core_attention(fusion))
    assert block_calls == [(BATCH * HEADS, SEQ, HEAD_DIM)]
    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)


def test_same_inputs_same_bits_as_the_full_body_within_float32_rounding(monkeypatch):
    """The blocks against the explicit body over the whole matrix (blocks turned off)."""
    blocked, _, got, _ = _run(_core_attention())
    monkeypatch.setattr(block_causal, "MIN_SEQ", 1 << 30)
    full, _, again, _ = _run(_core_attention())
    torch.testing.assert_close(blocked, full, atol=1e-6, rtol=1e-5)
    for a, b in zip(got, again):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["short", "bf16", "mask", "dropout", "window", "offset",
                                  "max-logit", "layer-scaling"])
def test_the_full_matrix_where_something_needs_it(block_calls, case):
    """Shorter than MIN_SEQ, half precision, an explicit mask, active attention dropout, a
    window, a softmax offset, the max-logit record and query-key layer scaling keep the
    explicit body over the whole matrix."""
    extra = {"bf16": dict(dtype=torch.bfloat16), "dropout": dict(dropout=0.1),
             "window": dict(window_size=(16, 0)), "offset": dict(softmax_type="off-by-one"),
             "max-logit": dict(log_max_attention_logit=True),
             "layer-scaling": dict(apply_query_key_layer_scaling=True, layer=2)
             }.get(case, {})
    dtype = extra.pop("dtype", torch.float32)
    module = _core_attention(dtype=dtype, **extra)
    seq = block_causal.MIN_SEQ - 1 if case == "short" else SEQ
    mask = None
    if case == "mask":
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    module.train()
    with torch.random.fork_rng():
        model_parallel_cuda_manual_seed(42, 0)
        _run(module, seq, dtype, mask)
    assert block_calls == []
    module.eval()                          # dropout and the max-logit record are off in eval
    with torch.no_grad():
        x = torch.randn(seq, BATCH, HEADS, HEAD_DIM, dtype=dtype)
        module(x, x, x, mask)
    taken = case in ("dropout", "max-logit")
    assert block_calls == ([(BATCH * HEADS, seq, HEAD_DIM)] if taken else [])


@pytest.mark.parametrize("seq, on_cpu, half, want", [
    (AUTO_FLASH_MIN_SEQ - 1, True, False, "fused"),
    (AUTO_FLASH_MIN_SEQ, True, False, "fused"),          # blocks
    (AUTO_BLOCKS_MAX_SEQ, True, False, "fused"),
    (AUTO_BLOCKS_MAX_SEQ + 1, True, False, "flash"),     # quadratic memory: flash
    (AUTO_FLASH_MIN_SEQ, True, True, "flash"),           # half precision: no blocks
    (AUTO_FLASH_MIN_SEQ, False, False, "flash"),         # GPU: flash
    (AUTO_FLASH_MIN_SEQ - 1, False, False, "fused"),
])
def test_auto_rule(seq, on_cpu, half, want):
    assert resolve("auto", seq_length=seq, on_cpu=on_cpu, half=half)[0] == want
    assert resolve("auto", seq_length=seq, on_cpu=on_cpu, half=half,
                   masked_softmax_fusion=False)[0] == ("unfused" if want == "fused" else want)


def test_memory_accounting_counts_what_the_blocks_keep():
    """What autograd keeps for one block-causal attention, beyond its inputs and output, is the
    per-layer attention term of megatron/training/memory_accounting.py with blocks."""
    from megatron.training import memory_accounting as ma

    module = _core_attention()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen).requires_grad_()
               for _ in range(3))
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    kept = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in inputs:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(q, k, v, None)
    output_bytes = out.numel() * out.element_size()       # the context, kept once
    probs = sum(kept.values()) - output_bytes
    assert probs == HEADS * BATCH * block_causal.kept_elements(SEQ) * 4
    config = module.config
    with_blocks = ma.layer_activation_bytes(config, BATCH, element_bytes=4,
                                            attention_in_blocks=True)
    without = ma.layer_activation_bytes(config, BATCH, element_bytes=4)
    assert without - with_blocks == HEADS * BATCH * (SEQ * SEQ * 9
                                                     - block_causal.kept_elements(SEQ) * 4)
    # 301 tokens in rows of 128: 128 x 128, 128 x 256 and 45 x 301 probabilities per head.
    assert (SEQ, block_causal.BLOCK_ROWS) == (301, 128)
    assert block_causal.kept_elements(SEQ) == 128 * 128 + 128 * 256 + 45 * 301

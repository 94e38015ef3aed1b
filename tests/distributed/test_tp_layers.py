"""Tensor-parallel layers against torch.nn.functional on the full, unsplit weights.

The reference for every TP=N layer is the same layer built with no tensor parallelism
(tp_group=None) from the same seed: its weights are the full weights, and F.linear /
F.embedding on them (float64, autograd) give the reference outputs and gradients. Splits of a
float64 matmul change only the summation order, so results must agree to 1e-12.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-12)
S, B, H, OUT = 4, 2, 8, 12          # OUT divisible by stride 3 x TP 4
INIT = tp.init_method_normal(0.3)


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _build(cls, seed, group, *args, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("params_dtype", torch.float64)
    return cls(*args, init_method=INIT, tp_group=group, **kwargs)


def _naive_gather(shard, group, n):
    pieces = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return pieces


def _unshard(pieces, dim, stride):
    """Full tensor from rank-ordered shards each holding ``stride`` interleaved blocks."""
    blocks = [p.chunk(stride, dim=dim) for p in pieces]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(pieces))], dim=dim)


def _check_weights_match_tp1(group, n):
    cases = [
        (tp.ColumnParallelLinear, (H, OUT), dict(stride=1), 0, 1),
        (tp.ColumnParallelLinear, (H, OUT), dict(stride=3), 0, 3),
        (tp.ColumnParallelLinear, (H, OUT), dict(params_dtype=torch.bfloat16), 0, 1),
        (tp.RowParallelLinear, (OUT, H), {}, 1, 1),
        (tp.VocabParallelEmbedding, (4 * n, H), {}, 0, 1),
    ]
    for cls, sizes, kwargs, dim, stride in cases:
        full = _build(cls, 7, None, *sizes, **kwargs).weight.detach()
        layer = _build(cls, 7, group, *sizes, **kwargs)
        w = layer.weight
        assert w.device == torch.device("cpu") and w.dtype == full.dtype
        assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, dim,
                                                                                  stride)
        gathered = _unshard(_naive_gather(w.detach(), group, n), dim, stride)
        assert torch.equal(gathered, full), (cls.__name__, kwargs)


def _reference(weight, bias, x, grad):
    weight = weight.detach().clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    x = x.clone().requires_grad_()
    out = F.linear(x, weight, bias)
    (out * grad).sum().backward()
    return out.detach(), weight.grad, bias.grad, x.grad


def _check_column(group, n, r):
    full_layer = _build(tp.ColumnParallelLinear, 11, None, H, OUT)
    full_bias = _rand((OUT,), 12)
    x = _rand((S, B, H), 13)
    grad = _rand((S, B, OUT), 14)
    ref_out, d_w, d_b, d_x = _reference(full_layer.weight, full_bias, x, grad)
    for gather, skip_bias, seq in [(False, False, False), (True, False, False),
                                   (False, True, False), (False, False, True)]:
        layer = _build(tp.ColumnParallelLinear, 11, group, H, OUT, gather_output=gather,
                       skip_bias_add=skip_bias, sequence_parallel=seq)
        with torch.no_grad():
            layer.bias.copy_(full_bias.chunk(n)[r])
        inp = (x.chunk(n, dim=0)[r] if seq else x).clone().requires_grad_()
        out, out_bias = layer(inp)
        if seq:  # backward keeps only the local [s/tp, b, h] input, not the gathered one
            assert [t.shape for t in out.grad_fn.saved_tensors] == [(S // n, B, H), (OUT // n, H)]
        assert (out_bias is layer.bias) if skip_bias else (out_bias is None)
        if skip_bias:
            out = out + out_bias
        expected = ref_out if gather else ref_out.chunk(n, dim=-1)[r]
        torch.testing.assert_close(out.detach(), expected, **TOL)
        (out * (grad if gather else grad.chunk(n, dim=-1)[r])).sum().backward()
        torch.testing.assert_close(layer.weight.grad, d_w.chunk(n, dim=0)[r], **TOL)
        torch.testing.assert_close(layer.bias.grad, d_b.chunk(n)[r], **TOL)
        torch.testing.assert_close(inp.grad, d_x.chunk(n, dim=0)[r] if seq else d_x, **TOL)


def _check_row(group, n, r):
    full_layer = _build(tp.RowParallelLinear, 21, None, OUT, H)
    full_bias = _rand((H,), 22)
    x = _rand((S, B, OUT), 23)
    grad = _rand((S, B, H), 24)
    ref_out, d_w, d_b, d_x = _reference(full_layer.weight, full_bias, x, grad)
    for parallel_in, seq, skip_bias in [(False, False, False), (True, False, False),
                                        (True, True, False), (True, False, True)]:
        layer = _build(tp.RowParallelLinear, 21, group, OUT, H, input_is_parallel=parallel_in,
                       sequence_parallel=seq, skip_bias_add=skip_bias)
        assert layer.bias.tensor_model_parallel is False and layer.bias.sequence_parallel is seq
        assert tp.param_is_not_tensor_parallel_duplicate(layer.bias, r) == (r == 0)
        assert tp.param_is_not_tensor_parallel_duplicate(layer.weight, r)
        with torch.no_grad():
            layer.bias.copy_(full_bias)
        inp = (x.chunk(n, dim=-1)[r] if parallel_in else x).clone().requires_grad_()
        out, out_bias = layer(inp)
        assert (out_bias is layer.bias) if skip_bias else (out_bias is None)
        if skip_bias:
            out = out + out_bias
        torch.testing.assert_close(out.detach(), ref_out.chunk(n, dim=0)[r] if seq else ref_out,
                                   **TOL)
        (out * (grad.chunk(n, dim=0)[r] if seq else grad)).sum().backward()
        torch.testing.assert_close(layer.weight.grad, d_w.chunk(n, dim=1)[r], **TOL)
        bias_grad = layer.bias.grad.clone()
        if seq:  # partial on each rank: the caller all-reduces it over the tp group
            dist.all_reduce(bias_grad, group=group)
        torch.testing.assert_close(bias_grad, d_b, **TOL)
        torch.testing.assert_close(inp.grad, d_x.chunk(n, dim=-1)[r] if parallel_in else d_x,
                                   **TOL)


def _check_embedding_and_tied_output(group, n, r):
    """Word embedding plus an output layer sharing its weight (GPT's tied logits)."""
    vocab = 4 * n
    full = _build(tp.VocabParallelEmbedding, 31, None, vocab, H).weight.detach()
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(32))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # both ends of the vocabulary
    hidden = _rand((S, B, H), 33)
    g_emb, g_logits = _rand((B, S, H), 34), _rand((S, B, vocab), 35)

    w_ref = full.clone().requires_grad_()
    h_ref = hidden.clone().requires_grad_()
    emb_ref, logits_ref = F.embedding(ids, w_ref), F.linear(h_ref, w_ref)
    ((emb_ref * g_emb).sum() + (logits_ref * g_logits).sum()).backward()

    emb = _build(tp.VocabParallelEmbedding, 31, group, vocab, H)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (r * 4, r * 4 + 4)
    output_layer = _build(tp.ColumnParallelLinear, 0, group, H, vocab, bias=False,
                          skip_weight_param_allocation=True)
    assert output_layer.weight is None and output_layer.bias is None
    h = hidden.clone().requires_grad_()
    out_emb = emb(ids)
    logits, _ = output_layer(h, weight=emb.weight)
    torch.testing.assert_close(out_emb.detach(), emb_ref.detach(), **TOL)
    torch.testing.assert_close(logits.detach(), logits_ref.detach().chunk(n, dim=-1)[r], **TOL)
    ((out_emb * g_emb).sum() + (logits * g_logits.chunk(n, dim=-1)[r]).sum()).backward()
    torch.testing.assert_close(emb.weight.grad, w_ref.grad.chunk(n, dim=0)[r], **TOL)
    torch.testing.assert_close(h.grad, h_ref.grad, **TOL)


def _body():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    quad = dist.new_group([0, 1, 2, 3])
    for group, n, r in [(pairs[rank // 2], 2, rank % 2), (quad, 4, rank)]:
        _check_weights_match_tp1(group, n)
        _check_column(group, n, r)
        _check_row(group, n, r)
        _check_embedding_and_tied_output(group, n, r)
    # Sizes the group cannot split are refused (before any communication) naming the flag.
    with pytest.raises(ValueError, match=r"output size \(10\) over "
                                         r"--tensor-model-parallel-size \(4\)"):
        tp.ColumnParallelLinear(H, 10, init_method=INIT, tp_group=quad)
    with pytest.raises(ValueError, match=r"input size \(6\) over "
                                         r"--tensor-model-parallel-size \(4\)"):
        tp.RowParallelLinear(6, H, init_method=INIT, tp_group=quad)
    with pytest.raises(ValueError, match=r"stride \(3\) x --tensor-model-parallel-size \(4\)"):
        tp.ColumnParallelLinear(H, 8, init_method=INIT, tp_group=quad, stride=3)
    return True


def test_tp_layers_match_full_weights_tp2_tp4():
    """One spawn of 4 ranks: both TP=2 groups and the TP=4 group run every check."""
    assert run_on_ranks(_body, 4) == [True] * 4


# ---- single process -------------------------------------------------------------------------

def test_tp1_layers_equal_functional():
    x = _rand((S, B, H), 1)
    col = _build(tp.ColumnParallelLinear, 3, None, H, OUT)
    torch.testing.assert_close(col(x)[0], F.linear(x, col.weight, col.bias), **TOL)
    row = _build(tp.RowParallelLinear, 3, None, H, OUT)
    torch.testing.assert_close(row(x)[0], F.linear(x, row.weight, row.bias), **TOL)
    assert torch.count_nonzero(col.bias) == 0 and torch.count_nonzero(row.bias) == 0


def test_init_methods_std():
    torch.manual_seed(0)
    w = torch.empty(400, 500)
    tp.init_method_normal(0.02)(w)
    assert abs(w.std().item() - 0.02) < 0.02 * 0.02
    tp.scaled_init_method_normal(0.02, 8)(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(16)) < 0.02 * 0.02 / 4


def test_layer_errors_name_the_values():
    with pytest.raises(ValueError, match="gather_output=True cannot be combined"):
        tp.ColumnParallelLinear(4, 8, init_method=INIT, tp_group=None, gather_output=True,
                                sequence_parallel=True)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        tp.RowParallelLinear(4, 8, init_method=INIT, tp_group=None, sequence_parallel=True)
    out_layer = tp.ColumnParallelLinear(4, 8, init_method=INIT, tp_group=None,
                                        skip_weight_param_allocation=True)
    with pytest.raises(ValueError, match="pass weight= to forward"):
        out_layer(torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match=r"weight= has shape \(8, 5\), expected \(8, 4\)"):
        out_layer(torch.randn(2, 1, 4), weight=torch.randn(8, 5))


def test_utils():
    with pytest.raises(ValueError, match=r"heads: 10 is not divisible by 4"):
        tp.divide(10, 4, "heads")
    assert tp.divide(12, 4) == 3
    parts = tp.split_tensor_along_last_dim(torch.arange(12).view(2, 6), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(12, 2, 4) == (6, 9)
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(5, 1, 2) == (5, 10)

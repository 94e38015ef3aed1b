"""Causal self-attention in blocks of query rows, for the explicit attention bodies on CPU.

The explicit body computes ``softmax(q k^T * scale + causal mask) v`` over the whole
``[s, s]`` score matrix, half of which the mask then throws away. Here the query rows are taken
``BLOCK_ROWS`` at a time; rows ``[i, i + n)`` see keys ``[0, i + n)`` only, so the products and
the softmax skip every block above the diagonal (with 128-row blocks 62% of the full work at 512
tokens, 53% at 2048), and each product is still one batched GEMM large enough for the BLAS.

Backward uses the probabilities kept from the forward (no recomputation)::

    dV[:, :e]  += P^T dO_i            dP = dO_i V[:, :e]^T
    dS = P * (dP - rowsum(dO_i * O_i)) * scale
    dQ_i = dS K[:, :e]                dK[:, :e] += dS^T Q_i

``benchmarks/bench_attention_backends.py`` measures it against ATen's flash kernel (RESULTS.md,
"Attention backends"); :func:`applies` says when :class:`~megatron.model.attention.CoreAttention`
takes it.
"""

import torch

# Query rows per block: the fastest of 64 / 128 / 256 at 256-2048 tokens on the CPUs measured.
BLOCK_ROWS = 128
# From this many tokens the blocks pay off (below, one block is nearly the whole matrix).
MIN_SEQ = 256


def applies(q: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether a causal, unmasked ``sq`` x ``sk`` attention over ``q``'s dtype and device runs
    in blocks: CPU, float32 / float64 (half-precision inputs keep the explicit body, whose
    softmax runs in float32), self-attention of at least ``MIN_SEQ`` tokens."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and sq == sk and sq >= MIN_SEQ)


def _accumulate(total: torch.Tensor, end: int, a: torch.Tensor, b: torch.Tensor,
                alpha: float) -> None:
    """``total[:, :end] += alpha * a @ b``. The product is formed whole and then added:
    ``baddbmm_`` into the slice ran one small GEMM per batch entry (ATen's in-place path takes
    only a plain batch of matrices as its result)."""
    total[:, :end].add_(torch.bmm(a, b), alpha=alpha)


def kept_elements(s: int, rows: int = BLOCK_ROWS) -> int:
    """Probabilities kept for backward per head and sequence: rows ``[i, i + n)`` keep
    ``n * (i + n)`` of them."""
    return sum((min(start + rows, s) - start) * min(start + rows, s)
               for start in range(0, s, rows))


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, rows: int):
        bh, s, _ = q.shape
        out = torch.empty(bh, s, v.size(-1), dtype=q.dtype, device=q.device)
        upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
        probs = []
        for start in range(0, s, rows):
            end = min(start + rows, s)
            n = end - start
            scores = torch.baddbmm(
                torch.empty(bh, n, end, dtype=q.dtype, device=q.device), q[:, start:end],
                k[:, :end].transpose(1, 2), beta=0.0, alpha=scale)     # [bh, n, end]
            scores[:, :, start:].masked_fill_(upper[:n, :n], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            out[:, start:end] = torch.bmm(p, v[:, :end])
            probs.append(p)
        ctx.scale, ctx.rows = scale, rows
        ctx.save_for_backward(q, k, v, out, *probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *probs = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        grad_out = grad_out.contiguous()
        row_dot = (grad_out * out).sum(dim=-1, keepdim=True)                 # [bh, s, 1]
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for block, start in enumerate(range(0, q.size(1), rows)):
            end = min(start + rows, q.size(1))
            p = probs[block]
            go = grad_out[:, start:end]
            _accumulate(dv, end, p.transpose(1, 2), go, 1.0)
            ds = torch.bmm(go, v[:, :end].transpose(1, 2))                  # dP
            ds.sub_(row_dot[:, start:end]).mul_(p)
            dq[:, start:end] = torch.bmm(ds, k[:, :end]).mul_(scale)
            _accumulate(dk, end, ds.transpose(1, 2), q[:, start:end], scale)
        return dq, dk, dv, None, None


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           rows: int = BLOCK_ROWS) -> torch.Tensor:
    """``softmax(q k^T * scale + causal mask) v`` for ``q``, ``k`` ``[batch, s, d]`` and ``v``
    ``[batch, s, dv]`` (any strides), in blocks of ``rows`` query rows -> ``[batch, s, dv]``."""
    return _BlockCausalAttention.apply(q, k, v, scale, rows)

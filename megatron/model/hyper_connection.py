"""Manifold-constrained hyper-connections (mHC, ``--enable-mhc-connections``).

The residual stream is widened to ``n`` streams (``--mhc-num-residual-streams``): the
activations between layers are ``[s, b, n*h]``. The first pipeline stage copies the
embedding's output into every stream (:func:`expand_streams`); the last stage averages the
streams (:func:`contract_streams`) before the final norm. Around attention and around the MLP
of each layer a :class:`HyperConnection` computes, per token, from the RMS-normalised streams
``x~ = x / (||x|| / sqrt(n h) + eps)``::

    h      = alpha * (mapping_proj(x) * r) + bias        r = 1 / (||x|| / sqrt(n h) + eps)
    H_pre  = sigmoid(h[:n]) + eps                        (n)     reads the sublayer input
    H_post = 2 sigmoid(h[n:2n])                          (n)     writes its output
    H_res  = sinkhorn_knopp(h[2n:].view(n, n))           (n, n)  mixes the streams

with one scalar gate ``alpha`` per part (``alpha_pre``, ``alpha_post``, ``alpha_res``, all
initialised to ``--mhc-init-gating-factor``) and a static ``bias`` (zeros). The sublayer reads
``sum_j H_pre[j] x_j`` (its usual norm follows) and the layer writes
``x'_i = sum_j H_res[j, i] x_j + H_post[i] * dropout(out + out_bias)`` (the dropout drawn on the
``n`` expanded streams). The mappings are computed in fp32 and cast to the activation dtype.

Parameters, per layer, under Megatron-Core's names: ``self_attention_hyper_connection.`` and
``mlp_hyper_connection.`` followed by ``mapping_proj.weight`` ``[n^2 + 2n, n h]``,
``alpha_pre``, ``alpha_post``, ``alpha_res`` (``[1]`` each) and ``bias`` ``[n^2 + 2n]``. They are
replicated over tensor-parallel ranks (each rank sees every hidden channel); under sequence
parallelism each rank holds a slice of the tokens, so their gradients are all-reduced like the
norms'.

``--recompute-granularity selective --recompute-modules mhc``: the outputs of the stream
reads and writes are freed after use and computed again in backward (see
:class:`MHCRecomputeGroup`), in groups of ``--mhc-recompute-layer-num`` layers.
"""

import math
from typing import Callable, List, Optional, Tuple

import torch

from megatron.core.tensor_parallel.random import rng_restore, rng_snapshot

# The small constants of Megatron-Core's mHC (Sinkhorn, the RMS factor, H_pre's floor).
SINKHORN_EPS = 1e-6
NORM_EPS = 1e-6
H_PRE_EPS = 1e-6


def sinkhorn_knopp(logits: torch.Tensor, iterations: int, eps: float = SINKHORN_EPS):
    """``[..., n, n]`` logits -> nearly doubly stochastic matrices.

    A row softmax (plus ``eps``), a column normalisation, then ``iterations - 1`` rounds of
    row and column normalisation, each dividing by the sum plus ``eps``.
    """
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, h]`` -> ``[s, b, n*h]``: every stream a copy of ``x``."""
    s, b, h = x.shape
    return x.unsqueeze(2).expand(s, b, n, h).reshape(s, b, n * h)


def contract_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, n*h]`` -> ``[s, b, h]``: the mean of the streams."""
    s, b, nh = x.shape
    return x.view(s, b, n, nh // n).mean(dim=2)


class HyperConnection(torch.nn.Module):
    """The mappings of one hyper-connection site (before attention, or before the MLP).

    Args:
        hidden_size: ``h``.
        n: residual streams.
        sinkhorn_iterations: ``--mhc-sinkhorn-iterations``.
        init_gating_factor: initial value of the three gates.
        params_dtype: dtype of the parameters.
        sequence_parallel: mark the parameters for the sequence-parallel gradient all-reduce.
    """

    def __init__(self, hidden_size: int, n: int, sinkhorn_iterations: int,
                 init_gating_factor: float, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False):
        super().__init__()
        self.n, self.hidden_size = n, hidden_size
        self.sinkhorn_iterations = sinkhorn_iterations
        width = n * n + 2 * n
        self.mapping_proj = torch.nn.Linear(n * hidden_size, width, bias=False)
        torch.nn.init.xavier_uniform_(self.mapping_proj.weight)
        self.mapping_proj.to(params_dtype)

        def gate():
            return torch.nn.Parameter(torch.full((1,), init_gating_factor, dtype=params_dtype))
        self.alpha_pre, self.alpha_post, self.alpha_res = gate(), gate(), gate()
        self.bias = torch.nn.Parameter(torch.zeros(width, dtype=params_dtype))
        if sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True

    def compute_mappings(self, x: torch.Tensor):
        """``[s, b, n*h]`` -> ``H_pre [s, b, n]``, ``H_post [s, b, n]``, ``H_res [s, b, n, n]``,
        computed in fp32 (fp64 for an fp64 model) and returned in ``x``'s dtype."""
        n = self.n
        dtype = torch.promote_types(x.dtype, torch.float32)    # fp32 at least (fp64 stays)
        x32 = x.to(dtype)
        proj = x32 @ self.mapping_proj.weight.to(dtype).t()                 # [s, b, n^2+2n]
        r = 1.0 / (x32.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]) + NORM_EPS)
        alpha = torch.cat([self.alpha_pre.to(dtype).expand(n),
                           self.alpha_post.to(dtype).expand(n),
                           self.alpha_res.to(dtype).expand(n * n)])
        h = r * proj * alpha + self.bias.to(dtype)
        h_pre = torch.sigmoid(h[..., :n]) + H_PRE_EPS
        h_post = torch.sigmoid(h[..., n:2 * n]) * 2
        h_res = sinkhorn_knopp(h[..., 2 * n:].unflatten(-1, (n, n)), self.sinkhorn_iterations,
                               SINKHORN_EPS)
        return h_pre.to(x.dtype), h_post.to(x.dtype), h_res.to(x.dtype)

    def aggregate(self, x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
        """``sum_j H_pre[j] x_j``: ``[s, b, n*h]``, ``[s, b, n]`` -> ``[s, b, h]``."""
        streams = x.unflatten(-1, (self.n, self.hidden_size))                # [s, b, n, h]
        return (streams * h_pre.unsqueeze(-1)).sum(dim=2)

    def combine(self, h_res: torch.Tensor, residual: torch.Tensor, h_post: torch.Tensor,
                out: torch.Tensor, bias: Optional[torch.Tensor],
                bias_dropout_add: Callable) -> torch.Tensor:
        """``H_res^T @ streams + H_post * dropout(out + bias)`` -> ``[s, b, n*h]``.

        ``bias_dropout_add(x, bias, residual)`` is the layer's ``residual + dropout(x +
        bias)``; ``H_post`` scales ``out`` and ``bias`` alike, so it runs on ``H_post * out``
        and ``H_post * bias`` expanded to the streams."""
        s, b = residual.shape[:2]
        streams = residual.view(s, b, self.n, self.hidden_size)              # [s, b, n, h]
        mixed = torch.matmul(h_res.transpose(-1, -2), streams).view(s, b, -1)
        expanded = (h_post.unsqueeze(-1) * out.unsqueeze(2)).view(s, b, -1)
        expanded_bias = None
        if bias is not None:
            expanded_bias = (h_post.unsqueeze(-1) * bias).view(s, b, -1)
        return bias_dropout_add(expanded, expanded_bias, mixed)


class _DiscardedOutput(torch.autograd.Function):
    """Forward: ``function(*inputs)`` without a graph. Backward: the recomputed graph."""

    @staticmethod
    def forward(ctx, record, *inputs):
        ctx.record = record
        with torch.no_grad():
            return record.function(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        record = ctx.record
        if record.recomputed is None:
            record.group.restore()
        inputs, output = record.recomputed
        torch.autograd.backward(output, grad_output)
        record.recomputed = None
        return (None,) + tuple(i.grad if need else None
                               for i, need in zip(inputs, ctx.needs_input_grad[1:]))


class _Record:
    """One discarded call: its function, detached inputs (sharing storage with the originals)
    and the RNG state it ran under, so a dropout draws the same mask again."""

    def __init__(self, group, function: Callable, inputs: Tuple[torch.Tensor, ...]):
        self.group, self.function = group, function
        self.inputs = tuple(x.detach() for x in inputs)
        self.rng = rng_snapshot()
        self.output, self.recomputed = None, None

    def recompute(self) -> None:
        current = rng_snapshot()
        rng_restore(self.rng)
        with torch.enable_grad():
            inputs = tuple(x.requires_grad_(True) for x in self.inputs)
            output = self.function(*inputs)
        rng_restore(current)
        storage = self.output.untyped_storage()
        if storage.size() == 0:
            # Storage to storage: tensors saved for backward see the values again without a
            # version bump (an in-place copy would count as a change).
            storage.resize_(output.untyped_storage().size())
            storage.copy_(output.untyped_storage())
        self.recomputed = (inputs, output)


class MHCRecomputeGroup:
    """The stream reads and writes of ``--mhc-recompute-layer-num`` consecutive layers.

    Each call through :meth:`__call__` keeps its inputs, runs without a graph, and its output
    is freed by :meth:`close` once the group's last write has been computed; when the
    gradient reaches that last write, every call is run again in forward order (each output
    comes back before a later call's recompute reads it), before any backward in the group.
    The last write itself runs normally: it is the group's output.
    """

    def __init__(self):
        self.records: List[_Record] = []
        self.restored = False

    def __call__(self, function: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        record = _Record(self, function, inputs)
        record.output = _DiscardedOutput.apply(record, *inputs)
        self.records.append(record)
        return record.output

    def restore(self) -> None:
        """Recompute every discarded output of the group (once)."""
        if self.restored:
            return
        self.restored = True
        for record in self.records:
            record.recompute()

    def close(self, group_output: torch.Tensor) -> None:
        """Free the outputs; they come back when ``group_output``'s gradient is computed."""
        if not self.records:
            return
        for record in self.records:
            record.output.untyped_storage().resize_(0)

        def restore(grad):
            self.restore()
            return grad

        group_output.register_hook(restore)

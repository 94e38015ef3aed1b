"""vocab_parallel_cross_entropy against F.cross_entropy on the full, unsplit logits.

Each rank gets its [s, b, V/tp] block of one float64 logit tensor; the loss and the gradient of
that block must match F.cross_entropy's (float64, autograd) to 1e-12. Label smoothing follows
Megatron's convention, checked both against a hand-written target distribution and against
PyTorch's smoothing of eps * V / (V - 1). Memory is checked two ways: what autograd keeps for
backward (via saved-tensor hooks) is ~1/tp of what the full-vocab loss keeps, and no tensor the
loss creates in forward or backward (seen through a dispatch mode) has full-vocab size.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-12)
S, B, V = 3, 2, 16


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _targets():
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(5))
    target[0] = torch.tensor([0, V - 1])  # both ends of the vocabulary
    return target


def _megatron_smoothed_reference(logits, target, eps):
    """-sum_c q_c log p_c with q = 1 - eps on the target and eps / (V - 1) elsewhere."""
    log_p = torch.log_softmax(logits, dim=-1)
    q = torch.full_like(log_p, eps / (V - 1))
    q.scatter_(-1, target.unsqueeze(-1), 1.0 - eps)
    return -(q * log_p).sum(-1)


def _reference(logits, target, eps, weights):
    logits = logits.clone().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none",
                           label_smoothing=eps * V / (V - 1)).view(S, B)
    (loss * weights).sum().backward()
    torch.testing.assert_close(loss.detach(), _megatron_smoothed_reference(
        logits.detach(), target, eps), **TOL)
    return loss.detach(), logits.grad


def _saved_bytes(fn):
    """Bytes of distinct storage autograd keeps for backward while ``fn`` runs (and its result)."""
    sizes = {}

    def pack(t):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(sizes.values()), out


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _check(group, n, r):
    full = _rand((S, B, V), 1) * 3
    target = _targets()
    weights = _rand((S, B), 2)
    for eps in (0.0, 0.1):
        ref_loss, ref_grad = _reference(full, target, eps, weights)
        local = full.chunk(n, dim=-1)[r].clone().requires_grad_()
        before = local.detach().clone()
        loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing=eps)
        assert loss.shape == (S, B) and loss.dtype == torch.float64
        torch.testing.assert_close(loss.detach(), ref_loss, **TOL)
        assert torch.equal(local.detach(), before), "the caller's logits were modified"
        (loss * weights).sum().backward()
        torch.testing.assert_close(local.grad, ref_grad.chunk(n, dim=-1)[r], **TOL)

    # Memory: what backward keeps, and the largest tensor ever made, are of size V/tp per token.
    local = full.chunk(n, dim=-1)[r].clone().requires_grad_()
    kept, loss = _saved_bytes(lambda: vocab_parallel_cross_entropy(local, target, group, 0.1))
    full_leaf = full.clone().requires_grad_()
    kept_full, _ = _saved_bytes(lambda: F.cross_entropy(full_leaf.view(-1, V), target.view(-1),
                                                        reduction="none"))
    tokens = S * B
    assert kept_full >= tokens * V * 8  # the full-vocab loss keeps at least its log-softmax
    # One float64 [tokens, V/tp] buffer, plus a bool mask and an int64 index per token.
    assert kept <= tokens * V // n * 8 + tokens * (1 + 8), (kept, kept_full, n)
    with _LargestTensor() as mode:
        loss = vocab_parallel_cross_entropy(local, target, group, 0.1)
        loss.sum().backward()
    assert mode.largest <= tokens * V // n, (mode.largest, tokens * V // n)

    # bf16 logits: float32 math, so the loss is far closer to the float64 loss of the same
    # (rounded) values than bf16 arithmetic could be; the gradient comes back in bf16.
    local_bf16 = full.chunk(n, dim=-1)[r].to(torch.bfloat16).requires_grad_()
    full_rounded = full.to(torch.bfloat16).double()
    ref_loss, ref_grad = _reference(full_rounded, target, 0.0, weights)
    loss = vocab_parallel_cross_entropy(local_bf16, target, group)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    (loss * weights.float()).sum().backward()
    assert local_bf16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(local_bf16.grad.double(), ref_grad.chunk(n, dim=-1)[r],
                               rtol=1e-2, atol=1e-2)


def _body():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    quad = dist.new_group([0, 1, 2, 3])
    _check(pairs[rank // 2], 2, rank % 2)
    _check(quad, 4, rank)
    return True


def test_vocab_parallel_cross_entropy_tp2_tp4():
    """One spawn of 4 ranks: both TP=2 groups and the TP=4 group."""
    assert run_on_ranks(_body, 4) == [True] * 4


def test_single_process_matches_and_rejects_bad_calls():
    _check(None, 1, 0)
    logits = _rand((S, B, V), 3).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, _targets(), None)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.sum().backward()
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.5"):
        vocab_parallel_cross_entropy(logits, _targets(), None, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"target shape \(2, 3\) must match .* \(3, 2\)"):
        vocab_parallel_cross_entropy(logits, _targets().t(), None)

"""Cross entropy over logits whose vocabulary dim is split across tensor-parallel ranks.

Each rank holds ``[..., V/tp]`` logits. The loss needs three quantities over the whole
vocabulary per token: the max logit (for a stable softmax), the sum of exponentials and the
target's logit. Each rank computes its partial value and the group reduces them (one max
all-reduce, then one sum all-reduce of a small stacked buffer), so no rank ever holds ``[..., V]``
logits. The math runs in float32 when the logits are float16 / bfloat16 (float64 stays float64).

Memory: forward makes one ``[..., V/tp]`` working buffer in the compute dtype, turns it into the
softmax in place and keeps it for backward, which turns it into the gradient in place. Nothing
else of vocabulary size is kept.

Label smoothing follows Megatron's convention: a smoothing of ``eps`` keeps probability
``1 - eps`` on the target and spreads ``eps`` evenly over the ``V - 1`` other classes. This
equals PyTorch's ``cross_entropy(..., label_smoothing=eps * V / (V - 1))``, which spreads its
smoothing over all ``V`` classes.
"""

import torch

from megatron.core.collectives import all_reduce, get_group_rank, get_group_size
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocab-split logits; the backward reuses the saved softmax buffer."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing):
        compute_dtype = torch.promote_types(vocab_parallel_logits.dtype, torch.float32)
        # The single [..., V/tp] working buffer: a copy, so the caller's logits stay untouched.
        logits = vocab_parallel_logits.to(compute_dtype, copy=True)       # [..., V/tp]
        logits_max = logits.max(dim=-1)[0]                                 # [...]
        all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        partition_vocab_size = logits.size(-1)
        world = get_group_size(group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_group_rank(group), world)
        target_outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target.long() - vocab_start).masked_fill(target_outside, 0)

        # Per-token partials, reduced over the group in one call:
        # [0] the target's (shifted) logit, [1] sum of exp, [2] sum of the shifted logits
        # (needed only for label smoothing).
        stats = torch.empty((3,) + tuple(logits_max.shape), dtype=compute_dtype,
                            device=logits.device)                          # [3, ...]
        stats[0] = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        stats[0].masked_fill_(target_outside, 0.0)
        stats[2] = logits.sum(dim=-1) if label_smoothing > 0 else 0.0
        logits.exp_()
        stats[1] = logits.sum(dim=-1)
        all_reduce(stats, group)
        predicted_logits, sum_exp_logits, sum_logits = stats.unbind(0)

        log_sum_exp = torch.log(sum_exp_logits)
        loss = log_sum_exp - predicted_logits                              # [...]
        logits.div_(sum_exp_logits.unsqueeze(-1))                          # softmax, in place

        vocab_size = partition_vocab_size * world
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = sum_logits / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.backward_done = False
        ctx.save_for_backward(logits, target_outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.backward_done:
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice through the same "
                               "graph; its saved softmax is turned into the gradient in place")
        ctx.backward_done = True
        softmax, target_outside, local_target = ctx.saved_tensors
        grad_input = softmax                                               # [..., V/tp]
        # d loss / d logit_c = p_c - q_c, with q the (smoothed) target distribution.
        on_target = (1.0 - ctx.smoothing) * (~target_outside).to(grad_input.dtype)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad_input.sub_(ctx.smoothing / ctx.vocab_size)
        grad_input.mul_(grad_output.unsqueeze(-1).to(grad_input.dtype))
        return grad_input.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross entropy from vocabulary-split logits.

    Args:
        vocab_parallel_logits: ``[..., V/tp]``, this rank's block of the vocabulary (rank ``r``
            owns ids ``[r V/tp, (r + 1) V/tp)``), e.g. ``[s, b, V/tp]``.
        target: int64 ids in ``[0, V)`` with the logits' leading shape, e.g. ``[s, b]``.
        group: the tensor-parallel group (None: the logits hold the whole vocabulary).
        label_smoothing: Megatron's smoothing (see the module docstring), in ``[0, 1)``.

    Returns:
        The loss per token, shaped like ``target``, in float32 (float64 for float64 logits).
    """
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must "
                         f"match the logits' leading shape "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1), "
                         f"got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group,
                                            float(label_smoothing))

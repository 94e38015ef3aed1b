"""Bias + SwiGLU: ``silu(a) * b`` where ``[a, b]`` are the two halves of ``input + bias``.

The MLP's ``dense_h_to_4h`` produces ``2 * ffn`` features per token (locally ``2 * ffn / tp``):
the first half is the gate, the second the value. :class:`SwiGLUFunction` is the fusable op with
its derivative written out; :func:`bias_swiglu_unfused` is the same through plain torch ops.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels import get_kernel


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(first half) * second half`` along the last dimension."""
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * b


def swiglu_grad(grad_output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` at ``y``, written out."""
    a, b = torch.chunk(y, 2, dim=-1)
    sig = torch.sigmoid(a)
    silu = a * sig
    grad_a = grad_output * b * sig * (1.0 + a * (1.0 - sig))
    grad_b = grad_output * silu
    return torch.cat([grad_a, grad_b], dim=-1)


class SwiGLUFunction(torch.autograd.Function):
    """``swiglu(input + bias)`` as one autograd node; ``bias`` may be None."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.has_bias = bias is not None
        ctx.save_for_backward(input, bias)
        return swiglu(input if bias is None else input + bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, bias = ctx.saved_tensors
        grad = swiglu_grad(grad_output, input if bias is None else input + bias)
        grad_bias = None
        if ctx.has_bias:
            grad_bias = grad.reshape(-1, bias.numel()).sum(dim=0).view_as(bias)
        return grad, grad_bias


def bias_swiglu_reference(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return SwiGLUFunction.apply(input, bias)


def bias_swiglu_impl(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The fusable op (compiled when registered as ``bias_swiglu``)."""
    return get_kernel("bias_swiglu", bias_swiglu_reference)(input, bias)


def bias_swiglu_unfused(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Same formula through plain torch ops (``--no-bias-swiglu-fusion``)."""
    return swiglu(input if bias is None else input + bias)

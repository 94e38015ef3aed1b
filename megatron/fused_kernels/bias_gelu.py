"""Bias + GeLU with the tanh approximation, and its exact hand-written backward.

``gelu(x) = 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))`` with ``x = input + bias``, the
constants Megatron's fused kernel uses. :class:`GeLUFunction` is the fusable op: one autograd node
whose backward is the derivative written out (what a compiled body implements), instead of the
chain of small nodes autograd would record for :func:`bias_gelu_unfused` (the
``--no-bias-gelu-fusion`` path, the same formula through plain torch ops).
"""

from typing import Optional

import torch

from megatron.fused_kernels import get_kernel

SQRT_2_OVER_PI = 0.79788456
GELU_CUBIC = 0.044715
# d/dx of SQRT_2_OVER_PI * x * (1 + GELU_CUBIC * x^2) is SQRT_2_OVER_PI + this * x^2.
_DERIV_CUBIC = 3.0 * GELU_CUBIC * SQRT_2_OVER_PI


def _add_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return y if bias is None else y + bias


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GeLU with Megatron's constants."""
    return x * 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_CUBIC * x * x)))


def gelu_tanh_grad(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad_output * d gelu_tanh(x) / dx``, written out."""
    t = torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_CUBIC * x * x))
    dgelu = 0.5 * x * (1.0 - t * t) * (SQRT_2_OVER_PI + _DERIV_CUBIC * x * x) + 0.5 * (1.0 + t)
    return dgelu * grad_output


class GeLUFunction(torch.autograd.Function):
    """``gelu_tanh(input + bias)`` as one autograd node; ``bias`` may be None."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.has_bias = bias is not None
        ctx.save_for_backward(input, bias)
        return gelu_tanh(_add_bias(input, bias))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, bias = ctx.saved_tensors
        grad = gelu_tanh_grad(grad_output, _add_bias(input, bias))
        grad_bias = None
        if ctx.has_bias:
            # The bias broadcasts over every leading dimension of the input.
            grad_bias = grad.reshape(-1, bias.numel()).sum(dim=0).view_as(bias)
        return grad, grad_bias


def bias_gelu_reference(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return GeLUFunction.apply(input, bias)


def bias_gelu_impl(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The fusable op (compiled when registered as ``bias_gelu``)."""
    return get_kernel("bias_gelu", bias_gelu_reference)(input, bias)


def bias_gelu_unfused(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Same formula through plain torch ops (``--no-bias-gelu-fusion``)."""
    return gelu_tanh(_add_bias(input, bias))

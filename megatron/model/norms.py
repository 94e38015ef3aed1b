"""The normalisation layer ``--normalization`` asks for."""

from typing import Optional

import torch

from megatron.core.config import TransformerConfig
from megatron.fused_kernels.layer_norm import FusedLayerNorm, MixedFusedRMSNorm


def get_norm(config: TransformerConfig, sequence_parallel: bool = False,
             hidden_size: Optional[int] = None) -> torch.nn.Module:
    """A LayerNorm or RMSNorm over ``hidden_size`` (default ``--hidden-size``) with
    ``--norm-epsilon``; a LayerNorm follows ``--apply-layernorm-1p``.

    ``sequence_parallel`` marks its parameters for the tensor-parallel gradient all-reduce.
    """
    size = config.hidden_size if hidden_size is None else hidden_size
    if config.normalization == "RMSNorm":  # the config refuses RMSNorm with the 1p form
        return MixedFusedRMSNorm(size, eps=config.layernorm_epsilon,
                                 sequence_parallel=sequence_parallel,
                                 params_dtype=config.params_dtype)
    return FusedLayerNorm(size, eps=config.layernorm_epsilon, sequence_parallel=sequence_parallel,
                          params_dtype=config.params_dtype,
                          apply_layernorm_1p=config.apply_layernorm_1p)


class L2Norm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, in fp32, cast back: an RMSNorm with no
    weight (Megatron-Core's ``L2Norm``, what ``--qk-l2-norm`` puts on query and key). It has no
    parameters, so it adds no checkpoint key."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

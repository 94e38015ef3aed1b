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

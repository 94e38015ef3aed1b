"""The normalisation layer ``--normalization`` asks for."""

import torch

from megatron.core.config import TransformerConfig
from megatron.fused_kernels.layer_norm import FusedLayerNorm, MixedFusedRMSNorm


def get_norm(config: TransformerConfig, sequence_parallel: bool = False) -> torch.nn.Module:
    """A LayerNorm or RMSNorm over ``hidden_size`` with ``--norm-epsilon``.

    ``sequence_parallel`` marks its parameters for the tensor-parallel gradient all-reduce.
    """
    cls = {"LayerNorm": FusedLayerNorm, "RMSNorm": MixedFusedRMSNorm}[config.normalization]
    return cls(config.hidden_size, eps=config.layernorm_epsilon,
               sequence_parallel=sequence_parallel, params_dtype=config.params_dtype)

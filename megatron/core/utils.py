"""Small helpers shared across megatron/core: weight initialisers.

Initialisers are in-place functions of one tensor (``init_method(tensor)``), the form
:mod:`megatron.core.tensor_parallel.layers` calls on the full, unsplit weight.
"""

import math
from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(sigma: float) -> InitMethod:
    """Initialiser drawing from N(0, sigma^2) (``--init-method-std``)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, (sigma / sqrt(2 * num_layers))^2), for the output projections feeding the residual.

    Each layer adds two such projections to the residual stream, so scaling by
    ``1 / sqrt(2 * num_layers)`` keeps the stream's variance independent of depth.
    """
    if num_layers < 1:
        raise ValueError(f"scaled_init_method_normal needs --num-layers >= 1, got {num_layers}")
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_

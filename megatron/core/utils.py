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


def xavier_uniform_init_method() -> InitMethod:
    """Initialiser drawing from U(-a, a), ``a = sqrt(6 / (fan_in + fan_out))``
    (``--init-method-xavier-uniform``).

    Applied, as every initialiser here, to the full unsplit weight, so the fans (and therefore
    the weights) are the same under any tensor-parallel split.
    """

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.xavier_uniform_(tensor)

    return init_


def _no_initialization(tensor: torch.Tensor) -> torch.Tensor:
    """Leave the weight as allocated, zeroed so that a forgotten load shows as a model that
    predicts nothing rather than as garbage (nor a draw from the random generator)."""
    with torch.no_grad():
        return tensor.zero_()


def get_init_method(config) -> InitMethod:
    """The initialiser of ``config`` (a TransformerConfig) for every weight that does not feed
    the residual stream directly: QKV, the first MLP layer, embeddings, the output layer and
    heads. With ``perform_initialization`` off (--no-initialization) nothing is drawn: the
    weights wait for a checkpoint."""
    if not config.perform_initialization:
        return _no_initialization
    if config.init_method_xavier_uniform:
        return xavier_uniform_init_method()
    return init_method_normal(config.init_method_std / _mup_width_root(config))


def _mup_width_root(config) -> float:
    """``sqrt(width_mult)`` under --use-mup (the hidden weights' std divisor), else 1."""
    width_mult = getattr(config, "mup_width_mult", 1.0)
    if not getattr(config, "use_mup", False) or width_mult == 1.0:
        return 1.0
    return math.sqrt(width_mult)


def get_embedding_init_method(config) -> InitMethod:
    """The initialiser of the embedding tables: N(0, --embedding-init-method-std^2) when that
    is set, else :func:`get_init_method`'s (Megatron-Core's ``embedding_init_method``); under
    --use-mup N(0, --init-method-std^2), not width-scaled (also an untied output layer's)."""
    std = getattr(config, "embedding_init_method_std", None)
    if std is not None:
        return init_method_normal(std)
    if getattr(config, "use_mup", False) and config.perform_initialization:
        return init_method_normal(config.init_method_std)
    return get_init_method(config)


def get_output_layer_init_method(config) -> InitMethod:
    """The initialiser of the projections that feed the residual stream (attention ``dense``,
    ``dense_4h_to_h``): depth-scaled normal, or xavier uniform as for every other weight."""
    if not config.perform_initialization:
        return _no_initialization
    if config.init_method_xavier_uniform:
        return xavier_uniform_init_method()
    return scaled_init_method_normal(config.init_method_std / _mup_width_root(config),
                                     config.num_layers)

"""``--moe-latent-size``: the routed experts of an MoE layer work in a narrower (latent) width.

As in Megatron-Core's ``MoELayer``: the router and the shared expert see the hidden state
``[s, b, h]``; the tokens are projected down by ``fc1_latent_proj`` (``[latent, h]``) before
they are dispatched, the experts map latent to latent (``linear_fc1`` ``[(2) ffn, latent]``,
``linear_fc2`` ``[latent, ffn]``), and the combined output is projected back up by
``fc2_latent_proj`` (``[h, latent]``) before the shared expert's output is added. Both
projections are whole on every tensor-parallel rank (Megatron-Core's "duplicated" linear:
checkpoint keys ``...mlp.fc1_latent_proj.weight`` / ``...mlp.fc2_latent_proj.weight``, biases
with ``--add-bias-linear``, initialised to zero); with sequence parallelism each rank sees its
own tokens, so their gradients are summed over the tensor-parallel group like the norms'.
"""

from typing import Callable, Optional

import torch

from megatron.core import device
from megatron.core.config import TransformerConfig
from megatron.model.utils import init_rng


class LatentProjection(torch.nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[output_size, input_size]``, replicated over the
    tensor-parallel ranks; initialised on its own seed so the layout does not change it."""

    def __init__(self, config: TransformerConfig, input_size: int, output_size: int,
                 init_method: Callable, seed_piece: str, init_seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        master = torch.empty(output_size, input_size,
                             dtype=torch.promote_types(config.params_dtype, torch.float32))
        with init_rng(init_seed, seed_piece):
            init_method(master)
        self.weight = torch.nn.Parameter(master.to(device=device.current_device(),
                                                   dtype=config.params_dtype))
        self.bias: Optional[torch.nn.Parameter] = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.zeros(
                output_size, device=device.current_device(), dtype=config.params_dtype))
        if sequence_parallel:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size]`` -> ``[..., output_size]``."""
        return torch.nn.functional.linear(x, self.weight, self.bias)

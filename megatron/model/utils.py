"""Small helpers shared by the model files: activations and split-independent initialisation."""

import contextlib
import math
import zlib

import torch

from megatron.core import device, meta_init


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU, tanh approximation with the exact sqrt(2/pi) (``--openai-gelu``)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` (``--squared-relu``)."""
    return torch.pow(torch.nn.functional.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``, the gate activation of ``--quick-geglu``."""
    return x * torch.sigmoid(1.702 * x)


def gated_linear_unit(x: torch.Tensor, gate_activation, linear_offset: float = 0.0,
                      clamp_value=None) -> torch.Tensor:
    """``act(gate) * (linear + linear_offset)`` for ``x = [..., gate | linear]`` (``[..., 2 f]``
    -> ``[..., f]``); with ``clamp_value`` v the gate is first clamped to at most v and the
    linear half to ``[-v, v]`` (``--activation-func-clamp-value``)."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        linear = linear.clamp(min=-clamp_value, max=clamp_value)
    if linear_offset:   # no copy of the linear half kept for backward when there is none
        linear = linear + linear_offset
    return gate_activation(gate) * linear


def glu_activation(config):
    """The gated unit ``config`` selects (``--swiglu`` or ``--quick-geglu``, with
    ``--glu-linear-offset`` / ``--activation-func-clamp-value``), as ``[..., 2 f] -> [..., f]``."""
    gate = quick_gelu if config.quick_geglu else torch.nn.functional.silu
    offset, clamp = config.glu_linear_offset, config.activation_func_clamp_value
    return lambda x: gated_linear_unit(x, gate, offset, clamp)


def plain_swiglu(config) -> bool:
    """Whether ``config``'s MLP is SwiGLU without offset or clamp (the fused kernel's case)."""
    return (config.swiglu and not config.glu_linear_offset
            and config.activation_func_clamp_value is None)


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU through erf."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def piece_seed(init_seed: int, piece: str) -> int:
    """Seed for initialising one parameter-owning piece of the model.

    ``piece`` names the piece globally (``"embedding"``, ``"layer.7"`` for global layer 7,
    ``"final_norm"``, ``"output_layer"``), so the same piece gets the same weights whichever
    pipeline stage or tensor-parallel rank builds it.
    """
    return (init_seed * 1_000_003 + zlib.crc32(piece.encode())) % (2 ** 63)


@contextlib.contextmanager
def init_rng(init_seed: int, piece: str):
    """Run the body with the RNGs seeded for ``piece``; restore every RNG afterwards.

    Layers create their full-shape weights from the default generator, so building each piece
    inside its own seeded fork makes the model independent of the parallel split and leaves the
    caller's random streams (data order, dropout) untouched.
    """
    devices = [torch.cuda.current_device()] if device.is_cuda() else []
    with torch.random.fork_rng(devices=devices), meta_init.piece(piece):
        device.manual_seed(piece_seed(init_seed, piece))
        yield

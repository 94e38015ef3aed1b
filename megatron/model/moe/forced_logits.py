"""The benchmark switches that replace a router's logits by random draws (as in Megatron-Core).

``--moe-router-force-load-balancing``: the logits ``[..., E]`` become standard normal draws, so
every expert receives about the same number of tokens whatever the model learned.

``--moe-router-force-biased STD``: the logits become ``eps[t, e] + b[e]``, ``eps`` standard normal
draws as above and ``b`` one bias per expert drawn from ``N(0, |STD|)``, so some experts are
"hot" and the load is skewed the way a trained model's can be:

* ``STD < 0``: ``b`` is drawn once per router and kept for the whole run (a stationary skew),
  from a generator of its own seeded by ``--seed`` and the router's global layer number: the
  same on every rank, after a resume, under any parallel layout;
* ``STD > 0``: ``b`` is drawn again at every forward, from the default generator right after
  ``eps``. The ranks of a pipeline stage seed that generator alike (``--seed`` plus 100 per
  stage) and, routing equally many tokens, draw equally much from it, so they draw the same
  ``b``; with ``--data-parallel-random-init`` each data-parallel rank seeds it differently and
  draws its own ``b``;
* ``STD == 0``: ``b = 0``, the draws of ``--moe-router-force-load-balancing``.

Given both switches, the biased logits are used (in Megatron-Core they replace the random ones
drawn first; here those are not drawn at all, since nothing sees them).

``eps`` comes from the default generator, which checkpoints save and activation recomputation
replays: a resumed run continues bit for bit and a recomputed router draws the same logits.
Each rank draws ``eps`` for its own tokens, so the routing depends on the parallel layout. The
router's gradient passes straight through the draws, as if they were its logits.
"""

from typing import Optional

import torch

from megatron.model.moe.config import MoEConfig
from megatron.model.utils import piece_seed


class _DrawnLogits(torch.autograd.Function):
    """Forward: standard normal draws of the logits' shape and dtype from the device's default
    generator, plus a per-expert bias (last dimension): ``bias`` ``[E]``, or with ``redraw_std``
    one drawn from the same generator right after them, ``N(0, redraw_std)``; no bias when both
    are None. Backward: the gradient passes to the logits unchanged (straight through)."""

    @staticmethod
    def forward(ctx, logits, bias, redraw_std):
        drawn = torch.empty_like(logits).normal_()
        if redraw_std is not None:
            bias = drawn.new_empty(logits.size(-1)).normal_(0.0, redraw_std)
        return drawn if bias is None else drawn + bias.to(drawn.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


def random_logits(logits: torch.Tensor) -> torch.Tensor:
    """``--moe-router-force-load-balancing``: the logits replaced by standard normal draws."""
    return _DrawnLogits.apply(logits, None, None)


def biased_logits(logits: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  redraw_std: Optional[float] = None) -> torch.Tensor:
    """``--moe-router-force-biased``: the logits replaced by standard normal draws plus the
    per-expert ``bias`` ``[E]`` (``STD < 0``), or plus a bias drawn right after them with
    ``redraw_std`` (``STD > 0``)."""
    return _DrawnLogits.apply(logits, bias, redraw_std)


def stationary_bias(std: float, num_experts: int, init_seed: int,
                    layer_number: int) -> torch.Tensor:
    """The kept bias of ``--moe-router-force-biased STD`` with ``STD < 0``: ``[E]`` float64 on
    the CPU, ``N(0, |STD|)`` from a generator seeded by ``init_seed`` (``--seed``) and the
    1-based global ``layer_number`` only."""
    seed = piece_seed(init_seed, f"layer.{layer_number - 1}.mlp.router.force_biased")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(num_experts, generator=gen, dtype=torch.float64, device="cpu") * abs(std)


class ForcedLogits:
    """One router's replacement of its logits under the benchmark switches (module docstring).

    Args:
        moe_config: the MoE settings (``moe_router_force_biased``,
            ``moe_router_force_load_balancing``).
        init_seed: ``--seed``; with ``STD < 0`` the bias depends on it and on ``layer_number``.
        layer_number: the router's 1-based global layer number.
    """

    def __init__(self, moe_config: MoEConfig, init_seed: int, layer_number: int):
        self.std = moe_config.moe_router_force_biased
        self.force_load_balancing = moe_config.moe_router_force_load_balancing
        self.bias = None
        if self.std is not None and self.std < 0:
            self.bias = stationary_bias(self.std, moe_config.num_moe_experts, init_seed,
                                        layer_number)
        self._bias_on_device = self.bias

    def _device_bias(self, device: torch.device) -> torch.Tensor:
        if self._bias_on_device.device != device:
            self._bias_on_device = self.bias.to(device)
        return self._bias_on_device

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [..., E]`` -> the draws that replace them (the logits when no switch is
        on)."""
        if self.std is None:
            return random_logits(logits) if self.force_load_balancing else logits
        if self.std < 0:
            return biased_logits(logits, bias=self._device_bias(logits.device))
        return biased_logits(logits, redraw_std=self.std if self.std > 0 else None)

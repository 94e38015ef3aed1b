"""Lion (``--optimizer lion``): sign of an interpolated momentum, one state tensor per parameter.

For each parameter ``p`` with gradient ``g`` and momentum ``m`` (``exp_avg``, zeros at first):

    u = sign(beta1 * m + (1 - beta1) * g)
    p = p * (1 - lr * weight_decay) - lr * u      (decoupled weight decay)
    m = beta2 * m + (1 - beta2) * g

``beta1`` / ``beta2`` are ``--lion-beta1`` / ``--lion-beta2`` (0.95 / 0.98). The state key is
``exp_avg``, the name Megatron's Lion saves, so checkpoints of both carry the same field; there is
no step counter (Lion has no bias correction).
"""

from typing import Iterable, Tuple

import torch

from megatron.optimizer.torch_base import OptimizerBase


class Lion(OptimizerBase):
    """The Lion update above over torch param groups (each may set its own ``lr``,
    ``weight_decay`` and ``betas``); the state is created on a parameter's first step."""

    def __init__(self, params: Iterable, lr: float, betas: Tuple[float, float] = (0.95, 0.98),
                 weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        for flag, beta in zip(("--lion-beta1", "--lion-beta2"), betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion: {flag} must be in [0, 1), got {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = torch.lerp(grad, exp_avg, beta1).sign_()
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(update, alpha=-lr)
                exp_avg.lerp_(grad, 1.0 - beta2)
        return loss

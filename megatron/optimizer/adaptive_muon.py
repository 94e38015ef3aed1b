"""Adaptive Muon (``--optimizer adaptive_muon``): Muon whose orthogonalised update is divided
by a running second moment of itself (AdaMuon / NorMuon), AdamW for every other parameter.

The meaning follows Megatron-Core's ``adaptive_muon`` (its tensor-parallel wrapper of NVIDIA
Emerging-Optimizers' AdaptiveMuon):

- Everything Muon reads is read as for ``--optimizer muon`` (``--muon-momentum``,
  ``--muon-nesterov``, the query/key/value split, ``--muon-scale-mode``,
  ``--muon-extra-scale-factor``, the Newton-Schulz table and steps, the matmul precision, and
  which parameters take it: megatron/optimizer/muon.py). The second moment's settings are
  Megatron-Core's ``OptimizerConfig`` fields ``adaptive_muon_moment2_method`` (``adamuon``),
  ``adaptive_muon_beta2`` (0.95) and ``adaptive_muon_eps`` (1e-8), which its command line does
  not set.
- A step, for a weight ``W`` with gradient ``G``::

      W <- W - lr * wd * W
      M <- lerp(M, G, 1 - momentum);  U = lerp(G, M, momentum) if nesterov else M
      O = scale * NS(U)                         (exactly Muon's scaled, orthogonalised update)
      adamuon:  V <- lerp(V, O^2, 1 - beta2);  D = O / (sqrt(V) + eps)
      normuon:  V <- lerp(V, mean(O^2 along the longer dim), 1 - beta2);
                D = O / sqrt(max(V, eps))        (V: one value per row, or per column)
      W <- W - lr * D

  State: Muon's ``momentum_buffer`` and ``moment2_buffer`` (``V``); no bias correction.
- Tensor parallelism: ``O`` and ``V`` are those of the whole matrix (``--muon-tp-mode
  duplicated``), so the numbers do not depend on the layout; each rank keeps its piece of ``D``.
- ``--use-distributed-optimizer``: Megatron-Core's layer-wise deal (megatron/optimizer/soap.py
  says how).
"""

from typing import List

import torch

from megatron.core.config import ConfigError

from .muon import Muon, gather_shards, own_shard
from .soap import check_matrix_state, share_state_from_owner

MOMENT2_METHODS = ("adamuon", "normuon")


class AdaptiveMuon(Muon):
    """:class:`~megatron.optimizer.muon.Muon` with a second moment on its update.

    Args:
        moment2_method, beta2, moment2_eps: the ``adaptive_muon_*`` settings (``eps`` is the
            AdamW part's, as in Muon).
        Everything else: as :class:`~megatron.optimizer.muon.Muon`.
    """

    def __init__(self, params, *, moment2_method: str = "adamuon", beta2: float = 0.95,
                 moment2_eps: float = 1e-8, **muon_kwargs):
        check_moment2_settings(moment2_method, beta2, moment2_eps)
        super().__init__(params, **muon_kwargs)
        self.moment2_method = moment2_method
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("moment2_eps", moment2_eps)

    def _muon_step(self, group: dict, params: List[torch.Tensor]) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            if wd != 0.0:
                p.add_(p, alpha=-lr * wd)
            buf.lerp_(grad, 1.0 - beta)
            update = grad.lerp(buf, beta) if group["nesterov"] else buf
            shard, dim = self._shard_group(p)
            orth = self.orthogonalize_full(p, gather_shards(update.float(), shard, dim))
            if "moment2_buffer" not in state:
                state["moment2_buffer"] = torch.zeros(self._moment2_shape(orth),
                                                      dtype=orth.dtype, device=orth.device)
            scaled = normalize_by_moment2(orth, state["moment2_buffer"], self.moment2_method,
                                          group["beta2"], group["moment2_eps"])
            p.add_(own_shard(scaled, shard, dim).to(p.dtype), alpha=-lr)

    def _moment2_shape(self, orth: torch.Tensor):
        if self.moment2_method == "adamuon":
            return orth.shape
        rows, cols = orth.shape
        return (rows, 1) if rows >= cols else (1, cols)

    def _share_state(self, p: torch.Tensor, use_muon: bool, owner: int) -> None:
        share_state_from_owner(self, p, owner)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        check_matrix_state(self, ("momentum_buffer", "moment2_buffer"), "adaptive_muon")


def normalize_by_moment2(orth: torch.Tensor, moment2: torch.Tensor, method: str, beta2: float,
                         eps: float) -> torch.Tensor:
    """Update ``moment2`` in place from the whole orthogonalised update ``orth`` and return
    ``orth`` divided by its root."""
    if method == "adamuon":
        moment2.lerp_(orth.square(), 1.0 - beta2)
        return orth / (moment2.sqrt() + eps)
    longer = -1 if orth.size(0) >= orth.size(1) else -2
    moment2.lerp_(orth.square().mean(dim=longer, keepdim=True), 1.0 - beta2)
    return orth * moment2.clamp_min(eps).rsqrt()


def check_moment2_settings(method: str, beta2: float, eps: float) -> None:
    """Refuse, in one line, an adaptive-Muon second-moment setting not built or out of range."""
    if method not in MOMENT2_METHODS:
        raise ConfigError(f"adaptive_muon_moment2_method must be one of {MOMENT2_METHODS}, "
                          f"got {method!r}")
    if not 0.0 <= beta2 < 1.0:
        raise ConfigError(f"adaptive_muon_beta2 must be in [0, 1), got {beta2}")
    if not eps > 0.0:
        raise ConfigError(f"adaptive_muon_eps must be > 0, got {eps}")


def build_adaptive_muon(config, param_groups: List[dict], tp_group=None, expert_tp_group=None,
                        dp_group=None) -> AdaptiveMuon:
    """The :class:`AdaptiveMuon` optimizer of ``config`` over ``param_groups`` (already split by
    ``split_muon_groups``); ``dp_group`` is dealt over with ``--use-distributed-optimizer``."""
    return AdaptiveMuon(
        param_groups, moment2_method=config.adaptive_muon_moment2_method,
        beta2=config.adaptive_muon_beta2, moment2_eps=config.adaptive_muon_eps, lr=config.lr,
        weight_decay=config.weight_decay, momentum=config.muon_momentum,
        nesterov=config.muon_nesterov, betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps, coefficient_type=config.muon_coefficient_type,
        num_ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_group=tp_group,
        expert_tp_group=expert_tp_group,
        dp_group=dp_group if config.use_distributed_optimizer else None)

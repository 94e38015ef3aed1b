"""SOAP (``--optimizer soap``): Adam run in the eigenbasis of Shampoo's two Kronecker factors
for the transformer layers' 2-D weight matrices, AdamW for every other parameter.

The meaning follows Megatron-Core's ``soap`` (NVIDIA Emerging-Optimizers' SOAP as Megatron-Core
builds it from its ``OptimizerConfig``):

- Which parameters: as ``--optimizer muon`` (2-D weights not marked
  ``is_embedding_or_output_parameter``); the rest get AdamW with ``--adam-beta1``,
  ``--adam-beta2``, ``--adam-eps``. No query/key/value split: the fused weight is one matrix.
- Settings: ``lr`` and ``weight_decay`` from the schedule (decoupled), the inner Adam's betas
  ``(--adam-beta1, --adam-beta2)``; SOAP's own ``eps`` is 1e-8 (Megatron-Core passes it no
  flag); ``OptimizerConfig.soap_shampoo_beta`` (0.95), ``soap_precondition_frequency`` (1) and
  ``soap_use_kl_shampoo`` (True) are Megatron-Core's config fields of the same names, which its
  command line does not set either.
- A step ``t = step + 1`` for a weight ``W`` (``m x n``) with gradient ``G``::

      b  = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)           (bias-corrected EMA)
      L <- b L + (1 - b) G G^T,  R <- b R + (1 - b) G^T G           (Shampoo's factors)
        KL-Shampoo instead: L <- b L + (1 - b) G C_R G^T / n,  R <- ... G^T C_L G / m,
        C_X = Q_X diag(1 / max(diag(Q_X^T X Q_X), eps)) Q_X^T     (the current basis)
      every precondition_frequency steps (counting from step 0):
        exp_avg <- Q_L exp_avg Q_R^T                                 (back to weight space)
        step 0: Q_X <- eigenvectors of X, eigenvalues descending   (torch.linalg.eigh)
        later:  sort Q_X's columns by diag(Q_X^T X Q_X) descending (exp_avg_sq's rows /
                columns with them), then Q_X <- QR(X Q_X).Q          (one power iteration)
        exp_avg <- Q_L^T exp_avg Q_R
      W <- W - lr * wd * W
      G' = Q_L^T G Q_R;  exp_avg <- lerp(exp_avg, G', 1 - beta1);
      exp_avg_sq <- lerp(exp_avg_sq, G'^2, 1 - beta2)
      U = (exp_avg / (1 - beta1^t)) / (sqrt(exp_avg_sq / (1 - beta2^t)) + eps)
      W <- W - lr * Q_L U Q_R^T

- Precision: the factors, bases and moments are kept and computed in float32 (float64 for a
  float64 weight); the Adam part of a bf16 run steps the fp32 main weights.
- Tensor parallelism: a split weight's gradient is all-gathered into the whole matrix, the
  factors and moments are those of the whole matrix (the same on every tensor-parallel rank)
  and each rank keeps its piece of the update, so the numbers do not depend on the layout (as
  ``--muon-tp-mode duplicated``). Megatron-Core steps each shard on its own instead.
- ``--use-distributed-optimizer``: as in Megatron-Core, the layer-wise distributed optimizer:
  whole parameters are dealt round-robin over the data-parallel ranks, each rank steps and keeps
  the state of its own, then every parameter is broadcast from its owner (``--optimizer
  dist_muon``'s deal). A state dict is gathered whole on every rank.
"""

from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.config import ConfigError

from .muon import Muon, gather_shards, own_shard

SOAP_EPS = 1e-8


@dataclass
class SoapSettings:
    """SOAP's knobs besides lr, weight decay and the Adam betas (Megatron-Core's names)."""

    shampoo_beta: float = 0.95
    precondition_frequency: int = 1
    use_kl_shampoo: bool = True
    eps: float = SOAP_EPS


class SOAP(Muon):
    """SOAP over the groups marked ``use_muon`` (the matrix groups, named as Muon's so the
    layer-wise deal and the AdamW part are shared), torch's AdamW over the others.

    State of a matrix: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (in the eigenbasis), ``L``,
    ``R`` (the Kronecker factors), ``Q_L``, ``Q_R`` (their eigenbases), all of the whole matrix.

    Args:
        params: param groups; each with ``use_muon`` (default False).
        lr, weight_decay: the groups' defaults (the scheduler sets them).
        betas: SOAP's inner Adam betas, and the AdamW part's.
        eps: the AdamW part's (SOAP's own is ``settings.eps``).
        settings: :class:`SoapSettings` (default: Megatron-Core's).
        tp_group / expert_tp_group / dp_group: as :class:`~megatron.optimizer.muon.Muon`'s.
    """

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999),
                 eps: float = 1e-8, settings: Optional[SoapSettings] = None, tp_group=None,
                 expert_tp_group=None, dp_group=None):
        settings = settings or SoapSettings()
        check_soap_settings(settings.shampoo_beta, settings.precondition_frequency)
        self.settings = settings
        self.tp_group, self.expert_tp_group = tp_group, expert_tp_group
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(
            dp_group) > 1 else None
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, use_muon=False)
        torch.optim.Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"SOAP takes 2-D weights only, got shape "
                                         f"{tuple(p.shape)}")

    def _muon_step(self, group: dict, params: List[torch.Tensor]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        for p in params:
            if p.grad is None:
                continue
            shard, dim = self._shard_group(p)
            dtype = torch.promote_types(p.dtype, torch.float32)
            grad = gather_shards(p.grad.to(dtype), shard, dim)
            state = self.state[p]
            if not state:
                state.update(init_soap_state(grad))
            update = soap_update(state, grad, group["betas"], self.settings)
            if wd != 0.0:
                p.add_(p, alpha=-lr * wd)
            p.add_(own_shard(update, shard, dim).to(p.dtype), alpha=-lr)

    def _share_state(self, p: torch.Tensor, use_muon: bool, owner: int) -> None:
        share_state_from_owner(self, p, owner)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        check_matrix_state(self, SOAP_FIELDS, "soap")


SOAP_FIELDS = ("step", "exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")


def check_matrix_state(optimizer, fields: Iterable[str], name: str) -> None:
    """Refuse a loaded state whose matrix weights do not carry exactly ``fields`` (a checkpoint
    of another optimizer), naming what was found."""
    for group in optimizer.param_groups:
        if not group["use_muon"]:
            continue
        for p in group["params"]:
            found = set(optimizer.state.get(p, {}))
            if found and found != set(fields):
                raise ValueError(f"the loaded optimizer state of a {tuple(p.shape)} weight has "
                                 f"fields {sorted(found)}, --optimizer {name} keeps "
                                 f"{sorted(fields)}: the checkpoint was saved with another "
                                 f"--optimizer (load it with --no-load-optim)")


def share_state_from_owner(optimizer, p: torch.Tensor, owner: int) -> None:
    """Broadcast ``p``'s whole state (any fields) from its data-parallel owner; a rank that
    receives nothing drops its own."""
    group = optimizer.dp_group
    src = dist.get_global_rank(group, owner)
    payload = [None]
    if dist.get_rank(group) == owner and optimizer.state.get(p):
        payload[0] = {k: v.cpu() if torch.is_tensor(v) else v
                      for k, v in optimizer.state[p].items()}
    dist.broadcast_object_list(payload, src, group=group,
                               device=p.device if p.is_cuda else None)
    if payload[0] is None:
        optimizer.state.pop(p, None)
        return
    optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v
                          for k, v in payload[0].items()}


def init_soap_state(grad: torch.Tensor) -> dict:
    """Zero moments and factors, identity bases, of the whole matrix ``grad`` is shaped like."""
    rows, cols = grad.shape
    kw = dict(dtype=grad.dtype, device=grad.device)
    return dict(step=0, exp_avg=torch.zeros_like(grad), exp_avg_sq=torch.zeros_like(grad),
                L=torch.zeros(rows, rows, **kw), R=torch.zeros(cols, cols, **kw),
                Q_L=torch.eye(rows, **kw), Q_R=torch.eye(cols, **kw))


def soap_update(state: dict, grad: torch.Tensor, betas, settings: SoapSettings) -> torch.Tensor:
    """One SOAP step on ``state`` for the whole gradient ``grad``; returns the direction the
    weight moves against (to be scaled by lr)."""
    t = state["step"] + 1
    beta = settings.shampoo_beta
    beta = 1.0 - (1.0 - beta) / (1.0 - beta ** t)
    _update_factors(state, grad, beta, settings)
    if state["step"] % settings.precondition_frequency == 0:
        _refresh_bases(state, use_eigh=state["step"] == 0)
    q_l, q_r = state["Q_L"], state["Q_R"]
    beta1, beta2 = betas
    projected = q_l.mT @ grad @ q_r
    state["exp_avg"].lerp_(projected, 1.0 - beta1)
    state["exp_avg_sq"].lerp_(projected.square(), 1.0 - beta2)
    mean = state["exp_avg"] / (1.0 - beta1 ** t)
    denom = (state["exp_avg_sq"] / (1.0 - beta2 ** t)).sqrt() + settings.eps
    state["step"] = t
    return q_l @ (mean / denom) @ q_r.mT


def _update_factors(state: dict, grad: torch.Tensor, beta: float,
                    settings: SoapSettings) -> None:
    if not settings.use_kl_shampoo:
        state["L"].lerp_(grad @ grad.mT, 1.0 - beta)
        state["R"].lerp_(grad.mT @ grad, 1.0 - beta)
        return
    rows, cols = grad.shape
    inv_l = _inverse_in_basis(state["L"], state["Q_L"], settings.eps) / rows
    inv_r = _inverse_in_basis(state["R"], state["Q_R"], settings.eps) / cols
    state["L"].lerp_(grad @ inv_r @ grad.mT, 1.0 - beta)
    state["R"].lerp_(grad.mT @ inv_l @ grad, 1.0 - beta)


def _inverse_in_basis(factor: torch.Tensor, basis: torch.Tensor, eps: float) -> torch.Tensor:
    """``Q diag(1 / max(diag(Q^T F Q), eps)) Q^T``: the factor's inverse as seen in basis Q."""
    eigenvalues = ((basis.mT @ factor) * basis.mT).sum(dim=-1)
    return (basis * eigenvalues.clamp_min(eps).reciprocal()) @ basis.mT


def _refresh_bases(state: dict, use_eigh: bool) -> None:
    """New eigenbases of L and R, the first moment carried over into them."""
    avg = state["Q_L"] @ state["exp_avg"] @ state["Q_R"].mT
    for axis, (factor, name) in enumerate(((state["L"], "Q_L"), (state["R"], "Q_R"))):
        if use_eigh:
            state[name] = torch.linalg.eigh(factor).eigenvectors.flip(-1)
            continue
        basis = state[name]
        order = torch.argsort(((basis.mT @ factor) * basis.mT).sum(dim=-1), descending=True)
        state["exp_avg_sq"] = state["exp_avg_sq"].index_select(axis, order)
        state[name] = torch.linalg.qr(factor @ basis[:, order]).Q
    state["exp_avg"] = state["Q_L"].mT @ avg @ state["Q_R"]


def check_soap_settings(shampoo_beta: float, precondition_frequency: int) -> None:
    """Refuse SOAP settings out of range, in one line."""
    if not 0.0 <= shampoo_beta < 1.0:
        raise ConfigError(f"soap_shampoo_beta must be in [0, 1), got {shampoo_beta}")
    if int(precondition_frequency) != precondition_frequency or precondition_frequency < 1:
        raise ConfigError(f"soap_precondition_frequency must be a whole number >= 1, got "
                          f"{precondition_frequency}")


def build_soap(config, param_groups: List[dict], tp_group=None, expert_tp_group=None,
               dp_group=None) -> SOAP:
    """The :class:`SOAP` optimizer of ``config`` (an ``OptimizerConfig``) over
    ``param_groups`` (already split by ``split_muon_groups``); ``dp_group`` is dealt over with
    ``--use-distributed-optimizer`` only."""
    settings = SoapSettings(shampoo_beta=config.soap_shampoo_beta,
                            precondition_frequency=config.soap_precondition_frequency,
                            use_kl_shampoo=config.soap_use_kl_shampoo)
    return SOAP(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                settings=settings, tp_group=tp_group, expert_tp_group=expert_tp_group,
                dp_group=dp_group if config.use_distributed_optimizer else None)

"""Maximal update parametrization (muP, `--use-mup`): Megatron-Core's formulas in one place.

A model tuned at a base hidden size ``h0`` is trained at ``h`` with ``w = h / h0``
(``--mup-width-mult``, derived from ``--mup-base-hidden-size`` when that is given):

* init: hidden matrices N(0, (sigma^2 / w)); the residual-output projections (attention
  ``dense``, MLP ``dense_4h_to_h``) N(0, sigma^2 / (2 L w)); the embedding tables and an
  untied output layer keep N(0, sigma^2) (``--embedding-init-method-std`` if given);
* forward: the embedding output times ``--mup-embedding-mult``; the logits times
  ``--mup-output-mult``, which, left at 1.0, becomes ``1 / w``; attention scores times
  ``sqrt(--mup-base-head-dim) / d^p`` (``1 / d^p`` without a base head dim), ``d`` the
  head dim (``--kv-channels``) and ``p`` ``--mup-attn-scale-power`` (0.5 is the standard
  ``1 / sqrt(d)``);
* optimizer (:func:`mup_group_overrides`): Adam divides the lr (and min lr) and ``eps`` of
  matrix-like parameters by ``w``; SGD multiplies the lr of vector-like ones (embeddings,
  biases, norms) by ``w``; Lion divides the lr of matrix-like ones by ``w``. With
  ``--decoupled-lr`` the embedding and output parameters keep their own lr. At ``w == 1``
  nothing changes in the optimizer. Weight-decay multipliers are not touched (Adam's
  decoupled decay is multiplied by the group's lr, so it follows the scaled lr).

With ``w == 1``, both multipliers 1 and ``--mup-attn-scale-power 0.5``, a muP run is the
standard run.
"""

import math
from typing import Optional, Tuple

import torch

MUP_OPTIMIZERS = ("adam", "sgd", "lion")


def mup_flag_problem(use_mup: bool, hidden_size: int, width_mult: float,
                     base_hidden_size: Optional[int], embedding_mult: float, output_mult: float,
                     base_head_dim: Optional[float], attn_scale_power: float) -> Optional[str]:
    """Why these muP settings cannot be used (None: they can); one line naming the flag."""
    if not use_mup:
        for flag, value, default in (
                ("--mup-width-mult", width_mult, 1.0),
                ("--mup-base-hidden-size", base_hidden_size, None),
                ("--mup-embedding-mult", embedding_mult, 1.0),
                ("--mup-output-mult", output_mult, 1.0),
                ("--mup-base-head-dim", base_head_dim, None),
                ("--mup-attn-scale-power", attn_scale_power, 1.0)):
            if value != default:
                return f"{flag} {value} has no effect without --use-mup; add it or drop the flag"
        return None
    if base_hidden_size is not None and base_hidden_size <= 0:
        return f"--mup-base-hidden-size must be > 0, got {base_hidden_size}"
    for flag, value in (("--mup-width-mult", width_mult),
                        ("--mup-embedding-mult", embedding_mult),
                        ("--mup-output-mult", output_mult)):
        if not (math.isfinite(value) and value > 0):
            return f"{flag} must be a finite number > 0, got {value}"
    if base_head_dim is not None and not base_head_dim > 0:
        return f"--mup-base-head-dim must be > 0, got {base_head_dim}"
    if not math.isfinite(attn_scale_power):
        return f"--mup-attn-scale-power must be finite, got {attn_scale_power}"
    if base_hidden_size is not None and width_mult != 1.0:
        derived = hidden_size / base_hidden_size
        if not math.isclose(width_mult, derived, rel_tol=1e-9):
            return (f"--mup-width-mult {width_mult} disagrees with --hidden-size {hidden_size} / "
                    f"--mup-base-hidden-size {base_hidden_size} = {derived}; give one of them")
    return None


def mup_model_conflict(use_mup: bool, multi_latent_attention: bool,
                       init_method_xavier_uniform: bool) -> Optional[str]:
    """Model settings muP is not built for here (None: none of them)."""
    if not use_mup:
        return None
    if multi_latent_attention:
        return ("--use-mup is not built for --multi-latent-attention (its softmax scale is "
                "its own); drop one")
    if init_method_xavier_uniform:
        return ("--use-mup scales the std of the normal init; it does not combine with "
                "--init-method-xavier-uniform")
    return None


def mup_optimizer_conflict(use_mup: bool, optimizer: str) -> Optional[str]:
    """The optimizers muP scales here: Adam, SGD, Lion (None: fine)."""
    if use_mup and optimizer not in MUP_OPTIMIZERS:
        return (f"--use-mup with --optimizer {optimizer} is not built; use "
                f"{', '.join(MUP_OPTIMIZERS)}")
    return None


def resolve_width_mult(hidden_size: int, width_mult: float,
                       base_hidden_size: Optional[int]) -> float:
    """``hidden_size / base_hidden_size`` when the base is given, else ``width_mult``."""
    if base_hidden_size is not None:
        return hidden_size / base_hidden_size
    return float(width_mult)


def resolve_output_mult(output_mult: float, width_mult: float) -> float:
    """The logit multiplier: ``1 / width_mult`` when left at 1.0 (Megatron-Core's rule)."""
    if output_mult == 1.0 and width_mult != 1.0:
        return 1.0 / width_mult
    return float(output_mult)


def attention_scale(head_dim: int, base_head_dim: Optional[float],
                    power: float) -> Tuple[float, float]:
    """``(softmax_scale, norm_factor)``: scores are ``q.k * softmax_scale`` (the explicit body
    divides by ``norm_factor``, its reciprocal computed directly so that power 0.5 without a
    base gives exactly ``sqrt(d)``)."""
    denominator = head_dim ** power
    if base_head_dim is None:
        return 1.0 / denominator, denominator
    base = math.sqrt(base_head_dim)
    return base / denominator, denominator / base


def _is_embedding(param: torch.nn.Parameter, name: str) -> bool:
    """Word/position tables and the last stage's copy of a tied table (Megatron-Core's
    fallback: the name says ``embedding``, or the parameter is a ``shared_embedding``)."""
    return getattr(param, "shared_embedding", False) or "embedding" in name.lower()


def is_vector_like(param: torch.nn.Parameter, name: str) -> bool:
    """muP's vector-like parameters: embeddings, biases and norm weights (one infinite dim)."""
    return _is_embedding(param, name) or param.dim() <= 1


def mup_group_overrides(optimizer: str, width_mult: float, decoupled_lr: bool,
                        param: torch.nn.Parameter, name: str) -> Tuple[float, float]:
    """``(lr_factor, eps_factor)`` for one parameter: its max and min lr are multiplied by
    the first, Adam's ``eps`` by the second ((1.0, 1.0): untouched)."""
    if width_mult == 1.0:
        return 1.0, 1.0
    own_lr = decoupled_lr and getattr(param, "is_embedding_or_output_parameter", False)
    vector = is_vector_like(param, name)
    if optimizer == "sgd":
        return (width_mult if vector and not own_lr else 1.0), 1.0
    if vector:
        return 1.0, 1.0
    lr_factor = 1.0 if own_lr else 1.0 / width_mult
    eps_factor = 1.0 / width_mult if optimizer == "adam" else 1.0
    return lr_factor, eps_factor

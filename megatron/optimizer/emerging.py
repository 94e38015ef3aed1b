"""What ``--optimizer soap`` and ``--optimizer adaptive_muon`` share: which settings they take,
and building them (megatron/optimizer/soap.py and adaptive_muon.py say what each computes).

As in Megatron-Core, ``--use-distributed-optimizer`` with either means the layer-wise
distributed optimizer (whole weights dealt over the data-parallel ranks), not Megatron's
element-sharded one: the gradients are all-reduced, not reduce-scattered, and
:func:`uses_element_sharding` says which of the two a run's gradient buffers need.
"""

from typing import List

from megatron.core.config import ConfigError

EMERGING_OPTIMIZERS = ("soap", "adaptive_muon")


def uses_element_sharding(optimizer: str, use_distributed_optimizer: bool) -> bool:
    """Whether the gradient buffers reduce-scatter for Megatron's distributed optimizer (False
    for the layer-wise deal of ``soap`` / ``adaptive_muon``)."""
    return use_distributed_optimizer and optimizer not in EMERGING_OPTIMIZERS


def check_emerging_settings(settings) -> None:
    """Refuse, in one line each, what ``--optimizer soap`` / ``adaptive_muon`` do not run with.

    ``settings``: the parsed args or an ``OptimizerConfig`` (Megatron's dests as attributes);
    the ``soap_*`` / ``adaptive_muon_*`` fields exist on the config only and are checked there.
    """
    name = settings.optimizer
    if settings.fp16:
        raise ConfigError(f"--optimizer {name} does not run with --fp16 (no loss scaling for "
                          "it, as in Megatron-Core); use --bf16")
    if getattr(settings, "optimizer_cpu_offload", False):
        raise ConfigError(f"--optimizer-cpu-offload steps adam, sgd or lion on the host; "
                          f"--optimizer {name} is not offloaded, drop the flag")
    if name == "adaptive_muon":
        from .muon import check_muon_settings

        check_muon_settings(settings)
    if not hasattr(settings, "soap_shampoo_beta"):
        return
    if name == "soap":
        from .soap import check_soap_settings

        check_soap_settings(settings.soap_shampoo_beta, settings.soap_precondition_frequency)
    else:
        from .adaptive_muon import check_moment2_settings

        check_moment2_settings(settings.adaptive_muon_moment2_method,
                               settings.adaptive_muon_beta2, settings.adaptive_muon_eps)


def check_emerging_args(args) -> None:
    """The harness-level refusals (checkpoint formats other than torch and torch_dist, FSDP2,
    overlapped gathers) on top of :func:`check_emerging_settings`."""
    name = args.optimizer
    check_emerging_settings(args)
    if args.ckpt_format not in ("torch", "torch_dist"):
        raise ConfigError(f"--ckpt-format {args.ckpt_format} with --optimizer {name} is not "
                          f"built (its state has no layout in that format here); use "
                          f"--ckpt-format torch_dist or torch")
    if args.use_torch_fsdp2:
        raise ConfigError(f"--optimizer {name} does not run with --use-torch-fsdp2 (it needs "
                          "each weight matrix whole); use --optimizer adam")
    if args.overlap_param_gather:
        raise ConfigError(f"--overlap-param-gather with --optimizer {name}: its distributed "
                          "optimizer broadcasts whole weights after the step, there is no "
                          "gather to overlap; drop --overlap-param-gather")


def build_emerging(config, param_groups: List[dict], tp_group=None, expert_tp_group=None,
                   dp_group=None):
    """The SOAP or adaptive-Muon optimizer of ``config`` over ``param_groups`` (already split
    by ``split_muon_groups``)."""
    if config.optimizer == "soap":
        from .soap import build_soap

        return build_soap(config, param_groups, tp_group, expert_tp_group, dp_group)
    from .adaptive_muon import build_adaptive_muon

    return build_adaptive_muon(config, param_groups, tp_group, expert_tp_group, dp_group)

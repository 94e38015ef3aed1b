"""Megatron-Core's side of the torch-format distributed-optimizer test: its own
``DistributedOptimizer.load_parameter_state`` reads a ``distrib_optim.pt`` written by this
project. Run under ``torchrun`` on the CPU with gloo, with the ``megatron-core`` package (and no
checkout of this project) importable:

    torchrun --nproc_per_node DP harness.py DISTRIB_OPTIM_PT SPEC OUT

SPEC (a ``torch.save`` file) is ``{"params": [(dotted name, shape), ...] in the model's module
order, "dtype": the parameters' dtype name ("float32" or "bfloat16"), "num_layers",
"hidden_size", "num_attention_heads"}``. The harness builds a module with
exactly those parameters, registered in that order (the distributed optimizer lays out its
buffers from ``named_parameters()`` and nothing else of the model), wraps it in Megatron-Core's
DDP and distributed optimizer at data-parallel size DP (one bucket, as without
--overlap-grad-reduce), loads the parameter state from the file (data-parallel rank 0 reads it
and scatters the ranges) and writes to OUT.<rank> ``{parameter name: {"param" | "exp_avg" |
"exp_avg_sq": tensor of the parameter's shape}}``: the fp32 main parameter and Adam moments this
rank's optimizer then holds, NaN outside this rank's range.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_core_013_harness import (_allocate_state, _cuda_type_names,  # noqa: E402
                                       _distributed, _range_of, _step_kept_apart)
from megatron_core_harness import _host_only  # noqa: E402

FIELDS = ("param", "exp_avg", "exp_avg_sq")


def _module(spec: dict) -> torch.nn.Module:
    """A module tree holding ``spec["params"]`` (zeros; the file gives the values) in order,
    with the transformer config Megatron-Core's DDP and optimizer read."""
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, spec["dtype"])
    root = torch.nn.Module()
    for name, shape in spec["params"]:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
    root.config = TransformerConfig(num_layers=spec["num_layers"],
                                    hidden_size=spec["hidden_size"],
                                    num_attention_heads=spec["num_attention_heads"],
                                    bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return root


def _optimizer(model):
    """Megatron-Core's DDP and distributed Adam over ``model``; gradients reduced in fp32 for a
    bf16 model, as Megatron-LM's argument validation sets for --bf16."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = model.config.bf16
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                    grad_reduce_in_fp32=bf16), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, bf16=bf16,
                        use_distributed_optimizer=True), [ddp])
    _allocate_state(_distributed(optimizer).optimizer)
    return optimizer


def _held_by_name(model, dist_opt) -> dict:
    held = {}
    for name, model_param in model.named_parameters():
        held[name] = {}
        mine = model_param in dist_opt.model_param_group_index_map  # none of it: not ours
        tensors = dist_opt._get_main_param_and_optimizer_states(model_param) if mine else {}
        lo, hi = _range_of(dist_opt, model_param) if mine else (0, 0)
        for field in FIELDS:
            whole = torch.full((model_param.numel(),), float("nan"))
            if mine:
                whole[lo:hi] = tensors[field].detach().float().reshape(-1)
            held[name][field] = whole.reshape(model_param.shape)
    return held


def main() -> None:
    path, spec_file, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    _host_only()
    _cuda_type_names()
    _step_kept_apart()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    parallel_state.initialize_model_parallel(1, 1)
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model = _module(torch.load(spec_file, weights_only=True))
    optimizer = _optimizer(model)
    with torch.no_grad():   # an fp32 model's main parameters are views of its leaf weights
        optimizer.load_parameter_state(path)
    torch.save(_held_by_name(model, _distributed(optimizer)), f"{out}.{dist.get_rank()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

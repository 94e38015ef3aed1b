"""Megatron-Core's side of the router interoperability test: run, like
``megatron_core_harness.py``, in the virtual environment with the ``megatron-core`` release from
PyPI, under ``torchrun`` (one process), on the CPU with gloo.

    torchrun --nproc_per_node 1 megatron_core_router_harness.py CASES_JSON INPUTS OUT

For each case of CASES_JSON (a list of ``{"types": [...], "coeffs": [...], "score": ...}``,
optionally ``"z"``, a z-loss coefficient, and ``"per_token": true``,
``calculate_per_token_loss``) build Megatron-Core's ``TopKRouter`` with those balancing types
and coefficients (fp32, top-2, layer 1 of 1; the auxiliary-loss scale left at its default 1),
give it the ``weight`` of INPUTS, and run two training micro-batches: each ``hidden``
``[s, b, h]`` of INPUTS forward, then ``(probs * upstream).sum()`` backward.
Written to OUT, per case: ``logged`` {name: the tracker's value of the layer, summed over the
micro-batches}, ``hidden_grad`` [2, s, b, h] and ``weight_grad``.
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist


def _router(case: dict, hidden_size: int, experts: int):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden_size, num_attention_heads=2,
        use_cpu_initialization=True, add_bias_linear=False, num_moe_experts=experts,
        moe_router_topk=2, moe_router_score_function=case["score"],
        moe_router_load_balancing_type=list(case["types"]),
        moe_aux_loss_coeff=list(case["coeffs"]), moe_token_dispatcher_type="allgather",
        moe_z_loss_coeff=case.get("z"),
        calculate_per_token_loss=case.get("per_token", False))
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    return router.train()


def _run(case: dict, ref: dict) -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # Its clear_aux_losses_tracker zeroes the values but keeps the names; start empty instead.
    get_moe_layer_wise_logging_tracker().clear()
    experts, hidden_size = ref["weight"].shape
    router = _router(case, hidden_size, experts)
    with torch.no_grad():
        router.weight.copy_(ref["weight"])
    grads = []
    for hidden, upstream in zip(ref["hidden"], ref["upstream"]):
        hidden = hidden.clone().requires_grad_()
        probs, _ = router(hidden)
        (probs * upstream).sum().backward()
        grads.append(hidden.grad)
    tracker = get_moe_layer_wise_logging_tracker()
    logged = {name: float(entry["values"][0]) for name, entry in tracker.items()}
    return {"logged": logged, "hidden_grad": torch.stack(grads),
            "weight_grad": router.weight.grad.clone()}


def main() -> None:
    cases_file, inputs, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron_core_dsv3_harness import _no_transformer_engine_names  # beside this file
    from megatron_core_harness import _host_only

    _host_only()
    _no_transformer_engine_names()
    parallel_state.initialize_model_parallel(1, 1)
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with open(cases_file) as f:
        cases = json.load(f)
    ref = torch.load(inputs, weights_only=True)
    torch.save([_run(case, ref) for case in cases], out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

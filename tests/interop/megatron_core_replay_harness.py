"""Megatron-Core's side of the routing-replay interoperability test, run like
``megatron_core_router_harness.py`` (the ``megatron-core`` release from PyPI, torchrun, one
process, CPU with gloo).

    torchrun --nproc_per_node 1 megatron_core_replay_harness.py CASES_JSON INPUTS OUT

For each case (``{"score": ..., "pre_softmax": ..., "scaling": ...}``) build Megatron-Core's
``TopKRouter`` with ``moe_enable_routing_replay`` (fp32, top-2, no balancing loss), give it
the ``weight`` of INPUTS, record the experts it chooses for ``record_hidden``, then replay the
``replay_ids`` of INPUTS on ``hidden`` and backpropagate ``(probs * upstream).sum()``.
Written to OUT, per case: ``recorded`` [T, 2], ``probs`` and ``routing_map`` [T, E] of the
replayed pass, ``hidden_grad`` and ``weight_grad``.
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist


def _run(case: dict, ref: dict) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    RouterReplay.clear_global_router_replay_instances()
    experts, hidden_size = ref["weight"].shape
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden_size, num_attention_heads=2,
        use_cpu_initialization=True, add_bias_linear=False, num_moe_experts=experts,
        moe_router_topk=2, moe_router_score_function=case["score"],
        moe_router_pre_softmax=case["pre_softmax"],
        moe_router_topk_scaling_factor=case["scaling"],
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_enable_routing_replay=True)
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    router.train()
    with torch.no_grad():
        router.weight.copy_(ref["weight"])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        router(ref["record_hidden"])
    recorded = RouterReplay.get_recorded_data()[0].clone()
    RouterReplay.set_replay_data([ref["replay_ids"]])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    hidden = ref["hidden"].clone().requires_grad_()
    probs, routing_map = router(hidden)
    (probs * ref["upstream"]).sum().backward()
    return {"recorded": recorded, "probs": probs.detach(), "routing_map": routing_map,
            "hidden_grad": hidden.grad, "weight_grad": router.weight.grad.clone()}


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

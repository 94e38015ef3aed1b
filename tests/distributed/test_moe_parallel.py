"""Expert parallelism (both token dispatchers) and expert tensor parallelism on gloo ranks
against the single-process MoE layer, in fp64: outputs, input gradients and every weight's
gradient, with the load-balancing and z losses on.

Each rank holds its own micro-batch, as data-parallel ranks do. Every rank also runs the
single-process layer (built from the same seed, so with the same weights: expert weights depend
on the global expert number only) on every rank's micro-batch: its output on this rank's tokens
must be this rank's output; the gradients of the experts this rank holds must be the sum over
all micro-batches (the dispatchers bring every rank's tokens to them); the router's must be that
sum once summed over the ranks (as the data-parallel reduction will). A forced routing sends
every token to experts 0 and 1, so experts 2 and 3, and the ranks holding only them, receive no
tokens at all; with capacity and padding those experts get padding rows only.

Tolerance 1e-12: the same float64 sums in another order.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import collectives
from megatron.core.config import TransformerConfig
from megatron.model.moe import MoEConfig, MoELayer, MoELossTracker
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-12)
SEQ, BATCH, HIDDEN, FFN, EXPERTS = 4, 3, 8, 12, 4

GPT_OSS_MLP = dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.7,
                   add_bias_linear=True)
CASES = [
    ("allgather", False, dict(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01), {}),
    ("alltoall", False, dict(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01,
                             moe_grouped_gemm=True), dict(swiglu=True, add_bias_linear=True)),
    ("allgather", True, dict(moe_aux_loss_coeff=0.05), {}),
    ("alltoall", True, dict(moe_aux_loss_coeff=0.05), {}),
    ("alltoall", True, dict(moe_expert_capacity_factor=1.0,
                            moe_pad_expert_input_to_capacity=True), {}),
    ("allgather", False, dict(moe_expert_capacity_factor=0.8, moe_token_drop_policy="position",
                              moe_pad_expert_input_to_capacity=True, moe_grouped_gemm=True), {}),
    # gpt-oss's experts: quick GeGLU, clamped, linear half + 1, router and expert biases.
    ("alltoall", False, dict(moe_aux_loss_coeff=0.05), GPT_OSS_MLP),
    ("allgather", False, dict(moe_grouped_gemm=True), GPT_OSS_MLP),
    ("alltoall", False, dict(moe_router_score_function="sigmoid",
                             moe_router_load_balancing_type="seq_aux_loss",
                             moe_aux_loss_coeff=0.1, moe_shared_expert_intermediate_size=6,
                             moe_shared_expert_gate=True), {}),
]


def _config(**overrides):
    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=16,
              max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=FFN,
              params_dtype=torch.float64, add_bias_linear=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _layer(config, moe_kwargs, forced, **groups):
    moe = MoEConfig(num_moe_experts=EXPERTS, **moe_kwargs)
    layer = MoELayer(config, moe, layer_number=1, tracker=MoELossTracker(1), **groups).train()
    first = layer.token_dispatcher.first_local_expert
    etp_group = groups.get("expert_tp_group")
    etp, etp_rank = collectives.get_group_size(etp_group), collectives.get_group_rank(etp_group)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith("experts.") and name.endswith("bias"):
                # expert biases start at zero: the same random full bias of
                index = int(name.split(".")[2])  # each global expert, split as its weight
                gen = torch.Generator().manual_seed(1000 + 2 * (first + index)
                                                    + ("fc2" in name))
                rows = param.numel() * (1 if "fc2" in name else etp)
                full = torch.randn(rows, generator=gen, dtype=param.dtype)
                param.copy_(_shard(full, name, etp_rank, etp, config.gated_linear_unit))
        if forced:  # with _batch(forced=True) every token prefers experts 0, then 1
            layer.router.weight.zero_()
            layer.router.weight[:, 0] = torch.tensor([10.0, 9.0, -10.0, -10.0])
    return layer


def _batch(source, forced):
    gen = torch.Generator().manual_seed(100 + source)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    if forced:
        x[..., 0] = 5.0
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)


def _run(layer, source, forced):
    x, grad = _batch(source, forced)
    x.requires_grad_()
    out, _ = layer(x)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _reference(config, moe_kwargs, forced, sources):
    """The single-process layer on every source's batch; gradients summed over the sources."""
    kwargs = {k: v for k, v in moe_kwargs.items()
              if k not in ("expert_model_parallel_size", "expert_tensor_parallel_size")}
    layer = _layer(config, kwargs, forced)
    runs = [_run(layer, q, forced) for q in range(sources)]
    return runs, {n: p.grad for n, p in layer.named_parameters()}


def _shard(full, name, etp_rank, etp, swiglu):
    """This expert-TP rank's piece of a full expert tensor (fc1 rows, fc2 weight columns)."""
    if etp == 1 or name.endswith("linear_fc2.bias"):
        return full
    if "linear_fc1" in name:
        stride = 2 if swiglu else 1
        blocks = full.chunk(stride * etp, dim=0)
        return torch.cat(blocks[etp_rank::etp], dim=0)
    return full.chunk(etp, dim=1)[etp_rank]


def _check(layer, ref, run, ep_rank, ep_size, etp_rank, etp, swiglu, ep_group):
    ref_runs, ref_grads = ref
    out, dx = run
    torch.testing.assert_close(out, ref_runs[ep_rank][0], **TOL)
    torch.testing.assert_close(dx, ref_runs[ep_rank][1], **TOL)
    local = EXPERTS // ep_size
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        if name.startswith("experts.local_experts."):
            index = int(name.split(".")[2])
            global_name = name.replace(f"local_experts.{index}.",
                                       f"local_experts.{ep_rank * local + index}.")
            want = _shard(ref_grads[global_name], name, etp_rank, etp, swiglu)
        else:
            collectives.all_reduce(grad, ep_group)   # what the data-parallel reduction adds
            want = ref_grads[name]
        torch.testing.assert_close(grad, want, **TOL, msg=name)


def _expert_parallel_cases(ep_group, ep_rank, ep_size, etp_group=None, etp_rank=0, etp=1):
    checked = 0
    for dispatcher, forced, moe_kwargs, config_kwargs in CASES:
        config = _config(**config_kwargs)
        kwargs = dict(moe_kwargs, moe_token_dispatcher_type=dispatcher,
                      expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp)
        layer = _layer(config, kwargs, forced, ep_group=ep_group, expert_tp_group=etp_group)
        run = _run(layer, ep_rank, forced)
        ref = _reference(config, kwargs, forced, ep_size)
        _check(layer, ref, run, ep_rank, ep_size, etp_rank, etp, config.gated_linear_unit,
               ep_group)
        if forced and not moe_kwargs.get("moe_pad_expert_input_to_capacity"):
            routed = layer.router.eval()(_batch(ep_rank, forced)[0])[1]
            assert routed[:, 2:].sum() == 0 and routed[:, :2].all()
        checked += 1
    return checked


def _expert_parallel_body():
    world, rank = dist.get_world_size(), dist.get_rank()
    checked = _expert_parallel_cases(dist.group.WORLD, rank, world)
    # the point-to-point fallback of the all-to-all, on the alltoall cases
    with collectives.forced_fallback():
        dispatcher, forced, moe_kwargs, config_kwargs = CASES[3]
        config = _config(**config_kwargs)
        kwargs = dict(moe_kwargs, moe_token_dispatcher_type=dispatcher,
                      expert_model_parallel_size=world)
        layer = _layer(config, kwargs, forced, ep_group=dist.group.WORLD)
        _check(layer, _reference(config, kwargs, forced, world), _run(layer, rank, forced),
               rank, world, 0, 1, False, dist.group.WORLD)
    return checked


def _expert_tensor_parallel_body(ep_size):
    """World = ep_size x 2: expert-TP pairs (0, 1), (2, 3) hold the same tokens; the
    expert-parallel groups are (0, 2), (1, 3)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    etp = world // ep_size
    etp_groups = [dist.new_group(list(range(i, i + etp))) for i in range(0, world, etp)]
    ep_groups = [dist.new_group(list(range(j, world, etp))) for j in range(etp)]
    etp_group, ep_group = etp_groups[rank // etp], ep_groups[rank % etp]
    if ep_size == 1:
        ep_group = None
    return _expert_parallel_cases(ep_group, rank // etp, ep_size, etp_group, rank % etp, etp)


def _two_ranks():
    return _expert_parallel_body(), _expert_tensor_parallel_body(ep_size=1)


def _four_ranks():
    return _expert_parallel_body(), _expert_tensor_parallel_body(ep_size=2)


@pytest.mark.parametrize("world,body", [(2, _two_ranks), (4, _four_ranks)],
                         ids=["ep2_etp2", "ep4_ep2xetp2"])
def test_expert_parallel_layouts_equal_one_process(world, body):
    assert run_on_ranks(body, world) == [(len(CASES), len(CASES))] * world

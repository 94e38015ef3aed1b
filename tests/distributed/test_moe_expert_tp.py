"""Expert tensor parallelism over ranks that hold different tokens (an expert-TP size other
than TP), on 4 gloo ranks against the single-process MoE layer in fp64: outputs, input
gradients, every weight's gradient after the reductions training applies, and the logged
load-balancing and z losses.

The ranks are laid out as training lays them out (``compute_rank_layout``). Data-parallel rank
``d`` holds micro-batch ``d``; with sequence parallelism tensor-parallel rank ``t`` holds slice
``t`` of its sequence, so the router's losses are counted over the tensor-parallel group. The
reference runs the one-process layer on each whole micro-batch: this rank's output and input
gradient must be its slice of the reference's; summed the way training sums them (experts over
expert-data-parallel ranks, the tensor-parallel shards of the shared expert over data-parallel
ranks, replicated weights over the world), each weight gradient must be the reference's summed
over the micro-batches (the expert-TP shard of it for an expert); each rank must log its
micro-batch's values.

Layouts (world 4): tp 1 x dp 4 with expert-tp 2 x ep 2 (whole micro-batches); tp 2 x dp 2
with sequence parallelism and expert-tp 1 x ep 2 (the ep group is the tp group) or expert-tp 4
x ep 1 (one expert-TP group across both data-parallel replicas); and a forward without
sequence parallelism (tp 2 x dp 2, expert-tp 1 x ep 2), as generation runs it.

Tolerance 1e-12: the same float64 sums in another order.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import collectives
from megatron.core.parallel_state import ModelGroups, compute_rank_layout
from megatron.core.config import ConfigError
from megatron.model.moe import MoEConfig, MoELayer, MoELossTracker
from megatron.model.transformer import ParallelTransformerLayer
from tests.distributed.test_moe_parallel import CASES, EXPERTS, SEQ, _batch, _config, _layer, _shard
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-12)
WORLD = 4


def _groups(layout):
    """This rank's handle of each kind of group (every rank creates every group)."""
    rank, mine = dist.get_rank(), {}
    for kind in ("tp_groups", "dp_groups", "ep_groups", "expert_tp_groups", "expert_dp_groups"):
        for ranks in getattr(layout, kind):
            handle = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = handle
    return mine


def _slice(tensor, tp_rank, tp):
    rows = tensor.size(0) // tp
    return tensor[tp_rank * rows:(tp_rank + 1) * rows]


def _reference(config, moe_kwargs, forced, batches):
    """Per micro-batch: (output, input gradient, logged values); gradients summed over all."""
    kwargs = {k: v for k, v in moe_kwargs.items()
              if k not in ("expert_model_parallel_size", "expert_tensor_parallel_size")}
    layer = _layer(config, kwargs, forced)
    runs = []
    for d in range(batches):
        layer.router.tracker = MoELossTracker(1)
        x, grad = _batch(d, forced)
        x.requires_grad_()
        out, _ = layer(x)
        (out * grad).sum().backward()
        logged = {k: v.clone() for k, v in layer.router.tracker.values.items()}
        runs.append((out.detach(), x.grad, logged))
    return runs, {n: p.grad for n, p in layer.named_parameters()}


def _case(layout, groups, dispatcher, forced, moe_kwargs, config_kwargs):
    rank = dist.get_rank()
    coords = layout.rank_coordinates(rank)
    tp, tp_rank, dp_rank = layout.tp_size, coords["tp"], coords["dp"]
    etp = layout.expert_tp_size
    etp_rank = rank % etp
    ep_rank = rank // etp % layout.ep_size
    config = _config(**config_kwargs)
    kwargs = dict(moe_kwargs, moe_token_dispatcher_type=dispatcher,
                  expert_model_parallel_size=layout.ep_size, expert_tensor_parallel_size=etp)
    layer = _layer(config, kwargs, forced, ep_group=groups["ep_groups"],
                   expert_tp_group=groups["expert_tp_groups"], tp_group=groups["tp_groups"],
                   expert_tp_shares_tokens=False, sequence_parallel=tp > 1)
    x, grad = _batch(dp_rank, forced)
    x = _slice(x, tp_rank, tp).clone().requires_grad_()
    out, _ = layer(x)
    (out * _slice(grad, tp_rank, tp)).sum().backward()

    ref_runs, ref_grads = _reference(config, kwargs, forced, layout.dp_size)
    ref_out, ref_dx, ref_logged = ref_runs[dp_rank]
    torch.testing.assert_close(out.detach(), _slice(ref_out, tp_rank, tp), **TOL)
    torch.testing.assert_close(x.grad, _slice(ref_dx, tp_rank, tp), **TOL)
    for name, value in layer.router.tracker.values.items():
        torch.testing.assert_close(value, ref_logged[name], **TOL, msg=name)
    assert set(layer.router.tracker.values) == set(ref_logged)
    local = EXPERTS // layout.ep_size
    for name, param in layer.named_parameters():
        grad_sum = param.grad.clone()
        if name.startswith("experts.local_experts."):
            collectives.all_reduce(grad_sum, groups["expert_dp_groups"])
            index = int(name.split(".")[2])
            global_name = name.replace(f"local_experts.{index}.",
                                       f"local_experts.{ep_rank * local + index}.")
            want = _shard(ref_grads[global_name], name, etp_rank, etp,
                          config.gated_linear_unit)
        elif name.startswith("shared_experts.linear_fc"):
            collectives.all_reduce(grad_sum, groups["dp_groups"])
            want = _shard(ref_grads[name], name, tp_rank, tp, config.gated_linear_unit)
        else:                  # the router and the shared expert's gate: every rank's part
            collectives.all_reduce(grad_sum, dist.group.WORLD)
            want = ref_grads[name]
        torch.testing.assert_close(grad_sum, want, **TOL, msg=name)


def _replicated_forward(layout, groups):
    """Without sequence parallelism the tensor-parallel ranks hold the same tokens, and route
    them as their own: every rank's forward is the whole micro-batch's (generation)."""
    coords = layout.rank_coordinates(dist.get_rank())
    dispatcher, forced, moe_kwargs, config_kwargs = CASES[1]
    config = _config(**config_kwargs)
    kwargs = dict(moe_kwargs, moe_token_dispatcher_type=dispatcher,
                  expert_model_parallel_size=layout.ep_size,
                  expert_tensor_parallel_size=layout.expert_tp_size)
    layer = _layer(config, kwargs, forced, ep_group=groups["ep_groups"],
                   expert_tp_group=groups["expert_tp_groups"], tp_group=groups["tp_groups"],
                   expert_tp_shares_tokens=False).eval()
    with torch.no_grad():
        out, _ = layer(_batch(coords["dp"], forced)[0])
    ref_out = _reference(config, kwargs, forced, layout.dp_size)[0][coords["dp"]][0]
    torch.testing.assert_close(out, ref_out, **TOL)


def _training_without_sequence_parallel_is_refused(groups):
    """The same layout in a transformer layer: a forward with gradients is refused."""
    config = _config(attention_dropout=0.0, hidden_dropout=0.0)
    moe = MoEConfig(num_moe_experts=EXPERTS, expert_model_parallel_size=2,
                    expert_tensor_parallel_size=1)
    model_groups = ModelGroups(tp_group=groups["tp_groups"], tp_size=2,
                               ep_group=groups["ep_groups"],
                               expert_tp_group=groups["expert_tp_groups"])
    layer = ParallelTransformerLayer(config, 1, model_groups, moe_config=moe,
                                     moe_tracker=MoELossTracker(1))
    x = torch.randn(SEQ, 3, config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        layer(x, None)
    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size 1, "
                       r"--tensor-model-parallel-size 2\) needs --sequence-parallel"):
        layer(x, None)


def _layouts_body():
    layouts = [compute_rank_layout(WORLD, 1, 1, ep_size=2, expert_tp_size=2),
               compute_rank_layout(WORLD, 2, 1, ep_size=2, expert_tp_size=1,
                                   sequence_parallel=True),
               compute_rank_layout(WORLD, 2, 1, ep_size=1, expert_tp_size=4,
                                   sequence_parallel=True)]
    checked = []
    for layout in layouts:
        groups = _groups(layout)
        count = 0
        for dispatcher, forced, moe_kwargs, config_kwargs in CASES:
            if layout.tp_size > 1 and moe_kwargs.get("moe_expert_capacity_factor") is not None:
                continue   # refused: capacity of one slice (test_sliced_routing_refuses_...)
            _case(layout, groups, dispatcher, forced, moe_kwargs, config_kwargs)
            count += 1
        checked.append(count)
    layout = compute_rank_layout(WORLD, 2, 1, ep_size=2, expert_tp_size=1)
    groups = _groups(layout)
    _replicated_forward(layout, groups)
    _training_without_sequence_parallel_is_refused(groups)
    return checked


def test_expert_tp_over_own_tokens_equals_one_process():
    capacity_cases = sum(c[2].get("moe_expert_capacity_factor") is not None for c in CASES)
    want = [len(CASES), len(CASES) - capacity_cases, len(CASES) - capacity_cases]
    assert run_on_ranks(_layouts_body, WORLD) == [want] * WORLD


def _census_body():
    """Per rank, what autograd keeps in one training forward against the accounting."""
    from megatron.training.memory_accounting import moe_mlp_activation_bytes
    from tests.unit.test_memory_accounting import _saved_activation_bytes

    seq, batch, hidden = 64, 4, 32
    results = []
    for tp, ep, etp, swiglu in ((1, 1, 2, False), (2, 2, 1, True)):
        layout = compute_rank_layout(2, tp, 1, ep_size=ep, expert_tp_size=etp,
                                     sequence_parallel=tp > 1)
        groups = _groups(layout)
        config = _config(hidden_size=hidden, ffn_hidden_size=48, seq_length=seq,
                         max_position_embeddings=seq, swiglu=swiglu, params_dtype=torch.float32)
        moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=1e-3, expert_model_parallel_size=ep,
                        expert_tensor_parallel_size=etp)
        torch.manual_seed(dist.get_rank())
        layer = MoELayer(config, moe, 1, ep_group=groups["ep_groups"],
                         expert_tp_group=groups["expert_tp_groups"], tp_group=groups["tp_groups"],
                         expert_tp_shares_tokens=False, sequence_parallel=tp > 1)
        x = torch.randn(seq // tp, batch, hidden, requires_grad=True)
        measured = _saved_activation_bytes(layer, x)
        accounted = moe_mlp_activation_bytes(config, moe, batch, tp, element_bytes=4)
        results.append(measured / accounted)
    return results


def test_activation_accounting_matches_a_census_with_expert_tp_over_own_tokens():
    """5%: the index tensors and the imbalance of a random router (see the one-rank census
    in test_memory_accounting.py)."""
    for ratios in run_on_ranks(_census_body, 2):
        assert all(r == pytest.approx(1.0, abs=0.05) for r in ratios), ratios

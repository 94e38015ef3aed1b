"""Gradient norm and clipping: against float64 hand computation on one process, under
tensor / pipeline / expert parallelism on 2 gloo ranks, and on 4 with expert tensor parallelism
other than tensor parallelism, against the norm of the whole, unsplit model.

Tolerances: norms are accumulated in fp32 (per-tensor norms, then their squares summed), so they
agree with the float64 reference to a few fp32 ulps; rel=1e-6 leaves margin for that.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.optimizer.clip_grads import (clip_grad_norm_fp32, count_zeros_fp32,
                                           get_grad_norm_fp32, get_grads_for_norm)
from tests.multiprocess import run_on_ranks


def _params_with_grads(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return params


def _norm64(grads, p):
    flat = torch.cat([g.double().reshape(-1) for g in grads])
    if p == math.inf:
        return float(flat.abs().max())
    return float((flat.abs() ** p).sum() ** (1.0 / p))


# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 3.0, 1.0, math.inf])
def test_norm_matches_float64_hand_computation(norm_type):
    params = _params_with_grads([(5, 3), (7,), (2, 2, 2)])
    grads = [p.grad.clone() for p in params]
    norm = get_grad_norm_fp32(get_grads_for_norm(params, tp_rank=0), norm_type)
    assert norm == pytest.approx(_norm64(grads, norm_type), rel=1e-6)


def test_clip_scales_every_grad_by_max_norm_over_norm():
    params = _params_with_grads([(5, 3), (7,)])
    grads = [p.grad.clone() for p in params]
    expected = _norm64(grads, 2)
    total = clip_grad_norm_fp32(params, get_grads_for_norm(params, tp_rank=0), max_norm=0.5)
    assert total == pytest.approx(expected, rel=1e-6)
    coeff = 0.5 / (expected + 1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad.double(), g.double() * coeff, rtol=1e-6, atol=0)
    # The clipped gradients now have norm max_norm.
    assert _norm64([p.grad for p in params], 2) == pytest.approx(0.5, rel=1e-5)
    # Below the limit nothing changes.
    before = [p.grad.clone() for p in params]
    clip_grad_norm_fp32(params, get_grads_for_norm(params, tp_rank=0), max_norm=10.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_duplicates_and_shared_params_are_not_counted():
    shard, replicated, shared, no_grad = _params_with_grads([(4, 2), (3,), (6, 2), (2,)])
    shard.tensor_model_parallel = True
    shared.shared = True
    no_grad.grad = None
    on_rank0 = get_grads_for_norm([shard, replicated, shared, no_grad], tp_rank=0)
    on_rank1 = get_grads_for_norm([shard, replicated, shared, no_grad], tp_rank=1)
    assert [g.shape for g in on_rank0] == [(4, 2), (3,)]
    assert [g.shape for g in on_rank1] == [(4, 2)]
    shard.grad[0] = 0.0
    replicated.grad[1] = 0.0
    shared.grad.zero_()
    assert count_zeros_fp32([shard, replicated, shared], tp_rank=0) == 3
    assert count_zeros_fp32([shard, replicated, shared], tp_rank=1) == 2


def test_empty_grads_give_zero_norm():
    assert get_grad_norm_fp32([], 2.0) == 0.0
    assert get_grad_norm_fp32([], math.inf) == 0.0


# -- tensor parallel: 2 ranks ----------------------------------------------------------------

# Full (unsplit) shapes and how each is held under TP: split along a dim, or replicated.
TP_LAYOUT = {
    "col_weight": ((8, 4), 0),    # column-parallel: rows split
    "col_bias": ((8,), 0),
    "row_weight": ((4, 8), 1),    # row-parallel: columns split
    "row_bias": ((4,), None),     # replicated
    "norm_weight": ((4,), None),  # replicated
    "norm_bias": ((4,), None),    # replicated
}


def _full_tp_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = {name: torch.randn(shape, generator=gen) for name, (shape, _) in TP_LAYOUT.items()}
    grads["col_weight"][0, :] = 0.0  # zeros inside a shard
    grads["norm_bias"][1] = 0.0      # a zero in a replicated param counts once
    return grads


def _shard(full, name, tp_rank):
    dim = TP_LAYOUT[name][1]
    return full.clone() if dim is None else full.chunk(2, dim=dim)[tp_rank].clone()


class ShardedToy(torch.nn.Module):
    """This TP rank's slice of a layer: sharded and replicated parameters."""

    def __init__(self, tp_rank, full_values, dtype):
        super().__init__()
        for name, value in full_values.items():
            param = torch.nn.Parameter(_shard(value, name, tp_rank).to(dtype))
            dim = TP_LAYOUT[name][1]
            param.tensor_model_parallel = dim is not None
            if dim is not None:
                param.partition_dim = dim
            self.register_parameter(name, param)


def _tp2_norm_and_clip(state, full_grads):
    mp_group, tp_rank = state.model_parallel_group, state.tp_rank
    params = []
    for name, grad in full_grads.items():
        p = torch.nn.Parameter(torch.zeros(_shard(grad, name, tp_rank).shape))
        p.grad = _shard(grad, name, tp_rank)
        p.tensor_model_parallel = TP_LAYOUT[name][1] is not None
        params.append(p)
    grads_for_norm = get_grads_for_norm(params, tp_rank=tp_rank)
    out = {
        "inf": get_grad_norm_fp32(grads_for_norm, math.inf, mp_group),
        "three": get_grad_norm_fp32(grads_for_norm, 3.0, mp_group),
        "zeros": count_zeros_fp32(params, mp_group, tp_rank=tp_rank),
        "two": clip_grad_norm_fp32(params, grads_for_norm, 1.0, model_parallel_group=mp_group),
    }
    out["clipped"] = {name: p.grad.clone() for name, p in zip(full_grads, params)}
    return out


def _tp_inputs():
    gen = torch.Generator().manual_seed(3)
    full_values = {n: torch.randn(shape, generator=gen) * 0.1
                   for n, (shape, _) in TP_LAYOUT.items()}
    return full_values, [_full_tp_grads(seed) for seed in (1, 2, 3)]


def _pp_inputs():
    gen = torch.Generator().manual_seed(5)
    embedding_grad = torch.randn(6, 4, generator=gen)
    return embedding_grad, [torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)]


def _two_rank_checks():
    """Every 2-rank check in one spawn (starting ranks costs more than the checks)."""
    out = {}
    state = ps.initialize_model_parallel(2, 1)
    out["tp_norm"] = _tp2_norm_and_clip(state, _full_tp_grads())
    out["tp_fp16"] = _tp2_fp16_optimizer(state, *_tp_inputs())
    ps.destroy_model_parallel()
    state = ps.initialize_model_parallel(1, 2)
    out["pp_shared"] = _pp2_shared_embedding(state, *_pp_inputs())
    ps.destroy_model_parallel()
    state = ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    out["ep"] = _ep2_optimizer(state, *_ep_inputs())
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    # A broken reduction makes ranks wait on each other; fail in 2 minutes, not 5.
    return run_on_ranks(_two_rank_checks, 2, timeout=120)


def test_tp2_norm_counts_each_parameter_once(two_rank_results):
    full = _full_tp_grads()
    results = [r["tp_norm"] for r in two_rank_results]
    grads = list(full.values())
    expected_two = _norm64(grads, 2)
    coeff = 1.0 / (expected_two + 1e-6)
    assert expected_two > 1.0
    for tp_rank, res in enumerate(results):
        assert res["two"] == pytest.approx(expected_two, rel=1e-6)
        assert res["three"] == pytest.approx(_norm64(grads, 3), rel=1e-6)
        assert res["inf"] == pytest.approx(_norm64(grads, math.inf), rel=1e-6)
        assert res["zeros"] == sum(int((g == 0).sum()) for g in grads) == 5
        for name, clipped in res["clipped"].items():
            expected = _shard(full[name], name, tp_rank).double() * coeff
            torch.testing.assert_close(clipped.double(), expected, rtol=1e-6, atol=0)


def _tp2_fp16_optimizer(state, full_values, grad_sets):
    """fp16 optimizer under TP=2: rank 1 alone sees an inf first; then two finite steps."""
    model = ShardedToy(state.tp_rank, full_values, torch.float16)
    config = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=1024.0, hysteresis=1,
                             clip_grad=1.0)
    opt = get_megatron_optimizer(config, [model], mp_group=state.model_parallel_group,
                                 tp_group=state.tp_group, dp_group=state.dp_group)
    results = []
    for step, full_grads in enumerate(grad_sets):
        scale = opt.get_loss_scale().item()
        for name, p in model.named_parameters():
            p.grad = (_shard(full_grads[name], name, state.tp_rank) * scale).half()
        if step == 0 and dist.get_rank() == 1:
            model.row_weight.grad[0, 0] = float("inf")
        ok, norm, _ = opt.step()
        results.append((ok, norm, scale))
        opt.zero_grad()
    replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                  if TP_LAYOUT[n][1] is None}
    return results, replicated


def test_tp2_fp16_optimizer_skips_together_and_norms_the_full_model(two_rank_results):
    _, grad_sets = _tp_inputs()
    results = [r["tp_fp16"] for r in two_rank_results]
    for steps, _ in results:
        ok0, norm0, scale0 = steps[0]
        assert (ok0, norm0, scale0) == (False, None, 1024.0)  # both ranks skipped
        for (ok, norm, scale), full_grads in zip(steps[1:], grad_sets[1:]):
            assert ok and scale == 512.0  # both backed off, then stepped
            # The half-precision rounding of the scaled gradients, unscaled, in float64.
            unscaled = [(g * scale).half().double() / scale for g in full_grads.values()]
            assert norm == pytest.approx(_norm64(unscaled, 2), rel=1e-6)
    replicated0, replicated1 = results[0][1], results[1][1]
    for name in replicated0:
        assert torch.equal(replicated0[name], replicated1[name]), name


# -- pipeline parallel with a tied embedding: 2 ranks --------------------------------------------


def _pp2_shared_embedding(state, embedding_grad, layer_grads):
    stage = state.pp_rank
    embedding = torch.nn.Parameter(torch.zeros(embedding_grad.shape))
    embedding.grad = embedding_grad.clone()  # both stages hold the summed tied-embedding grad
    if stage == 1:
        embedding.shared = True              # the output layer's copy of word embeddings
    layer = torch.nn.Parameter(torch.zeros(layer_grads[stage].shape))
    layer.grad = layer_grads[stage].clone()
    params = [embedding, layer]
    norm = clip_grad_norm_fp32(params, get_grads_for_norm(params, tp_rank=state.tp_rank),
                               max_norm=0.1, model_parallel_group=state.model_parallel_group)
    return norm, embedding.grad.clone()


def test_pp2_tied_embedding_is_counted_once(two_rank_results):
    embedding_grad, layer_grads = _pp_inputs()
    results = [r["pp_shared"] for r in two_rank_results]
    expected = _norm64([embedding_grad] + layer_grads, 2)
    twice = _norm64([embedding_grad, embedding_grad] + layer_grads, 2)
    assert abs(expected - twice) > 1e-2  # the test tells the two apart
    (norm0, emb0), (norm1, emb1) = results
    assert norm0 == pytest.approx(expected, rel=1e-6) and norm1 == pytest.approx(expected, rel=1e-6)
    assert torch.equal(emb0, emb1)  # both copies clipped alike, so they stay tied
    torch.testing.assert_close(emb0.double(), embedding_grad.double() * 0.1 / (expected + 1e-6),
                               rtol=1e-6, atol=0)


# -- expert parallel: 2 ranks, each holding other experts --------------------------------------


def _ep_inputs():
    """Gradients of a replicated (dense) weight and of each rank's expert, for two steps."""
    gen = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(2):
        dense = torch.randn(4, 3, generator=gen)
        experts = [torch.randn(5, 2, generator=gen) for _ in range(2)]
        experts[1][0] = 0.0                     # zeros on one rank's expert only
        steps.append((dense, experts))
    return (steps,)


def _ep2_optimizer(state, steps):
    """fp16 optimizer over a dense weight and this rank's expert: rank 1's expert alone sees
    an inf at step 0; both ranks must skip. Then a finite step: norm and zero count."""
    rank = dist.get_rank(state.ep_group)
    dense = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float16))
    expert = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.float16))
    expert.allreduce = False
    config = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=8.0, hysteresis=1,
                             clip_grad=1.0, log_num_zeros_in_grad=True)
    opt = get_megatron_optimizer(config, [torch.nn.ParameterList([dense, expert])],
                                 mp_group=state.model_parallel_group, tp_group=state.tp_group,
                                 dp_group=state.dp_group, use_main_grad=False,
                                 expert_model_parallel_group=state.expert_model_parallel_group,
                                 expert_tp_rank=state.expert_tp_rank)
    results = []
    for step, (dense_grad, expert_grads) in enumerate(steps):
        scale = opt.get_loss_scale().item()
        dense.grad = (dense_grad * scale).half()
        expert.grad = (expert_grads[rank] * scale).half()
        if step == 0 and rank == 1:
            expert.grad[0, 1] = float("inf")
        results.append((*opt.step(), scale))
        opt.zero_grad()
    return results


def test_ep2_norm_zeros_and_overflow_cover_every_ranks_experts(two_rank_results):
    (steps,) = _ep_inputs()
    dense, experts = steps[1]
    results = [r["ep"] for r in two_rank_results]
    for (skipped, finite) in results:
        assert skipped[:3] == (False, None, None)          # rank 1's inf skips both ranks
        ok, norm, zeros, scale = finite
        assert ok and scale == 4.0
        unscaled = [(g * scale).half().double() / scale for g in [dense] + experts]
        # Counting one rank's expert, or the dense weight twice, gives another norm.
        assert abs(_norm64(unscaled, 2) - _norm64(unscaled[:2], 2)) > 1e-2
        assert norm == pytest.approx(_norm64(unscaled, 2), rel=1e-6)
        assert zeros == 2


# -- expert tensor parallelism other than tensor parallelism: 4 ranks -------------------------
#
# Both layouts fold the 4 ranks of one stage into expert TP x EP (2) x expert DP:
#   tp 2, expert tp 1: TP = model-parallel = EP = expert model-parallel groups [0, 1] [2, 3],
#                      DP = expert-DP [0, 2] [1, 3]; every rank is expert-TP rank 0.
#   tp 1, expert tp 2: model-parallel groups [r], expert-TP [0, 1] [2, 3], EP [0, 2] [1, 3],
#                      expert model-parallel [0, 1, 2, 3], expert-DP [r].

# One expert's full shapes and how expert TP holds them: split along a dim, or replicated.
EXPERT_LAYOUT = {
    "fc1_weight": ((6, 4), 0),  # column-parallel: rows split
    "fc1_bias": ((6,), 0),
    "fc2_weight": ((4, 6), 1),  # row-parallel: columns split
    "fc2_bias": ((4,), None),   # replicated over expert TP
}
ETP_LAYOUTS = {"tp2_etp1": (2, 1), "tp1_etp2": (1, 2)}  # (tp, expert tp); ep 2 in both
EP_SIZE, NUM_EXPERTS = 2, 4                              # two local experts per EP rank


def _etp_full_grads():
    """The unsplit model's gradients: the dense layer of TP_LAYOUT and four experts."""
    gen = torch.Generator().manual_seed(17)
    dense = {n: torch.randn(shape, generator=gen) for n, (shape, _) in TP_LAYOUT.items()}
    experts = [{n: torch.randn(shape, generator=gen) for n, (shape, _) in EXPERT_LAYOUT.items()}
               for _ in range(NUM_EXPERTS)]
    dense["norm_bias"][1] = 0.0
    experts[1]["fc1_weight"][0] = 0.0  # zeros in an expert's shards
    experts[3]["fc2_bias"][2] = 0.0    # a zero in a replicated expert bias counts once
    experts[3]["fc2_bias"][0] = 9.0    # the max-norm sits in a replicated expert bias
    return dense, experts


def _cut(full, dim, size, rank):
    return full.clone() if dim is None else full.chunk(size, dim=dim)[rank].clone()


def _held(full, tp, etp, coords):
    """``name -> (value, tensor_model_parallel, expert)``: what the rank at ``coords``
    (tp rank, EP rank, expert-TP rank) holds of the full model ``full``."""
    (dense, experts), (tp_rank, ep_rank, etp_rank) = full, coords
    held = {}
    for name, value in dense.items():
        dim = TP_LAYOUT[name][1]
        held[name] = (_cut(value, dim, tp, tp_rank), dim is not None, False)
    per_rank = NUM_EXPERTS // EP_SIZE
    for local in range(per_rank):
        for name, value in experts[ep_rank * per_rank + local].items():
            dim = EXPERT_LAYOUT[name][1]
            held[f"expert{local}_{name}"] = (_cut(value, dim, etp, etp_rank), dim is not None,
                                             True)
    return held


class SplitMoE(torch.nn.Module):
    """One rank's part of a dense layer and four experts, each parameter's value equal to its
    gradient (so the params norm is the gradient norm)."""

    def __init__(self, held):
        super().__init__()
        for name, (value, tensor_model_parallel, expert) in held.items():
            param = torch.nn.Parameter(value.clone())
            param.tensor_model_parallel = tensor_model_parallel
            if expert:
                param.allreduce = False
            self.register_parameter(name, param)


def _etp_norms(state):
    """Norms, zero count and clipping of one rank's :class:`SplitMoE` through the replicated
    optimizer, the functions it calls, the params norm and the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.optimizer.clip_grads import is_expert_parallel
    from megatron.training.log import calc_params_l2_norm

    coords = (state.tp_rank, dist.get_rank(state.ep_group), state.expert_tp_rank)
    held = _held(_etp_full_grads(), state.tp_size, state.layout.expert_tp_size, coords)
    groups = dict(mp_group=state.model_parallel_group, tp_group=state.tp_group,
                  dp_group=state.dp_cp_group,
                  expert_model_parallel_group=state.expert_model_parallel_group,
                  expert_tp_rank=state.expert_tp_rank)
    model = SplitMoE(held)
    for p in model.parameters():
        p.grad = p.detach().clone()
    out = {"coords": coords, "params_norm": calc_params_l2_norm([model], state)}
    experts = [p for p in model.parameters() if is_expert_parallel(p)]
    dense = [p for p in model.parameters() if not is_expert_parallel(p)]
    out["inf"] = get_grad_norm_fp32(
        get_grads_for_norm(dense, tp_rank=state.tp_rank), math.inf, state.model_parallel_group,
        expert_grads=get_grads_for_norm(experts, tp_rank=state.expert_tp_rank),
        expert_model_parallel_group=state.expert_model_parallel_group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.0), [model], use_main_grad=False, **groups)
    out["zeros"] = opt.count_zeros()
    out["two"] = opt.clip_grad_norm(1.0)
    out["clipped"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    ddp = DistributedDataParallel(SplitMoE(held), dp_group=state.dp_cp_group,
                                  use_distributed_optimizer=True,
                                  expert_dp_group=state.expert_dp_group)
    config = OptimizerConfig(lr=0.0, clip_grad=1.0, log_num_zeros_in_grad=True,
                             use_distributed_optimizer=True)
    dist_opt = get_megatron_optimizer(config, [ddp], **groups)
    ddp.zero_grad_buffer()
    for p in ddp.module.parameters():
        p.main_grad.copy_(p.detach())
    # No finish_grad_sync: replicas hold identical gradients, which its reduce-scatter would
    # only round; each rank's shard of the buffer already holds the reduced gradient.
    out["dist"] = dist_opt.step()
    out["expert_buffers"] = bool(ddp.expert_grad_buffers)
    return out


def _four_rank_checks():
    out = {}
    for key, (tp, etp) in ETP_LAYOUTS.items():
        state = ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=EP_SIZE,
                                             expert_tensor_parallel_size=etp)
        out[key] = _etp_norms(state)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def four_rank_results():
    return run_on_ranks(_four_rank_checks, 4, timeout=120)


@pytest.mark.parametrize("layout", sorted(ETP_LAYOUTS))
def test_expert_tp_other_than_tp_counts_each_expert_shard_once(four_rank_results, layout):
    tp, etp = ETP_LAYOUTS[layout]
    full = _etp_full_grads()
    grads = list(full[0].values()) + [g for expert in full[1] for g in expert.values()]
    two = _norm64(grads, 2)
    zeros = sum(int((g == 0).sum()) for g in grads)
    assert two > 1.0 and _norm64(grads, math.inf) == 9.0 and zeros == 6
    coeff = 1.0 / (two + 1e-6)
    for rank, res in enumerate(r[layout] for r in four_rank_results):
        # (tp rank, EP rank, expert-TP rank), as the layout comment above says.
        assert res["coords"] == ((rank % 2, rank % 2, 0) if tp == 2 else
                                 (0, rank // 2, rank % 2)), rank
        assert res["two"] == pytest.approx(two, rel=1e-6), rank
        assert res["inf"] == pytest.approx(9.0, rel=1e-6), rank
        assert res["zeros"] == zeros, rank
        assert res["params_norm"] == pytest.approx(two, rel=1e-6), rank
        ok, dist_norm, dist_zeros = res["dist"]
        assert ok and dist_norm == pytest.approx(two, rel=1e-6) and dist_zeros == zeros, rank
        # Expert-DP is DP with tp 2 (experts in the dense buffers), [r] with tp 1.
        assert res["expert_buffers"] == (tp == 1)
        held = _held(full, tp, etp, res["coords"])
        for name, clipped in res["clipped"].items():
            expected = held[name][0].double() * coeff
            torch.testing.assert_close(clipped.double(), expected, rtol=1e-6, atol=0,
                                       msg=f"rank {rank} {name}")

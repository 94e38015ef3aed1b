"""Distributed optimizer (ZeRO-1) on 2 and 4 gloo ranks against the replicated optimizer.

Every rank function trains the same small model twice from one seed: once with the replicated
optimizer over an all-reducing DP wrapper (the reference, itself checked against fp64 elsewhere),
once with the distributed optimizer over a reduce-scattering one, and returns what the tests
compare. One spawn per DP size serves all tests of that size (module-scoped fixtures).

Why the fp32 tolerance is tight: both runs see the same averaged gradients (with 2 ranks the
sum a + b is the same in any order and the 1/dp pre-division is exact; with 4, gloo's
reduce-scatter and all-reduce may add in different orders, a few ulps) and apply the same
per-element AdamW arithmetic. The gradient norm differs only in summation order (per shard, then
over ranks), so the clip coefficient agrees to ~1e-7 relative; after a few steps the parameters
agree to well within 1e-6 relative.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, compute_buffer_layout
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.multiprocess import run_on_ranks

STEPS = 5
BUCKET = 60  # elements: several buckets, parameters straddling shard boundaries
IN, HID, OUT = 8, 13, 3


class Net(torch.nn.Module):
    """Linear + LayerNorm + Linear + Linear with odd sizes (265 parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HID)
        self.norm = torch.nn.LayerNorm(HID)
        self.fc2 = torch.nn.Linear(HID, 7)
        self.head = torch.nn.Linear(7, OUT)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(self.norm(self.fc1(x)))))


def build_net(dtype=torch.float32) -> Net:
    torch.manual_seed(42)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape))  # non-trivial norm weights and biases
    return net.to(dtype)


def batch(rank: int, step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, IN, generator=gen)
    y = torch.randn(4, OUT, generator=gen)
    return x.to(dtype), y.to(dtype)


def make_config(precision: str, **kwargs) -> OptimizerConfig:
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.5, fp16=precision == "fp16",
                bf16=precision == "bf16")
    base.update(kwargs)
    return OptimizerConfig(**base)


def build(precision: str, distributed: bool, dp_group, bucket_size=BUCKET,
          overlap_param_gather=False, **config_kwargs):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ddp = DistributedDataParallel(build_net(dtype), dp_group=dp_group,
                                  accumulate_allreduce_grads_in_fp32=precision == "bf16",
                                  bucket_size=bucket_size, use_distributed_optimizer=distributed)
    config = make_config(precision, use_distributed_optimizer=distributed, **config_kwargs)
    optimizer = get_megatron_optimizer(config, [ddp], mp_group=None, tp_group=None,
                                       dp_group=dp_group,
                                       overlap_param_gather=overlap_param_gather)
    return ddp, optimizer


def train_step(ddp, optimizer, rank, step, dtype, corrupt=None):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    x, y = batch(rank, step, dtype)
    loss = torch.nn.functional.mse_loss(ddp(x).float(), y.float())
    optimizer.scale_loss(loss).backward()
    if corrupt is not None:
        corrupt(ddp)
    ddp.finish_grad_sync()
    scale = float(optimizer.get_loss_scale())
    ok, norm, _ = optimizer.step()
    return ok, norm, scale


def full_params(ddp):
    return {n: p.detach().float().clone() for n, p in ddp.module.named_parameters()}


def train(precision, distributed, dp_group, steps=STEPS, **kwargs):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ddp, optimizer = build(precision, distributed, dp_group, **kwargs)
    rank = dist.get_rank(dp_group)
    history = [train_step(ddp, optimizer, rank, s, dtype) for s in range(steps)]
    return ddp, optimizer, history


def state_numel(optimizer, ddp) -> dict:
    """Elements of fp32 state this rank holds: optimizer moments, and main params that are
    copies (fp16/bf16), not the model's own parameters or views of them (fp32 models)."""
    moments = sum(v.numel() for s in optimizer.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0)
    model = {id(p) for p in ddp.parameters()}
    copies = sum(p.numel() for group in optimizer.optimizer.param_groups for p in group["params"]
                 if id(p) not in model and p._base is None)
    return {"moments": moments, "main_copies": copies}


def _precision_run(precision, dp_group):
    out = {}
    for distributed in (False, True):
        ddp, optimizer, history = train(precision, distributed, dp_group,
                                        **({"initial_loss_scale": 2.0 ** 18, "hysteresis": 1}
                                           if precision == "fp16" else {}))
        key = "dist" if distributed else "ref"
        out[key] = {"params": full_params(ddp), "history": history,
                    "numel": state_numel(optimizer, ddp), "type": type(optimizer).__name__}
        if distributed:
            out[key]["state"] = optimizer.state_dict()
            out[key]["pieces"] = sum(p.numel for g in optimizer.shard_groups for p, _ in g)
            buffer = ddp.grad_buffers[torch.float32 if precision != "fp16" else torch.float16]
            out[key]["buffer"] = (buffer.numel, len(buffer.buckets))
        else:
            out[key]["ref_state"] = _replicated_state(optimizer)
    return out


def _replicated_state(optimizer):
    """The replicated optimizer's fp32 main params and moments, in model order."""
    groups = []
    for group in optimizer.optimizer.param_groups:
        groups.append([{"param": p.detach().clone(),
                        **{k: v.clone() for k, v in optimizer.optimizer.state[p].items()
                           if k != "step"}} for p in group["params"]])
    return groups


def _reduce_scatter_run(dp_group):
    """Per parameter: the all-reduced gradient (reference), the reduce-scattered one, and which
    of its elements lie in this rank's shards."""
    grads, owned = {}, {}
    rank = dist.get_rank(dp_group)
    for distributed in (False, True):
        ddp = DistributedDataParallel(build_net(), dp_group=dp_group, bucket_size=BUCKET,
                                      use_distributed_optimizer=distributed)
        x, y = batch(rank, 0)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        grads["dist" if distributed else "ref"] = {
            n: p.main_grad.detach().reshape(-1).clone() for n, p in ddp.module.named_parameters()}
    buffer = ddp.grad_buffers[torch.float32]
    for name, param in ddp.module.named_parameters():
        p_start, p_end, index = buffer.param_index_map[param]
        bucket = buffer.buckets[index]
        s_start, s_end = (bucket.offset + i for i in bucket.shard_range())
        mask = torch.zeros(p_end - p_start, dtype=torch.bool)
        mask[max(s_start - p_start, 0):max(min(s_end, p_end) - p_start, 0)] = True
        owned[name] = mask
    return {"grads": grads, "owned": owned, "num_buckets": len(buffer.buckets)}


def _found_inf_run(dp_group):
    """fp16: an inf that lands only in DP rank 1's shard must skip the step on every rank."""
    ddp, optimizer = build("fp16", True, dp_group, initial_loss_scale=2.0 ** 10, hysteresis=1)
    rank = dist.get_rank(dp_group)
    victim = ddp.grad_buffers[torch.float16].buckets[0]
    start, _ = victim.shard_range(dp_rank=1)
    before = full_params(ddp)

    def corrupt(model):
        if rank == 0:  # rank 0's local gradient; after the reduce-scatter only rank 1 holds it
            victim.data[start] = float("inf")

    ok, norm, scale = train_step(ddp, optimizer, rank, 0, torch.float16, corrupt)
    own_start, own_end = victim.shard_range()
    own_finite = bool(torch.isfinite(victim.data[own_start:own_end]).all())
    return {"ok": ok, "norm": norm, "scale_before": scale,
            "scale_after": float(optimizer.get_loss_scale()), "own_shard_finite": own_finite,
            "unchanged": all(torch.equal(before[n], p) for n, p in full_params(ddp).items())}


def _resume_run(dp_group):
    """state_dict() mid-run, loaded into a fresh optimizer, continues bit for bit."""
    ddp, optimizer, _ = train("fp32", True, dp_group, steps=3)
    rank = dist.get_rank(dp_group)
    state = optimizer.state_dict()
    model_state = {n: p.detach().clone() for n, p in ddp.module.state_dict().items()}
    for step in (3, 4):
        train_step(ddp, optimizer, rank, step, torch.float32)
    straight = full_params(ddp)

    holder = [state]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    fresh, fresh_optimizer = build("fp32", True, dp_group)
    fresh.module.load_state_dict(model_state)
    fresh_optimizer.load_state_dict(holder[0])
    for step in (3, 4):
        train_step(fresh, fresh_optimizer, rank, step, torch.float32)
    return {"state": state, "straight": straight, "resumed": full_params(fresh)}


def _overlap_run(dp_group):
    """--overlap-param-gather: gathers pending after step, done by the next forward; same
    numbers as the synchronous gather."""
    ddp, optimizer = build("bf16", True, dp_group, overlap_param_gather=True)
    rank = dist.get_rank(dp_group)
    pending_after_step = []
    for step in range(STEPS):
        train_step(ddp, optimizer, rank, step, torch.bfloat16)
        pending_after_step.append(len(optimizer._pending_gathers))
    x, _ = batch(rank, STEPS, torch.bfloat16)
    ddp(x)  # forward pre-hooks wait for every bucket
    return {"pending_after_step": pending_after_step,
            "pending_after_forward": len(optimizer._pending_gathers),
            "params": full_params(ddp), "num_buckets": len(
                ddp.grad_buffers[torch.float32].buckets)}


def _tp_norm_run():
    """TP=2 x DP=2: known gradients; each parameter must count once in the global norm."""
    from megatron.core import parallel_state

    pstate = parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    net = build_net()
    net.fc1.weight.tensor_model_parallel = True  # a different slice on each TP rank
    net.head.weight.shared = True  # a tied copy counted elsewhere
    ddp = DistributedDataParallel(net, dp_group=pstate.dp_group, bucket_size=BUCKET,
                                  use_distributed_optimizer=True)
    norms = {}
    for distributed in (False, True):
        config = make_config("fp32", use_distributed_optimizer=distributed, clip_grad=1e-3)
        if not distributed:
            ddp_ref = DistributedDataParallel(build_net(), dp_group=pstate.dp_group)
            ddp_ref.module.fc1.weight.tensor_model_parallel = True
            ddp_ref.module.head.weight.shared = True
        model = ddp if distributed else ddp_ref
        optimizer = get_megatron_optimizer(config, [model], mp_group=pstate.model_parallel_group,
                                           tp_group=pstate.tp_group, dp_group=pstate.dp_group)
        model.zero_grad_buffer()
        for name, p in model.module.named_parameters():
            p.main_grad.copy_(_known_grad(name, p.shape, pstate.tp_rank))
        model.finish_grad_sync()
        _, norms["dist" if distributed else "ref"], _ = optimizer.step()
    return norms


def _known_grad(name, shape, tp_rank):
    """Deterministic per (parameter, TP rank) for the TP-sharded weight, else per parameter."""
    seed = sum(map(ord, name)) + (100 * tp_rank if name == "fc1.weight" else 0)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def all_checks():
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    results = {precision: _precision_run(precision, group)
               for precision in ("fp32", "bf16", "fp16")}
    results["reduce_scatter"] = _reduce_scatter_run(group)
    results["found_inf"] = _found_inf_run(group)
    results["resume"] = _resume_run(group)
    results["overlap"] = _overlap_run(group)
    if world == 4:
        results["tp_norm"] = _tp_norm_run()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def results(request):
    return request.param, run_on_ranks(all_checks, request.param)


def _reference_first_grad_norm(dp: int) -> float:
    """fp64, one process: norm of the gradient of the mean over ranks of each rank's loss."""
    net = build_net().double()
    loss = sum(torch.nn.functional.mse_loss(net(x.double()), y.double())
               for x, y in (batch(r, 0) for r in range(dp))) / dp
    loss.backward()
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in net.parameters()))


def test_fp32_matches_replicated_optimizer_and_fp64_norm(results):
    dp, per_rank = results
    expected_norm = _reference_first_grad_norm(dp)
    for rank, res in enumerate(per_rank):
        out = res["fp32"]
        assert out["dist"]["type"] == "DistributedOptimizer"
        assert out["ref"]["type"] == "FP32Optimizer"
        for name, ref in out["ref"]["params"].items():
            torch.testing.assert_close(out["dist"]["params"][name], ref, rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank} {name}")
        # Parameters moved: the comparison is not of two untouched models.
        assert not torch.allclose(out["dist"]["params"]["fc1.weight"],
                                  build_net().fc1.weight.detach(), atol=1e-3)
        for (ok_r, norm_r, _), (ok_d, norm_d, _) in zip(out["ref"]["history"],
                                                        out["dist"]["history"]):
            assert ok_r and ok_d
            assert norm_d == pytest.approx(norm_r, rel=1e-6)
        assert out["dist"]["history"][0][1] == pytest.approx(expected_norm, rel=1e-6)
        # Every DP rank holds the same, whole model after the all-gather.
        for name, value in out["dist"]["params"].items():
            assert torch.equal(value, per_rank[0]["fp32"]["dist"]["params"][name])


def test_bf16_and_fp16_match_replicated_optimizer(results):
    dp, per_rank = results
    for rank, res in enumerate(per_rank):
        for precision in ("bf16", "fp16"):
            out = res[precision]
            assert out["ref"]["type"] == "Float16OptimizerWithFloat16Params"
            ref_hist, dist_hist = out["ref"]["history"], out["dist"]["history"]
            # Same steps skipped, same loss-scale trajectory, and at least one step taken.
            assert [(ok, s) for ok, _, s in ref_hist] == [(ok, s) for ok, _, s in dist_hist]
            assert any(ok for ok, _, _ in dist_hist)
            for name, ref in out["ref"]["params"].items():
                # Half-precision weights are rounded from fp32 mains that agree to ~1e-7; a
                # rounding may tip over one half-precision ulp (2^-8 for bf16) in rare elements.
                torch.testing.assert_close(out["dist"]["params"][name], ref, rtol=2 ** -7,
                                           atol=1e-3, msg=f"rank {rank} {precision} {name}")
        assert any(not ok for ok, _, _ in res["fp16"]["dist"]["history"]), \
            "the fp16 run should start with an overflow that is skipped"


def test_fp32_main_params_and_moments_gathered_in_model_order(results):
    """state_dict() on DP rank 0 holds every parameter's fp32 main value and Adam moments,
    equal to the replicated optimizer's; other DP ranks return none."""
    dp, per_rank = results
    for precision in ("fp32", "bf16"):
        saved = per_rank[0][precision]["dist"]["state"]
        ref = per_rank[0][precision]["ref"]["ref_state"]
        assert [len(g) for g in saved["param_state"]] == [len(g) for g in ref]
        for g, (saved_group, ref_group) in enumerate(zip(saved["param_state"], ref)):
            for i, (entry, expected) in enumerate(zip(saved_group, ref_group)):
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert entry[key].dtype == torch.float32
                    torch.testing.assert_close(entry[key], expected[key], rtol=1e-5, atol=1e-7,
                                               msg=f"{precision} group {g} param {i} {key}")
        assert [grp["step"] for grp in saved["optimizer"]["param_groups"]] == [STEPS] * len(ref)
        for rank in range(1, dp):
            assert per_rank[rank][precision]["dist"]["state"]["param_state"] is None


def test_state_dict_loads_weights_only_and_resumes_bit_exactly(results, tmp_path):
    dp, per_rank = results
    state = per_rank[0]["resume"]["state"]
    path = tmp_path / "optim.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["param_state"][0][0]["exp_avg"].shape == state["param_state"][0][0][
        "exp_avg"].shape
    for rank, res in enumerate(per_rank):
        for name, value in res["resume"]["straight"].items():
            assert torch.equal(res["resume"]["resumed"][name], value), (rank, name)


def test_optimizer_state_is_sharded(results):
    """Each rank holds fp32 state for ~1/DP of the elements; together exactly all of them."""
    dp, per_rank = results
    total = sum(p.numel() for p in build_net().parameters())
    padded, num_buckets = per_rank[0]["fp32"]["dist"]["buffer"]
    assert total <= padded < total + dp * num_buckets  # each bucket padded by < dp elements
    pieces = [res["fp32"]["dist"]["pieces"] for res in per_rank]
    assert sum(pieces) == total
    for rank, res in enumerate(per_rank):
        assert pieces[rank] <= padded // dp
        assert res["fp32"]["ref"]["numel"] == {"moments": 2 * total, "main_copies": 0}
        assert res["fp32"]["dist"]["numel"] == {"moments": 2 * pieces[rank], "main_copies": 0}
        assert res["bf16"]["ref"]["numel"] == {"moments": 2 * total, "main_copies": total}
        assert res["bf16"]["dist"]["numel"] == {"moments": 2 * pieces[rank],
                                                "main_copies": pieces[rank]}
        assert pieces[rank] < 0.6 * total if dp == 2 else pieces[rank] < 0.35 * total


def test_gradients_are_reduce_scattered(results):
    """Each rank's shard of the buffer equals the all-reduced gradient; outside it, the
    rank's own unreduced values remain (no all-reduce happened)."""
    dp, per_rank = results
    owners = {}
    for rank, res in enumerate(per_rank):
        rs = res["reduce_scatter"]
        assert rs["num_buckets"] > 1
        mismatched_outside = 0
        for name, ref in rs["grads"]["ref"].items():
            got, mask = rs["grads"]["dist"][name], rs["owned"][name]
            torch.testing.assert_close(got[mask], ref[mask], rtol=1e-6, atol=1e-8,
                                       msg=f"rank {rank} {name}")
            mismatched_outside += int((~torch.isclose(got[~mask], ref[~mask])).sum())
            owners[name] = owners.get(name, 0) + mask.int()
        assert mismatched_outside > 0
    # The shards tile every parameter exactly once.
    for name, count in owners.items():
        assert torch.equal(count, torch.ones_like(count)), name


def test_found_inf_on_one_shard_skips_step_on_all_ranks(results):
    dp, per_rank = results
    assert per_rank[1]["found_inf"]["own_shard_finite"] is False
    assert per_rank[0]["found_inf"]["own_shard_finite"] is True
    for rank, res in enumerate(per_rank):
        out = res["found_inf"]
        assert out["ok"] is False and out["norm"] is None, rank
        assert out["unchanged"], rank
        assert out["scale_after"] == out["scale_before"] / 2, rank  # hysteresis 1: back off


def test_overlap_param_gather_matches_synchronous_gather(results):
    dp, per_rank = results
    for rank, res in enumerate(per_rank):
        out = res["overlap"]
        assert out["pending_after_step"] == [out["num_buckets"]] * STEPS
        assert out["pending_after_forward"] == 0
        for name, value in out["params"].items():
            assert torch.equal(value, res["bf16"]["dist"]["params"][name]), (rank, name)


@pytest.mark.parametrize("results", [4], indirect=True, ids=["tp2xdp2"])
def test_grad_norm_counts_each_parameter_once_over_dp_and_tp(results):
    """TP-sharded weight counted on both TP ranks, replicated ones once, the shared one never;
    the distributed optimizer's sum over DP and TP equals an fp64 sum over the full model."""
    dp, per_rank = results
    expected = 0.0
    for name, p in build_net().named_parameters():
        if name == "head.weight":
            continue  # shared: counted on another stage
        tp_ranks = (0, 1) if name == "fc1.weight" else (0,)
        expected += sum(float(_known_grad(name, p.shape, t).double().pow(2).sum())
                        for t in tp_ranks)
    expected = math.sqrt(expected)
    for rank, res in enumerate(per_rank):
        assert res["tp_norm"]["ref"] == pytest.approx(expected, rel=1e-6), rank
        assert res["tp_norm"]["dist"] == pytest.approx(expected, rel=1e-6), rank


def test_shared_embedding_gets_a_bucket_of_its_own():
    """Written out by hand: sizes 6, 4, 8, 3 on dp 4, parameter 2 alone; each bucket padded."""
    layout = compute_buffer_layout([6, 4, 8, 3], bucket_size=None, dp_size=4, pad_buckets=True,
                                   own_bucket=[2])
    assert layout.param_ranges == [(0, 6), (6, 10), (12, 20), (20, 23)]
    assert layout.bucket_ranges == [(0, 12), (12, 20), (20, 24)]
    assert layout.bucket_params == [[0, 1], [2], [3]]
    assert (layout.numel, layout.numel_unpadded) == (24, 21)

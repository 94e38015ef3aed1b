"""Distributed optimizer with expert parallelism: 4 gloo ranks, DP 4, EP 2, so expert-DP 2.

Layout (tp = pp = 1): EP groups ``[0, 1] [2, 3]``, expert-DP groups ``[0, 2] [1, 3]``. The toy
model has a dense part (replicated over DP 4) and two local experts per rank, marked
``allreduce = False``: EP rank ``e`` holds global experts ``2e`` and ``2e + 1``. There is no
token dispatch; each rank's experts see that rank's batch only, and the DP wrapper sums expert
gradients over expert-DP and divides by DP (4), which is exactly the gradient of
``L = (1 / 4) sum_r loss_r`` with ``loss_r`` using rank r's experts. That ``L`` in fp64 in one
process is the reference norm.

Every rank trains the same model twice from one seed: with the replicated optimizer (the
reference, checked against fp64 and by tests/distributed/test_clip_grads.py) and with the
distributed one, whose buckets (small, so parameters straddle shard boundaries) are sharded
over DP for the dense part and over expert-DP for the experts.

Tolerances, as in test_distrib_optimizer.py: with two ranks per reduction group the sums
``a + b`` are order-free and the 1/4 division exact; the norm differs from the replicated
optimizer's only in summation order (~1e-7 relative), so the parameters agree to 1e-6.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.multiprocess import run_on_ranks

WORLD, EP = 4, 2
STEPS = 4
BUCKET = 30  # elements: two buckets per buffer, parameters straddling shard boundaries
IN, HID, OUT = 6, 11, 3


class EPNet(torch.nn.Module):
    """A dense Linear + LayerNorm, then the sum of this rank's two experts (Linear each).

    The experts' last output is dropped, so their last weight row and bias element always get a
    zero gradient (what the zero count must find on every EP rank)."""

    def __init__(self, experts, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(42)
        self.fc = torch.nn.Linear(IN, HID)
        self.norm = torch.nn.LayerNorm(HID)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(HID))
        self.experts = torch.nn.ModuleList()
        for j in experts:
            torch.manual_seed(100 + j)
            expert = torch.nn.Linear(HID, OUT)
            for p in expert.parameters():
                p.allreduce = False
            self.experts.append(expert)
        self.to(dtype)

    def forward(self, x):
        h = torch.relu(self.norm(self.fc(x)))  # (b, HID)
        first, second = (e(h) for e in self.experts)  # (b, OUT) each
        return first[:, :OUT - 1] + second[:, :OUT - 1]  # (b, OUT - 1)


def local_experts(ep_rank: int):
    return [2 * ep_rank, 2 * ep_rank + 1]


def batch(rank: int, step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(4, IN, generator=gen).to(dtype),
            torch.randn(4, OUT - 1, generator=gen).to(dtype))


def build(pstate, distributed: bool, precision="fp32", **config_kwargs):
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[precision]
    net = EPNet(local_experts(dist.get_rank(pstate.ep_group)), dtype)
    ddp = DistributedDataParallel(net, dp_group=pstate.dp_cp_group, bucket_size=BUCKET,
                                  use_distributed_optimizer=distributed,
                                  expert_dp_group=pstate.expert_dp_group)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, log_num_zeros_in_grad=True,
                             use_distributed_optimizer=distributed, fp16=precision == "fp16",
                             **config_kwargs)
    optimizer = get_megatron_optimizer(config, [ddp], mp_group=pstate.model_parallel_group,
                                       tp_group=pstate.tp_group, dp_group=pstate.dp_cp_group,
                                       expert_model_parallel_group=(
                                           pstate.expert_model_parallel_group),
                                       expert_tp_rank=pstate.expert_tp_rank)
    return ddp, optimizer


def train_step(ddp, optimizer, step, dtype=torch.float32, corrupt=None):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    x, y = batch(dist.get_rank(), step, dtype)
    loss = torch.nn.functional.mse_loss(ddp(x).float(), y.float())
    optimizer.scale_loss(loss).backward()
    if corrupt is not None:
        corrupt()
    ddp.finish_grad_sync()
    return optimizer.step()


def params(ddp):
    return {n: p.detach().float().clone() for n, p in ddp.module.named_parameters()}


def _replicated_state(optimizer):
    return [[{"param": p.detach().clone(),
              **{k: v.clone() for k, v in optimizer.optimizer.state[p].items() if k != "step"}}
             for p in group["params"]] for group in optimizer.optimizer.param_groups]


def _parity_run(pstate):
    out = {}
    for distributed in (False, True):
        ddp, optimizer = build(pstate, distributed)
        history = [train_step(ddp, optimizer, s) for s in range(STEPS)]
        key = "dist" if distributed else "ref"
        out[key] = {"params": params(ddp), "history": history, "type": type(optimizer).__name__}
        if distributed:
            out[key]["state"] = optimizer.state_dict()
            out[key]["pieces"] = {n: sum(piece.numel for g in optimizer.shard_groups
                                         for piece, _ in g if piece.model_param is p)
                                  for n, p in ddp.module.named_parameters()}
            out[key]["expert_buckets"] = len(ddp.expert_grad_buffers[torch.float32].buckets)
        else:
            out[key]["state"] = _replicated_state(optimizer)
    return out


def _resume_run(pstate):
    """state_dict() after 3 steps; each rank loads the state of its EP coordinate (what its
    expert-DP rank 0 returned: the file of that (tp, pp, ep) rank) into a fresh optimizer."""
    ddp, optimizer = build(pstate, True)
    for step in range(3):
        train_step(ddp, optimizer, step)
    state = optimizer.state_dict()
    model_state = {n: p.detach().clone() for n, p in ddp.module.state_dict().items()}
    for step in (3, 4):
        train_step(ddp, optimizer, step)
    straight = params(ddp)

    holder = [state]
    group = pstate.expert_dp_group
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    fresh, fresh_optimizer = build(pstate, True)
    fresh.module.load_state_dict(model_state)
    fresh_optimizer.load_state_dict(holder[0])
    for step in (3, 4):
        train_step(fresh, fresh_optimizer, step)
    return {"straight": straight, "resumed": params(fresh)}


def _found_inf_run(pstate):
    """fp16: an inf that only expert-DP rank 1 of group [0, 2] (global rank 2) holds after the
    reduce-scatter of an expert bucket must skip the step on all four ranks."""
    ddp, optimizer = build(pstate, True, "fp16", initial_loss_scale=2.0 ** 10, hysteresis=1)
    victim = ddp.expert_grad_buffers[torch.float16].buckets[0]
    start, _ = victim.shard_range(dp_rank=1)
    before = params(ddp)

    def corrupt():
        if dist.get_rank() == 0:
            victim.data[start] = float("inf")

    ok, _, _ = train_step(ddp, optimizer, 0, torch.float16, corrupt)
    return {"ok": ok, "scale_after": float(optimizer.get_loss_scale()),
            "unchanged": all(torch.equal(before[n], p) for n, p in params(ddp).items())}


def ep_checks():
    pstate = parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    rank = dist.get_rank()
    layout = (dist.get_rank(pstate.ep_group), dist.get_rank(pstate.expert_dp_group))
    assert layout == (rank % EP, rank // EP), layout
    return {"parity": _parity_run(pstate), "resume": _resume_run(pstate),
            "found_inf": _found_inf_run(pstate)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(ep_checks, WORLD)


def _reference_first_step():
    """fp64, one process, all four experts: the first step's gradient norm and zero count."""
    nets = [EPNet(local_experts(e), torch.float64) for e in range(EP)]
    dense = {n: p for n, p in nets[0].named_parameters() if not n.startswith("experts")}
    for net in nets[1:]:  # one dense part shared by every rank's loss
        net.fc, net.norm = nets[0].fc, nets[0].norm
    loss = 0.0
    for r in range(WORLD):
        x, y = batch(r, 0)
        loss = loss + torch.nn.functional.mse_loss(nets[r % EP](x.double()), y.double())
    (loss / WORLD).backward()
    grads = [p.grad for p in dense.values()] + [p.grad for net in nets
                                                for p in net.experts.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    zeros = sum(int((g == 0).sum()) for g in grads)
    return norm, zeros


def test_norm_and_zeros_cover_all_experts_against_fp64(results):
    norm, zeros = _reference_first_step()
    assert zeros >= EP * (HID + 1)
    for rank, res in enumerate(results):
        out = res["parity"]
        assert out["dist"]["type"] == "DistributedOptimizer"
        ok, dist_norm, dist_zeros = out["dist"]["history"][0]
        assert ok and dist_norm == pytest.approx(norm, rel=1e-6), rank
        assert dist_zeros == zeros, rank
        for (_, norm_r, zeros_r), (_, norm_d, zeros_d) in zip(out["ref"]["history"],
                                                              out["dist"]["history"]):
            assert norm_d == pytest.approx(norm_r, rel=1e-6)
            assert zeros_d == zeros_r


def test_params_match_replicated_optimizer(results):
    for rank, res in enumerate(results):
        out = res["parity"]
        for name, ref in out["ref"]["params"].items():
            torch.testing.assert_close(out["dist"]["params"][name], ref, rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank} {name}")
        assert out["dist"]["expert_buckets"] > 1
    # Dense parts agree everywhere; experts within each expert-DP group only.
    for rank, res in enumerate(results):
        for name, value in res["parity"]["dist"]["params"].items():
            peer = 0 if not name.startswith("experts") else rank % EP
            assert torch.equal(value, results[peer]["parity"]["dist"]["params"][name]), \
                (rank, name)
    assert not torch.equal(results[0]["parity"]["dist"]["params"]["experts.0.weight"],
                           results[1]["parity"]["dist"]["params"]["experts.0.weight"])


def test_pieces_tile_dense_over_dp_and_experts_over_expert_dp(results):
    pieces = [res["parity"]["dist"]["pieces"] for res in results]
    net = EPNet(local_experts(0))
    for name, p in net.named_parameters():
        if name.startswith("experts"):
            for ep_rank in range(EP):
                assert sum(pieces[r][name] for r in range(WORLD) if r % EP == ep_rank) == \
                    p.numel(), name
        else:
            assert sum(pieces[r][name] for r in range(WORLD)) == p.numel(), name


def test_state_dict_is_whole_on_every_expert_dp_rank_0(results):
    """Ranks 0 and 1 (expert-DP rank 0 of EP ranks 0 and 1) return the dense parameters and
    their own experts, equal to the replicated optimizer's state; ranks 2 and 3 return none."""
    for rank, res in enumerate(results):
        saved = res["parity"]["dist"]["state"]
        if rank // EP != 0:
            assert saved["param_state"] is None, rank
            continue
        ref = res["parity"]["ref"]["state"]
        assert [len(g) for g in saved["param_state"]] == [len(g) for g in ref]
        for g, (saved_group, ref_group) in enumerate(zip(saved["param_state"], ref)):
            for i, (entry, expected) in enumerate(zip(saved_group, ref_group)):
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(entry[key], expected[key], rtol=1e-5, atol=1e-7,
                                               msg=f"rank {rank} group {g} param {i} {key}")
        assert [grp["step"] for grp in saved["optimizer"]["param_groups"]] == \
            [STEPS] * len(ref)


def test_state_dict_round_trip_resumes_bit_exactly(results):
    for rank, res in enumerate(results):
        for name, value in res["resume"]["straight"].items():
            assert torch.equal(res["resume"]["resumed"][name], value), (rank, name)


def test_inf_in_one_expert_shard_skips_every_rank(results):
    for rank, res in enumerate(results):
        out = res["found_inf"]
        assert out == {"ok": False, "scale_after": 2.0 ** 9, "unchanged": True}, rank

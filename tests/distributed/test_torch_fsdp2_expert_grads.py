"""The division of expert gradients under TorchFullyShardedDataParallel, at every dtype FSDP2
can reduce in, on two gloo CPU ranks.

An expert unit is sharded over the expert-data-parallel group; its gradient must be summed
over that group and divided by the data-parallel size once (by nothing with
``calculate_per_token_loss``), as the grad-buffer wrapper does. FSDP2 splits its division
differently by world size and reduce dtype: on one rank it divides while copying, and for a
dtype it guards against overflow (fp16) also by the pre- and post-factors it splits the
factor into, so the expert mesh of one rank (EP = DP) with fp16 reductions once came out
divided by the data-parallel size twice (fp16 reductions come from the class's
``reduce_dtype`` or fp16 parameters; the command line reduces in fp32 or bf16, see
tests/functional/test_torch_fsdp2_expert_grads.py).

Two meshes for the expert: both ranks (EP 1, expert-data-parallel size 2) and each rank alone
(EP 2, each rank's expert its own). The dense layers are sharded over both ranks.

Reference: fp64 autograd in one process on the same weights and each rank's batch: the dense
gradients are the mean over the ranks, the expert's the sum over its mesh divided by the
data-parallel size (1 with per-token loss). Tolerance: the relative distance of each whole
gradient, ``||g - ref|| / ||ref||``, set from its measured worst over the four cases: fp32
2e-7 (TOL 1e-5), fp16 compute (weights, inputs and products rounded to fp16) 1.5e-3 (5e-3),
bf16 compute 9.2e-3 (3e-2). An expert gradient divided twice or not at all is off by 0.5 or 1.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import TorchFullyShardedDataParallel
from tests.multiprocess import run_on_ranks

DP = 2
HIDDEN = 8
TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}

# (name, parameters' dtype, compute dtype, reduce dtype): every combination
# TorchFullyShardedDataParallel takes; fp16 reductions are the ones FSDP2 treats apart.
PRECISIONS = [
    ("fp32", torch.float32, None, None),
    ("bf16-reduce-fp32", torch.float32, torch.bfloat16, None),
    ("bf16-reduce-bf16", torch.float32, torch.bfloat16, torch.bfloat16),
    ("fp16-reduce-fp32", torch.float32, torch.float16, None),
    ("fp16-reduce-fp16", torch.float32, torch.float16, torch.float16),
    ("fp16-params", torch.float16, None, None),
]


class ExpertSandwich(torch.nn.Module):
    """dense -> expert -> dense, the expert a sub-module sharded as an expert unit."""

    def __init__(self):
        super().__init__()
        self.dense_in = torch.nn.Linear(HIDDEN, HIDDEN)
        self.expert = torch.nn.Linear(HIDDEN, HIDDEN)
        self.dense_out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.dense_out(torch.tanh(self.expert(torch.tanh(self.dense_in(x)))))


def _build(expert_seed: int) -> ExpertSandwich:
    """The dense layers alike on every rank; the expert from ``expert_seed`` (one per rank
    when each rank holds its own expert)."""
    torch.manual_seed(0)
    model = ExpertSandwich().double()
    torch.manual_seed(100 + expert_seed)
    model.expert.reset_parameters()
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(rank),
                       dtype=torch.float64)


def _loss(model, x):
    """A per-rank loss with gradients of order 1 (summed, as with per-token loss)."""
    return model(x).pow(2).sum()


def _reference(expert_alone: bool, per_token: bool) -> dict:
    """The fp64 gradients each rank must hold, one dict per rank."""
    grads, out = [], []
    for rank in range(DP):
        model = _build(rank if expert_alone else 0)
        _loss(model, _batch(rank)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    divide = 1.0 if per_token else float(DP)
    for rank in range(DP):
        want = {}
        for name in grads[rank]:
            if name.startswith("expert.") and expert_alone:
                want[name] = grads[rank][name] / divide
            else:
                want[name] = sum(g[name] for g in grads) / divide
        out.append(want)
    return out


def _body(expert_alone: bool, per_token: bool):
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(DP)][rank]
    expert_dp_group = own if expert_alone else dist.group.WORLD
    got = {}
    for name, param_dtype, compute_dtype, reduce_dtype in PRECISIONS:
        model = _build(rank if expert_alone else 0).to(param_dtype)
        fsdp = TorchFullyShardedDataParallel(
            model, dp_group=dist.group.WORLD, units=[model.dense_in, model.dense_out],
            compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
            expert_units=[model.expert], expert_dp_group=expert_dp_group,
            calculate_per_token_loss=per_token)
        _loss(fsdp, _batch(rank).to(compute_dtype or param_dtype)).backward()
        got[name] = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
    return got


@pytest.mark.parametrize("per_token", [False, True], ids=["averaged", "per-token"])
@pytest.mark.parametrize("expert_alone", [False, True], ids=["expert-dp2", "expert-dp1"])
def test_expert_and_dense_gradients_are_divided_once(expert_alone, per_token):
    want = _reference(expert_alone, per_token)
    results = run_on_ranks(_body, DP, expert_alone, per_token)
    off = {}
    for rank, got in enumerate(results):
        for precision, grads in got.items():
            tol = TOL[precision[:4]]
            for name, grad in grads.items():
                ref = want[rank][name]
                dist_rel = ((grad - ref).norm() / ref.norm()).item()
                if dist_rel > tol:
                    off[(rank, precision, name)] = round(dist_rel, 4)
    assert not off, off

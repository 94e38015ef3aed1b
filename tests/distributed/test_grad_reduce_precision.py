"""Half-precision gradient buffers on gloo CPU ranks, against a naive single-process reference.

What ``--grad-reduce-in-bf16`` (bf16 ``main_grad`` buffers), ``--ddp-param-name-patterns-for-
fp32-local-accumulation`` and ``--ddp-reduce-scatter-with-fp32-accumulation`` compute is written
out here with explicit roundings, in fp64 then rounded to bf16, from the per-rank gradients:

* bf16 accumulation: after each micro-batch, ``acc = bf16(acc + g)``;
* fp32 local accumulation: ``acc = fp32(acc + g)``, rounded to bf16 once before the reduction,
  and the reduced value handed back in fp32;
* the data-parallel reduction: each rank's sum pre-divided by dp size (exact: a power of two),
  then ``bf16(a + b)`` at DP 2 (one rounding whatever the order), or, with the fp32-accumulating
  reduce-scatter at DP 4, ``bf16(a + b + c + d)`` summed exactly.

The gradients are bf16 values in [2^-6, 2^6) in magnitude, so every sum above is exact in fp32
and fp64 and each rounding happens exactly where the reference puts it. The references are
checked to differ from the fp32-everywhere result (and the fp32-summing reduce-scatter from a
bf16 running sum), so a wrapper that ignored the flags would fail.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from tests.multiprocess import run_on_ranks

SHAPES = {"layer.weight": (6, 5), "layer.bias": (6,), "norm.weight": (7,), "norm.bias": (7,),
          "head.weight": (3, 7)}
NUM_MICRO = 4


class Probe(nn.Module):
    """Parameters whose gradient is whatever tensor the loss multiplies them by, exactly."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 6)
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 3, bias=False)
        self.to(torch.bfloat16)

    def forward(self, grads):
        """``sum(p * g)`` over parameters: backward leaves ``grads[name]`` in ``p.grad``."""
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def make_grads(rank: int, micro: int):
    """bf16 gradients of magnitude in [2^-6, 2^6), random signs and mantissas."""
    g = torch.Generator().manual_seed(100 * rank + micro)
    out = {}
    for name, shape in SHAPES.items():
        mant = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
        expo = torch.randint(-6, 6, shape, generator=g).to(torch.float64)
        sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
        out[name] = (sign * mant * 2.0 ** expo).to(torch.bfloat16)
    return out


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def reference(dp: int, fp32_local=(), fp32_reduce=False):
    """Each parameter's reduced gradient (fp64 holding bf16 values), from the per-rank grads."""
    out = {}
    for name in SHAPES:
        accs = []
        for rank in range(dp):
            acc = torch.zeros(SHAPES[name], dtype=torch.float64)
            for m in range(NUM_MICRO):
                acc = acc + make_grads(rank, m)[name].to(torch.float64)
                acc = acc if name in fp32_local else _bf16(acc)
            accs.append(_bf16(acc) / dp)            # rounded into the buffer, pre-divided
        if fp32_reduce:
            out[name] = _bf16(sum(accs))
        else:                                        # the backend's bf16 partial sums
            total = accs[0]
            for acc in accs[1:]:
                total = _bf16(total + acc)
            out[name] = total
    return out


def fp32_everywhere(dp: int):
    """What an fp32 buffer would give: a reference a wrapper ignoring the flags would match."""
    return {name: sum(make_grads(r, m)[name].to(torch.float64) for r in range(dp)
                      for m in range(NUM_MICRO)) / dp for name in SHAPES}


def run_step(model, rank):
    model.zero_grad_buffer()
    for m in range(NUM_MICRO):
        with nullcontext() if m == NUM_MICRO - 1 else model.no_sync():
            model(make_grads(rank, m)).backward()
    model.finish_grad_sync()


def reduced(model, shard_only: bool):
    """Each parameter's main_grad (fp64), with positions outside this rank's shard NaN."""
    out = {}
    for name, p in model.module.named_parameters():
        grad = p.main_grad.detach().to(torch.float64).clone()
        if shard_only:
            buffer = model.param_to_grad_buffer[p]
            start, end, index = buffer.param_index_map[p]
            bucket = buffer.buckets[index]
            lo, hi = bucket.shard_range()
            lo, hi = lo + bucket.offset - start, hi + bucket.offset - start
            mask = torch.ones(p.numel(), dtype=torch.bool)
            mask[max(lo, 0):max(min(hi, p.numel()), 0)] = False
            grad.view(-1)[mask] = float("nan")
        out[name] = grad
    return out


def _wrap(dp_group, **kwargs):
    torch.manual_seed(0)
    return DistributedDataParallel(Probe(), dp_group=dp_group, **kwargs)


def _dp2_body():
    state = ps.initialize_model_parallel(1, 1)
    rank, group = state.dp_rank, state.dp_group
    out = {}
    for dist_opt in (False, True):
        bf16 = _wrap(group, use_distributed_optimizer=dist_opt, bucket_size=40)
        assert list(bf16.grad_buffers) == [torch.bfloat16]
        run_step(bf16, rank)
        assert all(p.main_grad.dtype == torch.bfloat16 for p in bf16.parameters())
        out[("bf16", dist_opt)] = reduced(bf16, dist_opt)

        local = _wrap(group, use_distributed_optimizer=dist_opt, bucket_size=40,
                      overlap_grad_reduce=True,
                      fp32_local_accumulation_patterns=["norm.*", "*head*"])
        assert local.fp32_local_param_names == ["norm.weight", "norm.bias", "head.weight"]
        run_step(local, rank)
        dtypes = {n: p.main_grad.dtype for n, p in local.module.named_parameters()}
        assert dtypes == {"layer.weight": torch.bfloat16, "layer.bias": torch.bfloat16,
                          "norm.weight": torch.float32, "norm.bias": torch.float32,
                          "head.weight": torch.float32}, dtypes
        out[("local", dist_opt)] = reduced(local, dist_opt)
        local.zero_grad_buffer()
        assert not local.module.norm.weight.main_grad.any()
    return out


def _assert_matches(got, want, what):
    """Equal bits where ``got`` holds a reduced value (not NaN)."""
    for name, value in want.items():
        seen = got[name]
        keep = ~torch.isnan(seen)
        assert torch.equal(seen[keep], value[keep]), (what, name, seen[keep], value[keep])


def _assert_covered(outs):
    """The ranks' reduced positions together cover every element of every parameter."""
    for name in SHAPES:
        covered = torch.zeros(SHAPES[name], dtype=torch.bool)
        for out in outs:
            covered |= ~torch.isnan(out[name])
        assert covered.all(), name


@pytest.mark.slow
def test_bf16_buffers_at_dp2_match_the_rounded_reference():
    results = run_on_ranks(_dp2_body, 2)
    plain = reference(2)
    local = reference(2, fp32_local=("norm.weight", "norm.bias", "head.weight"))
    exact = fp32_everywhere(2)
    for name in SHAPES:      # the roundings the flags add are visible at these values
        assert not torch.equal(plain[name], _bf16(exact[name])), name
    assert any(not torch.equal(local[n], plain[n]) for n in ("norm.weight", "norm.bias",
                                                             "head.weight"))
    for rank, out in enumerate(results):
        for dist_opt in (False, True):
            _assert_matches(out[("bf16", dist_opt)], plain, ("bf16", dist_opt, rank))
            _assert_matches(out[("local", dist_opt)], local, ("local", dist_opt, rank))
    for key in results[0]:
        _assert_covered([out[key] for out in results])


def _dp4_body():
    state = ps.initialize_model_parallel(1, 1)
    rank, group = state.dp_rank, state.dp_group
    out = {}
    for overlap in (False, True):
        model = _wrap(group, use_distributed_optimizer=True, bucket_size=40,
                      overlap_grad_reduce=overlap, reduce_scatter_with_fp32_accumulation=True)
        assert len(model.grad_buffers[torch.bfloat16].buckets) > 1
        run_step(model, rank)
        out[overlap] = reduced(model, shard_only=True)
    return out


@pytest.mark.slow
def test_fp32_accumulating_reduce_scatter_at_dp4_rounds_once():
    results = run_on_ranks(_dp4_body, 4)
    want = reference(4, fp32_reduce=True)
    running_bf16 = reference(4)
    assert any(not torch.equal(want[n], running_bf16[n]) for n in SHAPES)
    for rank, out in enumerate(results):
        for overlap in (False, True):
            _assert_matches(out[overlap], want, ("fp32 reduce-scatter", overlap, rank))
    for overlap in (False, True):
        _assert_covered([out[overlap] for out in results])

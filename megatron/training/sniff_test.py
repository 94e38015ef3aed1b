"""--gpu-sniff-test-interval: a periodic self-test of every rank's device and links.

As in Megatron, five micro-benchmarks run on every rank and each result is compared across
ranks: matrix multiplies (TFLOP/s: two standard shapes and the model's own MLP shapes), an
all-reduce over all ranks, a reduce-scatter over the tensor-parallel group, an all-to-all over
the expert-parallel group and pairwise send/recv inside the data-parallel group (bus bandwidth,
GB/s). A rank whose value lies further from the median than the larger of the median absolute
deviation and 10% of the median is an outlier: rank 0 names it (and its host) in the report, and
training goes on. It runs at start-up and after every N-th iteration, on whatever device trains
(CPU included, with smaller sizes there).
"""

import math
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import collectives, device

OUTLIER_MIN_DEVIATION_FRAC = 0.10
# (GEMM shapes M x N x K, message sizes in bytes, warm-up and timed repetitions) per device kind.
SIZES = {
    "cuda": dict(gemms=((8192, 8192, 8192), (4096, 4096, 16384)),
                 messages=(256 * 2 ** 20, 2 ** 20), warmup=5, iters=20, dtype=torch.bfloat16),
    "cpu": dict(gemms=((512, 512, 512), (256, 256, 1024)),
                messages=(4 * 2 ** 20, 64 * 2 ** 10), warmup=1, iters=3, dtype=torch.float32),
}


def find_outliers(values: Sequence[float]) -> List[int]:
    """Indices of the outliers among ``values`` (NaN: a rank that took no part)."""
    present = [(i, v) for i, v in enumerate(values) if not math.isnan(v)]
    if not present:
        return []
    median = _median([v for _, v in present])
    mad = _median([abs(v - median) for _, v in present])
    threshold = max(mad, abs(median) * OUTLIER_MIN_DEVIATION_FRAC)
    return [i for i, v in present if abs(v - median) > threshold]


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _seconds_per_call(fn: Callable[[], None], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    device.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    device.synchronize()
    return (time.perf_counter() - start) / iters


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The multiply the GEMM benchmark times."""
    return torch.mm(a, b)


def _random(shape: Tuple[int, ...], sizes: dict) -> torch.Tensor:
    """Test data from a private generator: training's random streams stay untouched."""
    gen = sizes.get("generator")
    if gen is None:
        gen = sizes["generator"] = torch.Generator(device.current_device()).manual_seed(0)
    return torch.randn(shape, generator=gen, device=device.current_device(),
                       dtype=sizes["dtype"])


def bench_gemms(sizes: dict, extra: Sequence[Tuple[int, int, int, str]] = ()) -> list:
    """``(name, TFLOP/s)`` of each GEMM shape."""
    results = []
    for m, n, k, label in [(*shape, "") for shape in sizes["gemms"]] + list(extra):
        a, b = _random((m, k), sizes), _random((k, n), sizes)
        seconds = _seconds_per_call(lambda: matmul(a, b), sizes["warmup"], sizes["iters"])
        name = f"GEMM {m}x{n}x{k}{', ' + label if label else ''} [TFLOP/s]"
        results.append((name, 2.0 * m * n * k / seconds / 1e12))
    return results


def _buffer(numel: int, sizes: dict) -> torch.Tensor:
    return _random((numel,), sizes)


def bench_collectives(sizes: dict, world, tp_group, ep_group) -> list:
    """``(name, bus GB/s)`` of all-reduce (``world``), reduce-scatter (``tp_group``) and
    all-to-all (``ep_group``); a group of one rank (or None) is skipped."""
    results = []
    element = torch.finfo(sizes["dtype"]).bits // 8
    for what, group in (("all-reduce", world), ("reduce-scatter", tp_group),
                        ("all-to-all", ep_group)):
        size = 1 if group is None else collectives.get_group_size(group)
        if size <= 1:
            continue
        for nbytes in sizes["messages"]:
            numel = nbytes // element // size * size
            src = _buffer(numel, sizes)
            if what == "all-reduce":
                call, factor = (lambda: dist.all_reduce(src, group=group)), 2
            elif what == "reduce-scatter":
                out = _buffer(numel // size, sizes)
                call, factor = (lambda: collectives.reduce_scatter_tensor(out, src, group)), 1
            else:
                out = torch.empty_like(src)
                call, factor = (lambda: collectives.all_to_all_single(out, src, group)), 1
            seconds = _seconds_per_call(call, sizes["warmup"], sizes["iters"])
            busbw = factor * numel * element * (size - 1) / size / seconds / 1e9
            results.append((f"{what} busbw (size {size}, {numel * element / 1e6:.1f} MB) "
                            "[GB/s]", busbw))
    return results


def bench_sendrecv(sizes: dict, dp_group) -> list:
    """``(name, GB/s)`` of pairwise send/recv in ``dp_group`` at up to three strides (rank
    ``i`` with ``i xor stride``); NaN on a rank without a partner."""
    size = 1 if dp_group is None else collectives.get_group_size(dp_group)
    if size <= 1:
        return []
    me, ranks = dist.get_rank(dp_group), dist.get_process_group_ranks(dp_group)
    strides = [1 << i for i in range(size.bit_length()) if 1 << i <= size // 2]
    if len(strides) > 3:
        strides = [strides[0], strides[len(strides) // 2], strides[-1]]
    results = []
    for nbytes in sizes["messages"]:
        element = torch.finfo(sizes["dtype"]).bits // 8
        send, recv = _buffer(nbytes // element, sizes), _buffer(nbytes // element, sizes)
        for stride in strides:
            partner = me ^ stride
            value = float("nan")
            if partner < size:
                peer = ranks[partner]

                def exchange():
                    ops = [dist.P2POp(dist.isend, send, peer, dp_group),
                           dist.P2POp(dist.irecv, recv, peer, dp_group)]
                    for request in dist.batch_isend_irecv(ops):
                        request.wait()
                value = nbytes / _seconds_per_call(exchange, sizes["warmup"], sizes["iters"]) / 1e9
            results.append((f"send/recv busbw (stride {stride}, {nbytes / 1e6:.1f} MB) "
                            "[GB/s]", value))
    return results


def _gather(value: float) -> List[float]:
    mine = torch.tensor([value], dtype=torch.float64, device=device.current_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(t.item()) for t in everyone]


def report(results: list, tag: str = "") -> bool:
    """Gather each ``(name, value)`` from all ranks; rank 0 prints the statistics and names the
    outlier ranks. Returns whether any rank was an outlier (on every rank)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.uname().nodename)
    rank0 = dist.get_rank() == 0
    lines, any_outlier = [f"GPU sniff test{' -- ' + tag if tag else ''}"], False
    for name, value in results:
        values = _gather(value)
        present = [v for v in values if not math.isnan(v)]
        if not present:
            continue
        median = _median(present)
        lines.append(f"  {name}: median={median:.3f} mean={sum(present) / len(present):.3f} "
                     f"min={min(present):.3f} max={max(present):.3f}")
        for i in find_outliers(values):
            any_outlier = True
            off = f" ({(values[i] - median) / median:+.1%})" if median else ""
            lines.append(f"    OUTLIER rank {i} ({hosts[i]}): {values[i]:.3f}{off}")
    lines.append("  Result: " + ("OUTLIERS DETECTED" if any_outlier else "ALL RANKS OK"))
    if rank0:
        print("\n".join(lines), flush=True)
    return any_outlier


def ffn_gemm_shapes(args) -> List[Tuple[int, int, int, str]]:
    """The model's MLP multiplies per micro-batch on one tensor-parallel rank."""
    hidden, ffn = args.hidden_size, args.ffn_hidden_size
    if hidden is None or ffn is None:
        return []
    tokens, tp = args.micro_batch_size * args.seq_length, args.tensor_model_parallel_size
    glu = 2 if args.swiglu else 1
    return [(tokens, ffn * glu // tp, hidden, "up-proj/fc1"),
            (tokens, hidden, ffn // tp, "down-proj/fc2")]


def run_sniff_test(args, pstate, tag: str = "") -> bool:
    """All five benchmarks on this rank, then the cross-rank report; every rank takes part."""
    sizes = dict(SIZES["cuda" if device.is_cuda() else "cpu"])
    results = bench_gemms(sizes, ffn_gemm_shapes(args))
    results += bench_collectives(sizes, dist.group.WORLD, pstate.tp_group,
                                 getattr(pstate, "ep_group", None))
    results += bench_sendrecv(sizes, pstate.dp_group)
    outliers = report(results, tag)
    dist.barrier()
    return outliers


def sniff_test_if_due(args, pstate, iteration: Optional[int] = None) -> Optional[bool]:
    """Run the test at start-up (``iteration`` None) and after every
    --gpu-sniff-test-interval-th iteration; returns whether it found outliers (None: not run)."""
    interval = args.gpu_sniff_test_interval
    if not interval or (iteration is not None and iteration % interval):
        return None
    return run_sniff_test(args, pstate, "startup" if iteration is None
                          else f"iteration {iteration:8d}")

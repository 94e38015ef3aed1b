"""Pipeline bubble of the 1F1B and interleaved schedules, measured, against (p-1)/m and (p-1)/(mv).

The bubble fraction is the idle time of a stage relative to its useful work:
``(T_pipeline - T_ideal) / T_ideal``, where ``T_ideal`` is the time the stage's own forwards and
backwards take back to back. Theory: ``(p - 1) / m`` for 1F1B and ``(p - 1) / (m v)`` with ``v``
virtual stages per rank (Narayanan et al., 2021), when communication is free.

Part 1 (``real``) runs the schedules of this project with the real gloo communicator in ``p``
processes on CPU. Every stage has the same fixed workload: ``--layers`` layers of
``tanh(x W)`` on ``[s, b, h]`` activations (one thread per process, no sleeping), split into
``v`` chunks with interleaving. ``T_pipeline`` is the slowest rank's time for one schedule call;
``T_ideal`` is the slowest rank's time to run the same forwards and backwards without a
pipeline (all ranks at once, so both see the same load). The two are measured side by side,
round-robin over the sizes, ``--repeats`` times; the table gives the minimum times and the
median of the per-pair bubble (the machine may be shared and its load change). Use ``p`` no larger
than the number of free cores; with fewer cores the stages share them and the idle time is
hidden.

Part 2 (``clock``) runs the same schedule code with every stage as a thread and a communicator
that keeps a virtual clock instead of moving data in real time: a forward costs ``1 / v`` units,
a backward ``2 / v``, a message completes when both sides have posted it. It measures the
schedule's structure alone, for any ``p``, independently of the machine.

Run::

    python benchmarks/bench_pipeline_bubble.py [--pp 2] [--microbatches 2 4 8 16]
        [--hidden 256] [--layers 8] [--repeats 5] [--clock-pp 2 4 8]
"""

import argparse
import datetime
import os
import queue
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

from megatron.core.pipeline_parallel import p2p_communication as p2p  # noqa: E402
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="stages (processes) of the real run")
    parser.add_argument("--vp", type=int, default=2, help="virtual stages per rank (interleaved)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="layers per stage (all chunks)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock-pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-clock", action="store_true")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------- the workload

class Chunk(torch.nn.Module):
    """``layers`` layers of ``tanh(x W)``; the first virtual stage reads its input from data."""

    def __init__(self, layers: int, hidden: int, pre_process: bool, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5)
             for _ in range(layers)])
        self.pre_process = pre_process
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.pre_process else self.input_tensor
        for w in self.weights:
            h = torch.tanh(h @ w)                                   # [s, b, h]
        return h


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)
    return out, lambda o: ((o * o).mean(), {})


def _ideal_once(chunks, m, shape) -> float:
    """Seconds for the rank's forwards and backwards of ``m`` micro-batches, no pipeline."""
    start = time.perf_counter()
    for chunk in chunks:
        for _ in range(m):
            x = torch.randn(shape, requires_grad=not chunk.pre_process)
            chunk.set_input_tensor(x)
            out = chunk(x)
            out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def _timed(group, fn) -> float:
    """Slowest rank's seconds for ``fn()``, all ranks starting together."""
    dist.barrier(group)
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _real_worker(rank, p, v, args, store_dir, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=p, timeout=datetime.timedelta(seconds=300))
    group = dist.new_group(list(range(p)))
    shape = (args.seq, args.micro_batch_size, args.hidden)
    per_chunk = args.layers // (v or 1)
    chunks = [Chunk(per_chunk, args.hidden, rank == 0 and c == 0, 10 * c + rank)
              for c in range(v or 1)]
    comm = p2p.P2PCommunicator(pp_group=group, pp_ranks=list(range(p)), pp_rank=rank,
                               dtype=torch.float32, device="cpu")
    schedule = get_forward_backward_func(p, v)
    sizes = [m for m in args.microbatches if v is None or m % p == 0]
    data = {m: [torch.randn(shape) for _ in range(m)] for m in sizes}

    def pipelined(m):
        schedule(forward_step_func=_forward_step,
                 data_iterator=[iter(data[m]) for _ in chunks], model=chunks,
                 num_microbatches=m, communicator=comm, tensor_shape=shape)

    # Round-robin over sizes and repeats, each pipelined run next to its unpipelined twin, so a
    # change in the machine's load hits both; the first round warms up.
    pairs = {m: [] for m in sizes}
    for rep in range(args.repeats + 1):
        for m in sizes:
            pipe = _timed(group, lambda: pipelined(m))
            ideal = _timed(group, lambda: _ideal_once(chunks, m, shape))
            if rep:
                pairs[m].append((pipe, ideal))
    out = {}
    for m, runs in pairs.items():
        ratios = sorted(pipe / ideal - 1 for pipe, ideal in runs)
        out[m] = (min(r[0] for r in runs), min(r[1] for r in runs), ratios[len(ratios) // 2])
    if rank == 0:
        results.update(out)
    dist.barrier(group)
    dist.destroy_process_group()


def run_real(args, v):
    """{m: (min T_pipeline, min T_ideal, median bubble)} from ``args.pp`` gloo processes."""
    with tempfile.TemporaryDirectory(prefix="bubble_") as store_dir:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_real_worker, args=(args.pp, v, args, store_dir, results), nprocs=args.pp,
                     join=True)
            return dict(results)


# ------------------------------------------------------------------------- the virtual clock

class ClockComm(p2p.P2PCommunicator):
    """Messages carry their sender's post time; an exchange ends when every partner posted."""

    def __init__(self, channels, lock, pp_rank, pp_size, stage):
        super().__init__(pp_group=None, pp_ranks=list(range(pp_size)), pp_rank=pp_rank,
                         dtype=torch.float32, device="cpu")
        self.channels, self.lock, self.stage = channels, lock, stage

    def _channel(self, key):
        with self.lock:
            return self.channels.setdefault(key, queue.Queue())

    def _exchange(self, send_next, send_prev, recv_prev, recv_next):
        now = self.stage.clock
        sends = [(self.next_rank, p2p.ACTIVATION_TAG, send_next),
                 (self.prev_rank, p2p.GRADIENT_TAG, send_prev)]
        recvs = [(self.prev_rank, p2p.ACTIVATION_TAG, recv_prev),
                 (self.next_rank, p2p.GRADIENT_TAG, recv_next)]
        boxes = []
        for peer, tag, tensor in sends:
            if tensor is not None:
                box = {"event": threading.Event()}
                self._channel((self.pp_rank, peer, tag)).put((now, box))
                boxes.append(box)
        end = now
        for peer, tag, buffer in recvs:
            if buffer is not None:
                sent_at, box = self._channel((peer, self.pp_rank, tag)).get(timeout=60)
                box["posted"] = now
                box["event"].set()
                end = max(end, sent_at)
        for box in boxes:
            if not box["event"].wait(60):
                raise TimeoutError("virtual-clock pipeline deadlocked")
            end = max(end, box["posted"])
        self.stage.clock = end


class _Cost(torch.autograd.Function):
    """Identity whose backward advances the stage clock by the backward cost."""

    @staticmethod
    def forward(ctx, x, stage, cost):
        ctx.stage, ctx.cost = stage, cost
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stage.clock += ctx.cost
        return grad, None, None


class ClockStage:
    def __init__(self, clock_channels, lock, r, p, v):
        self.clock = 0.0
        self.v = v or 1
        self.comm = ClockComm(clock_channels, lock, r, p, self)
        self.chunks = [Chunk(0, 1, r == 0 and c == 0, 0) for c in range(self.v)]
        self.param = torch.nn.Parameter(torch.ones(1))

    def forward_step(self, data_iterator, model):
        x = next(data_iterator)
        h = x if model.pre_process else model.input_tensor
        self.clock += 1.0 / self.v
        out = _Cost.apply(h * self.param, self, 2.0 / self.v)
        return out, lambda o: (o.sum(), {})


def run_clock(p, m, v) -> float:
    """Bubble fraction of the schedule on the virtual clock (forward 1, backward 2 per stage)."""
    channels, lock = {}, threading.Lock()
    stages = [ClockStage(channels, lock, r, p, v) for r in range(p)]
    schedule = get_forward_backward_func(p, v)
    errors = []

    def body(st):
        try:
            schedule(forward_step_func=st.forward_step,
                     data_iterator=[iter([torch.zeros(1)] * m) for _ in st.chunks],
                     model=st.chunks, num_microbatches=m, communicator=st.comm,
                     tensor_shape=(1,))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(st,)) for st in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ideal = 3.0 * m
    return (max(st.clock for st in stages) - ideal) / ideal


# ------------------------------------------------------------------------- report

def main(argv=None):
    args = get_args(argv)
    if not args.skip_clock:
        print("## Virtual clock (forward 1, backward 2 per stage; communication free)\n")
        print("| p | m | 1F1B bubble | (p-1)/m | interleaved v=2 | (p-1)/(2m) |")
        print("|---|---|---|---|---|---|")
        for p in args.clock_pp:
            for m in args.microbatches:
                one = run_clock(p, m, None)
                # Interleaving needs m to be a multiple of p.
                inter = f"{run_clock(p, m, 2):.3f}" if m % p == 0 else "-"
                print(f"| {p} | {m} | {one:.3f} | {(p - 1) / m:.3f} | {inter} | "
                      f"{(p - 1) / (2 * m):.3f} |", flush=True)
        print()
    if not args.skip_real:
        print(f"## Real gloo processes: p = {args.pp}, {args.layers} layers of "
              f"tanh(x W) per stage, [s, b, h] = [{args.seq}, {args.micro_batch_size}, "
              f"{args.hidden}], fp32, 1 thread each; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f} at start\n")
        print("| schedule | m | T_pipeline (ms) | T_ideal (ms) | bubble (median) | theory |")
        print("|---|---|---|---|---|---|")
        for name, v in (("1F1B", None), (f"interleaved v={args.vp}", args.vp)):
            results = run_real(args, v)
            for m in sorted(results):
                pipe, ideal, bubble = results[m]
                theory = (args.pp - 1) / (m * (v or 1))
                print(f"| {name} | {m} | {1e3 * pipe:.1f} | {1e3 * ideal:.1f} | "
                      f"{bubble:.3f} | {theory:.3f} |", flush=True)


if __name__ == "__main__":
    main()

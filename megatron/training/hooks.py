"""What the training loop does around each iteration besides training: profiling (--profile,
with --nvtx-ranges and --pytorch-profiler-collect-chakra), memory reports and snapshots
(--log-memory-interval, --record-memory-history), manual garbage collection (--manual-gc),
emptying the allocator cache (--empty-unused-memory-level) and the MoE routing trace
(--moe-routing-trace-path), at the points where Megatron does them."""

import gc
import os
import pickle
import resource
from typing import Dict

import torch

from megatron.core import device, host_memory
from megatron.model.moe.routing_trace import RoutingTracer


class IterationProfiler:
    """--profile on the ranks in --profile-ranks, over iterations [start, end).

    Iterations are counted from 0 at the start of this run's loop, as Megatron counts them.
    With --use-pytorch-profiler a ``torch.profiler`` trace of those iterations (Chrome trace
    json, ``*.pt.trace.json``) is written into --tensorboard-dir, where TensorBoard's profiler
    plugin finds it. Without it, the range is marked for nsys with cudaProfilerStart/Stop and
    NVTX ranges on GPUs; on CPU that has no effect, which one note says.
    """

    def __init__(self, args, rank: int, timers=None):
        self.active = bool(args.profile) and rank in args.profile_ranks
        self.start_step, self.end_step = args.profile_step_start, args.profile_step_end
        self.torch_profiler = None
        self.nvtx = None
        self.step_count = 0
        # --nvtx-ranges: one range per profiled iteration, and the timers' phases inside it.
        self.nvtx_ranges = self.active and args.nvtx_ranges and device.is_cuda()
        self.timers = timers
        self.iteration_range_open = False
        if not self.active:
            return
        if args.use_pytorch_profiler:
            start = self.start_step
            schedule = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                               active=self.end_step - start, repeat=1)
            self.torch_profiler = torch.profiler.profile(
                schedule=schedule, record_shapes=True, with_stack=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir),
                execution_trace_observer=_chakra_observer(args, rank))
            self.torch_profiler.start()
        elif not device.is_cuda():
            print(f"NOTE: --profile without --use-pytorch-profiler marks iterations "
                  f"{self.start_step}-{self.end_step} for nsys (cudaProfilerStart/Stop); on CPU "
                  "it has no effect. Add --use-pytorch-profiler for a trace.", flush=True)
            self.active = False

    def before_iteration(self) -> None:
        if self.active and self.torch_profiler is None and self.step_count == self.start_step:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()
        if self.nvtx_ranges and self.start_step <= self.step_count < self.end_step:
            torch.cuda.nvtx.range_push(f"iteration {self.step_count}")
            self.iteration_range_open = True
            if self.timers is not None:
                self.timers.nvtx = True

    def after_iteration(self) -> None:
        if not self.active:
            return
        self._close_iteration_range()
        self.step_count += 1
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.step_count == self.end_step:
            self._stop_nsys()

    def _close_iteration_range(self) -> None:
        if self.iteration_range_open:
            torch.cuda.nvtx.range_pop()
            self.iteration_range_open = False
            if self.timers is not None:
                self.timers.nvtx = False

    def _stop_nsys(self) -> None:
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
            torch.cuda.cudart().cudaProfilerStop()

    def close(self) -> None:
        """End of the loop (also an early exit): finish whatever is still recording."""
        self._close_iteration_range()
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        self._stop_nsys()


def _chakra_observer(args, rank: int):
    """--pytorch-profiler-collect-chakra: torch's execution trace of the profiled iterations,
    written where Megatron writes it (``<--tensorboard-dir>/../chakra/rank-<R>.json.gz``)."""
    if not args.pytorch_profiler_collect_chakra:
        return None
    folder = os.path.join(os.path.dirname(os.path.abspath(args.tensorboard_dir)), "chakra")
    os.makedirs(folder, exist_ok=True)
    return torch.profiler.ExecutionTraceObserver().register_callback(
        os.path.join(folder, f"rank-{rank}.json.gz"))


MB = 1024.0 * 1024.0


def memory_numbers(include_device_used: bool) -> Dict[str, float]:
    """This rank's memory in MB under the names of Megatron's report: the CUDA caching
    allocator's allocated / reserved bytes and their peaks; on CPU, where no allocator keeps
    such counts, the process's resident set for both and its peak resident set for both peaks.
    ``total device memory used``: the whole device's (other processes too); on CPU the
    machine's MemTotal - MemAvailable."""
    if device.is_cuda():
        out = {"allocated": torch.cuda.memory_allocated() / MB,
               "max allocated": torch.cuda.max_memory_allocated() / MB,
               "reserved": torch.cuda.memory_reserved() / MB,
               "max reserved": torch.cuda.max_memory_reserved() / MB}
        if include_device_used:
            free, total = torch.cuda.mem_get_info()
            out["total device memory used"] = (total - free) / MB
        return out
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB)
    out = {"allocated": rss, "max allocated": peak, "reserved": rss, "max reserved": peak}
    if include_device_used:
        out["total device memory used"] = _host_memory_used_mb()
    return out


def _host_memory_used_mb(path: str = "/proc/meminfo") -> float:
    fields = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024      # kB
    return (fields["MemTotal"] - fields["MemAvailable"]) / MB


class MemoryTools:
    """--log-memory-interval (with --log-device-memory-used) and --record-memory-history /
    --memory-snapshot-path, at Megatron's points: the history is recorded from before the model
    is built; the report after every --log-memory-interval-th iteration on each data-parallel
    rank 0; the snapshot by the last rank at every --log-interval (and after iteration 1)."""

    def __init__(self, args, dp_rank: int):
        self.args = args
        self.report = args.log_memory_interval is not None and dp_rank == 0
        self.snapshot = args.record_memory_history and args.rank == args.world_size - 1

    def report_line(self, iteration: int) -> str:
        args = self.args
        numbers = memory_numbers(args.log_device_memory_used)
        return (f"[Rank {args.rank}] (after {iteration} iterations) memory (MB)"
                + "".join(f" | {name}: {value:.2f}" for name, value in numbers.items()))

    def after_iteration(self, iteration: int) -> None:
        args = self.args
        if self.report and iteration % args.log_memory_interval == 0:
            print(self.report_line(iteration), flush=True)
        if self.snapshot and (iteration % args.log_interval == 0 or iteration == 1):
            write_snapshot(args.memory_snapshot_path)


def write_snapshot(path: str) -> None:
    """The CUDA allocator's state and recorded history, pickled (what memory_viz reads)."""
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


def start_memory_history(args) -> None:
    """--record-memory-history: record allocations and frees (with their Python stacks, up to
    100,000 events) from here on, and have a rank that runs out of memory write its snapshot
    to ``oom_rank-<R>_<--memory-snapshot-path>``."""
    if not args.record_memory_history:
        return
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=100000)
    folder, name = os.path.split(args.memory_snapshot_path)
    oom_path = os.path.join(folder, f"oom_rank-{args.rank}_{name}")

    def on_oom(_device, _alloc, _device_alloc, _device_free):
        print(f"out of device memory: writing the allocator snapshot to {oom_path}", flush=True)
        write_snapshot(oom_path)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)


class ManualGC:
    """--manual-gc: Python's automatic collector is off during training, and a full collection
    runs every --manual-gc-interval iterations (0: only once, at the start), so that every rank
    collects at the same iteration instead of stalling the others at random points; and, as in
    Megatron, around each evaluation in the loop unless --no-manual-gc-eval."""

    def __init__(self, args):
        self.enabled = bool(args.manual_gc)
        self.interval = args.manual_gc_interval
        self.around_eval = self.enabled and args.manual_gc_eval
        self.was_enabled = gc.isenabled()
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        """A full collection before an evaluation in the loop (off with --no-manual-gc-eval)."""
        if self.around_eval:
            gc.collect()

    def after_eval(self) -> None:
        """After it, only the youngest generation: what evaluation made and dropped."""
        if self.around_eval:
            gc.collect(generation=0)

    def close(self) -> None:
        if self.enabled and self.was_enabled:
            gc.enable()


def empty_unused_memory(args, level: int) -> None:
    """--empty-unused-memory-level: at ``level`` or above, hand unused cached memory back (1:
    after forward-backward and after each evaluation step, 2: also after the optimizer step):
    the CUDA caching allocator's unused blocks, or on CPU the free host memory the run keeps
    (:func:`megatron.core.host_memory.release_freed_memory`)."""
    if args.empty_unused_memory_level >= level:
        if device.is_cuda():
            device.empty_cache()
        else:
            host_memory.release_freed_memory()


def note_cpu_only_flags(args) -> None:
    """One note, on rank 0, for what the memory flag costs on CPU."""
    if args.empty_unused_memory_level and not device.is_cuda() and args.rank == 0:
        print(f"NOTE: --empty-unused-memory-level {args.empty_unused_memory_level}: on CPU the "
              "free host memory the run keeps goes back to the kernel at each of its points, "
              "and the next step takes it again one page fault at a time", flush=True)


class RoutingTrace:
    """--moe-routing-trace-path and its options: a
    :class:`~megatron.model.moe.routing_trace.RoutingTracer` on the model's routers from the
    start of training, advanced after each iteration's optimizer step; nothing when unset."""

    def __init__(self, args, model_chunks):
        self.tracer = None
        if args.moe_routing_trace_path:
            self.tracer = RoutingTracer(
                args.moe_routing_trace_path, args.rank,
                max_steps=args.moe_routing_trace_max_training_iters,
                capture_hidden_states=args.moe_routing_trace_capture_hidden_states,
                capture_logits=args.moe_routing_trace_capture_logits,
                dump_weights=args.moe_routing_trace_dump_weights)
            self.tracer.attach(model_chunks)

    def after_iteration(self) -> None:
        if self.tracer is not None:
            self.tracer.advance_step()

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()

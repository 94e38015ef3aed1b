"""What the training loop does around each iteration besides training: profiling (--profile),
manual garbage collection (--manual-gc) and emptying the allocator cache
(--empty-unused-memory-level), at the points where Megatron does them."""

import gc

import torch

from megatron.core import device


class IterationProfiler:
    """--profile on the ranks in --profile-ranks, over iterations [start, end).

    Iterations are counted from 0 at the start of this run's loop, as Megatron counts them.
    With --use-pytorch-profiler a ``torch.profiler`` trace of those iterations (Chrome trace
    json, ``*.pt.trace.json``) is written into --tensorboard-dir, where TensorBoard's profiler
    plugin finds it. Without it, the range is marked for nsys with cudaProfilerStart/Stop and
    NVTX ranges on GPUs; on CPU that has no effect, which one note says.
    """

    def __init__(self, args, rank: int):
        self.active = bool(args.profile) and rank in args.profile_ranks
        self.start_step, self.end_step = args.profile_step_start, args.profile_step_end
        self.torch_profiler = None
        self.nvtx = None
        self.step_count = 0
        if not self.active:
            return
        if args.use_pytorch_profiler:
            start = self.start_step
            schedule = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                               active=self.end_step - start, repeat=1)
            self.torch_profiler = torch.profiler.profile(
                schedule=schedule, record_shapes=True, with_stack=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir))
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

    def after_iteration(self) -> None:
        if not self.active:
            return
        self.step_count += 1
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.step_count == self.end_step:
            self._stop_nsys()

    def _stop_nsys(self) -> None:
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
            torch.cuda.cudart().cudaProfilerStop()

    def close(self) -> None:
        """End of the loop (also an early exit): finish whatever is still recording."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        self._stop_nsys()


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
    """--empty-unused-memory-level: at ``level`` or above, hand the CUDA caching allocator's
    unused blocks back (1: after forward-backward and after each evaluation step, 2: also after
    the optimizer step). CPU tensors are freed at once, so on CPU it has no effect."""
    if args.empty_unused_memory_level >= level:
        device.empty_cache()


def note_cpu_only_flags(args) -> None:
    """One note, on rank 0, for the memory flag that does nothing on CPU."""
    if args.empty_unused_memory_level and not device.is_cuda() and args.rank == 0:
        print(f"NOTE: --empty-unused-memory-level {args.empty_unused_memory_level} empties the "
              "CUDA caching allocator; on CPU it has no effect", flush=True)

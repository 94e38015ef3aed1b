"""Per-rank peak memory of tensors in real training runs, against megatron/training/memory_accounting.py.

Each layout runs ``pretrain()`` of ``pretrain_gpt.py`` in real gloo processes on CPU (fp32, and
one bf16 layout), ``--mock-data``, for ``--train-iters`` iterations, and compares every rank's
measured memory with :func:`megatron.training.memory_accounting.estimate_memory` of the same rank, in
its two parts:

* **weights + gradients + optimizer state**: the level after the first optimizer step (Adam's
  moments exist from then on; no activation is alive between iterations), minus the level just
  before the model was built, minus what building the data iterators added, minus the
  output layer's logits storage kept between iterations on CPU (activation memory);
* **activations**: the peak during the forward/backward schedule of each later iteration, minus
  the memory just before that schedule started (the largest over the iterations is reported).

Two probes, each in its own processes (so that neither disturbs the other):

* ``rss``: levels from the anonymous resident set (``RssAnon`` of ``/proc/self/status``; pages
  of mapped files such as the shared libraries a first kernel call pulls in are left out), peaks
  from ``VmHWM`` (the ``ru_maxrss`` of the process), which is reset before each schedule by
  writing ``5`` to ``/proc/self/clear_refs``. The children run with
  ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every block of 64 KiB or more with its own
  ``mmap`` and unmaps it on ``free``, so the resident set follows the live tensors (by default
  glibc raises that threshold, up to 32 MiB, each time it frees a large block, and later blocks
  below it stay in the heap after they die); and with ``MKL_DISABLE_FAST_MM=1``, so that MKL
  does not keep its matrix-multiply work buffers (8 MiB here) after the first iteration.
  Before the baseline each process builds a throw-away optimizer and runs one small matmul,
  which imports ``torch._dynamo`` (about 70 MiB of Python objects) and initialises the BLAS.
  What remains is not only tensors: the peak also holds BLAS work buffers and gloo's buffers.
* ``tensors``: levels are the bytes of the distinct storages of every tensor object alive in
  Python (a ``gc`` walk); peaks come from ``torch.profiler`` with ``profile_memory=True``,
  started before the model is built, whose allocation and free events of torch's CPU allocator
  are replayed in time order to give the live bytes of tensors at every instant. The profiler
  sees the events of the training thread only: a tensor freed by a gloo worker thread stays
  "alive" in the replay, which matters only for the peak within one schedule.

A third number explains the activations: the bytes of the distinct storages autograd saved for
backward during one micro-batch's forward (a ``saved_tensors_hooks`` census, parameters
excluded), next to the accounting's bytes for one micro-batch. The peak also holds what backward
creates on top of the saved tensors (gradients of activations; a weight's gradient before it is
added into the gradient buffer; the tied embedding's gradient from the output layer, kept until
the embedding's own backward adds to it), which the formula leaves out.

Run::

    python benchmarks/bench_memory.py [--layouts tp2 pp2 dp2 dp2-distopt ...]
    python benchmarks/bench_memory.py --layouts fsdp-dp1 fsdp-dp2 fsdp-dp4
        [--probes rss tensors] [--train-iters 3]
"""

import argparse
import datetime
import gc
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

MB = 1024 * 1024
# gloo's worker threads drop their reference to a collective's input a few milliseconds after
# the caller's wait returns (seen: the 44 MiB parameter shard of the distributed optimizer's
# all-gather); levels are read after this pause so that such a tensor is not counted.
SETTLE_S = 0.2
# Environment of the child processes (see the module docstring).
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}


@dataclass(frozen=True)
class Layout:
    """One run: its processes, the flags beyond the common ones and the global batch."""

    world_size: int
    flags: Tuple[str, ...]
    global_batch_size: int
    note: str


RECOMPUTE_FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")
LAYOUTS: Dict[str, Layout] = {
    "tp2": Layout(2, ("--tensor-model-parallel-size", "2"), 2, "TP=2, m=2"),
    "pp2": Layout(2, ("--pipeline-model-parallel-size", "2"), 4, "PP=2 1F1B, m=4"),
    "dp2": Layout(2, (), 4, "DP=2, m=2"),
    "dp2-distopt": Layout(2, ("--use-distributed-optimizer",), 4,
                          "DP=2, distributed optimizer, m=2"),
    "tp2-selective": Layout(2, ("--tensor-model-parallel-size", "2", "--recompute-granularity",
                                "selective"), 2, "TP=2, selective recompute, m=2"),
    "dp2-full": Layout(2, RECOMPUTE_FULL, 4, "DP=2, full recompute (uniform, 1 layer), m=2"),
    "dp2-bf16": Layout(2, ("--bf16",), 4, "DP=2, bf16, m=2"),
    "dp2-bf16-distopt": Layout(2, ("--bf16", "--use-distributed-optimizer"), 4,
                               "DP=2, bf16, distributed optimizer, m=2"),
    # FSDP2: one micro-batch per rank, so no whole gradient waits between micro-batches and
    # the level after the step is the sharded weights, gradients and moments alone.
    "fsdp-dp1": Layout(1, ("--use-torch-fsdp2",), 1, "FSDP2 DP=1, m=1"),
    "fsdp-dp2": Layout(2, ("--use-torch-fsdp2",), 2, "FSDP2 DP=2, m=1"),
    "fsdp-dp4": Layout(4, ("--use-torch-fsdp2",), 4, "FSDP2 DP=4, m=1"),
}
DEFAULT_LAYOUTS = ["tp2", "pp2", "dp2", "dp2-distopt", "tp2-selective", "dp2-full",
                   "dp2-bf16-distopt"]


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS))
    parser.add_argument("--probes", nargs="+", default=["rss", "tensors"],
                        choices=["rss", "tensors"])
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=3,
                        help="iteration 1 sets up the optimizer state; activations are "
                             "measured over iterations 2..N")
    return parser.parse_args(argv)


def training_flags(bench: argparse.Namespace, layout: Layout) -> List[str]:
    """The pretrain_gpt.py command line of one layout."""
    flags = f"""
    --num-layers {bench.num_layers} --hidden-size {bench.hidden_size}
    --num-attention-heads {bench.num_attention_heads} --seq-length {bench.seq_length}
    --max-position-embeddings {bench.seq_length} --micro-batch-size {bench.micro_batch_size}
    --global-batch-size {layout.global_batch_size * bench.micro_batch_size}
    --train-iters {bench.train_iters} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.1 --attention-dropout 0.1
    --log-interval 1 --eval-interval 1000 --eval-iters 0 --tokenizer-type NullTokenizer
    --vocab-size {bench.vocab_size} --mock-data --num-workers 0 --device cpu --seed 1234
    """.split()
    return flags + list(layout.flags)


# ------------------------------------------------------------------------- resident set

def _proc_status_mb() -> Dict[str, float]:
    """``VmRSS``, ``RssAnon`` and ``VmHWM`` of this process in MiB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "RssAnon:", "VmHWM:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0]) / 1024.0
    return values


def rss_mb() -> Dict[str, float]:
    """The resident set, all of it and its anonymous part (not the pages of mapped files such
    as shared libraries, which the first use of a kernel library pulls in)."""
    status = _proc_status_mb()
    return {"total": status["VmRSS"], "anon": status["RssAnon"]}


def reset_peak_rss() -> bool:
    """Set ``VmHWM`` (the process's ``ru_maxrss``) back to the current resident set."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    status = _proc_status_mb()
    return status["VmHWM"] <= status["VmRSS"] + 1.0


def peak_rss_mb() -> float:
    return _proc_status_mb()["VmHWM"]


# ------------------------------------------------------------------------- tensors

def kept_logits_mb() -> float:
    """MiB of the output layer's logits storage kept between iterations on CPU
    (:class:`~megatron.core.tensor_parallel.layers.ReusableOutputBuffer`): activation memory
    held on purpose, not weights, gradients or optimizer state."""
    from megatron.core.tensor_parallel.layers import ReusableOutputBuffer

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, ReusableOutputBuffer) and obj._storage is not None:
            storage = obj._storage.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / MB


def python_tensor_mb() -> float:
    """MiB of the distinct storages of every CPU tensor object alive in Python.

    Between iterations that is every tensor of the run: parameters (and the buffers they are
    views of), ``main_grad`` views of the gradient buffers, optimizer state, RNG states.
    """
    sizes = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            continue
    return sum(sizes.values()) / MB


class AllocationTrace:
    """Live bytes of torch's CPU allocator over time, from ``torch.profiler`` memory events.

    Moments are marked with ``record_function`` ranges named ``bench::<name>``; an allocation
    made before the profiler started and freed later is not reported by the profiler, so the
    curve counts only what was allocated after :meth:`start`.
    """

    def __init__(self):
        self.profiler = None
        self.times: List[int] = []
        self.live: List[int] = []
        self.marks: Dict[str, int] = {}

    def start(self) -> None:
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.start()
        self.mark("start")

    @staticmethod
    def mark(name: str) -> None:
        with torch.profiler.record_function(f"bench::{name}"):
            pass

    def stop(self) -> None:
        """Stop and replay the events into the (time, live bytes) curve."""
        self.profiler.stop()
        memory, live = [], 0
        for event in self.profiler.profiler.kineto_results.events():
            name = event.name()
            if name == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
                memory.append((event.start_ns(), event.nbytes()))
            elif name.startswith("bench::"):
                self.marks[name[len("bench::"):]] = event.start_ns()
        for when, nbytes in sorted(memory):
            live += nbytes
            self.times.append(when)
            self.live.append(live)
        self.profiler = None

    def live_at(self, mark: str) -> int:
        """Live bytes just before the mark."""
        when, live = self.marks[mark], 0
        for time_ns, value in zip(self.times, self.live):
            if time_ns >= when:
                break
            live = value
        return live

    def peak_between(self, first: str, last: str) -> int:
        peak = self.live_at(first)
        lo, hi = self.marks[first], self.marks[last]
        for time_ns, value in zip(self.times, self.live):
            if lo <= time_ns < hi:
                peak = max(peak, value)
        return peak


# ------------------------------------------------------------------------- hooks into pretrain()

@dataclass
class Probe:
    """Wraps steps of :func:`megatron.training.training.pretrain` to read memory at fixed moments.

    Moments: ``before_model`` (just before the model is built), ``data_start`` / ``data_end``
    (around the data iterators, built after the model), ``static_<i>`` (after iteration i's
    optimizer step), ``sched_start_<i>`` / ``sched_end_<i>`` (around iteration i's
    forward/backward schedule). ``kind`` is ``rss`` or ``tensors`` (see the module docstring).
    Only module attributes of ``megatron.training.training`` are replaced; the training code itself runs
    unchanged.
    """

    kind: str
    train_iters: int
    trace: Optional[AllocationTrace] = None
    levels: Dict[str, float] = field(default_factory=dict)
    rss_at: Dict[str, float] = field(default_factory=dict)
    kept: Dict[str, float] = field(default_factory=dict)
    peaks: Dict[int, float] = field(default_factory=dict)
    peak_reset_ok: bool = True
    iteration: int = 0
    num_parameters: int = 0
    param_storages: set = field(default_factory=set)
    saved_bytes: List[int] = field(default_factory=list)

    def mark(self, name: str, level: bool = False) -> None:
        """Note the moment; with ``level``, first let gloo's threads let go, then read the
        level of memory (anonymous resident set, or tensors alive in Python)."""
        if level:
            time.sleep(SETTLE_S)
            self.kept[name] = kept_logits_mb()
        if self.kind == "rss":
            status = rss_mb()
            self.levels[name], self.rss_at[name] = status["anon"], status["total"]
            return
        self.trace.mark(name)
        if level:
            self.levels[name] = python_tensor_mb()

    def install(self) -> None:
        from megatron.training import training

        setup, build_data = training.setup_model_and_optimizer, training.build_chunk_data_iterators
        train_step, get_schedule = training.train_step, training.get_forward_backward_func

        def setup_wrapper(*args, **kwargs):
            if self.kind == "tensors":
                self.trace = AllocationTrace()
                self.trace.start()
            self.mark("before_model", level=True)
            model, optimizer, scheduler = setup(*args, **kwargs)
            params = [p for chunk in model for p in chunk.parameters()]
            self.num_parameters = sum(p.numel() for p in params)
            # (an FSDP2 parameter is a DTensor: its storage is its local shard's)
            self.param_storages = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
                                   for p in params}
            return model, optimizer, scheduler

        def build_data_wrapper(*args, **kwargs):
            self.mark("data_start", level=True)
            iterators = build_data(*args, **kwargs)
            self.mark("data_end", level=True)
            return iterators

        def train_step_wrapper(*args, **kwargs):
            self.iteration += 1
            result = train_step(*args, **kwargs)
            self.mark(f"static_{self.iteration}", level=True)
            if self.iteration == self.train_iters and self.trace is not None:
                self.trace.stop()
            return result

        def get_schedule_wrapper(*args, **kwargs):
            return self._timed_schedule(get_schedule(*args, **kwargs))

        training.setup_model_and_optimizer = setup_wrapper
        training.build_chunk_data_iterators = build_data_wrapper
        training.train_step = train_step_wrapper
        training.get_forward_backward_func = get_schedule_wrapper

    def _timed_schedule(self, schedule):
        def run(**kwargs):
            i = self.iteration
            if self.kind == "rss":
                self.peak_reset_ok &= reset_peak_rss()
            self.mark(f"sched_start_{i}")
            out = schedule(**kwargs)
            if self.kind == "rss":
                self.peaks[i] = peak_rss_mb()
            self.mark(f"sched_end_{i}")
            return out
        return run

    def counted_forward_step(self, forward_step):
        """``forward_step`` that records the bytes of the storages autograd saves for backward."""
        def step(data_iterator, model):
            if not torch.is_grad_enabled():
                return forward_step(data_iterator, model)
            storages: Dict[int, int] = {}

            def pack(tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.param_storages:
                    storages[storage.data_ptr()] = storage.nbytes()
                # A detached alias: the same storage, but no reference back to its grad_fn.
                return tensor.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = forward_step(data_iterator, model)
            self.saved_bytes.append(sum(storages.values()))
            return out
        return step

    def measurements(self) -> Dict[str, float]:
        """Weights + grads + optimizer, activation peaks, drift of the static level, in MiB."""
        later = range(2, self.train_iters + 1)
        if self.kind == "tensors":
            acts = [(self.trace.peak_between(f"sched_start_{i}", f"sched_end_{i}")
                     - self.trace.live_at(f"sched_start_{i}")) / MB for i in later]
        elif self.peak_reset_ok:
            # VmHWM counts every resident page: compare it with the whole resident set.
            acts = [self.peaks[i] - self.rss_at[f"sched_start_{i}"] for i in later]
        else:
            acts = [float("nan")]
        level = self.levels
        data = level["data_end"] - level["data_start"]
        # The logits storage the output layer keeps from iteration 1 on is activation memory.
        return {"weights_opt": level["static_1"] - level["before_model"] - data
                - self.kept["static_1"],
                "activations": max(acts), "activations_min": min(acts), "data": data,
                "drift": level[f"static_{self.train_iters}"] - level["static_1"]}


# ------------------------------------------------------------------------- one rank

def theory(args, pp_rank: int, num_microbatches: int) -> Dict[str, float]:
    """The accounting's numbers for this rank, in MiB (and per micro-batch alive)."""
    from megatron.training.arguments import build_configs
    from megatron.training.memory_accounting import activation_bytes_on_rank, estimate_memory

    est = estimate_memory(args, pp_rank, num_microbatches)
    act_dtype = torch.float32 if args.fp32_residual_connection else args.params_dtype
    one = activation_bytes_on_rank(
        build_configs(args).model, micro_batch_size=args.micro_batch_size, num_microbatches=1,
        tp_size=args.tensor_model_parallel_size, pp_size=args.pipeline_model_parallel_size,
        pp_rank=pp_rank, vp_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        element_bytes=torch.tensor([], dtype=act_dtype).element_size())
    return {"num_parameters": est.num_parameters, "bytes_per_parameter": est.bytes_per_parameter,
            "weights_opt": est.weight_and_optimizer_bytes / MB,
            "activations": est.activation_bytes / MB, "per_microbatch": one / MB}


def warm_up_libraries() -> None:
    """Load what the first optimizer and the first matmul load, before the baseline is taken.

    Building the first torch optimizer imports ``torch._dynamo`` (about 70 MiB of Python
    objects); the first matmul and backward initialise the BLAS and the autograd engine. Neither
    is a tensor of the model.
    """
    weight = torch.nn.Parameter(torch.randn(64, 64))
    optimizer = torch.optim.AdamW([weight])
    (torch.randn(8, 64) @ weight).sum().backward()
    optimizer.step()


def _worker(rank, world_size, flags, probe_kind, train_iters, store_dir, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # The training log and the profiler's notices go to a file, shown only if a rank fails
    # (mp.spawn also passes a Python traceback to the parent).
    log = open(os.path.join(store_dir, f"log_rank{rank}.txt"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.core import device, parallel_state
    from megatron.training.training import pretrain

    device.configure("cpu")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=600))
    warm_up_libraries()
    probe = Probe(probe_kind, train_iters)
    probe.install()
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 None, probe.counted_forward_step(pretrain_gpt.forward_step), argv=flags)
        args, pstate = global_vars.get_args(), global_vars.get_parallel_state()
        num_microbatches = args.global_batch_size // (args.micro_batch_size
                                                      * args.data_parallel_size)
        results[(probe_kind, rank)] = {
            "ranks": (pstate.tp_rank, pstate.pp_rank, pstate.dp_rank),
            "measured": probe.measurements(), "theory": theory(args, pstate.pp_rank,
                                                               num_microbatches),
            "num_parameters": probe.num_parameters, "peak_reset_ok": probe.peak_reset_ok,
            "saved_per_microbatch": (min(probe.saved_bytes) / MB, max(probe.saved_bytes) / MB),
            "env": " ".join(f"{key}={os.environ.get(key)}" for key in CHILD_ENV),
        }
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def _print_logs(store_dir: str, world_size: int, lines: int = 30) -> None:
    for rank in range(world_size):
        path = os.path.join(store_dir, f"log_rank{rank}.txt")
        if os.path.exists(path):
            with open(path) as log:
                tail = log.readlines()[-lines:]
            print(f"--- rank {rank}, last lines of its log:\n{''.join(tail)}", file=sys.stderr)


def run_layout(bench, layout: Layout, probe_kind: str) -> Dict[int, dict]:
    """Every rank's results for one layout and probe; the children get the malloc setting."""
    flags = training_flags(bench, layout)
    saved = {key: os.environ.get(key) for key in CHILD_ENV}
    os.environ.update(CHILD_ENV)  # read by glibc and MKL as a child starts
    try:
        with tempfile.TemporaryDirectory(prefix="bench_memory_") as store_dir:
            with mp.Manager() as manager:
                results = manager.dict()
                try:
                    mp.spawn(_worker, args=(layout.world_size, flags, probe_kind,
                                            bench.train_iters, store_dir, results),
                             nprocs=layout.world_size, join=True)
                except Exception:
                    _print_logs(store_dir, layout.world_size)
                    raise
                return {rank: value for (_, rank), value in dict(results).items()}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ------------------------------------------------------------------------- report

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_header(bench) -> None:
    print(f"# Per-rank memory against megatron/training/memory_accounting.py "
          f"({datetime.date.today().isoformat()})\n")
    print(f"command: python {' '.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}")
    print(f"machine: {os.cpu_count()} CPUs ({_cpu_model()}), load average "
          f"{os.getloadavg()[0]:.1f} at start; torch {torch.__version__}, Python "
          f"{platform.python_version()}")
    print(f"model: GPT, {bench.num_layers} layers, h={bench.hidden_size}, "
          f"a={bench.num_attention_heads}, s={bench.seq_length}, b={bench.micro_batch_size}, "
          f"vocab {bench.vocab_size} (padded by the tokenizer), dropout 0.1, Adam; --mock-data, "
          f"--device cpu, 1 thread per rank, {bench.train_iters} iterations")
    print(f"children run with {' '.join(f'{k}={v}' for k, v in CHILD_ENV.items())}; probes: "
          f"{', '.join(bench.probes)}; MB = MiB")
    common = training_flags(bench, Layout(1, (), 1, ""))
    at = common.index("--global-batch-size")
    print(f"pretrain_gpt.py flags: {' '.join(common[:at] + common[at + 2:])}")
    for name in bench.layouts:
        layout = LAYOUTS[name]
        extra = " ".join((f"--global-batch-size "
                          f"{layout.global_batch_size * bench.micro_batch_size}",) + layout.flags)
        print(f"  {name} ({layout.note}): {layout.world_size} processes, {extra}")
    print(flush=True)


def _ratio(measured: Optional[float], expected: float) -> str:
    if measured is None or measured != measured or not expected:
        return "-"
    return f"{measured / expected:.3f}"


def _mb(value: Optional[float]) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def _rows(results: Dict[str, Dict[str, Dict[int, dict]]]):
    """(layout, rank, theory, {probe: measured}, census) for every rank of every layout."""
    for name, by_probe in results.items():
        any_probe = next(iter(by_probe.values()))
        for rank in sorted(any_probe):
            measured = {probe: runs[rank]["measured"] for probe, runs in by_probe.items()}
            yield name, rank, any_probe[rank], measured


def print_tables(results) -> None:
    print("## Weights + gradients + optimizer state (live after the first optimizer step)\n")
    print("| layout | rank (tp,pp,dp) | parameters | bytes/param | theory MB | RSS MB | ratio | "
          "tensors (gc) MB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rank, run, measured in _rows(results):
        th = run["theory"]
        rss, prof = measured.get("rss", {}), measured.get("tensors", {})
        params = (f"{th['num_parameters']:,}" if th["num_parameters"] == run["num_parameters"]
                  else f"{th['num_parameters']:,} (model {run['num_parameters']:,})")
        print(f"| {name} | {rank} {run['ranks']} | {params} | {th['bytes_per_parameter']:.2f} | "
              f"{th['weights_opt']:.1f} | {_mb(rss.get('weights_opt'))} | "
              f"{_ratio(rss.get('weights_opt'), th['weights_opt'])} | "
              f"{_mb(prof.get('weights_opt'))} | "
              f"{_ratio(prof.get('weights_opt'), th['weights_opt'])} |")
    print("\n## Activations (peak of the forward/backward schedule minus the memory before it)\n")
    print("| layout | rank (tp,pp,dp) | theory MB | RSS MB | ratio | tensors (profiler) MB | "
          "ratio | theory MB / micro-batch | saved for backward MB / micro-batch | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rank, run, measured in _rows(results):
        th = run["theory"]
        rss, prof = measured.get("rss", {}), measured.get("tensors", {})
        saved = run["saved_per_microbatch"][1]
        print(f"| {name} | {rank} {run['ranks']} | {th['activations']:.1f} | "
              f"{_mb(rss.get('activations'))} | "
              f"{_ratio(rss.get('activations'), th['activations'])} | "
              f"{_mb(prof.get('activations'))} | "
              f"{_ratio(prof.get('activations'), th['activations'])} | "
              f"{th['per_microbatch']:.1f} | {saved:.1f} | {_ratio(saved, th['per_microbatch'])} |")
    print()


def print_checks(results) -> None:
    """Sanity numbers: drift between iterations, data iterators, the spread over iterations."""
    print("## Checks\n")
    print("| layout | rank | probe | static drift iter 1 -> N MB | data iterators MB | "
          "activations min..max over iterations 2..N MB | peak reset | environment |")
    print("|---|---|---|---|---|---|---|---|")
    for name, by_probe in results.items():
        for probe, runs in by_probe.items():
            for rank in sorted(runs):
                m = runs[rank]["measured"]
                print(f"| {name} | {rank} | {probe} | {m['drift']:+.1f} | {m['data']:+.1f} | "
                      f"{_mb(m['activations_min'])}..{_mb(m['activations'])} | "
                      f"{runs[rank]['peak_reset_ok'] if probe == 'rss' else '-'} | "
                      f"{runs[rank]['env']} |")
    print()


def main(argv=None):
    bench = get_args(argv)
    print_header(bench)
    results: Dict[str, Dict[str, Dict[int, dict]]] = {}
    for name in bench.layouts:
        layout = LAYOUTS[name]
        results[name] = {}
        for probe in bench.probes:
            start = time.perf_counter()
            results[name][probe] = run_layout(bench, layout, probe)
            print(f"[{name} ({layout.note}), {probe}: {time.perf_counter() - start:.0f} s]",
                  file=sys.stderr, flush=True)
    print_tables(results)
    print_checks(results)


if __name__ == "__main__":
    main()

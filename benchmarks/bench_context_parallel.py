"""Context parallelism on CPU: activation memory per rank at CP 1, 2, 4 next to
megatron/training/memory_accounting.py, and training throughput at CP = 2 against one rank.

One small GPT (``--layers`` layers, hidden ``--hidden``, ``--heads`` heads, fp32, dropout 0,
micro-batch 1) at sequence ``--seq`` (8192 by default) runs forward and backward on each layout
in real gloo processes (one intra-op thread each, so every layout uses one core per rank):

* **memory**: per rank, the bytes of the distinct storages autograd holds for backward at the
  end of one forward (a ``saved_tensors_hooks`` census, parameters excluded), the peak of the bytes
  torch's allocator holds during one forward + backward above what it held before (every
  allocation and free of the step, from the torch profiler's memory events, summed in order:
  the rank's own tensors, unaffected by what glibc keeps or returns), and the accounting's
  activation bytes for one micro-batch
  (:func:`~megatron.training.memory_accounting.activation_bytes_on_rank`, 4-byte elements);
* **throughput**: tokens of the whole sequence per second of forward + backward (fastest of
  ``--repeats``), and the share of that time spent inside context parallelism's exchanges
  (the ring's ``_shift`` or a2a's all-to-all, timed in the training thread: on CPU they are
  blocking, so this includes waiting for the partner rank).

Run::

    python benchmarks/bench_context_parallel.py [--seq 8192] [--layers 2] [--hidden 64]
        [--heads 4] [--repeats 3] [--record]
"""

import argparse
import datetime
import os
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MB = 1024 * 1024


def peak_allocated_bytes(fn) -> int:
    """The most bytes torch's allocator held above its level at the start while ``fn()``
    ran: the running sum of the profiler's allocation (+) and free (-) events, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    if not events:
        raise RuntimeError("the torch profiler recorded no memory events")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def _config(a):
    from megatron.core.config import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        padded_vocab_size=128, max_position_embeddings=a.seq, seq_length=a.seq,
        hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
        cp_comm_type=a.comm)


def _worker(rank, world, store_path, a, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=20))
    from megatron.core import context_parallel as cpmod
    from megatron.core import parallel_state
    from megatron.core.context_parallel import split_for_cp_rank
    from megatron.model import GPTModel
    from megatron.training import memory_accounting as ma

    pstate = parallel_state.initialize_model_parallel(context_parallel_size=world)
    config = _config(a)
    model = GPTModel(config, pstate, init_seed=1234)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 128, (1, a.seq + 1), generator=gen)
    tokens = split_for_cp_rank(text[:, :-1], 1, world, pstate.cp_rank)
    labels = split_for_cp_rank(text[:, 1:], 1, world, pstate.cp_rank)
    comm = {"s": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                comm["s"] += time.perf_counter() - start
        return wrapper

    cpmod._shift = timed(cpmod._shift)
    cpmod._all_to_all = timed(cpmod._all_to_all)

    def step():
        loss = model(tokens, None, None, labels=labels).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: first-call allocations, BLAS initialisation
    dist.barrier()
    peak = peak_allocated_bytes(step)
    times = []
    for _ in range(a.repeats):
        dist.barrier()
        comm["s"] = 0.0
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start, comm["s"]))
    best = min(times)
    # Last: this forward has no backward (the output layer's reused logits storage then stays
    # taken), and nothing else runs after it.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []

    def pack(t):
        # Not ``t`` itself: a saved output holding its own grad_fn is a reference cycle that
        # would keep the whole graph alive after ``del loss``.
        kept = t.detach()
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            packed.append((weakref.ref(kept), storage.data_ptr(), storage.nbytes()))
        return kept

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None, None, labels=labels).sum()
    # Only what the finished graph still holds: a node that dies during the forward (the
    # attention's detached row maxima) frees what it saved.
    saved = {ptr: nbytes for ref, ptr, nbytes in packed if ref() is not None}
    del loss
    accounted = ma.activation_bytes_on_rank(config, micro_batch_size=1, num_microbatches=1,
                                            element_bytes=4, cp_size=world)
    out[rank] = (sum(saved.values()), peak, accounted, best[0], best[1])
    dist.barrier()
    dist.destroy_process_group()


def run_layout(cp: int, a) -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = ctx.Manager().dict()
        procs = [ctx.Process(target=_worker, args=(r, cp, os.path.join(tmp, "store"), a, out))
                 for r in range(cp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"CP={cp}: a rank failed ({[p.exitcode for p in procs]})")
        return [out[r] for r in range(cp)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--comm", default="p2p", choices=["p2p", "all_gather", "a2a"])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    from record import recording

    with recording(a.record, "Context parallelism (bench_context_parallel.py)"):
        print(f"GPT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, rope, fp32, "
              f"sequence {a.seq}, micro-batch 1, --cp-comm-type {a.comm}; one thread per rank")
        print()
        print("| CP | saved for backward / rank (MB) | peak allocated in fwd+bwd / rank (MB) | "
              "accounting / rank (MB) | saved / CP=1 | accounting / CP=1 | "
              "fwd+bwd (s) | tokens/s | vs one rank | communication share |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        first = None
        for cp in a.cp_sizes:
            rows = run_layout(cp, a)
            saved = max(r[0] for r in rows)
            peak = max(r[1] for r in rows)
            accounted = rows[0][2]
            step = max(r[3] for r in rows)
            comm = max(r[4] for r in rows)
            tps = a.seq / step
            if first is None:
                first = (saved, accounted, tps)
            print(f"| {cp} | {saved / MB:.1f} | {peak / MB:.1f} | {accounted / MB:.1f} | "
                  f"{saved / first[0]:.3f} | {accounted / first[1]:.3f} | {step:.3f} | "
                  f"{tps:.0f} | {tps / first[2]:.2f}x | {comm / step:.1%} |", flush=True)


if __name__ == "__main__":
    main()

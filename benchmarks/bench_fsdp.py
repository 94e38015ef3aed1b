"""Fully sharded data parallelism (FSDP2) against plain data parallelism on CPU: the parameter,
gradient and optimizer-state memory each rank holds, and the time per iteration.

Each layout runs ``pretrain()`` of ``pretrain_gpt.py`` in real gloo processes (fp32, Adam,
``--mock-data``), at data-parallel 1, 2 and 4, once with ``--use-torch-fsdp2`` and once with
the grad-buffer wrapper (plain DP). After the last iteration's optimizer step every rank counts
the bytes it holds, each storage once:

* **parameters**: the local shard of each parameter (the whole parameter under plain DP);
* **gradients**: the local shard of each ``param.grad`` (under plain DP the gradient buffer
  behind ``main_grad``);
* **optimizer state**: every tensor in the torch optimizer's ``state`` (Adam's two moments and
  its step counters), local shards only.

That sum is set beside :func:`megatron.training.memory_accounting.estimate_memory`'s
weights + gradients + optimizer bytes of the same rank (parameters x bytes per parameter: 16
under plain DP, 16 / DP under FSDP2), and the process's peak resident set is shown for context
(it also holds the interpreter, libraries, activations and communication buffers). The global
batch is one micro-batch per rank, so FSDP2 never keeps a whole gradient between micro-batches
(the accounting's ``accumulates`` term is 0). The largest rank is reported: FSDP2 splits each
tensor's first dimension into equal rows, padding the last rank's shard.

The time per iteration is the median of the iterations after ``--warmup``, as the training
loop's ``train_step`` takes it on rank 0 (wall clock: it depends on what else the machine runs).

Run::

    python benchmarks/bench_fsdp.py [--quick] [--record]
"""

import argparse
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import record  # noqa: E402

MB = 1024 * 1024
TARGET = 0.10   # the per-rank memory must be within 10% of the accounting


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3,
                        help="iterations left out of the time per iteration")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, DP 1 and 2, 3 iterations: checks the script runs")
    parser.add_argument("--record", action="store_true",
                        help="append the output to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.dp_sizes, args.num_layers, args.hidden_size = [1, 2], 2, 64
        args.num_attention_heads, args.seq_length, args.vocab_size = 2, 32, 512
        args.train_iters, args.warmup = 3, 1
    if args.warmup >= args.train_iters:
        parser.error(f"--warmup ({args.warmup}) must be below --train-iters "
                     f"({args.train_iters})")
    return args


def training_flags(bench: argparse.Namespace, dp_size: int, fsdp: bool) -> List[str]:
    """The pretrain_gpt.py command line of one layout."""
    flags = f"""
    --num-layers {bench.num_layers} --hidden-size {bench.hidden_size}
    --num-attention-heads {bench.num_attention_heads} --seq-length {bench.seq_length}
    --max-position-embeddings {bench.seq_length} --micro-batch-size {bench.micro_batch_size}
    --global-batch-size {bench.micro_batch_size * dp_size}
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --train-iters {bench.train_iters} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --log-interval 1000 --eval-interval 1000
    --eval-iters 0 --tokenizer-type NullTokenizer --vocab-size {bench.vocab_size} --mock-data
    --num-workers 0 --device cpu --seed 1234
    """.split()
    return flags + (["--use-torch-fsdp2"] if fsdp else [])


# ------------------------------------------------------------------------- in each rank

def _local(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core.distributed.torch_fsdp2 import local_tensor

    return local_tensor(tensor)


def _count(tensors, seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which takes them)."""
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def held_bytes(model, optimizer) -> Dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage once."""
    params = [p for chunk in model for p in chunk.parameters()]
    seen: set = set()
    counted = {"params": _count(params, seen)}
    grads = [p.grad for p in params if p.grad is not None]
    grads += [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    counted["grads"] = _count(grads, seen)
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    states = [v for state in torch_optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    counted["optimizer"] = _count(states, seen)
    return counted


def _install_probe(found: dict) -> None:
    """Time every ``train_step`` and count the held bytes after the last one."""
    from megatron.training import training

    setup, train_step = training.setup_model_and_optimizer, training.train_step

    def setup_wrapper(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        found["model"], found["optimizer"] = model, optimizer
        return model, optimizer, scheduler

    def train_step_wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = train_step(*args, **kwargs)
        found["times"].append(time.perf_counter() - start)
        found["held"] = held_bytes(found["model"], found["optimizer"])
        return result

    training.setup_model_and_optimizer = setup_wrapper
    training.train_step = train_step_wrapper


def _accounting(args) -> Tuple[int, float]:
    from megatron.training.memory_accounting import estimate_memory

    est = estimate_memory(args, 0, args.global_batch_size // (args.micro_batch_size
                                                              * args.data_parallel_size))
    return est.num_parameters, est.weight_and_optimizer_bytes


def _worker(rank, world_size, flags, store_dir, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    log = open(os.path.join(store_dir, f"log_rank{rank}.txt"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import pretrain_gpt
    from megatron.core import device, parallel_state
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    device.configure("cpu")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=600))
    found = {"times": []}
    _install_probe(found)
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 None, pretrain_gpt.forward_step, argv=flags)
        num_parameters, estimate = _accounting(global_vars.get_args())
        results[rank] = {"held": found["held"], "times": found["times"],
                         "num_parameters": num_parameters, "estimate": estimate,
                         "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def run_layout(bench, dp_size: int, fsdp: bool) -> Dict[int, dict]:
    """Every rank's results for one layout."""
    flags = training_flags(bench, dp_size, fsdp)
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as store_dir:
        with mp.Manager() as manager:
            results = manager.dict()
            try:
                mp.spawn(_worker, args=(dp_size, flags, store_dir, results), nprocs=dp_size,
                         join=True)
            except Exception:
                for rank in range(dp_size):
                    path = os.path.join(store_dir, f"log_rank{rank}.txt")
                    if os.path.exists(path):
                        with open(path) as f:
                            print(f"--- rank {rank}:\n{''.join(f.readlines()[-30:])}",
                                  file=sys.stderr)
                raise
            return dict(results)


# ------------------------------------------------------------------------- report

def summarise(ranks: Dict[int, dict], warmup: int) -> dict:
    """The largest rank's held bytes, its parts, the accounting, peak RSS and the time."""
    largest = max(ranks.values(), key=lambda r: sum(r["held"].values()))
    held = sum(largest["held"].values())
    return {"held": held, "parts": largest["held"], "estimate": largest["estimate"],
            "num_parameters": largest["num_parameters"],
            "peak_rss": max(r["peak_rss"] for r in ranks.values()),
            "ratio": held / largest["estimate"],
            "iteration_s": statistics.median(ranks[0]["times"][warmup:])}


def print_tables(bench, rows: Dict[Tuple[str, int], dict]) -> bool:
    """The memory and time tables; True when every FSDP2 layout meets the target."""
    print("\n| layout | DP | params MiB | grads MiB | optimizer MiB | held MiB (largest rank) | "
          "accounting MiB | held / accounting | held x DP / held at DP 1 | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for (kind, dp), row in sorted(rows.items()):
        base = rows.get((kind, 1))
        scale = f"{row['held'] * dp / base['held']:.3f}" if base else "n/a"
        parts = row["parts"]
        print(f"| {kind} | {dp} | {parts['params'] / MB:.2f} | {parts['grads'] / MB:.2f} | "
              f"{parts['optimizer'] / MB:.2f} | {row['held'] / MB:.2f} | "
              f"{row['estimate'] / MB:.2f} | {row['ratio']:.3f} | {scale} | "
              f"{row['peak_rss'] / MB:.0f} |")
        if kind == "FSDP2" and abs(row["ratio"] - 1) > TARGET:
            ok = False
    print("\n| DP | plain DP s/iteration | FSDP2 s/iteration | FSDP2 / plain |")
    print("|---|---|---|---|")
    for dp in bench.dp_sizes:
        plain, fsdp = rows[("plain DP", dp)], rows[("FSDP2", dp)]
        print(f"| {dp} | {plain['iteration_s']:.3f} | {fsdp['iteration_s']:.3f} | "
              f"{fsdp['iteration_s'] / plain['iteration_s']:.2f}x |")
    verdict = "meets" if ok else "MISSES"
    print(f"\n# FSDP2 per-rank parameter+gradient+optimizer memory {verdict} the target: within "
          f"{TARGET:.0%} of the accounting at every DP size")
    return ok


def main(argv=None) -> int:
    bench = get_args(argv)
    with record.recording(bench.record, "FSDP2 memory and speed (bench_fsdp.py)"):
        print(f"# model: {bench.num_layers} layers, hidden {bench.hidden_size}, "
              f"{bench.num_attention_heads} heads, seq {bench.seq_length}, vocab "
              f"{bench.vocab_size}, micro-batch {bench.micro_batch_size} (one per rank), fp32 "
              f"Adam, {bench.train_iters} iterations ({bench.warmup} warm-up)")
        rows = {}
        for dp in bench.dp_sizes:
            for kind, fsdp in (("plain DP", False), ("FSDP2", True)):
                rows[(kind, dp)] = summarise(run_layout(bench, dp, fsdp), bench.warmup)
                print(f"# {kind} DP={dp}: held {rows[(kind, dp)]['held'] / MB:.2f} MiB on the "
                      f"largest rank, {rows[(kind, dp)]['iteration_s']:.3f} s/iteration",
                      flush=True)
        ok = print_tables(bench, rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

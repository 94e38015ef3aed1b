"""Save and load time, peak memory per rank and bytes on disk: ``--ckpt-format torch`` against
``--ckpt-format torch_dist``, side by side in one run.

The model is a GPT of about 355M parameters (24 layers, hidden 1024, 16 heads, GPT-2's
50,257-token vocabulary, sequence 1024), fp32, on 2 gloo ranks on CPU at TP=2: each rank holds
half of the weights, of the gradient buffer and of the Adam moments (about 2.8 GiB), so the two
ranks together stay near 6 GiB before a save or load adds its own. ``--small`` runs a tiny model
instead (a dry run of every phase in seconds).

Every phase runs in 2 fresh processes (``tests/multiprocess.py``): each builds the model and
optimizer as ``pretrain_gpt.py`` does (``parse_args``, ``validate_args``,
``initialize_megatron``, ``build_tokenizer``, ``build_configs``, ``setup_model_and_optimizer``;
``--mock-data``, no data is read), and

* ``save``: fills random gradients and takes one real optimizer step (so the Adam moments exist
  and are not zero), then times ``megatron.checkpoint.load.save_checkpoint`` of iteration 1;
* ``load``: times ``megatron.checkpoint.load.load_checkpoint`` of that checkpoint into the freshly
  built model and optimizer, and checks that the weights are those saved (same layout) and that
  the Adam state arrived.

The extra row loads the TP=2 ``torch_dist`` checkpoint at TP=1 x DP=2 with the distributed
optimizer (each rank then holds the whole model and half the moments); ``torch`` files cannot
load at another layout without ``tools/checkpoint/convert.py``.

Time is the slowest rank's, from a barrier to the call's return. Memory: ``VmHWM`` is reset
(``5`` into ``/proc/self/clear_refs``) just before the call, so "peak" is the resident set's
high-water mark during the call alone, and "extra" is that peak minus the resident set at the
call's start. Children run with ``MALLOC_MMAP_THRESHOLD_=65536`` (as ``bench_memory.py``), so
freed large blocks leave the resident set. Each measurement is repeated (``--repeats``, default
3; the order of the formats alternates between repeats) and reported as fastest and median; the
load average is logged with every result. The checkpoint just written is in the page cache when
it is loaded, so loads measure reading from memory, not from the disk.

Run::

    python benchmarks/bench_checkpoint_formats.py [--repeats 3] [--small] [--record]
"""

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import record  # noqa: E402

MB = 1024 * 1024
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}
FORMATS = ("torch", "torch_dist")
# (label, TP size, flags beyond the model's) of the layout saved and of the other one loaded.
SAVE_LAYOUT = ("TP=2", 2, [])
CROSS_LAYOUT = ("TP=1 x DP=2, distributed optimizer", 1, ["--use-distributed-optimizer"])


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257, help="the tokenizer's size")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true",
                        help="a tiny model (2 layers, hidden 64): a dry run of every phase")
    parser.add_argument("--skip-cross-layout", action="store_true",
                        help="leave out the torch_dist load at TP=1 x DP=2")
    parser.add_argument("--workdir", default=None, help="default: a temporary folder, removed")
    parser.add_argument("--record", action="store_true",
                        help="append the output to benchmarks/RESULTS.md")
    opts = parser.parse_args(argv)
    if opts.small:
        # 300 tokens: padded to 384, so padding rows exist at both layouts.
        opts.layers, opts.hidden, opts.heads, opts.vocab, opts.seq = 2, 64, 2, 300, 32
    return opts


def model_flags(opts, fmt: str, tp: int, extra=()) -> List[str]:
    """The pretrain_gpt.py flags of the model at one layout (no data is read).

    The vocabulary is padded to a multiple of 128 at every TP size (``128 // tp`` x TP): a
    checkpoint loads only into the padded vocabulary size it was saved with.
    """
    flags = f"""
    --num-layers {opts.layers} --hidden-size {opts.hidden} --num-attention-heads {opts.heads}
    --seq-length {opts.seq} --max-position-embeddings {opts.seq} --micro-batch-size 1
    --global-batch-size 2 --train-iters 100 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --tokenizer-type NullTokenizer
    --vocab-size {opts.vocab - 1} --make-vocab-size-divisible-by {128 // tp}
    --tensor-model-parallel-size {tp} --mock-data
    --num-workers 0 --device cpu --seed 1234 --ckpt-format {fmt}
    """.split()
    return flags + list(extra)


# ------------------------------------------------------------------------- in each rank

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _fill_adam_state(model, optimizer, scheduler, args):
    """Random gradients and one real optimizer step: the moments exist and are not zero.
    Returns the train state of that one iteration.

    Every rank draws the same gradients, so that the weights TP ranks both hold stay equal, as
    after a real all-reduced step (``torch_dist`` writes such a weight once, from TP rank 0).
    """
    from megatron.training.train_state import TrainState

    generator = torch.Generator().manual_seed(1000)
    for chunk in model:
        for param in chunk.module.parameters():
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            if grad is None:
                param.grad = grad = torch.zeros_like(param)
            grad.copy_(torch.randn(grad.shape, generator=generator) * 1e-3)
    optimizer.step()
    scheduler.step(args.global_batch_size)
    return TrainState(iteration=1, consumed_train_samples=args.global_batch_size)


def _param_checksum(model) -> float:
    return float(sum(p.detach().double().sum() for c in model for p in c.module.parameters()))


def _adam_state_count(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(1 for state in inner.state.values() if "exp_avg_sq" in state)


def phase(kind: str, flags: List[str], ckpt_dir: str, log_path: str) -> Dict:
    """Rank body: build the model and optimizer, then time one save or load of ``ckpt_dir``."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.tokenizer import build_tokenizer
    from megatron.training.training import setup_model_and_optimizer

    log = open(log_path, "w")
    os.dup2(log.fileno(), 1)
    sys.stdout = log
    where = ["--save", ckpt_dir] if kind == "save" else ["--load", ckpt_dir]
    args = validate_args(parse_args(argv=flags + where))
    pstate = initialize_megatron(args)
    try:
        tokenizer = build_tokenizer(args)
        build_configs(args)
        global_vars.set_global_variables(args=args, tokenizer=tokenizer, parallel_state=pstate)
        model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider,
                                                                args, pstate)
        if kind == "save":
            train_state = _fill_adam_state(model, optimizer, scheduler, args)
        gc.collect()
        dist.barrier()
        rss_before = _status_kb("VmRSS")
        _reset_peak_rss()
        start = time.perf_counter()
        if kind == "save":
            checkpointing.save_checkpoint(1, model, optimizer, scheduler, args, pstate,
                                          train_state=train_state)
            iteration = 1
        else:
            iteration = checkpointing.load_checkpoint(model, optimizer, scheduler, args, pstate)
        seconds = time.perf_counter() - start
        peak = _status_kb("VmHWM")
        return {"seconds": seconds, "rss_before": rss_before * 1024, "peak": peak * 1024,
                "iteration": iteration, "checksum": _param_checksum(model),
                "adam_states": _adam_state_count(optimizer)}
    finally:
        global_vars.unset_global_variables()
        log.flush()


# ------------------------------------------------------------------------- the driver

def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_phase(kind: str, flags: List[str], ckpt_dir: str, log_dir: str, label: str) -> List[Dict]:
    from tests.multiprocess import run_on_ranks

    load = _load_average()
    log_path = os.path.join(log_dir, f"{label.replace(' ', '_')}_rank%d.log")
    saved = {key: os.environ.get(key) for key in CHILD_ENV}
    os.environ.update(CHILD_ENV)
    try:
        ranks = run_on_ranks(_phase_of_rank, 2, kind, flags, ckpt_dir, log_path, timeout=1800)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    seconds = max(r["seconds"] for r in ranks)
    peaks = " / ".join(f"{r['peak'] / MB:.0f}" for r in ranks)
    print(f"#   {label}: {seconds:.2f} s, peak RSS per rank {peaks} MiB "
          f"(load average {load})", flush=True)
    return ranks


def _phase_of_rank(kind, flags, ckpt_dir, log_path):
    return phase(kind, flags, ckpt_dir, log_path % torch.distributed.get_rank())


def bytes_on_disk(ckpt_dir: str) -> int:
    iter_dir = os.path.join(ckpt_dir, "iter_0000001")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(iter_dir)
               for f in files)


def _check_load(saved: List[Dict], loaded: List[Dict], same_layout: bool, what: str) -> None:
    for rank, out in enumerate(loaded):
        if out["iteration"] != 1 or out["adam_states"] == 0:
            raise SystemExit(f"{what}: rank {rank} loaded iteration {out['iteration']} with "
                             f"{out['adam_states']} Adam states; expected iteration 1 with state")
        if same_layout and out["checksum"] != saved[rank]["checksum"]:
            raise SystemExit(f"{what}: rank {rank}'s weights after the load sum to "
                             f"{out['checksum']!r}, the saved ones to {saved[rank]['checksum']!r}")


def measure(opts, workdir: str) -> Dict[str, List[List[Dict]]]:
    """Every repeat of every phase: {row name: [ranks' results per repeat]}."""
    log_dir = os.path.join(workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    results: Dict[str, List[List[Dict]]] = {}
    for repeat in range(opts.repeats):
        order = FORMATS if repeat % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            ckpt = os.path.join(workdir, fmt)
            shutil.rmtree(ckpt, ignore_errors=True)
            flags = model_flags(opts, fmt, SAVE_LAYOUT[1])
            saved = run_phase("save", flags, ckpt, log_dir, f"round {repeat + 1} {fmt} save")
            loaded = run_phase("load", flags, ckpt, log_dir, f"round {repeat + 1} {fmt} load")
            _check_load(saved, loaded, True, f"{fmt} at {SAVE_LAYOUT[0]}")
            results.setdefault(f"{fmt} save", []).append(saved)
            results.setdefault(f"{fmt} load", []).append(loaded)
            results.setdefault(f"{fmt} bytes", []).append(bytes_on_disk(ckpt))
        if not opts.skip_cross_layout:
            flags = model_flags(opts, "torch_dist", CROSS_LAYOUT[1], CROSS_LAYOUT[2])
            cross = run_phase("load", flags, os.path.join(workdir, "torch_dist"), log_dir,
                              f"round {repeat + 1} torch_dist load at TP=1 x DP=2")
            _check_load([], cross, False, f"torch_dist at {CROSS_LAYOUT[0]}")
            results.setdefault("torch_dist cross load", []).append(cross)
    return results


def _times(runs: List[List[Dict]]) -> List[float]:
    return [max(r["seconds"] for r in ranks) for ranks in runs]


def _median_per_rank(runs: List[List[Dict]], key) -> List[float]:
    return [statistics.median(key(ranks[rank]) for ranks in runs) for rank in range(2)]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report(results: Dict, opts) -> None:
    rows = []  # (what, torch value, torch_dist value, torch number, torch_dist number)
    for kind in ("save", "load"):
        t = _times(results[f"torch {kind}"])
        d = _times(results[f"torch_dist {kind}"])
        rows.append((f"{kind} time, fastest", f"{min(t):.2f} s", f"{min(d):.2f} s",
                     min(t), min(d)))
        rows.append((f"{kind} time, median", f"{statistics.median(t):.2f} s",
                     f"{statistics.median(d):.2f} s", statistics.median(t),
                     statistics.median(d)))
        for name, key in (("peak RSS", lambda r: r["peak"]),
                          ("extra over start", lambda r: r["peak"] - r["rss_before"])):
            t = _median_per_rank(results[f"torch {kind}"], key)
            d = _median_per_rank(results[f"torch_dist {kind}"], key)
            rows.append((f"{kind} {name}, rank 0 / rank 1 (median)",
                         f"{t[0] / MB:.0f} / {t[1] / MB:.0f} MiB",
                         f"{d[0] / MB:.0f} / {d[1] / MB:.0f} MiB", max(t), max(d)))
    t, d = results["torch bytes"][-1], results["torch_dist bytes"][-1]
    rows.append(("bytes on disk", f"{t / MB:.0f} MiB", f"{d / MB:.0f} MiB", t, d))
    print()
    print("| what | torch | torch_dist | torch_dist / torch |")
    print("|---|---|---|---|")
    for what, tv, dv, tn, dn in rows:
        print(f"| {what} | {tv} | {dv} | {_ratio(dn, tn)} |")
    if "torch_dist cross load" in results:
        runs = results["torch_dist cross load"]
        c = _times(runs)
        peak = _median_per_rank(runs, lambda r: r["peak"])
        extra = _median_per_rank(runs, lambda r: r["peak"] - r["rss_before"])
        same = _times(results["torch_dist load"])
        print()
        print("| torch_dist saved at TP=2, loaded at | load fastest | load median | "
              "peak RSS rank 0 / 1 | extra rank 0 / 1 | fastest / same-layout load |")
        print("|---|---|---|---|---|---|")
        print(f"| {CROSS_LAYOUT[0]} | {min(c):.2f} s | {statistics.median(c):.2f} s | "
              f"{peak[0] / MB:.0f} / {peak[1] / MB:.0f} MiB | "
              f"{extra[0] / MB:.0f} / {extra[1] / MB:.0f} MiB | {_ratio(min(c), min(same))} |")
    print()
    print("Time: slowest rank, barrier to return; fastest and median of "
          f"{opts.repeats}. Peak RSS: VmHWM during the call (reset just before); extra: peak "
          "minus the resident set at the call's start. Ratios of memory rows: larger rank.")


def main(argv=None) -> None:
    opts = get_args(argv)
    with record.recording(opts.record, "Checkpoint formats (bench_checkpoint_formats.py)"):
        workdir = opts.workdir or tempfile.mkdtemp(prefix="bench_ckpt_formats_")
        try:
            params = _param_count(opts)
            print(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} | {os.cpu_count()} cores | torch "
                  f"{torch.__version__} | load average at start {_load_average()}")
            print(f"# GPT {params / 1e6:.0f}M parameters ({opts.layers} layers, hidden "
                  f"{opts.hidden}, {opts.heads} heads, vocab {opts.vocab}, seq {opts.seq}), "
                  f"fp32 weights and Adam moments, saved at {SAVE_LAYOUT[0]} on 2 gloo ranks, "
                  f"1 thread per rank; {opts.repeats} rounds; checkpoints in {workdir}")
            results = measure(opts, workdir)
            print(f"# load average at end {_load_average()}")
            report(results, opts)
        finally:
            if opts.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)


def _param_count(opts) -> int:
    """Parameters of the whole model (vocabulary padded to a multiple of 128)."""
    h, layers = opts.hidden, opts.layers
    vocab = -(-opts.vocab // 128) * 128
    per_layer = 12 * h * h + 13 * h
    return vocab * h + opts.seq * h + layers * per_layer + 2 * h


if __name__ == "__main__":
    main()

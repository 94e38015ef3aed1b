"""Scaling on CPU: one GPT and one global batch trained under (TP, PP, DP) = (1,1,1) ... (1,1,2).

Every run is the real ``pretrain_gpt.py`` under ``torchrun``: the same model (same flags, same
seed, the padded vocabulary identical in every layout), the same global batch, fp32, dropout 0,
``--mock-data``. The single-process run gets all the cores as threads (2 on the project VM);
each parallel layout runs 2 processes x 1 thread. The script checks that every layout's
first-iteration loss matches the single process's (the layouts train the same model on the same
data) before it reports a speed.

Throughput: the layouts run alternately, ``--repeats`` times each, every run a fresh process
group; a run's time per iteration is the median of the ``elapsed time per iteration`` log lines
after ``--warmup`` iterations; the table shows the median over runs (and all runs).
tokens/s = global batch x seq length / time per iteration (the whole job, not per device).
The machine may be shared: each run starts only once other programs have used fewer than
``--quiet-cores`` cores over ``--quiet-window`` s (default 5; waiting at most ``--quiet-wait``
s), and the script reports, per run, the cores other programs used while it ran (machine busy
time from /proc/stat minus this run's own CPU time, over its wall time). Two threads of one
process suffer more from such sharing than two one-thread processes (every OpenMP region waits
for its slowest thread), so only runs with that number near 0 compare the layouts fairly.

Communication share: each layout runs once more under ``benchmarks/scaling_probe.py`` (the same
``pretrain_gpt.py``, with every torch.distributed call timed at run time, see that file). Counted
per rank, over the iterations after warm-up:

- blocked in communication = time the training thread spends inside a torch.distributed call
  (collective, broadcast, barrier, point-to-point) plus inside ``wait()`` of an asynchronous
  request. Time an asynchronous all-reduce spends in gloo's own thread while the training
  thread computes is NOT counted (it is hidden), except as the CPU it takes from the compute;
- share = blocked / iteration wall time;
- of a collective's blocked time, "waiting for peers" is the part before the last rank of its
  group entered the same call (for an asynchronous one: before the last rank launched it); the
  rest is "transfer" (the collective running with every rank present: gloo's copies, sums and
  socket traffic). Ranks' clocks are the machine's one monotonic clock. Point-to-point waits
  (pipeline) are not split: they are mostly the other stage still computing (the bubble).

``--profile-ops`` layouts also run one iteration after the measured ones under torch.profiler
(that iteration is left out of the communication numbers) and print per-op self CPU times next
to the single process's.

Run::

    python benchmarks/bench_scaling.py [--layers 6] [--hidden 512] [--heads 8] [--seq 512]
        [--micro-batch 2] [--global-batch 8] [--iters 5] [--warmup 2] [--repeats 3]
        [--layouts 1,1,1 2,1,1 1,2,1 1,1,2 (suffix +sp, +distopt, +overlap: add
        --sequence-parallel, --use-distributed-optimizer, --overlap-grad-reduce)]
        [--skip-probe] [--profile-ops 1,1,1 2,1,1] [--quiet-cores 0.25] [--quiet-wait 600]
        [--quiet-window 5]
"""

import argparse
import collections
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
ITER_RE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                     r"lm loss: ([\d.E+-]+)")
TP_SITE_HINT = {
    "mappings.py:_reduce": "TP all-reduce, forward (row-parallel output, embedding)",
    "layers.py:backward": "TP all-reduce, backward (column-parallel input grad, async)",
    "data.py:broadcast_data": "TP broadcast of the batch",
    "data.py:_broadcast_shapes": "TP broadcast of the batch's shapes",
    "ops.py:forward": "TP all-reduces of the vocab-parallel cross entropy (max, sums)",
    "finalize_model_grads.py:_allreduce_word_embedding_grads":
        "PP all-reduce of the tied embedding's gradient",
    "clip_grads.py:_all_reduce": "gradient norm all-reduce",
    "p2p_communication.py:_exchange": "PP send/recv (includes the bubble)",
    "grad_buffer.py:start_grad_sync": "DP gradient all-reduce",
    "grad_buffer.py:finish_grad_sync": "DP gradient all-reduce",
    "pretrain_gpt.py:loss_func": "DP loss average (logging)",
}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    threads: int
    options: tuple = ()

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        return f"({self.tp},{self.pp},{self.dp})" + "".join(f"+{o}" for o in self.options)

    @property
    def flags(self) -> list:
        return [OPTION_FLAGS[o] for o in self.options]


# Layout suffixes (``2,1,1+sp``) and the pretrain_gpt.py flag each adds.
OPTION_FLAGS = {"sp": "--sequence-parallel", "distopt": "--use-distributed-optimizer",
                "overlap": "--overlap-grad-reduce"}


def parse_layout(text: str, cores: int) -> Layout:
    sizes, *options = text.split("+")
    try:
        tp, pp, dp = (int(x) for x in sizes.split(","))
    except ValueError:
        raise SystemExit(f"--layouts: expected TP,PP,DP[+option...] such as 2,1,1 or 2,1,1+sp, "
                         f"got {text!r}")
    unknown = [o for o in options if o not in OPTION_FLAGS]
    if unknown:
        raise SystemExit(f"--layouts {text}: unknown option(s) {unknown}; known: "
                         f"{sorted(OPTION_FLAGS)}")
    return Layout(tp, pp, dp, max(1, cores // (tp * pp * dp)), tuple(options))


def pretrain_flags(a, layout: Layout) -> list:
    """The run's flags: identical model and global batch in every layout."""
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
            f"--seq-length {a.seq} --max-position-embeddings {a.seq} "
            f"--micro-batch-size {a.micro_batch} --global-batch-size {a.global_batch} "
            f"--tensor-model-parallel-size {layout.tp} "
            f"--pipeline-model-parallel-size {layout.pp} "
            f"--train-iters {a.iters} --lr 1e-4 --lr-warmup-iters 1 --log-interval 1 "
            f"--eval-iters 0 --eval-interval 100000 --mock-data --tokenizer-type NullTokenizer "
            # NullTokenizer adds one EOD id: vocab-size V - 1 gives V ids; divisible-by 64
            # keeps the padded size V under TP = 1 and 2 (Megatron pads to 64 x TP).
            f"--vocab-size {a.vocab - 1} --make-vocab-size-divisible-by 64 "
            f"--hidden-dropout 0 --attention-dropout 0 "
            f"--device cpu --seed 1234 --num-workers 0").split() + layout.flags + list(a.extra)


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)     # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(a) -> float:
    """Wait (up to --quiet-wait s) until other programs use under --quiet-cores cores, averaged
    over --quiet-window s; returns what they used in the last window."""
    deadline = time.monotonic() + a.quiet_wait
    while True:
        busy, start = _busy_cpu_s(), time.monotonic()
        time.sleep(a.quiet_window)
        others = (_busy_cpu_s() - busy) / (time.monotonic() - start)
        if others < a.quiet_cores or time.monotonic() > deadline:
            return others


def _launch(a, layout: Layout, script: str, env_extra: dict):
    """Run ``script`` under torchrun; returns its stdout and how undisturbed the run was:
    ``others_cores`` = CPU used by other programs during the run / its wall time."""
    quiet_before = wait_for_quiet(a)
    env = dict(os.environ, OMP_NUM_THREADS=str(layout.threads), **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={layout.nproc}", script] + pretrain_flags(a, layout)
    load, busy, mine, start = (os.getloadavg()[0], _busy_cpu_s(), _children_cpu_s(),
                               time.monotonic())
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    cpu = _children_cpu_s() - mine
    if out.returncode != 0:
        raise SystemExit(f"run {layout.name} failed: {' '.join(cmd)}\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout, {"load": load, "quiet_before": quiet_before, "cpu_s": cpu,
                        "others_cores": max(0.0, (_busy_cpu_s() - busy - cpu) / wall)}


def _iterations(a, layout: Layout, stdout: str):
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in map(ITER_RE.search, stdout.splitlines()) if m]
    if len(rows) != a.iters:
        raise SystemExit(f"run {layout.name}: expected {a.iters} iteration lines, got "
                         f"{len(rows)}:\n{stdout[-3000:]}")
    return rows


def run_plain(a, layout: Layout) -> dict:
    """One ``pretrain_gpt.py`` run: median ms/iteration after warm-up, the losses, and how
    disturbed the run was (see :func:`_launch`)."""
    stdout, stats = _launch(a, layout, os.path.join(ROOT, "pretrain_gpt.py"), {})
    rows = _iterations(a, layout, stdout)
    times = [t for it, t, _ in rows if it > a.warmup]
    return dict(stats, ms=statistics.median(times), losses=[loss for _, _, loss in rows])


def run_probe(a, layout: Layout, profile: bool) -> list:
    """One run under scaling_probe.py; returns each rank's records."""
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        env = {"SCALING_PROBE_DIR": tmp,
               "SCALING_PROBE_PROFILE_STEP": str(a.iters if profile else 0)}
        _, stats = _launch(a, layout, os.path.join(ROOT, "benchmarks", "scaling_probe.py"), env)
        records = []
        for rank in range(layout.nproc):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                records.append(json.load(f))
    return records, stats


# ---- analysis of the probe records ---------------------------------------------------------

def _kept_steps(record: dict, warmup: int) -> dict:
    return {step: (t0, t1) for step, t0, t1 in record["steps"]
            if step > warmup and step != record["profiled_step"]}


def _peer_wait(records: list, warmup: int) -> list:
    """Per rank, per call index: seconds of that call spent before the last peer arrived."""
    # Entry k of (op, group) on one rank is entry k on every rank of the group.
    arrivals = collections.defaultdict(dict)   # (op, group, k) -> {rank: t_enter}
    per_rank_keys = []
    for record in records:
        counts = collections.Counter()
        keys = []
        for op, ranks, seq, t0, t1, step, site in record["calls"]:
            base = op.split(".")[0]
            if op.endswith(".wait") or base in ("isend", "irecv", "batch_isend_irecv", "send",
                                                "recv"):
                keys.append(None)
                continue
            key = (base, tuple(ranks), counts[(base, tuple(ranks))])
            counts[(base, tuple(ranks))] += 1
            arrivals[key][record["rank"]] = t0
            keys.append(key)
        per_rank_keys.append(keys)
    # Launch times of asynchronous calls, to split their waits: seq -> key on this rank.
    result = []
    for record, keys in zip(records, per_rank_keys):
        launch_key = {call[2]: key for call, key in zip(record["calls"], keys)
                      if key is not None and call[0].endswith(".launch")}
        waits = []
        for (op, ranks, seq, t0, t1, step, site), key in zip(record["calls"], keys):
            if op.endswith(".wait"):
                key = launch_key.get(seq)
            last = None
            if key is not None and len(arrivals[key]) == len(key[1]):
                last = max(arrivals[key].values())
            waits.append(None if last is None else min(max(0.0, last - t0), t1 - t0))
        result.append(waits)
    return result


def _site_name(site: str) -> str:
    return TP_SITE_HINT.get(site, site)


def analyse(records: list, warmup: int) -> dict:
    """Communication time per rank over the kept iterations (see the module docstring)."""
    peer_waits = _peer_wait(records, warmup)
    ranks = []
    for record, waits in zip(records, peer_waits):
        kept = _kept_steps(record, warmup)
        wall = sum(t1 - t0 for t0, t1 in kept.values())
        blocked = peer = unsplit = 0.0
        by_site, peer_by_site = collections.Counter(), collections.Counter()
        for (op, group, seq, t0, t1, step, site), wait in zip(record["calls"], waits):
            if step not in kept:
                continue
            blocked += t1 - t0
            by_site[(_site_name(site), op)] += t1 - t0
            if wait is None:
                unsplit += t1 - t0
            else:
                peer += wait
                peer_by_site[(_site_name(site), op)] += wait
        n = max(1, len(kept))
        ranks.append({"rank": record["rank"], "iters": len(kept), "wall_ms": wall / n * 1e3,
                      "blocked_ms": blocked / n * 1e3, "peer_ms": peer / n * 1e3,
                      "unsplit_ms": unsplit / n * 1e3,
                      "sites": {f"{s} [{op}]": v / n * 1e3 for (s, op), v in by_site.items()},
                      "sites_peer": {f"{s} [{op}]": v / n * 1e3
                                     for (s, op), v in peer_by_site.items()}})
    return {"ranks": ranks}


# ---- reporting -----------------------------------------------------------------------------

def _first_losses_agree(results: dict, reference: Layout) -> None:
    ref = results[reference][0]["losses"][0]
    for layout, runs in results.items():
        loss = runs[0]["losses"][0]
        if abs(loss - ref) > 1e-4 * abs(ref):
            raise SystemExit(f"layout {layout.name}: first-iteration loss {loss:.6E} differs "
                             f"from {reference.name}'s {ref:.6E}: not the same model and batch")


def print_throughput(a, results: dict, comm: dict, base: Layout) -> None:
    tokens = a.global_batch * a.seq
    base_ms = statistics.median(r["ms"] for r in results[base])
    print("| (TP,PP,DP) | processes x threads | ms/iter | tokens/s | vs (1,1,1) "
          "| comm share | waiting for peers | transfer | pt-to-pt (unsplit) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, runs in results.items():
        ms = statistics.median(r["ms"] for r in runs)
        row = (f"| {layout.name} | {layout.nproc} x {layout.threads} | {ms:.0f} | "
               f"{tokens / ms * 1e3:.0f} | {base_ms / ms:.2f}x |")
        if layout in comm:
            ranks = comm[layout]["ranks"]
            share = [r["blocked_ms"] / r["wall_ms"] for r in ranks]
            peer = [r["peer_ms"] / r["wall_ms"] for r in ranks]
            unsplit = [r["unsplit_ms"] / r["wall_ms"] for r in ranks]
            transfer = [s - p - u for s, p, u in zip(share, peer, unsplit)]

            def pct(values):
                return "/".join(f"{100 * v:.1f}%" for v in values)

            row += f" {pct(share)} | {pct(peer)} | {pct(transfer)} | {pct(unsplit)} |"
        else:
            row += " | | | |"
        print(row)
    print(f"# per-rank percentages are rank 0/rank 1 of the probe run; all runs (ms/iter): " +
          "; ".join(f"{l.name} " + " ".join(f"{r['ms']:.0f}" for r in runs)
                    for l, runs in results.items()))
    print("# CPU seconds of each whole run (all processes, start-up included): " +
          "; ".join(f"{l.name} " + " ".join(f"{r['cpu_s']:.0f}" for r in runs)
                    for l, runs in results.items()))
    print("# cores used by other programs during each run: " +
          "; ".join(f"{l.name} " + " ".join(f"{r['others_cores']:.2f}" for r in runs)
                    for l, runs in results.items()))
    print("# load average (1 min) at each run's start: " +
          "; ".join(f"{l.name} " + " ".join(f"{r['load']:.1f}" for r in runs)
                    for l, runs in results.items()))


def print_comm_detail(comm: dict) -> None:
    for layout, info in comm.items():
        print(f"\n{layout.name}: probe run, ms per iteration per rank "
              f"(iterations kept: {info['ranks'][0]['iters']})")
        sites = sorted({s for r in info["ranks"] for s in r["sites"]},
                       key=lambda s: -max(r["sites"].get(s, 0.0) for r in info["ranks"]))
        header = " | ".join(f"rank {r['rank']}" for r in info["ranks"])
        print(f"| what | {header} |")
        print("|---|" + "---|" * len(info["ranks"]))
        rows = [("iteration (wall)", "wall_ms"), ("blocked in communication", "blocked_ms"),
                ("  of which waiting for peers", "peer_ms"),
                ("  of which point-to-point (unsplit)", "unsplit_ms")]
        for label, key in rows:
            print(f"| {label} | " + " | ".join(f"{r[key]:.1f}" for r in info["ranks"]) + " |")
        print("| compute and everything else (wall - blocked) | " + " | ".join(
            f"{r['wall_ms'] - r['blocked_ms']:.1f}" for r in info["ranks"]) + " |")
        for s in sites:
            cells = []
            for r in info["ranks"]:
                cell = f"{r['sites'].get(s, 0.0):.1f}"
                if s in r["sites_peer"]:
                    cell += f" (peers {r['sites_peer'][s]:.1f})"
                cells.append(cell)
            print(f"| {s} | " + " | ".join(cells) + " |")


def print_op_tables(op_tables: dict, base: Layout, top: int) -> None:
    if base not in op_tables:
        return
    for layout, tables in op_tables.items():
        if layout == base:
            continue
        ref = {e["name"]: e for e in op_tables[base][0]}
        mine = {e["name"]: e for e in tables[0]}
        names = sorted(set(ref) | set(mine), key=lambda n: -max(
            ref.get(n, {}).get("self_ms", 0.0), mine.get(n, {}).get("self_ms", 0.0)))
        print(f"\nself CPU ms of one profiled iteration: {base.name} vs {layout.name} rank 0")
        print(f"| op | {base.name} | {layout.name} r0 | calls {base.name} / {layout.name} |")
        print("|---|---|---|---|")
        for n in names[:top]:
            r, m = ref.get(n, {}), mine.get(n, {})
            print(f"| {n} | {r.get('self_ms', 0):.1f} | {m.get('self_ms', 0):.1f} | "
                  f"{r.get('count', 0)} / {m.get('count', 0)} |")
        print(f"| total | {sum(e['self_ms'] for e in ref.values()):.1f} | "
              f"{sum(e['self_ms'] for e in mine.values()):.1f} | |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304, help="padded vocabulary size")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,1", "1,2,1", "1,1,2"])
    p.add_argument("--skip-probe", action="store_true", help="throughput only")
    p.add_argument("--quiet-cores", type=float, default=0.25,
                   help="start a run only once other programs use fewer cores than this")
    p.add_argument("--quiet-wait", type=float, default=600.0,
                   help="longest wait (s) for that before starting anyway")
    p.add_argument("--quiet-window", type=float, default=5.0,
                   help="seconds over which other programs' CPU use is averaged before each "
                   "run (at least one window is always measured)")
    p.add_argument("--profile-ops", nargs="*", default=["1,1,1", "2,1,1"],
                   help="layouts whose probe run also profiles one iteration's ops")
    p.add_argument("--top-ops", type=int, default=25)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--record", action="store_true",
                   help="append the output to benchmarks/RESULTS.md as a dated section")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    a = p.parse_args()
    layouts = [parse_layout(t, a.cores) for t in a.layouts]
    base = layouts[0]
    profiled = {parse_layout(t, a.cores) for t in a.profile_ops}
    if a.warmup >= a.iters - (1 if profiled else 0):
        raise SystemExit(f"--warmup {a.warmup} leaves no measured iteration of --iters {a.iters}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from record import recording

    with recording(a.record, "Scaling on CPU (bench_scaling.py)"):
        run(a, layouts, base, profiled)


def run(a, layouts, base, profiled) -> None:
    """Measure every layout and print the tables (see the module docstring)."""
    import torch

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')} | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
          f"torch {torch.__version__} | load average {os.getloadavg()[0]:.2f}")
    print("# " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    print("# flags: " + " ".join(pretrain_flags(a, base)))
    results = {layout: [] for layout in layouts}
    for repeat in range(a.repeats):
        for layout in layouts:
            results[layout].append(run_plain(a, layout))
            r = results[layout][-1]
            print(f"# run {repeat + 1}/{a.repeats} {layout.name}: {r['ms']:.0f} ms/iter (other "
                  f"programs used {r['others_cores']:.2f} cores)", file=sys.stderr, flush=True)
    _first_losses_agree(results, base)
    comm, op_tables = {}, {}
    if not a.skip_probe:
        for layout in layouts:
            records, stats = run_probe(a, layout, layout in profiled)
            print(f"# probe run {layout.name} done (other programs used "
                  f"{stats['others_cores']:.2f} cores)", file=sys.stderr, flush=True)
            comm[layout] = dict(analyse(records, a.warmup), **stats)
            if layout in profiled:
                op_tables[layout] = [r["op_table"] for r in records]
    print(f"\nmodel: {a.layers} layers, h {a.hidden}, {a.heads} heads, s {a.seq}, vocab {a.vocab}, "
          f"micro-batch {a.micro_batch}, global batch {a.global_batch}, fp32, dropout 0; "
          f"median of {a.repeats} runs, each the median of iterations {a.warmup + 1}-{a.iters}")
    print_throughput(a, results, comm, base)
    print_comm_detail(comm)
    print_op_tables(op_tables, base, a.top_ops)
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": {l.name: r for l, r in results.items()},
                       "comm": {l.name: c for l, c in comm.items()},
                       "ops": {l.name: t for l, t in op_tables.items()}}, f, indent=1)


if __name__ == "__main__":
    main()

"""Page faults per CPU training step, with freed host memory kept in the process or not.

``megatron/core/host_memory.py`` keeps freed host memory in a CPU run's process (glibc's trim and
mmap thresholds); ``MEGATRON_KEEP_FREED_HOST_MEMORY=0`` leaves glibc's default policy. This runs
``bench_peers.py``'s GPT (same flags, one process, ``--threads`` threads) both ways, alternating
over ``--repeats`` rounds, and prints per step: wall time, minor page faults (the kernel's count,
``getrusage``), system and user CPU time. The losses of both ways are printed too: the setting
moves no number.

Run::

    python benchmarks/bench_host_memory.py [--repeats 2] [--iters 4] [--warmup 2] [--record]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TAG = "HOST_MEMORY_STEPS "


def child(flags: list) -> None:
    """Train in this process, printing each step's counters as one JSON line."""
    import resource
    import time

    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import pretrain_gpt
    import megatron.training.training as training

    original, steps = training.train_step, []

    def counted(*args, **kwargs):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        result = original(*args, **kwargs)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"wall_ms": (time.perf_counter() - t0) * 1e3,
                      "faults": r1.ru_minflt - r0.ru_minflt,
                      "sys_ms": (r1.ru_stime - r0.ru_stime) * 1e3,
                      "user_ms": (r1.ru_utime - r0.ru_utime) * 1e3,
                      "loss": float(result[0].get("lm loss", float("nan")))})
        return result

    training.train_step = counted
    training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, None, pretrain_gpt.forward_step, argv=flags)
    print(TAG + json.dumps(steps), flush=True)


def run(a, keep: bool) -> list:
    sys.path.insert(0, HERE)
    import bench_peers

    env = dict(bench_peers._child_env(a), MEGATRON_KEEP_FREED_HOST_MEMORY="1" if keep else "0")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--"] + bench_peers.ours_flags(
        a, [])
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_host_memory.py: the training run failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(TAG))
    return json.loads(line[len(TAG):])[a.warmup:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--iters", type=int, default=4, help="counted steps per run")
    p.add_argument("--warmup", type=int, default=2, help="uncounted steps per run")
    p.add_argument("--repeats", type=int, default=2, help="rounds of alternating runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--record", action="store_true", help="append the output to RESULTS.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.ours_extra = ""
    if a.child:
        child([f for f in a.rest if f != "--"])
        return
    sys.path.insert(0, HERE)
    from record import recording

    with recording(a.record, "Host memory kept between steps (bench_host_memory.py)"):
        print(f"# {a.layers} layers, h {a.hidden}, {a.heads} heads, s {a.seq}, "
              f"b {a.micro_batch}, V {a.vocab}, fp32, {a.threads} threads, {a.warmup} warm-up + "
              f"{a.iters} counted steps per run, {a.repeats} rounds")
        steps = {"kept": [], "glibc default": []}
        losses = {}
        for round_ in range(a.repeats):
            for name in (("kept", "glibc default") if round_ % 2 == 0
                         else ("glibc default", "kept")):
                rows = run(a, keep=name == "kept")
                steps[name] += rows
                losses.setdefault(name, [r["loss"] for r in rows])
                print(f"#   round {round_ + 1} {name}: faults per step "
                      f"{[r['faults'] for r in rows]}, wall ms "
                      f"{[round(r['wall_ms']) for r in rows]}", flush=True)
        print()
        print("| host memory | steps | page faults / step (median, max) | system ms / step "
              "(median) | user ms / step (median) | wall ms / step (median) |")
        print("|---|---|---|---|---|---|")
        for name, rows in steps.items():
            def med(key):
                return statistics.median(r[key] for r in rows)
            print(f"| {name} | {len(rows)} | {med('faults'):.0f}, "
                  f"{max(r['faults'] for r in rows)} | {med('sys_ms'):.0f} | "
                  f"{med('user_ms'):.0f} | {med('wall_ms'):.0f} |")
        print()
        same = losses["kept"] == losses["glibc default"]
        print(f"losses of the counted steps identical both ways: {same} "
              f"({losses['kept']})")


if __name__ == "__main__":
    main()

"""End-to-end effect of the fusions: tokens/s of the same GPT run with every fusion on vs off.

"On" is the default run: the compiled kernels (masked softmax, layer norm, bias + GeLU,
bias + dropout + add, AdamW, cross entropy) and gradient-accumulation fusion. "Off" is the same
flags with ``MEGATRON_FUSED_KERNELS=0`` (no compiled kernels: pure-torch references and
``torch.optim.AdamW``) and ``--no-masked-softmax-fusion --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-gradient-accumulation-fusion --no-cross-entropy-loss-fusion``
(plain torch compositions in the model). Both train from the same seed on the same mock data; their dropout masks come from
different generators (the fused bias-dropout-add draws from its own counter-based stream), so
their losses agree closely but not bit for bit: the script checks they stay within 2% before it
reports a speed.

The two are run alternately, ``--repeats`` times each, every run a fresh ``pretrain_gpt.py``
process; a run's speed is the median of its per-iteration times after ``--warmup`` iterations
(taken from the log line ``elapsed time per iteration``), and the table gives the fastest run of
each side (the least disturbed on a shared machine) and their ratio.

Run::

    python benchmarks/bench_e2e_fusions.py [--layers 4] [--hidden 512] [--heads 8] [--seq 512]
        [--micro-batch 2] [--iters 8] [--warmup 3] [--repeats 3] [--nproc 1]
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

OFF_FLAGS = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-gradient-accumulation-fusion", "--no-cross-entropy-loss-fusion"]
ITER_RE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                     r"lm loss: ([\d.E+-]+)")


def _flags(a) -> list:
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
            f"--seq-length {a.seq} --max-position-embeddings {a.seq} "
            f"--micro-batch-size {a.micro_batch} --global-batch-size {a.micro_batch * a.nproc} "
            f"--tensor-model-parallel-size {a.nproc} "
            f"--train-iters {a.iters} --lr 1e-4 --lr-warmup-iters 1 --log-interval 1 "
            f"--eval-iters 0 --eval-interval 100000 --mock-data --tokenizer-type NullTokenizer "
            f"--vocab-size {a.vocab} --hidden-dropout 0.1 --attention-dropout 0.1 "
            f"--device cpu --seed 1234 --num-workers 0").split()


def _run(a, fused: bool):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    flags = _flags(a)
    if not fused:
        env["MEGATRON_FUSED_KERNELS"] = "0"
        flags += OFF_FLAGS
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.nproc}", os.path.join(ROOT, "pretrain_gpt.py")] + flags
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({'fused' if fused else 'unfused'}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in map(ITER_RE.search, out.stdout.splitlines()) if m]
    if len(rows) != a.iters:
        raise SystemExit(f"expected {a.iters} iteration lines, got {len(rows)}:\n"
                         f"{out.stdout[-3000:]}")
    times = [t for it, t, _ in rows if it > a.warmup]
    return statistics.median(times), [loss for _, _, loss in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1, help="tensor-parallel processes")
    p.add_argument("--threads", type=int, default=None,
                   help="threads per process (default: cores / nproc)")
    a = p.parse_args()
    if a.threads is None:
        a.threads = max(1, (os.cpu_count() or 1) // a.nproc)
    import torch

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')} | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
          f"torch {torch.__version__}")
    print("# " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    results = {True: [], False: []}
    losses = {}
    for _ in range(a.repeats):
        for fused in (True, False):
            t, loss = _run(a, fused)
            results[fused].append(t)
            losses[fused] = loss
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses[True], losses[False]))
    print(f"losses fused vs unfused, max relative difference over {a.iters} iterations: "
          f"{worst:.2e}")
    if worst > 2e-2:
        raise SystemExit("the fused and unfused runs train differently; not reporting speeds")
    tokens = a.micro_batch * a.nproc * a.seq
    best_on, best_off = min(results[True]), min(results[False])
    print(f"| model | fusions on: ms/iter, tokens/s | off: ms/iter, tokens/s | speed-up |")
    print(f"|---|---|---|---|")
    print(f"| {a.layers} layers, h {a.hidden}, {a.heads} heads, s {a.seq}, b {a.micro_batch}, "
          f"V {a.vocab}, TP {a.nproc} | {best_on:.0f}, {tokens / best_on * 1000:.0f} | "
          f"{best_off:.0f}, {tokens / best_off * 1000:.0f} | {best_off / best_on:.2f}x |")
    print(f"# all runs (ms/iter): on {['%.0f' % t for t in results[True]]}, "
          f"off {['%.0f' % t for t in results[False]]}")


if __name__ == "__main__":
    main()

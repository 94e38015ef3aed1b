"""Cost of the fused-kernel self-check (megatron/fused_kernels/selfcheck.py), per op and total.

Times the first use's check of every compiled op for each dtype on one device: the fastest of
``--repeats`` fresh checks (verdicts forgotten between repeats), after one warm-up round that
pays one-off costs (first dispatch, OpenMP thread start). Also prints each verdict.

    python benchmarks/bench_kernel_selfcheck.py [--device cpu] [--repeats 5]
"""

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.fused_kernels import loader, ops, selfcheck  # noqa: E402
def time_checks(device, dtypes, repeats):
    """{(op, dtype): (fastest seconds, verdict)}, and the seconds of the cold first round."""
    paths = ops.compiled_paths()
    best, cold = {}, 0.0
    for round_ in range(repeats + 1):
        for dtype in dtypes:
            for op, (compiled, reference) in paths.items():
                selfcheck.reset()
                start = time.perf_counter()
                verdict = selfcheck.passes(op, device, dtype, compiled, reference)
                took = time.perf_counter() - start
                cold += took if round_ == 0 else 0.0
                if round_ > 0:  # round 0 is the warm-up
                    old = best.get((op, dtype), (float("inf"), verdict))[0]
                    best[(op, dtype)] = (min(old, took), verdict)
    return best, cold


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if loader.load() is None or not ops.kernels_available(args.device):
        sys.exit(f"no compiled kernels for {args.device}: {loader.load_error()}")
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} | {platform.machine()} | {os.cpu_count()} "
          f"cores | torch {torch.__version__} | {torch.get_num_threads()} threads | load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"# python benchmarks/bench_kernel_selfcheck.py --device {args.device} "
          f"--repeats {args.repeats}  (fastest of {args.repeats} after 1 warm-up round)")
    best, cold = time_checks(args.device, dtypes, args.repeats)
    names = [str(d).replace("torch.", "") for d in dtypes]
    print("| op | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---|" * len(dtypes))
    for op in selfcheck.CHECKS:
        cells = [f"{best[(op, d)][0] * 1e3:.2f}" + ("" if best[(op, d)][1] else " FAILED")
                 for d in dtypes]
        print(f"| {op} | " + " | ".join(cells) + " |")
    totals = [sum(best[(op, d)][0] for op in selfcheck.CHECKS) * 1e3 for d in dtypes]
    print("| **all ops** | " + " | ".join(f"**{t:.2f}**" for t in totals) + " |")
    print(f"# every op, every dtype: {sum(totals):.1f} ms; the cold first round (first calls "
          f"in this process): {cold * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

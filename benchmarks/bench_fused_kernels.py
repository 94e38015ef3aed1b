"""Fused kernels against the unfused torch compositions they replace, side by side.

Each row times forward + backward of one op at GPT-2-small shapes (s=1024, b=4, h=768, 12
heads, vocab 50304; ``--small`` shrinks them) for the fused op (``megatron.fused_kernels.ops``)
and for the pure-torch composition that runs without it (the references in
``megatron/fused_kernels``), interleaved, at least ``--repeats`` times (cheap ops up to 50 times); the fastest run counts
(the machine may be shared, and the fastest run is the least disturbed). ``--compile`` adds
``torch.compile`` of the unfused composition as a third column.

Also: one AdamW step over 124M float32 parameters (GPT-2 small's shapes) for FusedAdamW
against ``torch.optim.AdamW(foreach=True)`` and ``(fused=True)``; and the peak memory of cross
entropy forward + backward over ``[s*b, vocab]`` logits beyond the logits themselves (CPU: each
variant in a fresh process, growth of peak RSS after it is reset once the logits exist; CUDA:
``torch.cuda.max_memory_allocated``).

Run::

    python benchmarks/bench_fused_kernels.py [--small] [--repeats 5] [--dtype float32]
        [--device cpu|cuda] [--compile]
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa
from megatron.fused_kernels import loader, ops  # noqa: E402
from megatron.fused_kernels.bias_dropout_add import bias_dropout_add  # noqa: E402
from megatron.fused_kernels.bias_gelu import bias_gelu_unfused  # noqa: E402
from megatron.fused_kernels.layer_norm import layer_norm_reference, rms_norm_reference  # noqa
from megatron.fused_kernels.softmax import (  # noqa: E402
    scaled_masked_softmax_reference,
    scaled_upper_triang_masked_softmax_reference,
)
from megatron.optimizer.fused_adam import FusedAdamW  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="shrink every shape ~4-8x")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile of the unfused composition")
    parser.add_argument("--skip-ops", action="store_true", help="no per-op / cross-entropy rows")
    parser.add_argument("--skip-adam", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: one CE variant
    return parser.parse_args(argv)


def shapes(small: bool) -> dict:
    if small:
        return dict(s=256, b=2, h=384, heads=6, vocab=8192, adam_scale=0.125)
    return dict(s=1024, b=4, h=768, heads=12, vocab=50304, adam_scale=1.0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fastest(variants: dict, repeats: int, device: str, budget_s: float = 4.0) -> dict:
    """Fastest seconds of each zero-argument callable. Two warm-ups each (allocator, thread
    pool, first touch, torch.compile), then runs interleaved: at least ``repeats`` rounds, more
    (up to 50) while a round fits in ``budget_s`` -- cheap ops get many tries, which is what
    makes the minimum meaningful on a shared machine."""
    def once(fn):
        _sync(device)
        start = time.perf_counter()
        own = fn()  # a callable may time itself (to leave its setup out) and return seconds
        _sync(device)
        return own if isinstance(own, float) else time.perf_counter() - start

    times = {name: min(once(fn), once(fn)) for name, fn in variants.items()}
    rounds = max(repeats, min(50, int(budget_s / max(sum(times.values()), 1e-9))))
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name] = min(times[name], once(fn))
    return times


def fwd_bwd(fn, args, grad=None):
    """A callable running ``fn(*args)`` and its backward; float tensors in ``args`` become
    fresh leaves that require grad, everything else passes through."""
    leaves = [a.detach().clone().requires_grad_(True)
              if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]

    def run():
        for a in leaves:
            if isinstance(a, torch.Tensor):
                a.grad = None
        out = fn(*leaves)
        out.backward(grad if grad is not None else torch.ones_like(out))
    return run


def _dropout_train(x, bias, residual, prob):
    return bias_dropout_add(x, bias, residual, prob, True)


def _cases(cfg: dict, dtype: torch.dtype, device: str):
    s, b, h, heads = cfg["s"], cfg["b"], cfg["h"], cfg["heads"]
    torch.manual_seed(0)
    kw = dict(device=device)
    scores = torch.randn(b * heads, s, s, **kw).to(dtype)
    pad_mask = torch.rand(b, 1, s, s, **kw) < 0.1
    x = torch.randn(s, b, h, **kw).to(dtype)
    w, bias = torch.randn(h, **kw).to(dtype), torch.randn(h, **kw).to(dtype)
    x4, b4 = torch.randn(s * b, 4 * h, **kw).to(dtype), torch.randn(4 * h, **kw).to(dtype)
    scale = 1.0 / (h // heads) ** 0.5
    return [
        ("causal softmax [b*np,s,s]", ops.scaled_upper_triang_masked_softmax,
         scaled_upper_triang_masked_softmax_reference, (scores, scale)),
        ("masked softmax [b,np,s,s]", ops.scaled_masked_softmax,
         scaled_masked_softmax_reference, (scores.view(b, heads, s, s), pad_mask, scale)),
        ("layer norm [s,b,h]", ops.layer_norm, layer_norm_reference, (x, w, bias, 1e-5)),
        ("rms norm [s,b,h]", ops.rms_norm, rms_norm_reference, (x, w, 1e-5)),
        ("bias+gelu [s*b,4h]", ops.bias_gelu, bias_gelu_unfused, (x4, b4)),
        ("bias+dropout+add [s,b,h]", ops.bias_dropout_add_train, _dropout_train,
         (x, bias, x.clone(), 0.1)),
        # Context: torch's native layer norm is already a single ATen kernel.
        ("layer norm vs F.layer_norm", ops.layer_norm,
         lambda a, c, d, e: F.layer_norm(a, (h,), c, d, e), (x, w, bias, 1e-5)),
    ]


def op_rows(cfg: dict, dtype: torch.dtype, device: str, repeats: int, compile_: bool):
    rows = []
    for name, fused, unfused, args in _cases(cfg, dtype, device):
        variants = {"fused": fwd_bwd(fused, args), "unfused": fwd_bwd(unfused, args)}
        if compile_:
            variants["compiled"] = fwd_bwd(torch.compile(unfused), args)
        rows.append(_row(name, fastest(variants, repeats, device)))
    return rows


def _row(name: str, times: dict) -> dict:
    row = dict(op=name, fused_ms=times["fused"] * 1e3, unfused_ms=times["unfused"] * 1e3,
               ratio=times["unfused"] / times["fused"])
    if "compiled" in times:
        row.update(compiled_ms=times["compiled"] * 1e3,
                   ratio_compiled=times["compiled"] / times["fused"])
    return row


def cross_entropy_rows(cfg: dict, dtype: torch.dtype, device: str, repeats: int,
                       compile_: bool):
    n, vocab = cfg["s"] * cfg["b"], cfg["vocab"]
    torch.manual_seed(0)
    logits = torch.randn(n, vocab, device=device).to(dtype)
    target = torch.randint(0, vocab, (n,), device=device)
    grad = torch.ones(n, device=device)

    def fused(z):
        return ops.vocab_parallel_cross_entropy(z, target)

    def reference(z):
        return vocab_parallel_cross_entropy(z, target, None)

    def torch_ce(z):
        return F.cross_entropy(z.float(), target, reduction="none")

    def fused_inplace(z):
        return ops.vocab_parallel_cross_entropy(z, target, inplace_backward=True)

    rows = []
    for label, mine, unfused in (("CE vs Megatron-style ref", fused, reference),
                                 ("CE vs F.cross_entropy", fused, torch_ce),
                                 ("CE in-place bwd vs Megatron ref", fused_inplace, reference)):
        # fresh logits per run: the in-place backward overwrites them
        variants = {"fused": _fresh(mine, logits, grad), "unfused": _fresh(unfused, logits, grad)}
        if compile_:
            variants["compiled"] = _fresh(torch.compile(unfused), logits, grad)
        rows.append(_row(label, fastest(variants, repeats, device)))
    return rows


def _fresh(fn, logits, grad):
    """Like fwd_bwd, but on a fresh copy of the logits each run; times itself without the copy."""
    def run():
        z = logits.clone().requires_grad_(True)
        _sync(z.device.type)
        start = time.perf_counter()
        fn(z).backward(grad)
        _sync(z.device.type)
        return time.perf_counter() - start
    return run


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _ce_variant(variant: str, logits, target):
    if variant == "fused":
        return ops.vocab_parallel_cross_entropy(logits, target)
    if variant == "fused_inplace":
        return ops.vocab_parallel_cross_entropy(logits, target, inplace_backward=True)
    if variant == "reference":
        return vocab_parallel_cross_entropy(logits, target, None)
    return F.cross_entropy(logits.float(), target, reduction="none")


def memory_probe(variant: str, cfg: dict, dtype: torch.dtype, device: str) -> int:
    """Peak memory growth (bytes) of one cross entropy forward + backward."""
    n, vocab = cfg["s"] * cfg["b"], cfg["vocab"]
    logits = torch.randn(n, vocab, device=device).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), device=device)
    torch.ones(1, requires_grad=True).sum().backward()  # autograd engine threads up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _ce_variant(variant, logits, target).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    _ce_variant(variant, logits, target).sum().backward()
    return max(0, _status_bytes("VmHWM") - before)


CE_VARIANTS = (("torch", "F.cross_entropy (log-softmax materialised)"),
               ("reference", "Megatron-style (softmax materialised)"),
               ("fused", "fused chunked"),
               ("fused_inplace", "fused chunked, in-place backward"))


def memory_rows(args, cfg: dict) -> dict:
    mem = {}
    for variant, _ in CE_VARIANTS:
        cmd = [sys.executable, __file__, "--memory-probe", variant, "--dtype", args.dtype,
               "--device", args.device] + (["--small"] if args.small else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        mem[variant] = int(out.stdout.strip().splitlines()[-1])
    return mem


def gpt2_small_param_shapes(scale: float):
    h, vocab, s = max(1, int(768 * scale)), 50304, 1024
    shapes_ = [(vocab, h), (s, h)]
    for _ in range(12):
        shapes_ += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h),
                    (4 * h,), (h, 4 * h), (h,)]
    return shapes_ + [(h,), (h,)]


def adam_rows(cfg: dict, device: str, repeats: int):
    shapes_ = gpt2_small_param_shapes(cfg["adam_scale"])
    numel = sum(torch.Size(sh).numel() for sh in shapes_)
    kw = dict(lr=1e-4, weight_decay=0.1)
    makers = {"FusedAdamW": lambda p: FusedAdamW(p, **kw),
              "AdamW(foreach=True)": lambda p: torch.optim.AdamW(p, foreach=True, **kw),
              "AdamW(fused=True)": lambda p: torch.optim.AdamW(p, fused=True, **kw)}
    steps = {}
    for name, make in makers.items():  # 2 GB each at 124M; all alive so runs interleave
        torch.manual_seed(0)
        params = [torch.randn(sh, device=device).requires_grad_(True) for sh in shapes_]
        for p in params:
            p.grad = torch.randn(p.shape, device=device)
        steps[name] = make(params).step
    times = fastest(steps, repeats, device)
    del steps
    fused = times["FusedAdamW"]
    rows = [dict(op=f"AdamW step vs {name}", fused_ms=fused * 1e3, unfused_ms=t * 1e3,
                 ratio=t / fused) for name, t in times.items() if name != "FusedAdamW"]
    return numel, rows


def print_table(rows, title, first="op (fwd+bwd)"):
    compiled = any("compiled_ms" in r for r in rows)
    print(f"\n{title}")
    head = f"{first:38s} {'fused ms':>10s} {'unfused ms':>11s} {'speedup':>8s}"
    print(head + (f" {'compiled ms':>12s} {'vs compiled':>11s}" if compiled else ""))
    for r in rows:
        line = f"{r['op']:38s} {r['fused_ms']:10.2f} {r['unfused_ms']:11.2f} {r['ratio']:7.2f}x"
        if "compiled_ms" in r:
            line += f" {r['compiled_ms']:12.2f} {r['ratio_compiled']:10.2f}x"
        print(line)


def main(argv=None):
    args = get_args(argv)
    cfg = shapes(args.small)
    dtype = DTYPES[args.dtype]
    if args.memory_probe:
        print(memory_probe(args.memory_probe, cfg, dtype, args.device))
        return
    if not ops.kernels_available(args.device):
        raise SystemExit(f"fused kernels unavailable on {args.device}: {loader.load_error()}")
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
          f"dtype {args.dtype}, shapes {cfg}, fastest of >= {args.repeats} runs")
    rows = []
    if not args.skip_ops:
        rows += op_rows(cfg, dtype, args.device, args.repeats, args.compile)
        rows += cross_entropy_rows(cfg, dtype, args.device, args.repeats, args.compile)
        print_table(rows, "Fused op vs unfused torch composition (speedup = unfused / fused)")
    if not args.skip_adam:
        numel, adam = adam_rows(cfg, args.device, args.repeats)
        print_table(adam, f"AdamW, one step over {numel / 1e6:.1f}M float32 params "
                          f"(speedup = torch / fused)", first="optimizer step")
        rows += adam
    if not args.skip_memory:
        mem = memory_rows(args, cfg)
        logits_mb = cfg["s"] * cfg["b"] * cfg["vocab"] * dtype.itemsize / 2 ** 20
        print(f"\nCross entropy peak memory beyond the {logits_mb:.0f} MiB of logits "
              f"(forward + backward):")
        for variant, label in CE_VARIANTS:
            ratio = mem["reference"] / max(mem[variant], 1)
            print(f"  {label:46s} {mem[variant] / 2 ** 20:9.1f} MiB   "
                  f"(Megatron-style / this = {ratio:.2f}x)")
        rows.append(dict(op="ce_peak_memory_bytes", **mem))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""End-to-end GPU training speed: Megatron GPT at 124M and 1.3B, beside transformers' GPT-2.

Contenders, each a fresh process, one GPU:

- ``megatron-124m``: ``pretrain_gpt.py`` (under torchrun, 1 process), GPT-2 small (12 layers,
  h 768, 12 heads, s 1024), bf16 (``--bf16``: bf16 weights, fp32 main weights and gradient
  accumulation), ``--use-flash-attn`` and every fusion at its default (compiled layer norm,
  bias + GeLU, bias + dropout + add, cross entropy, AdamW, gradient-accumulation fusion),
  ``--mock-data``;
- ``megatron-1.3b``: the same at 24 layers, h 2048, 16 heads, s 2048;
- ``hf-gpt2-124m``: ``transformers.GPT2LMHeadModel`` with GPT-2 small's shapes (SDPA attention),
  ``torch.compile``-d, trained by a plain loop: fp32 weights under bf16 autocast, torch's fused
  AdamW, gradient clipping, the same micro/global batch on random tokens.

All use the padded GPT-2 vocabulary (50304), dropout 0.1 (Megatron's and GPT-2's default),
AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), clipping at 1.0.

Speed: median time per iteration after the warm-up iterations (Megatron: its own log line; HF:
CUDA-synchronised wall time per optimizer step). tokens/s = global batch x seq / time.
Model FLOPs per iteration: Megatron's count (``megatron.training.log.
num_floating_point_operations``: the matrix multiplications of forward + backward, logits
included, no recomputation), the same count for the HF model of the same shape. MFU = model
FLOP/s / ``--peak-tflops`` (989: the H200's dense bf16 datasheet rate); the table also gives the
rate of one large bf16 matmul measured on the spot, as the practical ceiling.

``--dry-run`` runs every contender on the CPU with tiny shapes for 2 iterations (argument
building, the launch, log parsing, the table), no GPU needed. Without it the script stops at
once when torch has no CUDA device.

Writes ``results.json``, ``results.md`` and one log per contender into ``--out``; prints the
markdown table. Normally started by ``benchmarks/gpu_run.py`` (its ``mfu`` and ``recompute``
stages).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
ITER_RE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                     r"throughput per GPU \(TFLOP/s/GPU\): ([\d.e+-]+).*lm loss: ([\d.E+-]+)")
TARGETS = {"megatron-124m": 0.45, "megatron-1.3b": 0.50}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int = 50304
    iters: int = 30
    warmup: int = 10
    selective: int = 0      # 1: --recompute-activations (Megatron's selective recompute)


FULL = {
    "megatron-124m": Shape(12, 768, 12, 1024, micro_batch=32, global_batch=128),
    "megatron-1.3b": Shape(24, 2048, 16, 2048, micro_batch=8, global_batch=32, iters=15,
                           warmup=5),
    "hf-gpt2-124m": Shape(12, 768, 12, 1024, micro_batch=32, global_batch=128),
    "megatron-1.3b-selective": Shape(24, 2048, 16, 2048, micro_batch=8, global_batch=32,
                                     iters=15, warmup=5, selective=1),
}
# Run when no --only is given; the selective-recompute one only when asked for.
DEFAULT = ("megatron-124m", "megatron-1.3b", "hf-gpt2-124m")
TINY = {
    "megatron-124m": Shape(2, 64, 4, 128, 2, 4, vocab=1024, iters=2, warmup=1),
    "megatron-1.3b": Shape(2, 128, 4, 256, 1, 2, vocab=1024, iters=2, warmup=1),
    "hf-gpt2-124m": Shape(2, 64, 4, 128, 2, 4, vocab=1024, iters=2, warmup=1),
    "megatron-1.3b-selective": Shape(2, 128, 4, 256, 1, 2, vocab=1024, iters=2, warmup=1,
                                     selective=1),
}


def model_flops(shape: Shape) -> float:
    """Megatron's model FLOPs of one iteration (global batch) for this GPT shape."""
    sys.path.insert(0, ROOT)
    from megatron.training.log import num_floating_point_operations

    args = SimpleNamespace(seq_length=shape.seq, hidden_size=shape.hidden,
                           num_layers=shape.layers, num_attention_heads=shape.heads,
                           num_query_groups=shape.heads, kv_channels=shape.hidden // shape.heads,
                           swiglu=False, ffn_hidden_size=4 * shape.hidden,
                           padded_vocab_size=shape.vocab)
    return num_floating_point_operations(args, shape.global_batch)


def megatron_flags(shape: Shape, dry_run: bool, dropout: float) -> list:
    """pretrain_gpt.py flags: bf16, flash attention, every fusion at its (on) default."""
    flags = (f"--num-layers {shape.layers} --hidden-size {shape.hidden} "
             f"--num-attention-heads {shape.heads} --seq-length {shape.seq} "
             f"--max-position-embeddings {shape.seq} --micro-batch-size {shape.micro_batch} "
             f"--global-batch-size {shape.global_batch} --train-iters {shape.iters} "
             f"--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine "
             f"--lr-warmup-iters {min(2, shape.iters - 1)} "
             f"--adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 "
             f"--init-method-std 0.02 --hidden-dropout {dropout} --attention-dropout {dropout} "
             f"--bf16 --use-flash-attn --log-throughput --log-interval 1 --eval-iters 0 "
             f"--eval-interval 1000000 --mock-data --tokenizer-type NullTokenizer "
             # NullTokenizer adds one EOD id, so V - 1 here gives V ids, a multiple of 128.
             f"--vocab-size {shape.vocab - 1} --seed 1234 --num-workers 0").split()
    if shape.selective:
        flags.append("--recompute-activations")
    return flags + ["--device", "cpu" if dry_run else "cuda"]


def _run(cmd, env, timeout_s: float, log_path: str):
    """Run ``cmd``; returns (stdout + stderr, error or None). The output goes to ``log_path``."""
    try:
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=max(1.0, timeout_s))
        text, error = out.stdout + out.stderr, (None if out.returncode == 0 else
                                                f"exit status {out.returncode}")
    except subprocess.TimeoutExpired as exc:
        text = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                else exc.stdout or "")
        error = f"timed out after {timeout_s:.0f} s"
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    return text, error


def run_megatron(name: str, shape: Shape, a, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if a.dry_run:
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "2")
    script = [os.path.join(ROOT, "pretrain_gpt.py")]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
           + script + megatron_flags(shape, a.dry_run, a.dropout))
    text, error = _run(cmd, env, timeout_s, os.path.join(a.out, f"{name}.log"))
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)))
            for m in map(ITER_RE.search, text.splitlines()) if m]
    kernels = ("compiled" if "fused kernels: compiled" in text else
               "references" if "pure-torch references" in text else "?")
    result = {"kernels": kernels, "error": error}
    if error is None and len(rows) != shape.iters:
        result["error"] = f"expected {shape.iters} iteration lines, got {len(rows)}"
    kept = [r for r in rows if r[0] > shape.warmup]
    if kept:
        result["ms"] = statistics.median(r[1] for r in kept)
        result["logged_tflops"] = statistics.median(r[2] for r in kept)
        result["loss"] = [r[3] for r in rows]
    if result["error"]:
        result["tail"] = text[-2000:]
    return result


def run_hf(name: str, shape: Shape, a, timeout_s: float) -> dict:
    """The transformers contender, in its own process (``--hf-worker``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker",
           json.dumps(asdict(shape)), "--dropout", str(a.dropout)]
    if a.dry_run:
        cmd.append("--dry-run")
    if a.no_compile:
        cmd.append("--no-compile")
    text, error = _run(cmd, env, timeout_s, os.path.join(a.out, f"{name}.log"))
    found = [line for line in text.splitlines() if line.startswith("HF_RESULT ")]
    if not found:
        return {"error": error or "no HF_RESULT line", "tail": text[-2000:], "kernels": "-"}
    result = json.loads(found[-1][len("HF_RESULT "):])
    result.update(error=error, kernels="torch.compile" if not a.no_compile else "eager")
    return result


def hf_worker(shape: Shape, dry_run: bool, dropout: float, compile_model: bool) -> None:
    """Train transformers' GPT2LMHeadModel with a plain loop; print one HF_RESULT json line."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    dev = torch.device("cpu" if dry_run else "cuda")
    config = GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads,
                        n_positions=shape.seq, vocab_size=shape.vocab, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(dev)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=dev.type == "cuda")
    forward = torch.compile(model) if compile_model else model
    n_micro = shape.global_batch // shape.micro_batch
    batches = torch.randint(0, shape.vocab, (4, shape.micro_batch, shape.seq), device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    for it in range(shape.iters):
        sync()
        start = time.perf_counter()
        total = 0.0
        for m in range(n_micro):
            tokens = batches[(it * n_micro + m) % len(batches)]
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                loss = forward(input_ids=tokens, labels=tokens).loss / n_micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))   # syncs, as Megatron's logging does
        sync()
        times.append((time.perf_counter() - start) * 1000.0)
        print(f"step {it + 1}: {times[-1]:.1f} ms, loss {losses[-1]:.4f}", flush=True)
    kept = times[shape.warmup:]
    print("HF_RESULT " + json.dumps({"ms": statistics.median(kept), "loss": losses,
                                     "all_ms": times}), flush=True)


def matmul_tflops() -> float:
    """bf16 8192^3 matmul rate on this GPU (median of 10 after 3 warm-ups)."""
    import torch

    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rates = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(x, y)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            rates.append(2 * n ** 3 / (start.elapsed_time(end) / 1000.0) / 1e12)
    return statistics.median(rates)


def table(results: dict, shapes: dict, peak: float, ceiling) -> str:
    lines = ["| contender | layers / h / heads / s | micro / global batch | attention, kernels "
             "| ms/iter | tokens/s | model TFLOP/s | MFU (of %.0f) | of measured matmul | target |"
             % peak, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = shapes[name]
        desc = f"{s.layers} / {s.hidden} / {s.heads} / {s.seq}"
        attn = f"SDPA, {r.get('kernels', '?')}"
        if "ms" not in r:
            lines.append(f"| {name} | {desc} | {s.micro_batch} / {s.global_batch} | {attn} | "
                         f"failed: {r.get('error')} | | | | | |")
            continue
        tflops = model_flops(s) / (r["ms"] / 1000.0) / 1e12
        r.update(tokens_per_s=s.global_batch * s.seq / (r["ms"] / 1000.0),
                 model_tflops=tflops, mfu=tflops / peak)
        target = TARGETS.get(name)
        verdict = ("" if target is None else
                   f">= {100 * target:.0f}%: {'met' if r['mfu'] >= target else 'not met'}")
        of_ceiling = f"{100 * tflops / ceiling:.1f}%" if ceiling else "-"
        lines.append(f"| {name} | {desc} | {s.micro_batch} / {s.global_batch} | {attn} | "
                     f"{r['ms']:.1f} | {r['tokens_per_s']:.0f} | {tflops:.3g} | "
                     f"{100 * r['mfu']:.3g}% | {of_ceiling} | {verdict} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_bench_out")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, 2 iterations each (no GPU needed)")
    p.add_argument("--only", nargs="+", choices=list(FULL),
                   help="run only these contenders (default: all, in the order listed)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-compile", action="store_true", help="HF model without torch.compile")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="wall-clock budget for all contenders together")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME.FIELD=VALUE",
                   help="override a shape, e.g. megatron-1.3b.micro_batch=4")
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hf_worker:
        hf_worker(Shape(**json.loads(a.hf_worker)), a.dry_run, a.dropout, not a.no_compile)
        return
    import torch

    if not a.dry_run and not (torch.cuda.is_available() and torch.version.cuda):
        raise SystemExit(f"gpu_bench: needs a CUDA build of torch and a visible GPU (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}, devices "
                         f"{torch.cuda.device_count() if torch.version.cuda else 0}); "
                         "use --dry-run for the CPU check")
    shapes = dict(TINY if a.dry_run else FULL)
    for item in a.set:
        key, _, value = item.partition("=")
        name, _, field = key.rpartition(".")
        if name not in shapes or field not in Shape.__dataclass_fields__:
            raise SystemExit(f"--set {item}: expected NAME.FIELD=VALUE with NAME in "
                             f"{list(shapes)} and FIELD in {list(Shape.__dataclass_fields__)}")
        shapes[name] = replace(shapes[name], **{field: int(value)})
    names = a.only or list(DEFAULT)
    os.makedirs(a.out, exist_ok=True)
    device = "cpu (dry run)" if a.dry_run else torch.cuda.get_device_name()
    header = (f"{datetime.datetime.now().isoformat(timespec='seconds')} | {device} | torch "
              f"{torch.__version__} | CUDA {torch.version.cuda}")
    print("# " + header, flush=True)
    ceiling = None if a.dry_run else matmul_tflops()
    if ceiling:
        print(f"# bf16 8192^3 matmul on this GPU: {ceiling:.0f} TFLOP/s", flush=True)
    deadline = time.monotonic() + a.budget_s
    results = {}
    for i, name in enumerate(names):
        # Leave every later contender at least an equal share of what remains.
        share = (deadline - time.monotonic()) / (len(names) - i)
        timeout = max(share, deadline - time.monotonic() - 60.0 * (len(names) - i - 1))
        runner = run_hf if name.startswith("hf-") else run_megatron
        started = time.monotonic()
        results[name] = runner(name, shapes[name], a, timeout)
        print(f"# {name}: {time.monotonic() - started:.0f} s, "
              f"{results[name].get('error') or 'ok'}", flush=True)
    text = table(results, shapes, a.peak_tflops, ceiling)
    print(text)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(f"{header}\n\n" + (f"bf16 8192^3 matmul: {ceiling:.0f} TFLOP/s\n\n"
                                   if ceiling else "") + text + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"header": header, "matmul_tflops": ceiling, "peak_tflops": a.peak_tflops,
                   "shapes": {n: asdict(shapes[n]) for n in names}, "results": results}, f,
                  indent=1)
    failed = [n for n, r in results.items() if "ms" not in r or r.get("error")]
    if failed:
        for n in failed:
            print(f"# {n} failed: {results[n].get('error')}\n{results[n].get('tail', '')}")
        sys.exit(1)


if __name__ == "__main__":
    main()

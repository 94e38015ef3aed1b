"""Training throughput on CPU against peers: this project's ``pretrain_gpt.py`` vs plain PyTorch.

The same GPT (default: 6 layers, hidden 512, 8 heads, sequence 512, micro-batch 4, vocabulary
50304, fp32, AdamW, dropout 0, gradient clipping at 1.0, tied input/output embeddings) is
trained by:

- ``ours``: a real ``pretrain_gpt.py`` process (one rank, no launcher; ``--mock-data
  --tokenizer-type NullTokenizer --vocab-size V --make-vocab-size-divisible-by 1``: the model's
  vocabulary is exactly V, with no padding); the time per iteration is read
  from its log line ``elapsed time per iteration (ms)``;
- ``ours-sdpa``: the same with ``--attention-backend flash`` (``scaled_dot_product_attention``,
  its CPU flash kernel, instead of the explicit body with the fused masked softmax);
- ``ours-fused``: ``ours`` with ``--attention-backend fused`` (the explicit body with the fused
  masked softmax, what ``auto`` picks below 256 tokens), to show what the rule gains;
- ``ours-bf16``: ``ours`` with ``--bf16`` (bf16 weights and activations, fp32 main weights and
  gradient reduction; oneDNN's bf16 GEMMs use AVX512_BF16 / AMX where the CPU has them), set
  beside fp32 (not in the default list: a different precision);
- ``hf``: ``transformers``' ``GPT2LMHeadModel`` (its default attention, SDPA) in a plain PyTorch
  loop: forward, ``F.cross_entropy`` over the ``[b*s, V]`` logits, backward,
  ``clip_grad_norm_``, ``torch.optim.AdamW`` (torch's default, ``foreach``);
- ``nanogpt``: a minimal GPT written here (pre-norm blocks, ``scaled_dot_product_attention``
  with ``is_causal``, tied head) trained the same way with ``torch.optim.AdamW(fused=True)``.

Every contender is a fresh process with the same layout (one process, ``--threads`` intra-op
threads, ``OMP_NUM_THREADS`` set to the same), the same batch and sequence, and counts
``b * s`` tokens per iteration. The contenders run alternately, ``--repeats`` rounds; a run's
time is the median of its iterations after ``--warmup``, a contender's the median of its runs.

Model FLOPs follow Megatron's count (:func:`megatron.training.log.num_floating_point_operations`:
the matmuls only, causal attention counted in full). They are compared with this machine's fp32
GEMM rate, measured by a separate process in every round between the contenders: ``torch.mm`` of
two 2048 x 2048 matrices, and the mix of this model's own GEMM shapes (every projection's forward,
input-gradient and weight-gradient products, the attention batched products and the output
layer), each timed into a preallocated output.

``--profile`` adds one profiled step per contender (after the warm-up) and prints where its time
goes by op category; ``--baseline-root DIR`` adds ``base`` / ``base-sdpa`` (unless
``--contenders`` names either): ``pretrain_gpt.py``
of another checkout (to measure a change side by side).

Run::

    python benchmarks/bench_peers.py [--repeats 3] [--iters 6] [--warmup 2] [--threads 2]
        [--contenders ours,ours-sdpa,hf,nanogpt[,ours-fused,ours-bf16]] [--profile]
        [--baseline-root DIR]
"""

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
ITER_RE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                     r"lm loss: ([\d.E+-]+)")
RESULT_TAG = "BENCH_PEERS_RESULT "
ALL_CONTENDERS = ("ours", "ours-sdpa", "hf", "nanogpt")
# pretrain_gpt.py contenders: (checkout: "ours" or "base", extra flags).
OURS_VARIANTS = {"ours": ("ours", []),
                 "ours-sdpa": ("ours", ["--attention-backend", "flash"]),
                 "ours-fused": ("ours", ["--attention-backend", "fused"]),
                 "ours-bf16": ("ours", ["--bf16"]),
                 "base": ("base", []),
                 "base-sdpa": ("base", ["--attention-backend", "flash"])}
# What the CPU-speed targets ask: ours at >= 90% of the fp32 GEMM rate, >= 1.15x each peer.
TARGET_GEMM_SHARE = 0.90
TARGET_RATIO = 1.15
# /proc/cpuinfo flags worth naming: the vector extensions torch's kernels and ours may use.
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


# ---------------------------------------------------------------------------------------------
# Contender processes
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("MKL_NUM_THREADS", None)
    return env


def ours_flags(a, extra: list) -> list:
    """``pretrain_gpt.py`` flags of the benchmarked configuration."""
    flags = (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} "
             f"--micro-batch-size {a.micro_batch} --global-batch-size {a.micro_batch} "
             f"--train-iters {a.warmup + a.iters} --lr 1e-4 --min-lr 1e-4 "
             f"--lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0 --log-interval 1 "
             f"--eval-iters 0 --eval-interval 100000 --mock-data "
             f"--tokenizer-type NullTokenizer --vocab-size {a.vocab} "
             f"--make-vocab-size-divisible-by 1 --hidden-dropout 0 --attention-dropout 0 "
             f"--device cpu --seed 1234 --num-workers 0").split()
    return flags + list(extra) + a.ours_extra.split()


def _run_ours(a, root: str, extra: list, profile: bool) -> dict:
    env = _child_env(a)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if profile:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "profile-ours",
               "--child-root", root, "--warmup", str(a.warmup), "--"] + ours_flags(a, extra)
    else:
        cmd = [sys.executable, os.path.join(root, "pretrain_gpt.py")] + ours_flags(a, extra)
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, rows, cpu = [], [], [_cpu_seconds(proc.pid)]
    for line in proc.stdout:
        lines.append(line)
        m = ITER_RE.search(line)
        if m:
            # CPU seconds of the process (all threads) at the end of each iteration.
            cpu.append(_cpu_seconds(proc.pid))
            rows.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
    stdout = "".join(lines)
    if proc.wait() != 0:
        raise SystemExit(f"pretrain_gpt.py failed in {root}:\n{stdout[-5000:]}")
    if len(rows) != a.warmup + a.iters:
        raise SystemExit(f"expected {a.warmup + a.iters} iteration lines, got {len(rows)}:\n"
                         f"{stdout[-3000:]}")
    result = {"times_ms": [t for it, t, _ in rows if it > a.warmup],
              "cpu_ms": [(y - x) * 1000.0 for x, y in zip(cpu[a.warmup:-1], cpu[a.warmup + 1:])],
              "losses": [loss for _, _, loss in rows]}
    if profile:
        result["profile"] = _parse_child_result(stdout)["profile"]
    return result


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_child(a, kind: str, profile: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind] + _shape_argv(a)
    if profile:
        cmd.append("--profile")
    out = subprocess.run(cmd, env=_child_env(a), cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return _parse_child_result(out.stdout)


def _shape_argv(a) -> list:
    return [f"--layers={a.layers}", f"--hidden={a.hidden}", f"--heads={a.heads}",
            f"--seq={a.seq}", f"--micro-batch={a.micro_batch}", f"--vocab={a.vocab}",
            f"--iters={a.iters}", f"--warmup={a.warmup}", f"--threads={a.threads}"]


def _parse_child_result(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise SystemExit(f"no result line in the child's output:\n{stdout[-3000:]}")


def run_contender(a, name: str) -> dict:
    """One fresh process of contender ``name``; its per-iteration times (ms) and losses."""
    if name in OURS_VARIANTS:
        checkout, extra = OURS_VARIANTS[name]
        root = ROOT if checkout == "ours" else a.baseline_root
        return _run_ours(a, root, extra, a.profile_now)
    return _run_child(a, name, a.profile_now)


def cpu_description() -> str:
    """The CPU's model name, its vector extensions (from /proc/cpuinfo) and the SIMD clone our
    fused CPU bodies run on it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if flags and model:
                    break
    except OSError:
        pass
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from megatron.fused_kernels import loader

    found = [f for f in VECTOR_FLAGS if f in flags] or ["none found"]
    return (f"CPU: {model} | vector extensions: {' '.join(found)} | "
            f"fused CPU bodies: {loader.cpu_isa() or 'not loaded'} clone")


# ---------------------------------------------------------------------------------------------
# Peer models (run inside a child process)
# ---------------------------------------------------------------------------------------------

def build_nanogpt(a):
    """A minimal GPT in the style of nanoGPT, written for this benchmark: ``[b, s, h]``
    activations, pre-norm blocks, SDPA attention, tied output head."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            h = a.hidden
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.c_attn, self.attn_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):                                             # [b, s, h]
            b, s, h = x.shape
            qkv = self.c_attn(self.ln_1(x)).split(h, dim=2)              # 3 x [b, s, h]
            q, k, v = (t.view(b, s, a.heads, h // a.heads).transpose(1, 2)
                       for t in qkv)                                      # [b, a, s, d]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [b, a, s, d]
            x = x + self.attn_proj(y.transpose(1, 2).reshape(b, s, h))    # [b, s, h]
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.hidden)
            self.wpe = nn.Embedding(a.seq, a.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.hidden)
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
            self.lm_head.weight = self.wte.weight
            for name, p in self.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx):                                           # [b, s]
            pos = torch.arange(idx.size(1), device=idx.device)
            x = self.wte(idx) + self.wpe(pos)                             # [b, s, h]
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))                             # [b, s, V]

    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    return model, optimizer, lambda tokens: model(tokens)


def build_hf(a):
    """``transformers.GPT2LMHeadModel`` of the same shape, with torch's default AdamW."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.hidden,
                        n_layer=a.layers, n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, optimizer, lambda tokens: model(input_ids=tokens).logits


def train_peer(a, kind: str) -> dict:
    """Train a peer for ``warmup + iters`` steps; per-step times, losses, optional profile."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(1234)
    model, optimizer, logits_of = (build_hf if kind == "hf" else build_nanogpt)(a)
    model.train()
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, a.vocab, (a.warmup + a.iters + 1, a.micro_batch, a.seq + 1),
                         generator=gen)

    def step(i):
        tokens, labels = data[i, :, :-1], data[i, :, 1:]                 # [b, s]
        logits = logits_of(tokens)                                        # [b, s, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, cpu, losses, profile = [], [], [], None
    for i in range(a.warmup + a.iters):
        if a.profile and i == a.warmup:
            profile, loss = profile_call(lambda: step(i))
            losses.append(loss)
            continue
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(i))
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1000.0)
            cpu.append((time.process_time() - cpu_start) * 1000.0)
    return {"times_ms": times, "cpu_ms": cpu, "losses": losses, "profile": profile,
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# Profile: self time by op category
# ---------------------------------------------------------------------------------------------

CATEGORIES = (
    ("optimizer", ("adam", "optimizer.", "_foreach", "clip", "vector_norm", "zero_grad")),
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
              "aten::matmul")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
    ("softmax", ("softmax",)),
    ("norm", ("layer_norm", "rms_norm")),
    ("GeLU, bias, residual", ("gelu", "bias_dropout_add", "aten::add", "aten::mul", "aten::sum")),
    ("copy, fill, cat", ("copy_", "fill_", "zero_", "aten::cat", "clone", "contiguous",
                         "empty", "index_", "embedding")),
)


def _category(name: str, ancestors: list) -> str:
    low = name.lower()
    for anc in ancestors:
        if anc.lower().startswith("optimizer.") or "clip_grad" in anc.lower():
            return "optimizer"
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other ops"


def profile_call(fn):
    """Run ``fn`` under ``torch.profiler``; (summary, fn's result). Summary: wall ms, self ms per
    category (ops of the main thread, by name and enclosing ranges) and the top ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        result = fn()
        wall = (time.perf_counter() - start) * 1000.0
    by_cat, by_op, by_gemm = {}, {}, {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        ancestors, parent = [], ev.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        self_ms = ev.self_cpu_time_total / 1000.0
        cat = _category(ev.name, ancestors)
        by_cat[cat] = by_cat.get(cat, 0.0) + self_ms
        by_op[ev.name] = by_op.get(ev.name, 0.0) + self_ms
        if cat == "GEMM":
            shapes = "x".join(str(list(s)) for s in (ev.input_shapes or []) if s)
            key = f"{ev.name} {shapes}"
            count, total = by_gemm.get(key, (0, 0.0))
            by_gemm[key] = (count + 1, total + self_ms)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    gemms = sorted(((k, c, ms) for k, (c, ms) in by_gemm.items()), key=lambda r: -r[2])[:16]
    return {"wall_ms": wall, "categories": by_cat, "top_ops": top, "top_gemms": gemms}, result


def profile_ours(a, root: str, flags: list) -> None:
    """In-process ``pretrain_gpt.pretrain`` with the step after the warm-up profiled."""
    sys.path.insert(0, root)
    os.chdir(root)
    import pretrain_gpt
    import megatron.training.training as training

    original = training.train_step
    state = {"step": 0, "profile": None}

    def profiled_train_step(*args, **kwargs):
        state["step"] += 1
        if state["step"] != a.warmup + 1:
            return original(*args, **kwargs)
        state["profile"], result = profile_call(lambda: original(*args, **kwargs))
        return result

    training.train_step = profiled_train_step
    training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, None, pretrain_gpt.forward_step, argv=flags)
    import torch
    state["profile"]["threads"] = torch.get_num_threads()
    print(RESULT_TAG + json.dumps({"profile": state["profile"]}), flush=True)


# ---------------------------------------------------------------------------------------------
# The machine's GEMM rate
# ---------------------------------------------------------------------------------------------

def model_gemm_shapes(a) -> list:
    """``(count, batch, m, k, n, transpose_a, transpose_b)`` of every GEMM of one training step:
    forward ``x W^T``, input gradient ``g W`` and weight gradient ``g^T x`` of each projection,
    the attention batched products (two forward, four backward) and the output layer."""
    n, h, s = a.micro_batch * a.seq, a.hidden, a.seq
    bh, d = a.micro_batch * a.heads, a.hidden // a.heads
    shapes = []
    for out_f, in_f in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
        shapes += [(a.layers, 1, n, in_f, out_f, False, True),     # x [n, in] @ W^T
                   (a.layers, 1, n, out_f, in_f, False, False),    # g [n, out] @ W
                   (a.layers, 1, out_f, n, in_f, True, False)]     # g^T @ x
    shapes += [(a.layers, bh, s, d, s, False, True), (a.layers, bh, s, s, d, False, False)] * 3
    shapes += [(1, 1, n, h, a.vocab, False, True), (1, 1, n, a.vocab, h, False, False),
               (1, 1, a.vocab, n, h, True, False)]
    return shapes


def _time_gemm(torch, batch, m, k, n, ta, tb, reps):
    def operand(rows, cols, transposed):
        shape = (batch, cols, rows) if transposed else (batch, rows, cols)
        t = torch.randn(shape)
        return t.transpose(1, 2) if transposed else t
    x, w = operand(m, k, ta), operand(k, n, tb)
    out = torch.empty(batch, m, n)
    if batch == 1:
        x, w, out = x[0], w[0], out[0]
    fn = (lambda: torch.mm(x, w, out=out)) if batch == 1 else (lambda: torch.bmm(x, w, out=out))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemm(a) -> dict:
    """GFLOP/s of ``torch.mm`` 2048 x 2048 and of this model's GEMM mix (median timings)."""
    import torch

    torch.set_num_threads(a.threads)
    size = 2048
    t = _time_gemm(torch, 1, size, size, size, False, False, 9)
    mm_rate = 2.0 * size ** 3 / t / 1e9
    flops = seconds = 0.0
    for count, batch, m, k, n, ta, tb in model_gemm_shapes(a):
        t = _time_gemm(torch, batch, m, k, n, ta, tb, 3)
        flops += count * 2.0 * batch * m * k * n
        seconds += count * t
    return {"mm2048_gflops": mm_rate, "model_gemm_gflops": flops / seconds / 1e9,
            "model_gemm_s": seconds, "threads": torch.get_num_threads()}


def model_flops(a) -> float:
    """Megatron's model FLOPs of one iteration (forward + backward of ``micro_batch``
    sequences)."""
    sys.path.insert(0, ROOT)
    from types import SimpleNamespace

    from megatron.training.log import num_floating_point_operations

    args = SimpleNamespace(seq_length=a.seq, hidden_size=a.hidden, num_layers=a.layers,
                           num_attention_heads=a.heads, num_query_groups=a.heads,
                           kv_channels=a.hidden // a.heads, ffn_hidden_size=4 * a.hidden,
                           swiglu=False, padded_vocab_size=a.vocab)
    return num_floating_point_operations(args, a.micro_batch)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(a, results: dict, gemm: list) -> None:
    flops = model_flops(a)
    tokens = a.micro_batch * a.seq
    mm_rate = statistics.median(g["mm2048_gflops"] for g in gemm)
    mix_rate = statistics.median(g["model_gemm_gflops"] for g in gemm)
    rounds = ", ".join("%.0f/%.0f" % (g["mm2048_gflops"], g["model_gemm_gflops"]) for g in gemm)
    print(f"\nfp32 GEMM rate ({a.threads} threads, median of {len(gemm)} rounds): torch.mm "
          f"2048^3 {mm_rate:.1f} GFLOP/s; this model's GEMM mix {mix_rate:.1f} GFLOP/s "
          f"(rounds: {rounds})")
    print(f"model FLOPs per iteration (Megatron's count): {flops / 1e9:.1f} GFLOP; "
          f"{tokens} tokens per iteration\n")
    print("| contender | ms/iter | tokens/s | model GFLOP/s | of mm 2048 | of model GEMM mix | "
          "CPU ms/iter | runs (ms/iter) | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|")
    med, cpu = {}, {}
    for name, runs in results.items():
        med[name] = statistics.median(statistics.median(r["times_ms"]) for r in runs)
        cpu[name] = statistics.median(statistics.median(r["cpu_ms"]) for r in runs)
        rate = flops / (med[name] / 1000.0) / 1e9
        losses = runs[-1]["losses"]
        print(f"| {name} | {med[name]:.0f} | {tokens / med[name] * 1000:.0f} | {rate:.1f} | "
              f"{rate / mm_rate:.1%} | {rate / mix_rate:.1%} | {cpu[name]:.0f} | "
              f"{', '.join('%.0f' % statistics.median(r['times_ms']) for r in runs)} | "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} |")
    for name in ("ours", "ours-sdpa"):
        if name in med:
            share = flops / (med[name] / 1000.0) / 1e9 / mix_rate
            print(f"\n{name}: {share:.1%} of this model's fp32 GEMM mix rate (target >= "
                  f"{TARGET_GEMM_SHARE:.0%}: {'met' if share >= TARGET_GEMM_SHARE else 'not met'})")
    print("\nCPU ms/iter: user + system CPU time of the process (all threads) per timed iteration; "
          "less sensitive to other load than wall time.")
    print("\n| ratio (tokens/s) | wall | CPU time | target |")
    print("|---|---|---|---|")
    targets = {("ours", "hf"): TARGET_RATIO, ("ours", "nanogpt"): TARGET_RATIO,
               ("ours-sdpa", "hf"): TARGET_RATIO, ("ours-sdpa", "nanogpt"): TARGET_RATIO,
               ("ours-sdpa", "ours"): None, ("ours", "ours-fused"): None,
               ("ours-bf16", "ours"): None,
               ("ours", "base"): None, ("ours-sdpa", "base-sdpa"): None}
    for (x, y), target in targets.items():
        if x in med and y in med:
            value = med[y] / med[x]
            verdict = "" if target is None else (
                f">= {target}x: {'met' if value >= target else 'not met'}")
            # CPU time is counted in clock ticks: a tiny run may show none.
            cpu_ratio = f"{cpu[y] / cpu[x]:.2f}x" if cpu[x] > 0 else "n/a"
            print(f"| {x} / {y} | {value:.2f}x | {cpu_ratio} | {verdict} |")


def print_profiles(profiles: dict) -> None:
    cats = [c for c, _ in CATEGORIES] + ["other ops"]
    print("\nProfiled step, self time by op category (ms; share of the step's wall time):\n")
    print("| category | " + " | ".join(profiles) + " |")
    print("|---|" + "---|" * len(profiles))
    for cat in cats:
        spent = [p["categories"].get(cat, 0.0) for p in profiles.values()]
        cells = [f"{ms:.0f} ({ms / p['wall_ms']:.0%})" for ms, p in zip(spent, profiles.values())]
        print(f"| {cat} | " + " | ".join(cells) + " |")
    cells = []
    for p in profiles.values():
        outside = p["wall_ms"] - sum(p["categories"].values())
        cells.append(f"{outside:.0f} ({outside / p['wall_ms']:.0%})")
    print("| outside ops (Python, framework) | " + " | ".join(cells) + " |")
    print("| step wall time under the profiler | " +
          " | ".join(f"{p['wall_ms']:.0f}" for p in profiles.values()) + " |")
    for name, p in profiles.items():
        print(f"\ntop ops of {name} (self ms): " +
              ", ".join(f"{op} {ms:.0f}" for op, ms in p["top_ops"]))
    for name, p in profiles.items():
        print(f"\nGEMMs of {name} by operand shapes (calls, self ms):\n")
        for key, count, ms in p.get("top_gemms", []):
            print(f"- {key}: {count} calls, {ms:.0f} ms")


def main(a) -> None:
    import torch

    contenders = a.contenders.split(",")
    if a.baseline_root:
        a.baseline_root = os.path.abspath(a.baseline_root)
        if not {"base", "base-sdpa"} & set(contenders):
            contenders += ["base", "base-sdpa"]
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')} | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
          f"torch {torch.__version__} | load average at start {_load()}")
    print("# " + cpu_description())
    print("# python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    print(f"# {a.layers} layers, h {a.hidden}, {a.heads} heads, s {a.seq}, b {a.micro_batch}, "
          f"V {a.vocab}, fp32, {a.threads} threads per process, {a.warmup} warm-up + "
          f"{a.iters} timed iterations per run, {a.repeats} rounds")
    print("# ours: python pretrain_gpt.py " + " ".join(ours_flags(a, [])))
    results = {name: [] for name in contenders}
    gemm, profiles = [], {}
    a.profile_now = False
    for round_ in range(a.repeats):
        gemm.append(measure_gemm_in_child(a))
        order = contenders if round_ % 2 == 0 else contenders[::-1]
        for name in order:
            results[name].append(run_contender(a, name))
            print(f"#   round {round_ + 1} {name}: "
                  f"{statistics.median(results[name][-1]['times_ms']):.0f} ms/iter "
                  f"(load {_load()})", flush=True)
    if a.profile:
        a.profile_now = True
        for name in contenders:
            profiles[name] = run_contender(a, name)["profile"]
    if a.repeats > 0:
        print_table(a, results, gemm)
    if profiles:
        print_profiles(profiles)
    print(f"\n# load average at end {_load()}")


def measure_gemm_in_child(a) -> dict:
    return _run_child(a, "gemm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--iters", type=int, default=6, help="timed iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of alternating runs")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every process")
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS))
    p.add_argument("--profile", action="store_true",
                   help="add one profiled run per contender and print where the time goes")
    p.add_argument("--baseline-root", default=None,
                   help="another checkout whose pretrain_gpt.py runs as 'base' / 'base-sdpa'")
    p.add_argument("--ours-extra", default="", help="extra pretrain_gpt.py flags (ours, base)")
    p.add_argument("--record", action="store_true",
                   help="append the output to benchmarks/RESULTS.md as a dated section")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-root", default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.child == "gemm":
        print(RESULT_TAG + json.dumps(measure_gemm(args)))
    elif args.child in ("hf", "nanogpt"):
        print(RESULT_TAG + json.dumps(train_peer(args, args.child)))
    elif args.child == "profile-ours":
        profile_ours(args, args.child_root, [f for f in args.rest if f != "--"])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from record import recording

        with recording(args.record, "Training throughput against peers (bench_peers.py)"):
            main(args)

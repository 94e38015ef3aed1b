"""The one GPU run: build, kernel tests, GPU-vs-CPU parity, a bf16 run that trains, then MFU.

Stages, in order, each in its own processes, each with its verdict in the table printed last:

1. ``env``: Python, torch, CUDA, the device and its driver.
2. ``build``: the fused kernels' CUDA bodies (``setup.py build_ext --inplace``) for
   ``TORCH_CUDA_ARCH_LIST`` (default 9.0: sm_90, the H100 / H200); they must register.
3. ``kernels``: the ``gpu``-marked kernel tests (every op against float64 on the GPU, with the
   self-check off so a body cannot hide behind its reference), then the self-check test that
   counts calls of the compiled CUDA bodies: passing it proves they ran and agreed.
4. ``parity``: a tiny GPT (fp32, dropout 0, 6 iterations, ``--mock-data``) on the GPU, its losses
   within 1e-4 of the ones recorded on the CPU in ``gpu_parity_cpu_losses.json`` (beside this
   file; ``--record-cpu-losses`` rewrites it on a CPU machine). TF32 is off for this stage.
5. ``bf16``: a small GPT on real text (this machine's Python standard library, a BPE vocabulary
   trained on it, Megatron's ``.bin/.idx``), trained in fp32 and in bf16 from the same seed: the
   bf16 loss must fall by ``BF16_MIN_DROP`` and end within ``BF16_MAX_GAP`` of fp32's.
6. ``mfu``: ``gpu_bench_models.py``: GPT-2 124M (s 1024) and 1.3B (24 layers, h 2048, s 2048),
   bf16, every fusion, SDPA flash attention, against 989 TFLOP/s and the measured bf16 matmul
   rate, beside ``transformers`` GPT-2 124M under ``torch.compile``.
7. if time remains: ``recompute`` (1.3B with selective recompute) and ``profile`` (the top GPU
   kernels of two 124M iterations, from ``torch.profiler``).

The whole run keeps to ``--budget-s`` (default 470 s: 8 minutes with the start-up); a stage that
would not fit is skipped and says so. ``--dry-run`` runs every stage on the CPU with tiny shapes
(no build: the CPU bodies of ``tools/setup_env.sh`` are used; the CPU kernel tests stand in for
the GPU ones), so the script is exercised by a slow test and cannot rot.

Output in ``$OUT`` (or ``--out``): ``summary.md`` (the table), ``summary.json``, and
``logs.tar.gz`` with every stage's log; three files, as a device machine's result folder takes.
Exit status 0 only when every stage that ran passed. Normally started by ``gpu_run.sh``.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
PARITY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "gpu_parity_cpu_losses.json")
PARITY_ATOL = 1e-4
BF16_MIN_DROP = 1.5      # nats from the first logged loss to the mean of the last five
BF16_MIN_DROP_DRY = 0.6  # the dry run's tiny model and 40 iterations on the CPU
BF16_MAX_GAP = 0.1       # nats between the bf16 and fp32 means of the last five losses
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\d.E+-]+)")

PARITY_FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 6 "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 "
    "--clip-grad 1.0 --init-method-std 0.02 --hidden-dropout 0 --attention-dropout 0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --seed 1234 "
    "--log-interval 1 --eval-iters 0 --eval-interval 1000000 --num-workers 0").split()


@dataclass
class Stage:
    name: str
    status: str = "skipped"          # ok | FAILED | skipped
    seconds: float = 0.0
    summary: str = ""
    details: dict = field(default_factory=dict)


@dataclass
class Run:
    """What every stage reads: the options, the log folder, the deadline."""

    dry_run: bool
    logs: str
    deadline: float
    python: str = sys.executable

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def env(self, **extra) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **extra)
        if self.dry_run:
            env.setdefault("OMP_NUM_THREADS", "2")
        return env

    def sh(self, name: str, cmd: List[str], timeout: float, **env) -> "Result":
        """Run ``cmd`` in the checkout; its output goes to ``<logs>/<name>.log``."""
        timeout = max(1.0, min(timeout, self.left()))
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=self.env(**env), capture_output=True,
                                 text=True, timeout=timeout)
            text, rc = out.stdout + out.stderr, out.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = _text(exc.stdout) + _text(exc.stderr), None
        with open(os.path.join(self.logs, f"{name}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n\n" + text)
        return Result(text, rc, timeout)


@dataclass
class Result:
    text: str
    rc: Optional[int]                # None: timed out
    timeout: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def why(self) -> str:
        if self.rc is None:
            return f"timed out after {self.timeout:.0f} s"
        tail = [line for line in self.text.strip().splitlines() if line.strip()][-1:]
        return f"exit status {self.rc}" + (f": {tail[0][:160]}" if tail else "")


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


def pretrain(run: Run, name: str, flags: List[str], timeout: float, **env) -> Result:
    cmd = [run.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "pretrain_gpt.py")] + flags + ["--device", run.device()]
    return run.sh(name, cmd, timeout, **env)


def losses_of(text: str) -> List[float]:
    """The ``lm loss`` of each logged iteration, in order."""
    return [float(m.group(2)) for m in map(LOSS_RE.search, text.splitlines()) if m]


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------

def stage_env(run: Run, stage: Stage) -> None:
    import platform

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine()}
    if not run.dry_run:
        if not torch.cuda.is_available():
            raise StageError(f"torch {torch.__version__} sees no CUDA device")
        facts["device"] = torch.cuda.get_device_name()
        facts["capability"] = "%d.%d" % torch.cuda.get_device_capability()
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            facts["driver"] = out.stdout.strip()
    stage.details = facts
    stage.summary = ", ".join(f"{k} {v}" for k, v in facts.items())


def stage_build(run: Run, stage: Stage) -> None:
    if run.dry_run:
        check = [run.python, "-c", "from megatron.fused_kernels import ops; "
                 "assert ops.kernels_available('cpu'), 'CPU bodies not built'"]
        result = run.sh("build", check, 60)
        stage.summary = "dry run: CPU bodies of tools/setup_env.sh"
    else:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 4))
        started = time.monotonic()
        result = run.sh("build", [run.python, "setup.py", "build_ext", "--inplace"], 300,
                        TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=jobs)
        if result.ok:
            result = run.sh("build_check", [run.python, "-c", (
                "from megatron.fused_kernels import loader, ops; "
                "assert ops.kernels_available('cuda'), loader.load_error() or 'no CUDA bodies'")],
                60)
        stage.summary = f"arch {arch}, {jobs} jobs, {time.monotonic() - started:.0f} s"
    if not result.ok:
        raise StageError(result.why())


def stage_kernels(run: Run, stage: Stage) -> None:
    pytest = [run.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # The dry run proves the stage's plumbing with one kernel family's CPU cases; the default
    # test suite runs all of them on the CPU anyway.
    marker = ["-m", "not slow", "-k", "bias_gelu"] if run.dry_run else ["-m", "gpu"]
    tests = run.sh("kernel_tests", pytest + marker + ["tests/unit/test_fused_kernels.py"], 240,
                   MEGATRON_KERNEL_SELFCHECK="0")
    proof = run.sh("kernel_proof", pytest + ["-k", "healthy_bodies", "-m",
                                             "not gpu" if run.dry_run else "gpu",
                                             "tests/unit/test_kernel_selfcheck.py"], 120)
    counts = [_pytest_counts(r.text) for r in (tests, proof)]
    stage.details = {"tests": counts[0], "proof": counts[1]}
    stage.summary = (f"kernel tests {counts[0]}; compiled-call proof {counts[1]}"
                     + (" (CPU bodies: dry run)" if run.dry_run else ""))
    for result, what in ((tests, "kernel tests"), (proof, "compiled-call proof")):
        if not result.ok or "passed" not in counts[0 if what == "kernel tests" else 1]:
            raise StageError(f"{what}: {result.why()}")


def _pytest_counts(text: str) -> str:
    found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
    return found[-1] if found else "no summary line"


def stage_parity(run: Run, stage: Stage, record: bool = False) -> None:
    result = pretrain(run, "parity", PARITY_FLAGS, 180, NVIDIA_TF32_OVERRIDE="0")
    got = losses_of(result.text)
    if not result.ok or len(got) != 6:
        raise StageError(f"{result.why()}; {len(got)} of 6 losses logged")
    if record:
        _record_cpu_losses(got)
        stage.summary = f"recorded {PARITY_FILE}"
        return
    with open(PARITY_FILE) as f:
        recorded = json.load(f)
    if recorded["flags"] != " ".join(PARITY_FLAGS):
        raise StageError(f"{PARITY_FILE} was recorded with other flags: rerun "
                         "benchmarks/gpu_run.py --record-cpu-losses on a CPU machine")
    gap = max(abs(a - b) for a, b in zip(got, recorded["losses"]))
    offload = _offload_losses(run)
    stage.details = {"device": got, "cpu": recorded["losses"], "max_abs_diff": gap,
                     "offload": offload}
    same = all(losses == got for losses in offload.values())
    stage.summary = (f"6 losses, max |{run.device()} - recorded cpu| = {gap:.2e} "
                     f"(limit {PARITY_ATOL:g}); activation offloading "
                     f"{'gives the same losses' if same else 'CHANGES the losses'}")
    if gap > PARITY_ATOL or not same:
        raise StageError(stage.summary)


# Activation offloading moves saved tensors to the host and back: on the device the losses must
# be the plain run's bit for bit (on the CPU of a dry run nothing moves).
OFFLOAD_FLAGS = {
    "layer": ["--cpu-offloading-num-layers", "1"],
    "modules": ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
                "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                "--min-offloaded-tensor-size", "1"],
}


def _offload_losses(run: Run) -> Dict[str, List[float]]:
    out = {}
    for name, extra in OFFLOAD_FLAGS.items():
        result = pretrain(run, f"parity_offload_{name}", PARITY_FLAGS + extra, 180,
                          NVIDIA_TF32_OVERRIDE="0")
        out[name] = losses_of(result.text)
        if not result.ok or len(out[name]) != 6:
            raise StageError(f"offload {name}: {result.why()}")
    return out


def _record_cpu_losses(losses: List[float]) -> None:
    import platform

    import torch

    with open(PARITY_FILE, "w") as f:
        json.dump({"what": "lm loss of iterations 1-6 of pretrain_gpt.py with these flags and "
                           "--device cpu (one process); gpu_run.py's parity stage compares the "
                           "GPU's with them",
                   "recorded": datetime.date.today().isoformat(),
                   "machine": platform.processor() or platform.machine(),
                   "torch": torch.__version__, "flags": " ".join(PARITY_FLAGS), "losses": losses},
                  f, indent=1)
        f.write("\n")


def stage_bf16(run: Run, stage: Stage) -> None:
    data = os.path.join(run.logs, "bf16_data")
    prefix = _build_corpus(run, data)
    shape = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
             "--micro-batch-size 4 --global-batch-size 8 --train-iters 40" if run.dry_run else
             "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
             "--micro-batch-size 8 --global-batch-size 32 --train-iters 60")
    seq = shape.split("--seq-length ")[1].split()[0]
    flags = (shape + f" --max-position-embeddings {seq} --lr 2e-3 --min-lr 2e-4 "
             "--lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.01 --clip-grad 1.0 "
             "--hidden-dropout 0 --attention-dropout 0 --seed 1234 --log-interval 1 "
             "--eval-iters 0 --eval-interval 1000000 --num-workers 0 --split 100,0,0 "
             f"--data-path {prefix} --tokenizer-type GPT2BPETokenizer "
             f"--vocab-file {data}/vocab.json --merge-file {data}/merges.txt").split()
    curves = {}
    for precision in ("fp32", "bf16"):
        extra = ["--bf16"] if precision == "bf16" else []
        result = pretrain(run, f"train_{precision}", flags + extra, 150)
        curves[precision] = losses_of(result.text)
        if not result.ok or len(curves[precision]) < 10:
            raise StageError(f"{precision} run: {result.why()}")
    first, tail = curves["bf16"][0], sum(curves["bf16"][-5:]) / 5
    gap = abs(tail - sum(curves["fp32"][-5:]) / 5)
    least = BF16_MIN_DROP_DRY if run.dry_run else BF16_MIN_DROP
    stage.details = curves
    stage.summary = (f"bf16 loss {first:.3f} -> {tail:.3f} (drop >= {least}), "
                     f"|bf16 - fp32| at the end {gap:.4f} (<= {BF16_MAX_GAP})")
    if first - tail < least or gap > BF16_MAX_GAP:
        raise StageError(stage.summary)


def _build_corpus(run: Run, data: str) -> str:
    """Standard-library JSONL, a BPE vocabulary trained on it, and its ``.bin/.idx``."""
    os.makedirs(data, exist_ok=True)
    size, vocab = ("600000", "1024") if run.dry_run else ("3000000", "4096")
    steps = [
        ("corpus", ["tools/build_stdlib_corpus.py", "--output", f"{data}/code.jsonl",
                    "--max-bytes", size]),
        ("tokenizer", ["tools/train_tokenizer.py", "--input", f"{data}/code.jsonl",
                       "--json-keys", "content", "--tokenizer-type", "GPT2BPETokenizer",
                       "--vocab-size", vocab, "--output", data]),
        ("preprocess", ["tools/preprocess_data.py", "--input", f"{data}/code.jsonl",
                        "--output-prefix", f"{data}/code", "--json-keys", "content",
                        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                        f"{data}/vocab.json", "--merge-file", f"{data}/merges.txt",
                        "--append-eod", "--workers", "2"]),
    ]
    for name, cmd in steps:
        result = run.sh(f"bf16_{name}", [run.python] + cmd, 120)
        if not result.ok:
            raise StageError(f"{name}: {result.why()}")
    return f"{data}/code_content_document"


def stage_mfu(run: Run, stage: Stage, only: Optional[List[str]] = None,
              reserve: float = 0.0) -> None:
    out = os.path.join(run.logs, "mfu" if only is None else "mfu_" + "_".join(only))
    cmd = [run.python, "benchmarks/gpu_bench_models.py", "--out", out,
           "--budget-s", str(max(30.0, run.left() - reserve - 20.0))]
    cmd += (["--dry-run", "--no-compile"] if run.dry_run else [])
    cmd += (["--only"] + only if only else [])
    result = run.sh(os.path.basename(out), cmd, run.left() - reserve)
    table = [line for line in result.text.splitlines() if line.startswith("|")]
    stage.details = {"table": table}
    stage.summary = "see the table below" if table else result.why()
    if not result.ok:
        raise StageError(result.why())


def stage_profile(run: Run, stage: Stage) -> None:
    from gpu_bench_models import FULL, TINY, megatron_flags

    shape = (TINY if run.dry_run else FULL)["megatron-124m"]
    shape = type(shape)(**{**asdict(shape), "iters": 5, "warmup": 2})
    board = os.path.join(run.logs, "profile_trace")
    flags = megatron_flags(shape, run.dry_run, 0.1)[:-2]   # pretrain() adds --device
    flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
              "--profile-step-end", "5", "--tensorboard-dir", board,
              "--pytorch-profiler-collect-chakra", "--log-memory-interval", "1",
              "--log-device-memory-used"]
    snapshot = os.path.join(run.logs, "memory_snapshot.pickle")
    if not run.dry_run:     # the CUDA allocator's history: GPU only
        flags += ["--record-memory-history", "--memory-snapshot-path", snapshot]
    result = pretrain(run, "profile", flags, run.left())
    if not result.ok:
        raise StageError(result.why())
    top = top_kernels(board, "cpu_op" if run.dry_run else "kernel")
    memory = [line for line in result.text.splitlines() if " memory (MB) | " in line]
    stage.details = {"top": top, "memory": memory[-1:],
                     "chakra": os.path.exists(os.path.join(run.logs, "chakra", "rank-0.json.gz")),
                     "snapshot_bytes": (os.path.getsize(snapshot) if os.path.exists(snapshot)
                                        else None)}
    stage.summary = "; ".join(f"{name[:48]} {share:.0%}" for name, share in top[:5])
    if not memory or not stage.details["chakra"] or (
            not run.dry_run and not stage.details["snapshot_bytes"]):
        raise StageError(f"memory report / chakra trace / snapshot missing: {stage.details}")


def top_kernels(folder: str, category: str, count: int = 10):
    """(name, share of the summed duration) of the ``count`` costliest events of ``category``
    in the Chrome traces under ``folder``."""
    totals = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".json") or name.endswith(".json.gz"):
                for event in _trace_events(os.path.join(dirpath, name)):
                    if event.get("cat") == category and "dur" in event:
                        totals[event["name"]] = totals.get(event["name"], 0.0) + event["dur"]
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:count]
    if not ranked:
        raise StageError(f"no {category} events in a trace under {folder}")
    return [(name, dur / whole) for name, dur in ranked]


def _trace_events(path: str):
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


class StageError(Exception):
    """A stage's failure, said in one line."""


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def stages(record: bool):
    """(name, function, the least time it needs in seconds), in the order they run."""
    return [
        ("env", stage_env, 1),
        ("build", stage_build, 60),
        ("kernels", stage_kernels, 30),
        ("parity", lambda run, st: stage_parity(run, st, record), 60),
        ("bf16", stage_bf16, 60),
        ("mfu", stage_mfu, 90),
        ("recompute", lambda run, st: stage_mfu(run, st, ["megatron-1.3b-selective"]), 60),
        ("profile", stage_profile, 40),
    ]


def run_stage(run: Run, name: str, body: Callable, least: float) -> Stage:
    stage = Stage(name)
    if run.left() < least:
        stage.summary = f"skipped: {run.left():.0f} s left, it needs {least} s"
        return stage
    started = time.monotonic()
    try:
        body(run, stage)
        stage.status = "ok"
    except StageError as exc:
        stage.status, stage.summary = "FAILED", str(exc)
    except Exception as exc:   # noqa: BLE001 - one stage's bug must not lose the others' results
        stage.status, stage.summary = "FAILED", f"{type(exc).__name__}: {exc}"
    stage.seconds = time.monotonic() - started
    print(f"[gpu_run] {name}: {stage.status} ({stage.seconds:.0f} s) {stage.summary}",
          flush=True)
    return stage


def summary_table(done: List[Stage]) -> str:
    lines = ["| stage | result | seconds | what it measured |", "|---|---|---|---|"]
    for st in done:
        lines.append(f"| {st.name} | {st.status} | {st.seconds:.0f} | "
                     f"{st.summary.replace('|', '/')} |")
    for st in done:
        if st.details.get("table"):
            lines += ["", f"{st.name}:", ""] + st.details["table"]
    return "\n".join(lines)


def write_outputs(out: str, logs: str, done: List[Stage], header: str) -> str:
    os.makedirs(out, exist_ok=True)
    text = summary_table(done)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"{header}\n\n{text}\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"header": header, "stages": [asdict(s) for s in done]}, f, indent=1)
    with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as tar:
        for dirpath, _, files in os.walk(logs):
            for name in files:
                path = os.path.join(dirpath, name)
                if not name.endswith((".bin", ".idx", ".jsonl")):   # data, not logs
                    tar.add(path, arcname=os.path.relpath(path, logs))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_run_out"))
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on the CPU with tiny shapes (no GPU, no build)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all stages (default 470; 1500 with --dry-run)")
    p.add_argument("--only", nargs="+", help="run only these stages")
    p.add_argument("--record-cpu-losses", action="store_true",
                   help="on a CPU machine: run the parity stage and rewrite " + PARITY_FILE)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if a.record_cpu_losses:
        a.dry_run, a.only = True, ["env", "parity"]
    if a.budget_s is None:
        a.budget_s = 1500.0 if a.dry_run else 470.0
    logs = tempfile.mkdtemp(prefix="gpu_run_logs_")
    run = Run(dry_run=a.dry_run, logs=logs, deadline=time.monotonic() + a.budget_s)
    header = (f"gpu_run {'--dry-run ' if a.dry_run else ''}"
              f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    done = []
    for name, body, least in stages(a.record_cpu_losses):
        if a.only and name not in a.only:
            continue
        done.append(run_stage(run, name, body, least))
        if name == "env" and done[-1].status != "ok":
            break                    # no GPU: nothing else can run
    text = write_outputs(a.out, logs, done, header + " | " + done[0].summary)
    shutil.rmtree(logs, ignore_errors=True)
    print(text, flush=True)
    return 1 if any(s.status == "FAILED" for s in done) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Mixture of experts on CPU: training speed against transformers' Mixtral, and the token
dispatcher's share of the step at expert parallelism 2.

One Mixtral-shaped GPT (default: 4 layers, hidden 256, 8 heads in 2 query groups (GQA), rope,
RMSNorm, no biases, untied output layer, 8 SwiGLU experts of FFN 512 in every layer, top-2
softmax routing with no capacity limit and no auxiliary loss, vocabulary 8192, sequence 256,
micro-batch 4, fp32, dropout 0, AdamW with lr 1e-4 constant, weight decay 0, gradient clipping
at 1.0) is trained on the same random batches by:

**(a) one process, against transformers** (``--threads`` intra-op threads each):

- ``ours``: this project's training step in-process, as ``pretrain_gpt.py`` runs it
  (``setup_model_and_optimizer`` and :func:`megatron.training.training.train_step` on
  ``pretrain_gpt.forward_step``: forward, fused cross entropy, backward, gradient buffer,
  clipping, our AdamW); ``ours-gg`` the same with ``--moe-grouped-gemm``;
- ``hf``: ``transformers.MixtralForCausalLM`` loaded from the folder that
  ``tools/checkpoint/convert.py --saver hf`` writes from ``ours``' initial checkpoint (so the
  two start from the same weights), in a plain PyTorch loop: forward, ``F.cross_entropy`` over
  the ``[b*s, V]`` logits, backward, ``clip_grad_norm_``, ``torch.optim.AdamW`` (its defaults:
  SDPA attention and, in transformers 5.24, the ``grouped_mm`` experts).

Each contender is a fresh process; they run alternately ``--repeats`` rounds. A run's time is
the median of its step times after ``--warmup`` steps, a contender's the fastest of its runs.
Next to the wall time, the process's CPU seconds per step (``time.process_time``, all threads):
on a machine that other work keeps busy, the wall time of a side depends on what else ran at
that moment, its CPU time much less (spinning OpenMP threads count in it).
Before any speed is printed, the first-batch losses of ``hf`` and ``ours`` must agree to 1e-5
relative (the same fp32 computation summed in another order differs by ulps per op), and the
losses of the following steps are shown side by side.

**(b) expert parallelism 2** (2 gloo processes under torchrun, data parallel 2, each rank 4 of
the 8 experts, one thread each), for ``--moe-token-dispatcher-type allgather`` and ``alltoall``,
next to EP 1 (every rank all experts, no dispatcher communication): the time spent in the
dispatcher's collectives over the expert-parallel group (all-to-all of the rows and of the row
counts; all-gather of tokens, probabilities and routing map; reduce-scatter of the outputs; in
forward and in backward, timed around each call in the training thread) as a share of the
training step, and the forward collectives as a share of the MoE layers' forward time. On CPU
gloo's collectives block, so this includes waiting for the other rank (its routing may give it
more rows).

Run::

    python benchmarks/bench_moe.py [--repeats 2] [--iters 6] [--warmup 2] [--threads 2]
        [--contenders ours,ours-gg,hf] [--parts hf,ep] [--quick] [--record]

``--quick`` shrinks the model and the runs to seconds (a smoke test of both parts, no numbers
worth recording).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
RESULT_TAG = "BENCH_MOE_RESULT "
LOSS_RTOL = 1e-5
ALL_CONTENDERS = ("ours", "ours-gg", "hf")


# ---------------------------------------------------------------------------------------------
# The configuration
# ---------------------------------------------------------------------------------------------

def model_flags(a) -> list:
    """``pretrain_gpt.py`` flags of the benchmarked Mixtral-shaped model and its optimizer."""
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
            f"--group-query-attention --num-query-groups {a.query_groups} "
            f"--position-embedding-type rope --normalization RMSNorm --swiglu "
            f"--disable-bias-linear --untie-embeddings-and-output-weights "
            f"--num-experts {a.experts} --moe-router-topk {a.topk} "
            f"--moe-ffn-hidden-size {a.ffn} --ffn-hidden-size {a.ffn} "
            f"--seq-length {a.seq} --max-position-embeddings {a.seq} "
            f"--micro-batch-size {a.micro_batch} "
            f"--lr 1e-4 --min-lr 1e-4 --lr-decay-style constant --weight-decay 0.0 "
            f"--clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 "
            f"--hidden-dropout 0 --attention-dropout 0 --tokenizer-type NullTokenizer "
            f"--vocab-size {a.vocab - 1} --make-vocab-size-divisible-by 1 --mock-data "
            f"--eval-iters 0 --device cpu --seed 1234 --num-workers 0").split()


def batches(a, count: int, seed: int = 0) -> list:
    """``count`` batches of ``[b, s + 1]`` token ids (never the null tokenizer's EOD, V - 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, a.vocab - 1, (a.micro_batch, a.seq + 1), generator=g)
            for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("MKL_NUM_THREADS", None)
    return env


def _run_child(cmd: list, env: dict) -> dict:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    results = [json.loads(line[len(RESULT_TAG):]) for line in proc.stdout.splitlines()
               if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-5000:]}")
    return results[0]


def _child_cmd(a, child: str, *extra) -> list:
    sizes = (f"--layers {a.layers} --hidden {a.hidden} --heads {a.heads} "
             f"--query-groups {a.query_groups} --experts {a.experts} --topk {a.topk} "
             f"--ffn {a.ffn} --vocab {a.vocab} --seq {a.seq} --micro-batch {a.micro_batch} "
             f"--iters {a.iters} --warmup {a.warmup} --threads {a.threads}").split()
    return [os.path.abspath(__file__), "--child", child] + sizes + list(extra)


# ---------------------------------------------------------------------------------------------
# In the child processes
# ---------------------------------------------------------------------------------------------

def _setup_ours(flags: list):
    """Model, optimizer, scheduler and micro-batch calculator as ``pretrain()`` builds them."""
    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.microbatches import NumMicroBatchesCalculator
    from megatron.training.timers import Timers
    from megatron.tokenizer import build_tokenizer
    from megatron.training.training import setup_model_and_optimizer

    args = validate_args(parse_args(argv=flags))
    pstate = initialize_megatron(args)
    tokenizer = build_tokenizer(args)
    build_configs(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer, timers=Timers(0),
                                     parallel_state=pstate)
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args,
                                                            pstate)
    calculator = NumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size,
                                           args.data_parallel_size, args.rampup_batch_size)
    return args, pstate, model, optimizer, scheduler, calculator


def _train_ours(setup, data: list, on_step=None) -> dict:
    """Train one step per batch of ``data``; step times (s) and losses."""
    import pretrain_gpt
    from megatron.training.training import train_step

    args, pstate, model, optimizer, scheduler, calculator = setup
    times, cpu, losses = [], [], []
    for i, text in enumerate(data, start=1):
        if on_step is not None:
            on_step()
        start, start_cpu = time.perf_counter(), time.process_time()
        logged, skipped, _, _ = train_step(pretrain_gpt.forward_step, iter([{"text": text}]),
                                           model, optimizer, scheduler, args, pstate,
                                           calculator, iteration=i)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        assert not skipped
        losses.append(logged.get("lm loss"))
    return {"times": times, "cpu": cpu, "losses": losses}


def child_ours(a) -> dict:
    import torch

    from megatron.training import checkpointing
    from megatron.training.train_state import TrainState

    torch.set_num_threads(a.threads)
    flags = model_flags(a) + ["--global-batch-size", str(a.micro_batch),
                              "--train-iters", str(a.warmup + a.iters)]
    if a.grouped_gemm:
        flags.append("--moe-grouped-gemm")
    if a.save:
        flags += ["--save", a.save]
    setup = _setup_ours(flags)
    if a.save:   # the untrained weights, for the Hugging Face side
        args, pstate, model, optimizer, scheduler, _ = setup
        checkpointing.save_checkpoint(0, model, optimizer, scheduler, args, pstate,
                                      train_state=TrainState())
    return _train_ours(setup, batches(a, a.warmup + a.iters))


def child_hf(a) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(a.threads)
    model = transformers.MixtralForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    times, cpu, losses = [], [], []
    for text in batches(a, a.warmup + a.iters):
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens, labels = text[:, :-1], text[:, 1:]                        # [b, s]
        logits = model(input_ids=tokens).logits                           # [b, s, V]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(loss.item())
    return {"times": times, "cpu": cpu, "losses": losses}


class _CommTimer:
    """Seconds spent in collectives over one group, by kind and by forward / backward.

    Wraps the functions the dispatcher and its autograd pairs call (the module attributes they
    look up: ``megatron.core.collectives`` for the dispatcher's own calls, the names
    ``megatron.core.tensor_parallel.mappings`` imported for the autograd functions), counting a
    call only when its group is ``group``. A call made while an MoE layer's forward runs
    (``in_forward``, set by :func:`child_ep`) is forward, any other backward. (Gradients are
    off inside an autograd function's forward, so the grad mode cannot tell the two apart.)
    """

    KINDS = {"all_to_all_single": "all-to-all", "all_gather_into_tensor": "all-gather",
             "reduce_scatter_tensor": "reduce-scatter"}

    def __init__(self, group):
        import torch

        from megatron.core import collectives
        from megatron.core.tensor_parallel import mappings

        self.group, self.torch = group, torch
        self.seconds = {}
        self.in_forward = False
        for module in (collectives, mappings):
            for name in self.KINDS:
                if hasattr(module, name):
                    setattr(module, name, self._wrap(getattr(module, name), self.KINDS[name]))

    def _wrap(self, fn, kind):
        def timed(*args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            if group is not self.group:
                return fn(*args, **kwargs)
            key = (kind, "fwd" if self.in_forward else "bwd")
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        return timed

    def reset(self):
        self.seconds = {}


def _time_method(cls, name: str, totals: dict, key: str, comm=None) -> None:
    """Add the wall time of every ``cls.name`` call made with gradients enabled to
    ``totals[key]``; with ``comm`` (a :class:`_CommTimer`), mark the call as forward for it."""
    import torch

    fn = getattr(cls, name)

    def timed(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(self, *args, **kwargs)
        start = time.perf_counter()
        if comm is not None:
            comm.in_forward = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            if comm is not None:
                comm.in_forward = False
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
    setattr(cls, name, timed)


def child_ep(a) -> dict:
    """Rank body under torchrun: train at ``--ep``, timing the dispatcher's collectives."""
    import torch
    import torch.distributed as dist

    from megatron.model.moe import dispatcher as dispatcher_mod
    from megatron.model.moe.layer import MoELayer

    torch.set_num_threads(a.threads)
    world = int(os.environ["WORLD_SIZE"])
    flags = model_flags(a) + [
        "--global-batch-size", str(a.micro_batch * world),
        "--train-iters", str(a.warmup + a.iters),
        "--expert-model-parallel-size", str(a.ep),
        "--moe-token-dispatcher-type", a.dispatcher]
    setup = _setup_ours(flags)
    pstate = setup[1]
    comm = _CommTimer(pstate.ep_group)
    moe = {}
    _time_method(MoELayer, "forward", moe, "layer", comm)
    for cls in (dispatcher_mod.AllGatherTokenDispatcher, dispatcher_mod.AllToAllTokenDispatcher):
        _time_method(cls, "dispatch", moe, "dispatch")
        _time_method(cls, "combine", moe, "combine")
    per_step = []

    def on_step():
        if comm.seconds or moe:
            per_step.append((dict(comm.seconds), dict(moe)))
        comm.reset()
        moe.clear()

    rank_data = batches(a, a.warmup + a.iters, seed=100 + pstate.dp_rank)
    result = _train_ours(setup, rank_data, on_step)
    on_step()
    steps = per_step[a.warmup:]
    result["comm"] = [{f"{k}/{d}": v for (k, d), v in s[0].items()} for s in steps]
    result["moe"] = [s[1] for s in steps]
    out = [None] * world
    dist.all_gather_object(out, result)
    return out


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def _median_after_warmup(result: dict, warmup: int, key: str = "times") -> float:
    return statistics.median(result[key][warmup:])


def part_hf(a, tmp: str) -> None:
    tokens = a.micro_batch * a.seq
    ckpt, hf_dir = os.path.join(tmp, "ckpt"), os.path.join(tmp, "hf")
    env = _child_env(a.threads)
    env.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1")
    runs = {c: [] for c in a.contenders}
    for round_ in range(a.repeats):
        for c in a.contenders:
            env["MASTER_PORT"] = str(_free_port())
            if c == "hf":
                if not os.path.isdir(hf_dir):
                    convert = [sys.executable, "tools/checkpoint/convert.py", "--model-type",
                               "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
                               ckpt, "--save-dir", hf_dir, "--allow-no-tokenizer"]
                    out = subprocess.run(convert, env=env, cwd=ROOT, capture_output=True,
                                         text=True)
                    if out.returncode:
                        raise SystemExit(f"export failed:\n{out.stdout[-3000:]}"
                                         f"{out.stderr[-3000:]}")
                cmd = _child_cmd(a, "hf", "--hf-dir", hf_dir)
            else:
                extra = ["--save", ckpt] if not os.path.isdir(ckpt) else []
                if c == "ours-gg":
                    extra.append("--grouped-gemm")
                cmd = _child_cmd(a, "ours", *extra)
            runs[c].append(_run_child([sys.executable] + cmd, env))
    if "hf" in runs and "ours" in runs:
        ours, hf = runs["ours"][0]["losses"], runs["hf"][0]["losses"]
        gap = abs(ours[0] - hf[0]) / abs(hf[0])
        if gap > LOSS_RTOL:
            raise SystemExit(f"first-batch loss: ours {ours[0]:.7f}, hf {hf[0]:.7f} (relative "
                             f"{gap:.2e} > {LOSS_RTOL}): not the same computation")
        print(f"first-batch loss: ours {ours[0]:.6f}, hf {hf[0]:.6f} (relative difference "
              f"{gap:.1e}, within {LOSS_RTOL}: the same computation)")
        shown = min(len(ours), 6)
        print("losses, steps 1-%d: ours %s; hf %s" % (
            shown, " ".join(f"{x:.5f}" for x in ours[:shown]),
            " ".join(f"{x:.5f}" for x in hf[:shown])))
        print()
    print("| contender | step (s), each run | tokens/s | speed vs hf | CPU s / step, each run "
          "| tokens per CPU s | vs hf |")
    print("|---|---|---|---|---|---|---|")
    best = {c: min(_median_after_warmup(r, a.warmup) for r in rs) for c, rs in runs.items()}
    cpu = {c: min(_median_after_warmup(r, a.warmup, "cpu") for r in rs)
           for c, rs in runs.items()}
    for c, rs in runs.items():
        vs = f"{best['hf'] / best[c]:.2f}x" if "hf" in best else "-"
        vs_cpu = f"{cpu['hf'] / cpu[c]:.2f}x" if "hf" in cpu else "-"
        each = ", ".join(f"{_median_after_warmup(r, a.warmup):.3f}" for r in rs)
        each_cpu = ", ".join(f"{_median_after_warmup(r, a.warmup, 'cpu'):.3f}" for r in rs)
        print(f"| {c} | {each} | {tokens / best[c]:.0f} | {vs} | {each_cpu} | "
              f"{tokens / cpu[c]:.0f} | {vs_cpu} |", flush=True)
    print()


def part_ep(a) -> None:
    env = _child_env(1)
    rows = []
    for ep, dispatcher in ((1, "allgather"), (2, "allgather"), (2, "alltoall")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2"] + _child_cmd(a, "ep", "--ep", str(ep),
                                                      "--dispatcher", dispatcher)
        cmd[cmd.index("--threads") + 1] = "1"
        rows.append((ep, dispatcher, _run_child(cmd, env)))
    print(f"Expert parallelism on 2 gloo ranks (data parallel 2, micro-batch {a.micro_batch} "
          f"per rank, one thread per rank); medians over {a.iters} steps, mean of the ranks:")
    print()
    print("| EP | dispatcher | step (s) | tokens/s (both ranks) | MoE layers fwd (s) | "
          "dispatcher collectives fwd + bwd (s) | of the step | fwd collectives / MoE fwd | "
          "by kind, fwd + bwd (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ep, dispatcher, ranks in rows:
        def mean_median(get):
            return statistics.mean(statistics.median(get(r, i) for i in range(a.iters))
                                   for r in ranks)
        step = mean_median(lambda r, i: r["times"][a.warmup + i])
        layer = mean_median(lambda r, i: r["moe"][i].get("layer", 0.0))
        total = mean_median(lambda r, i: sum(r["comm"][i].values()))
        fwd = mean_median(lambda r, i: sum(v for k, v in r["comm"][i].items()
                                           if k.endswith("/fwd")))
        def of_kind(kind):
            return mean_median(lambda r, i: sum(v for k, v in r["comm"][i].items()
                                                if k.startswith(kind + "/")))
        kinds = sorted({k.split("/")[0] for r in ranks for s in r["comm"] for k in s})
        by_kind = ", ".join(f"{kind} {of_kind(kind):.3f}" for kind in kinds) or "-"
        tokens = 2 * a.micro_batch * a.seq
        name = dispatcher if ep > 1 else "(none: every rank all experts)"
        print(f"| {ep} | {name} | {step:.3f} | {tokens / step:.0f} | {layer:.3f} | "
              f"{total:.3f} | {total / step:.1%} | "
              f"{(fwd / layer if layer else 0):.1%} | {by_kind} |", flush=True)
    print()


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--query-groups", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512, help="each expert's FFN size")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of part (a)")
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS))
    p.add_argument("--parts", default="hf,ep", help="hf: (a), ep: (b)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--record", action="store_true", help="append the output to RESULTS.md")
    # Child processes.
    p.add_argument("--child", choices=["ours", "hf", "ep"], help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--grouped-gemm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--dispatcher", default="allgather", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.heads, a.query_groups, a.experts = 2, 64, 4, 2, 4
        a.ffn, a.vocab, a.seq, a.micro_batch = 128, 512, 32, 2
        a.iters, a.warmup, a.repeats = 2, 1, 1
    a.contenders = [c for c in a.contenders.split(",") if c]
    a.parts = [x for x in a.parts.split(",") if x]
    unknown = set(a.contenders) - set(ALL_CONTENDERS)
    if unknown:
        p.error(f"--contenders: unknown {sorted(unknown)}; choose from {list(ALL_CONTENDERS)}")
    return a


def main(argv=None) -> None:
    a = _parse(argv)
    if a.child:
        sys.path.insert(0, ROOT)
        result = {"ours": child_ours, "hf": child_hf, "ep": child_ep}[a.child](a)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT_TAG + json.dumps(result), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from record import recording

    with recording(a.record, "Mixture of experts (bench_moe.py)"):
        print(f"Mixtral-shaped GPT: {a.layers} layers, hidden {a.hidden}, {a.heads} heads / "
              f"{a.query_groups} query groups, {a.experts} SwiGLU experts (FFN {a.ffn}) top-"
              f"{a.topk}, rope, RMSNorm, vocabulary {a.vocab}, sequence {a.seq}, micro-batch "
              f"{a.micro_batch}, fp32, AdamW; {a.warmup} warm-up + {a.iters} timed steps")
        print(f"load average before: {_load_average()} (other work on the machine disturbs "
              "the times; the alternating runs share it only roughly)")
        print()
        if "hf" in a.parts:
            print(f"(a) One process, {a.threads} thread{'s' if a.threads > 1 else ''}, "
                  f"against transformers "
                  f"{_version('transformers')} MixtralForCausalLM; best of {a.repeats} runs:")
            print()
            with tempfile.TemporaryDirectory() as tmp:
                part_hf(a, tmp)
        if "ep" in a.parts:
            print("(b) ", end="")
            part_ep(a)
        print(f"load average after: {_load_average()}")


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:   # noqa: BLE001 - only for the heading
        return "?"


if __name__ == "__main__":
    main()

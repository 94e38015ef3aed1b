"""Peak memory of checkpoint resharding against the size of the checkpoint and of its pieces.

Writes a GPT checkpoint of about 350M parameters (24 layers, hidden 1024, 16 heads, GPT-2's
50,257-token vocabulary; fp32) directly with ``torch.save`` in our layout at TP=2, PP=1, with
Adam moments as a trained checkpoint has them (``--no-optimizer`` leaves them out), then runs
``tools/checkpoint/convert.py`` to TP=1, PP=2 as a separate program and reports its peak RSS
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``, taken in a small wrapper process, see ``_WRAPPER``),
its peak anonymous (non-file) RSS sampled from ``/proc`` every 10 ms, and the peak RSS of a
program that only imports what the converter imports. The claim under test: the converter's
memory follows the largest piece (the embedding table or one layer), not the checkpoint.

Run::

    python benchmarks/bench_convert_memory.py [--layers 24] [--hidden 1024] [--workdir /tmp/x]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron.training import checkpointing
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.convert.schema import padded_vocab_size  # noqa: E402

MB = 1024 * 1024


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257, help="the tokenizer's size")
    parser.add_argument("--source-tp", type=int, default=2)
    parser.add_argument("--target-tp", type=int, default=1)
    parser.add_argument("--target-pp", type=int, default=2)
    parser.add_argument("--no-optimizer", action="store_true",
                        help="write the source without Adam moments")
    parser.add_argument("--workdir", default=None, help="default: a temporary folder, removed")
    return parser.parse_args(argv)


def _model_args(opts) -> argparse.Namespace:
    """The args namespace a training run of this model would save."""
    flags = (f"--num-layers {opts.layers} --hidden-size {opts.hidden} --num-attention-heads "
             f"{opts.heads} --seq-length 1024 --max-position-embeddings 1024 "
             "--micro-batch-size 1 --global-batch-size 8 --train-iters 100 --lr 1e-4 "
             "--tokenizer-type NullTokenizer "
             f"--vocab-size {opts.vocab - 1} --tensor-model-parallel-size {opts.source_tp} "
             "--mock-data").split()
    args = parse_args(argv=flags)
    args.world_size, args.rank = opts.source_tp, 0
    validate_args(args)
    args.padded_vocab_size = padded_vocab_size(opts.vocab, 128, opts.source_tp)
    args.consumed_train_samples, args.consumed_valid_samples, args.iteration = 800, 0, 100
    return args


def _rank_model(args, tp: int) -> dict:
    """One rank's ``model`` tree at TP size ``tp``, random weights (ones for norm weights)."""
    h, ffn = args.hidden_size, args.ffn_hidden_size

    def rand(*shape):
        return torch.randn(*shape) * 0.02

    encoder = {}
    for i in range(args.num_layers):
        for name, shape in (("input_layernorm.weight", (h,)), ("input_layernorm.bias", (h,)),
                            ("self_attention.query_key_value.weight", (3 * h // tp, h)),
                            ("self_attention.query_key_value.bias", (3 * h // tp,)),
                            ("self_attention.dense.weight", (h, h // tp)),
                            ("self_attention.dense.bias", (h,)),
                            ("post_attention_layernorm.weight", (h,)),
                            ("post_attention_layernorm.bias", (h,)),
                            ("mlp.dense_h_to_4h.weight", (ffn // tp, h)),
                            ("mlp.dense_h_to_4h.bias", (ffn // tp,)),
                            ("mlp.dense_4h_to_h.weight", (h, ffn // tp)),
                            ("mlp.dense_4h_to_h.bias", (h,))):
            norm_weight = "norm" in name and name.endswith("weight")
            encoder[f"layers.{i}.{name}"] = torch.ones(shape) if norm_weight else rand(*shape)
    encoder["final_layernorm.weight"] = torch.ones(h)
    encoder["final_layernorm.bias"] = torch.zeros(h)
    embedding = {"word_embeddings": {"weight": rand(args.padded_vocab_size // tp, h)},
                 "position_embeddings": {"weight": rand(args.max_position_embeddings, h)}}
    return {"language_model": {"embedding": embedding, "encoder": encoder}}


def write_source(opts, root: str) -> dict:
    """The TP x 1 checkpoint under ``root``; returns its sizes in bytes."""
    args = _model_args(opts)
    total = 0
    for tp in range(opts.source_tp):
        model = _rank_model(args, opts.source_tp)
        params = list(_leaves(model))
        state = {"args": args, "checkpoint_version": checkpointing.CHECKPOINT_VERSION,
                 "iteration": args.iteration, "model": model,
                 "opt_param_scheduler": {"num_steps": 800, "max_lr": 1e-4}}
        if not opts.no_optimizer:
            state["optimizer"] = {"state": {i: {"exp_avg": torch.zeros_like(p),
                                                "exp_avg_sq": torch.zeros_like(p)}
                                            for i, p in enumerate(params)},
                                  "param_groups": [{"params": list(range(len(params)))}]}
        path = checkpointing.checkpoint_file(root, args.iteration, tp, 0, 1)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
        total += os.path.getsize(path)
        del state, model, params
    with open(os.path.join(root, checkpointing.TRACKER_FILENAME), "w") as f:
        f.write(str(args.iteration))
    h, ffn = args.hidden_size, args.ffn_hidden_size
    layer = 4 * (3 * h * h + 3 * h + h * h + h + 2 * h * ffn + ffn + h + 4 * h)
    return {"checkpoint": total, "layer": layer, "embedding": 4 * args.padded_vocab_size * h,
            "params": sum(t.numel() for t in _leaves(_shapes_only(args)))}


def _leaves(tree: dict):
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


def _shapes_only(args) -> dict:
    """The whole model's tensors as meta tensors (for the parameter count)."""
    with torch.device("meta"):
        return _rank_model(args, 1)


# Runs a command and prints its peak RSS. getrusage reports for a child the larger of its own
# peak and that of the memory image it replaced at exec, i.e. of the process that spawned it: this
# wrapper is a fresh, small interpreter, so the number is the command's alone (the benchmark
# itself held the whole source checkpoint while writing it).
_WRAPPER = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(p.returncode)")


def _child_pid(pid: int):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        return int(children[0]) if children else None
    except OSError:
        return None


def _anon_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(cmd) -> dict:
    """Run ``cmd``; its peak RSS (getrusage), peak anonymous RSS (sampled every 10 ms), wall
    seconds and output."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER] + cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak_anon, child = 0, None
    while proc.poll() is None:
        child = child or _child_pid(proc.pid)
        if child:
            peak_anon = max(peak_anon, _anon_rss(child))
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
    lines = output.strip().splitlines()
    peak = int(lines[-1].split()[1]) * 1024
    return {"peak_rss": peak, "peak_anon": peak_anon, "seconds": seconds,
            "output": "\n".join(lines[:-1])}


def run_converter(opts, src: str, dst: str) -> dict:
    return measure([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                    "--model-type", "GPT", "--loader", "megatron", "--saver", "megatron",
                    "--load-dir", src, "--save-dir", dst,
                    "--target-tensor-parallel-size", str(opts.target_tp),
                    "--target-pipeline-parallel-size", str(opts.target_pp)])


def import_baseline() -> int:
    """Peak RSS of a program that imports what the converter imports and does nothing."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tools.checkpoint.convert, "
            "megatron.convert.megatron_io, megatron.model.transformer, "
            "megatron.tokenizer.tokenizer")
    return measure([sys.executable, "-c", code, ROOT])["peak_rss"]


def main(argv=None) -> None:
    opts = get_args(argv)
    workdir = opts.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    src, dst = os.path.join(workdir, "source"), os.path.join(workdir, "target")
    try:
        start = time.perf_counter()
        sizes = write_source(opts, src)
        print(f"wrote the source in {time.perf_counter() - start:.1f} s", flush=True)
        result = run_converter(opts, src, dst)
        baseline = import_baseline()
        target = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(dst)
                     for f in files)
        print(result["output"].strip())
        print(f"model: {sizes['params'] / 1e6:.0f}M parameters, fp32, {opts.layers} layers, "
              f"hidden {opts.hidden}; TP={opts.source_tp} PP=1 -> TP={opts.target_tp} "
              f"PP={opts.target_pp}")
        print(f"source checkpoint on disk:        {sizes['checkpoint'] / MB:8.0f} MiB"
              + ("" if opts.no_optimizer else " (with Adam moments)"))
        print(f"target checkpoint on disk:        {target / MB:8.0f} MiB")
        print(f"largest layer (whole):            {sizes['layer'] / MB:8.1f} MiB")
        print(f"word embedding table (whole):     {sizes['embedding'] / MB:8.1f} MiB")
        print(f"converter peak RSS:               {result['peak_rss'] / MB:8.0f} MiB")
        print(f"converter peak anonymous RSS:     {result['peak_anon'] / MB:8.0f} MiB "
              "(sampled every 10 ms)")
        print(f"peak RSS of the imports alone:    {baseline / MB:8.0f} MiB")
        print(f"converter peak RSS - imports:     {(result['peak_rss'] - baseline) / MB:8.0f} "
              f"MiB = {(result['peak_rss'] - baseline) / sizes['embedding']:.2f} x the "
              "embedding table")
        print(f"conversion time:                  {result['seconds']:8.1f} s")
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

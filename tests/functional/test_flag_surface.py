"""The training-loop flags of Megatron's surface, end to end on one CPU rank: --log-params-norm,
--log-throughput, --log-timers-to-tensorboard and --log-memory-to-tensorboard (console line and
TensorBoard scalars), --profile with --use-pytorch-profiler (a trace json with op events) and
--pytorch-profiler-collect-chakra, --log-memory-interval with --log-device-memory-used,
--manual-gc, --empty-unused-memory-level and --pretrained-checkpoint.

All runs share one spawned process (each pretrain() is set up from scratch).
"""

import glob
import gzip
import json
import os
import re

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 4


def _run(argv, count_gc=False):
    """pretrain() on this rank; its stdout, losses and (with ``count_gc``) what the garbage
    collector did: the iterations at which a collection ran and whether automatic collection was
    on during each forward step."""
    import contextlib
    import gc
    import io
    import sys

    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training import training
    from megatron.core import parallel_state

    seen = {"collect_at": [], "auto_gc_in_forward": []}
    real_collect, real_train_step = gc.collect, training.train_step
    iteration = [0]

    def collect(*a, **k):
        seen["collect_at"].append(iteration[0])
        return real_collect(*a, **k)

    def train_step(*a, **k):
        out = real_train_step(*a, **k)
        iteration[0] += 1
        return out

    def forward_step(data_iterator, model):
        seen["auto_gc_in_forward"].append(gc.isenabled())
        return pretrain_gpt.forward_step(data_iterator, model)

    out = io.StringIO()
    if count_gc:
        gc.collect, training.train_step = collect, train_step
    try:
        with contextlib.redirect_stdout(out):
            state = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                      pretrain_gpt.model_provider, None, forward_step, argv=argv)
    finally:
        gc.collect, training.train_step = real_collect, real_train_step
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    sys.stdout.write(out.getvalue())
    return {"stdout": out.getvalue(), "losses": [v for _, v in state.train_loss_history],
            "gc": seen, "gc_enabled_after": gc.isenabled()}


def _scenarios(runs):
    return {name: _run(argv, **kw) for name, argv, kw in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("surface"))
    corpus = write_counting_corpus(os.path.join(root, "corpus", "count_document"))
    base = gpt_flags(corpus, ITERS)
    ckpt = os.path.join(root, "pretrained")
    scenarios = [
        ("logging", base + ["--log-params-norm", "--log-throughput", "--timing-log-level", "1",
                            "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
                            "--tensorboard-dir", os.path.join(root, "tb"), "--save",
                            os.path.join(root, "logged"),
                            "--ckpt-format", "torch"], {}),   # its file is read below
        ("profile", base + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                            "--profile-step-end", "3", "--tensorboard-dir",
                            os.path.join(root, "prof"), "--pytorch-profiler-collect-chakra",
                            "--nvtx-ranges", "--log-memory-interval", "2",
                            "--log-device-memory-used"], {}),
        ("nsys_on_cpu", base + ["--profile"], {}),
        ("plain", base, {}),
        ("manual_gc", base + ["--manual-gc", "--manual-gc-interval", "2",
                              "--empty-unused-memory-level", "2"], {"count_gc": True}),
        ("pretrain", gpt_flags(corpus, 2) + ["--save", ckpt], {}),
        ("finetune", base + ["--load", ckpt, "--finetune"], {}),
        ("from_pretrained", base + ["--load", os.path.join(root, "empty"),
                                    "--pretrained-checkpoint", ckpt], {}),
    ]
    result = run_on_ranks(_scenarios, 1, scenarios, timeout=600)[0]
    return {"root": root, **result}


def _tensorboard(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith(" iteration ")]


def test_params_norm_is_the_norm_of_the_saved_weights(runs):
    """The logged norm after the last step equals the fp64 norm of the checkpoint saved then
    (one rank: every parameter counted once, the tied embedding once)."""
    lines = _log_lines(runs["logging"]["stdout"])
    norms = [float(re.search(r"\| params norm: ([\d.]+) \|", line)[1]) for line in lines]
    assert len(norms) == ITERS
    path = os.path.join(runs["root"], "logged", f"iter_{ITERS:07d}", "mp_rank_00",
                        "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)["model"]

    def tensors(tree):
        for value in tree.values():
            if isinstance(value, dict):
                yield from tensors(value)
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                yield value

    want = float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors(state))))
    assert norms[-1] == pytest.approx(want, abs=1e-3)  # printed with 3 decimals
    tb = _tensorboard(os.path.join(runs["root"], "tb"))
    assert [s for s, _ in tb["params-norm"]] == list(range(1, ITERS + 1))
    assert tb["params-norm"][-1][1] == pytest.approx(want, rel=1e-6)
    # Without the flag, no field.
    assert "params norm" not in runs["plain"]["stdout"]


def test_throughput_field_and_scalar(runs):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.log import num_floating_point_operations

    lines = _log_lines(runs["logging"]["stdout"])
    tflops = [float(re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): ([-+.\de]+) \|", ln)[1])
              for ln in lines]
    ms = [float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", ln)[1])
          for ln in lines]
    args = validate_args(parse_args(argv=gpt_flags("x", ITERS)))
    args.padded_vocab_size = 256  # 128 + the EOD token, padded to a multiple of 128
    flops = num_floating_point_operations(args, 4)
    for t, m in zip(tflops, ms):
        # The time is printed to 0.1 ms (rounding: up to 0.05 ms of m), the throughput to 4
        # significant digits.
        assert t == pytest.approx(flops / (m / 1000.0) / 1e12, rel=0.05 / m + 1e-3)
    tb = _tensorboard(os.path.join(runs["root"], "tb"))
    assert [s for s, _ in tb["throughput"]] == list(range(1, ITERS + 1))
    assert "TFLOP/s" not in runs["plain"]["stdout"]


def test_timers_and_memory_scalars(runs):
    tb = _tensorboard(os.path.join(runs["root"], "tb"))
    steps = list(range(1, ITERS + 1))
    for tag in ("iteration-time", "forward-backward-time", "optimizer-time"):
        assert [s for s, _ in tb[tag]] == steps, tag
        assert all(v > 0 for _, v in tb[tag]), tag
    # forward-backward and the optimizer step are parts of an iteration.
    for (_, it), (_, fb), (_, opt) in zip(tb["iteration-time"], tb["forward-backward-time"],
                                          tb["optimizer-time"]):
        assert fb + opt < it
    for tag in ("mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes"):
        assert [s for s, _ in tb[tag]] == steps, tag
        assert all(v > 10 * 2 ** 20 for _, v in tb[tag]), tag  # a torch process: > 10 MiB RSS
    assert all(m >= a for (_, m), (_, a) in zip(tb["mem-max-allocated-bytes"],
                                                tb["mem-allocated-bytes"]))


def test_pytorch_profiler_trace_has_op_events(runs):
    traces = glob.glob(os.path.join(runs["root"], "prof", "*.pt.trace.json*"))
    assert len(traces) == 1, traces
    opener = gzip.open if traces[0].endswith(".gz") else open
    with opener(traces[0], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::addmm"} & ops and len(ops) > 20
    # Iterations 1 and 2 (0-based) are recorded: two ProfilerStep ranges.
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]
    # The profiled run trains as the plain one does.
    assert runs["profile"]["losses"] == runs["plain"]["losses"]


def test_chakra_execution_trace_is_written_where_megatron_writes_it(runs):
    """--pytorch-profiler-collect-chakra: <--tensorboard-dir>/../chakra/rank-0.json.gz, torch's
    execution trace (a graph of the recorded ops) of the profiled iterations."""
    with gzip.open(os.path.join(runs["root"], "chakra", "rank-0.json.gz"), "rt") as f:
        trace = json.load(f)
    names = [node["name"] for node in trace["nodes"]]
    assert "aten::mm" in names and len(names) > 100
    notes = [ln for ln in runs["profile"]["stdout"].splitlines() if "--nvtx-ranges" in ln]
    assert len(notes) == 1 and "on CPU it has no effect" in notes[0]


def test_log_memory_interval_reports_every_second_iteration(runs):
    """Megatron's memory line after iterations 2 and 4 (--log-memory-interval 2): on CPU the
    resident set (allocated, reserved) and its peak, and the machine's used memory."""
    pattern = re.compile(r"^\[Rank 0\] \(after (\d+) iterations\) memory \(MB\) \| "
                         r"allocated: ([\d.]+) \| max allocated: ([\d.]+) \| reserved: "
                         r"([\d.]+) \| max reserved: ([\d.]+) \| total device memory used: "
                         r"([\d.]+)$")
    found = [pattern.match(ln) for ln in runs["profile"]["stdout"].splitlines()]
    found = [m for m in found if m]
    assert [int(m.group(1)) for m in found] == [2, 4]
    with open("/proc/meminfo") as f:
        total_mb = int(f.readline().split()[1]) / 1024
    for m in found:
        allocated, peak, reserved, peak_reserved, used = map(float, m.groups()[1:])
        assert 10 < allocated <= peak < total_mb and (reserved, peak_reserved) == (allocated, peak)
        assert allocated < used < total_mb
    assert not [ln for ln in runs["plain"]["stdout"].splitlines() if "memory (MB) |" in ln]


def test_profile_without_pytorch_profiler_notes_no_effect_on_cpu(runs):
    notes = [ln for ln in runs["nsys_on_cpu"]["stdout"].splitlines() if "--profile" in ln]
    assert len(notes) == 1 and "on CPU it has no effect" in notes[0]
    assert runs["nsys_on_cpu"]["losses"] == runs["plain"]["losses"]


def test_manual_gc(runs):
    """Automatic collection is off in every training forward step, a collection runs at the start and
    after iterations 2 and 4, and the collector is on again afterwards; losses unchanged."""
    out = runs["manual_gc"]
    # Two micro-batches per iteration; the final evaluation (after training) comes later.
    in_training = out["gc"]["auto_gc_in_forward"][:2 * ITERS]
    assert len(in_training) == 2 * ITERS and not any(in_training)
    assert out["gc"]["collect_at"] == [0, 2, 4]
    assert out["gc_enabled_after"]
    assert out["losses"] == runs["plain"]["losses"]
    notes = [ln for ln in out["stdout"].splitlines() if "--empty-unused-memory-level" in ln]
    assert len(notes) == 1 and "on CPU the free host memory the run keeps goes back" in notes[0]


def test_pretrained_checkpoint_starts_as_finetune_when_load_is_empty(runs):
    out = runs["from_pretrained"]
    assert "starting from the weights of --pretrained-checkpoint" in out["stdout"]
    assert len(out["losses"]) == ITERS  # from iteration 0
    assert out["losses"] == runs["finetune"]["losses"]
    assert out["losses"][0] != runs["plain"]["losses"][0]

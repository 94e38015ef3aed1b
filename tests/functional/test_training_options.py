"""Training-loop flags end to end: batch ramp-up, exits (SIGTERM, duration, interval), --skip-train,
TensorBoard and wandb scalars, and the checkpoint flags (--no-save-optim, --no-save-rng,
--finetune, --use-checkpoint-args, the LR-schedule override flags).

Several ``pretrain()`` runs share one spawned process (each is set up from scratch), which keeps
the process start-up cost to one per test.
"""

import math
import os
import re

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks

GBS = 4  # gpt_flags' global batch
LOG_LINE = re.compile(r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|.*"
                      r"\| learning rate: ([-+.\dE]+) \| global batch size: +(\d+) \| "
                      r"(?:lm loss: ([-+.\dE]+) \| )?loss scale: ([\d.]+) \| "
                      r"(?:grad norm: ([\d.]+) \| )?number of skipped iterations: +(\d+) \| "
                      r"number of nan iterations: +(\d+) \|$")
EVAL_VALUE = re.compile(r"validation loss at (.*?) \| lm loss value: ([-+.\dE]+) \|")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


# -- flags ------------------------------------------------------------------------------------

def _without(flags, name, nvalues=1):
    i = flags.index(name)
    return flags[:i] + flags[i + 1 + nvalues:]


def _with(flags, name, value):
    flags = list(flags)
    flags[flags.index(name) + 1] = str(value)
    return flags


def megatron_cosine_lr(step, warmup, decay, max_lr, min_lr):
    """Megatron's LR at ``step`` samples: linear warmup from 0, then cosine to ``min_lr``."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


# -- bodies run in the spawned ranks ------------------------------------------------------------

def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value.detach().clone()
    return out


def _fake_wandb_module():
    import types

    fake = types.ModuleType("wandb")
    fake.calls = []
    fake.init = lambda **kw: fake.calls.append(("init", {k: kw[k] for k in ("project", "name",
                                                                           "dir")}))
    fake.log = lambda data, step=None: fake.calls.append(("log", data, step))
    fake.finish = lambda: fake.calls.append(("finish",))
    return fake


def _pretrain_probed(argv, kill_after=None, minutes_per_iteration=None, fake_wandb=False):
    """pretrain() with probes: the state the training loop starts from, each iteration's logged
    scalars and the console output.

    Args:
        kill_after: send this process SIGTERM after that many iterations (last rank only).
        minutes_per_iteration: the training loop's clock advances this much per iteration.
        fake_wandb: install a recording stand-in for the ``wandb`` package.
    """
    import contextlib
    import inspect
    import io
    import signal
    import sys
    import types

    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training import training
    from megatron.training import log as training_log
    from megatron.core import parallel_state

    probe = {"start": None, "scalars": []}
    real = {"train": training.train, "step": training.train_step, "time": training.time,
            "write": training_log.write_train_scalars}
    steps = [0]

    def train(*a, **k):
        run = inspect.signature(real["train"]).bind(*a, **k).arguments["run"]
        state, sched, opt = run.train_state, run.scheduler, run.optimizer
        probe["start"] = {
            "iteration": state.iteration, "consumed": state.consumed_train_samples,
            "scheduler_steps": sched.num_steps, "max_lr": sched.max_lr,
            "optimizer_state_entries": len(opt.state), "rng": torch.get_rng_state(),
            "weights": _flat(run.model[0].state_dict_for_save_checkpoint())}
        return real["train"](*a, **k)

    def train_step(*a, **k):
        out = real["step"](*a, **k)
        steps[0] += 1
        if kill_after == steps[0] and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    def write(*a, **k):
        b = inspect.signature(real["write"]).bind(*a, **k).arguments
        state = b["train_state"]
        probe["scalars"].append((state.iteration, b["learning_rate"], b["batch_size"],
                                 state.consumed_train_samples))
        return real["write"](*a, **k)

    training.train, training.train_step = train, train_step
    training_log.write_train_scalars = write
    if minutes_per_iteration is not None:
        training.time = types.SimpleNamespace(time=lambda: 60.0 * minutes_per_iteration * steps[0])
    if fake_wandb:
        sys.modules["wandb"] = _fake_wandb_module()
    handler_before = signal.getsignal(signal.SIGTERM)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            state = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                      pretrain_gpt.model_provider, None,
                                      pretrain_gpt.forward_step, argv=argv)
        args = global_vars.get_args()
        return {"losses": state.train_loss_history, "iteration": state.iteration,
                "consumed": state.consumed_train_samples, "exit_requested": state.exit_requested,
                "valid": state.final_valid_losses,
                "shape": (args.num_layers, args.hidden_size, args.num_attention_heads),
                "stdout": out.getvalue(), "start": probe["start"], "scalars": probe["scalars"],
                "handler_restored": signal.getsignal(signal.SIGTERM) == handler_before,
                "wandb": sys.modules["wandb"].calls if fake_wandb else None}
    finally:
        training.train, training.train_step, training.time = real["train"], real["step"], \
            real["time"]
        training_log.write_train_scalars = real["write"]
        if fake_wandb:
            sys.modules.pop("wandb", None)
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _run_named(scenarios):
    """Each ``(name, keywords of _pretrain_probed)`` in turn; returns name -> result. A user
    error is returned as ``{"error": message}`` so a scenario can check that a run is refused."""
    from megatron.training.checkpointing import CheckpointError
    from megatron.core.config import ConfigError

    results = {}
    for name, run in scenarios:
        try:
            results[name] = _pretrain_probed(**run)
        except (CheckpointError, ConfigError) as err:
            results[name] = {"error": str(err)}
    return results


def _log_lines(stdout):
    return [LOG_LINE.match(line) for line in stdout.splitlines() if LOG_LINE.match(line)]


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return f.read()


# -- the scenarios: one spawned process for the 1-rank ones, one for the 2-rank ones ------------

def _rampup_flags(corpus):
    flags = gpt_flags(corpus, 1, micro_batch=2, global_batch=8, dropout=0.0)
    flags = _without(_without(flags, "--train-iters"), "--lr-warmup-iters")
    return flags + ["--train-samples", "52", "--lr-warmup-samples", "8",
                    "--rampup-batch-size", "2", "2", "24"]


TB_ITERS, TB_INITIAL_SCALE = 12, 2.0 ** 20


def _tensorboard_flags(corpus, root):
    return gpt_flags(corpus, TB_ITERS, dropout=0.0, lr=2e-2, extra=[
        "--fp16", "--initial-loss-scale", str(TB_INITIAL_SCALE), "--eval-interval", "5",
        "--tensorboard-dir", os.path.join(root, "tb"), "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--wandb-project", "proj",
        "--wandb-exp-name", "tiny", "--wandb-save-dir", os.path.join(root, "wandb")])


def _checkpoint_flag_scenarios(corpus, root):
    """Checkpoints are saved at iteration 3 of 6 (--exit-interval 3), so a resumed run keeps
    the same --train-iters and LR schedule. They are read back as torch-format files."""
    no_optim, no_rng = os.path.join(root, "no_optim"), os.path.join(root, "no_rng")
    base = gpt_flags(corpus, 6, extra=["--ckpt-format", "torch"])
    bigger = _with(_with(_with(base, "--hidden-size", 64), "--num-layers", 3),
                   "--num-attention-heads", 8)
    shapeless = _without(_without(_without(base, "--hidden-size"), "--num-layers"),
                         "--num-attention-heads")
    new_lr = _with(base, "--lr", 1e-2) + ["--load", no_rng, "--no-load-rng"]
    return [
        ("save_no_optim", base + ["--save", no_optim, "--no-save-optim", "--exit-interval", "3"]),
        ("load_needs_no_load_optim", base + ["--load", no_optim]),
        ("no_load_optim", base + ["--load", no_optim, "--no-load-optim"]),
        ("save_no_rng", base + ["--save", no_rng, "--no-save-rng", "--exit-interval", "3"]),
        ("load_needs_no_load_rng", base + ["--load", no_rng]),
        ("no_load_rng", base + ["--load", no_rng, "--no-load-rng"]),
        ("finetune", _with(base, "--train-iters", 2) + ["--load", no_rng, "--finetune"]),
        ("checkpoint_args", shapeless + ["--load", no_rng, "--no-load-rng",
                                         "--use-checkpoint-args"]),
        ("checkpoint_args_run_shape", bigger + ["--load", no_rng, "--no-load-rng",
                                                "--use-checkpoint-args"]),
        ("new_lr_refused", new_lr),
        ("override", new_lr + ["--override-opt_param-scheduler"]),
        ("use_checkpoint_schedule", new_lr + ["--use-checkpoint-opt_param-scheduler"]),
    ]


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory):
    """Every single-rank scenario, run in order in one process; name -> result (and "root")."""
    root = str(tmp_path_factory.mktemp("one_rank"))
    scenarios = [
        ("rampup", {"argv": _rampup_flags(corpus)}),
        ("by_time", {"argv": gpt_flags(corpus, 6, extra=[
            "--save", os.path.join(root, "by_time"), "--exit-duration-in-mins", "2"]),
            "minutes_per_iteration": 50 / 60}),
        ("by_interval", {"argv": gpt_flags(corpus, 6, extra=[
            "--save", os.path.join(root, "by_interval"), "--save-interval", "5",
            "--exit-interval", "2"])}),
        ("tensorboard", {"argv": _tensorboard_flags(corpus, root), "fake_wandb": True}),
    ] + [(name, {"argv": argv}) for name, argv in _checkpoint_flag_scenarios(corpus, root)]
    results = run_on_ranks(_run_named, 1, scenarios)[0]
    results["root"] = root
    for name in ("no_optim", "no_rng"):
        path = os.path.join(root, name, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
        results[f"file_{name}"] = torch.load(path, weights_only=False)
    return results


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory):
    """The 2-rank scenarios in one pair of processes; one list of name -> result per rank."""
    root = str(tmp_path_factory.mktemp("two_ranks"))
    save = os.path.join(root, "ckpt")
    base = gpt_flags(corpus, 6)  # 2 ranks: data-parallel size 2, one micro-batch each
    scenarios = [
        ("straight", {"argv": base}),
        ("stopped", {"argv": base + ["--save", save, "--exit-signal-handler"],
                     "kill_after": 3}),
        ("resumed", {"argv": base + ["--save", save, "--load", save, "--exit-signal-handler"]}),
        ("skip_train", {"argv": base + ["--load", save, "--skip-train"]}),
        ("timing", {"argv": gpt_flags(corpus, 3, tp=2, extra=[
            "--timing-log-level", "1", "--save", os.path.join(root, "timing"),
            "--save-interval", "1"])}),
    ]
    ranks = run_on_ranks(_run_named, 2, scenarios, timeout=180)
    return {"root": root, "save": save, "ranks": ranks}


# -- 1. batch-size ramp-up ---------------------------------------------------------------------

def test_rampup_batch_size_end_to_end(one_rank):
    """--rampup-batch-size 2 2 24 to a global batch of 8, --train-samples 52.

    One increment per 24 / ((8 - 2) / 2) = 8 samples: batches 2,2,2,2 (to 8 consumed), 4,4 (to
    16), 6,6 (to 28 > 24 samples), then 8,8,8: 11 iterations consume exactly 52 samples. The LR
    schedule counts samples, so its steps follow the consumed samples.
    """
    out = one_rank["rampup"]
    batches = [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8]
    consumed = [sum(batches[:i + 1]) for i in range(len(batches))]
    lines = _log_lines(out["stdout"])
    assert [int(m[1]) for m in lines] == list(range(1, 12))
    assert {int(m[2]) for m in lines} == {11}  # train iterations derived from the samples
    assert [int(m[5]) for m in lines] == batches
    assert [int(m[3]) for m in lines] == consumed
    assert out["consumed"] == 52
    for m, step in zip(lines, consumed):
        want = megatron_cosine_lr(step, 8, 52, 5e-3, 1e-4)
        assert float(m[4]) == pytest.approx(want, rel=1e-5), (m[0], want)


# -- 2. exits and --skip-train ------------------------------------------------------------------

def test_sigterm_saves_exits_and_resumes(two_ranks):
    """On 2 data-parallel ranks, SIGTERM reaches the last rank after iteration 3: both ranks stop
    there, the checkpoint of iteration 3 is written, final evaluation is skipped and the handler
    is put back. Resuming runs 4..6 with the losses of a run that never stopped."""
    ranks = two_ranks["ranks"]
    straight, stopped, resumed = (ranks[-1][k] for k in ("straight", "stopped", "resumed"))
    for rank_results in ranks:
        assert rank_results["stopped"]["iteration"] == 3
        assert rank_results["stopped"]["exit_requested"]
    assert "exiting at iteration 3: received SIGTERM" in ranks[0]["stopped"]["stdout"]
    assert "validation loss at the end of training" not in stopped["stdout"]
    assert stopped["valid"] is None and stopped["handler_restored"]
    assert [i for i, _ in stopped["losses"]] == [1, 2, 3]
    assert sorted(os.listdir(two_ranks["save"])) == ["iter_0000003", "iter_0000006",
                                                     "latest_checkpointed_iteration.txt"]
    assert resumed["start"]["iteration"] == 3 and resumed["start"]["consumed"] == 3 * GBS
    assert resumed["losses"] == straight["losses"][3:]
    assert stopped["losses"] == straight["losses"][:3]


def test_skip_train_evaluates_only(two_ranks):
    """--skip-train on the resumed run's last checkpoint: no training, and the validation loss
    that run printed at its end (saved before that evaluation) is reproduced exactly."""
    ranks = two_ranks["ranks"]
    resumed, skipped = ranks[-1]["resumed"], ranks[-1]["skip_train"]
    assert skipped["losses"] == [] and skipped["iteration"] == 6 and skipped["start"] is None
    assert resumed["valid"] is not None and skipped["valid"] == resumed["valid"]
    assert "validation loss at the end of training for val data" in \
        ranks[0]["skip_train"]["stdout"]


def test_exit_duration_and_exit_interval_save_then_exit(one_rank):
    """The loop's clock runs 50 s per iteration: with --exit-duration-in-mins 2 the run stops
    after iteration 3 (2.5 min), saving it. --exit-interval 2 stops after iteration 2 and saves
    it although --save-interval is 5. Neither runs the final evaluation."""
    timed, interval = one_rank["by_time"], one_rank["by_interval"]
    by_time = os.path.join(one_rank["root"], "by_time")
    by_interval = os.path.join(one_rank["root"], "by_interval")
    assert timed["iteration"] == 3 and [i for i, _ in timed["losses"]] == [1, 2, 3]
    assert "exiting at iteration 3: exceeded --exit-duration-in-mins 2" in timed["stdout"]
    assert sorted(os.listdir(by_time)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert _tracker(by_time) == "3"
    assert interval["iteration"] == 2 and [i for i, _ in interval["losses"]] == [1, 2]
    assert "exiting at iteration 2: reached --exit-interval 2" in interval["stdout"]
    assert sorted(os.listdir(by_interval)) == ["iter_0000002",
                                               "latest_checkpointed_iteration.txt"]
    for out in (timed, interval):
        assert out["valid"] is None and "validation loss" not in out["stdout"]


def test_timing_log_with_several_ranks(two_ranks):
    """--timing-log-level 1 on 2 ranks (TP=2): the timers are reduced over every rank (not only
    the one that prints), so training goes on, and after each save the last rank prints the min
    and max checkpoint-saving time across ranks under its log line."""
    lines = two_ranks["ranks"][-1]["timing"]["stdout"].splitlines()
    timing = re.compile(r"^\(min, max\) time across ranks \(ms\): .*"
                        r"save-checkpoint: \(([\d.]+), ([\d.]+)\)$")
    logged = [i for i, line in enumerate(lines) if LOG_LINE.match(line)]
    assert len(logged) == 3
    # Iteration 1 is logged before its checkpoint is saved; 2 and 3 report the earlier saves.
    assert not timing.match(lines[logged[0] + 1])
    for i in logged[1:]:
        m = timing.match(lines[i + 1])
        assert m, lines[i + 1]
        assert 0.0 < float(m[1]) <= float(m[2])


# -- 3/4. TensorBoard and wandb -------------------------------------------------------------------

def _simulate_loss_scale(skipped, initial, hysteresis=2):
    """Megatron's dynamic scaler after each step: an overflow uses up hysteresis (which only
    growth restores), then halves the scale; growth needs 1000 good steps, more than here."""
    scale, left, out = initial, hysteresis, []
    for was_skipped in skipped:
        if was_skipped:
            left -= 1
            if left <= 0:
                scale = max(scale * 0.5, 1.0)
        out.append(scale)
    return out


def test_tensorboard_and_wandb_scalars(one_rank):
    """An fp16 run that overflows (iterations 1-3 and 9-11 from a scale of 2^20): every
    TensorBoard series holds Megatron's scalar names at the right steps with the values the
    console printed, and wandb gets the same per-iteration scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, iters = one_rank["tensorboard"], TB_ITERS
    lines = _log_lines(out["stdout"])
    skipped = [int(m[9]) == 1 for m in lines]
    assert len(lines) == iters and any(skipped) and not all(skipped), skipped

    acc = EventAccumulator(os.path.join(one_rank["root"], "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    steps = list(range(1, iters + 1))
    losses = [loss for _, loss in out["losses"]]
    assert [s for s, _ in tb["lm loss"]] == steps
    assert [v for _, v in tb["lm loss"]] == pytest.approx(losses, rel=1e-6)
    assert [s for s, _ in tb["lm loss vs samples"]] == [GBS * s for s in steps]
    assert tb["batch-size"] == [(s, GBS) for s in steps]
    # The LR schedule only advances on steps that were not skipped.
    good = [sum(1 for x in skipped[:i + 1] if not x) for i in range(iters)]
    want_lr = [megatron_cosine_lr(GBS * n, GBS, GBS * iters, 2e-2, 1e-4) for n in good]
    assert [v for _, v in tb["learning-rate"]] == pytest.approx(want_lr, rel=1e-6)
    assert [s for s, _ in tb["learning-rate"]] == steps
    # The scale after each step, as Megatron logs it (and as the console line shows).
    want_scale = _simulate_loss_scale(skipped, TB_INITIAL_SCALE)
    assert tb["loss-scale"] == [(s, v) for s, v in zip(steps, want_scale)]
    assert [float(m[7]) for m in lines] == want_scale
    # A skipped step has no gradient norm.
    assert [s for s, _ in tb["grad-norm"]] == [s for s, k in zip(steps, skipped) if not k]
    printed_norms = [float(m[8]) for m in lines if m[8] is not None]
    assert [v for _, v in tb["grad-norm"]] == pytest.approx(printed_norms, abs=6e-4)
    # Validation at iterations 5 and 10, then the end-of-training validation and test sets.
    evals = EVAL_VALUE.findall(out["stdout"])
    assert [p for p, _ in evals] == ["iteration 5", "iteration 10",
                                     "the end of training for val data",
                                     "the end of training for test data"]
    assert [s for s, _ in tb["lm loss validation"]] == [5, 10, 12, 12]
    printed = [float(v) for _, v in evals]
    assert [v for _, v in tb["lm loss validation"]] == pytest.approx(printed, rel=1e-6)
    assert [v for _, v in tb["lm loss validation ppl"]] == pytest.approx(
        [math.exp(v) for v in printed], rel=1e-5)

    calls = out["wandb"]
    assert calls[0] == ("init", {"project": "proj", "name": "tiny",
                                 "dir": os.path.join(one_rank["root"], "wandb")})
    assert calls[-1] == ("finish",)
    logged = [(name, step, value) for _, data, step in calls[1:-1] for name, value in data.items()]
    from_tb = [(tag, s, v) for tag, series in tb.items() if not tag.endswith(" vs samples")
               for s, v in series]
    assert len(logged) == len(from_tb)
    for (name, step, value), (tb_name, tb_step, tb_value) in zip(sorted(logged), sorted(from_tb)):
        assert (name, step) == (tb_name, tb_step)
        assert value == pytest.approx(tb_value, rel=1e-6)  # TensorBoard stores float32


# -- 5. checkpoint flags -------------------------------------------------------------------------

def _same_weights(start, saved_state):
    want = _flat(saved_state["model"])
    return set(start["weights"]) == set(want) and all(
        torch.equal(start["weights"][k], want[k]) for k in want)


def test_no_save_optim_and_no_load_optim(one_rank):
    state = one_rank["file_no_optim"]
    assert sorted(state) == ["args", "checkpoint_version", "iteration", "model", "rng_state"]
    assert "has no optimizer state (saved with --no-save-optim?); pass --no-load-optim or " \
           "--finetune" in one_rank["load_needs_no_load_optim"]["error"]
    run = one_rank["no_load_optim"]
    start = run["start"]
    assert (start["iteration"], start["consumed"]) == (3, 3 * GBS)
    assert _same_weights(start, state)
    # A fresh optimizer (no Adam moments) and, as in Megatron, a fresh LR schedule.
    assert start["optimizer_state_entries"] == 0 and start["scheduler_steps"] == 0
    assert [i for i, _ in run["losses"]] == [4, 5, 6]
    # The RNG state was restored from the file: not the state a fresh start has.
    assert not torch.equal(start["rng"], one_rank["save_no_rng"]["start"]["rng"])


def test_no_save_rng_and_no_load_rng(one_rank):
    state = one_rank["file_no_rng"]
    assert sorted(state) == sorted(["args", "checkpoint_version", "iteration", "model",
                                    "optimizer", "opt_param_scheduler"])
    assert "has no RNG state (saved with --no-save-rng?); pass --no-load-rng" in \
        one_rank["load_needs_no_load_rng"]["error"]
    run = one_rank["no_load_rng"]
    start = run["start"]
    assert (start["iteration"], start["consumed"], start["scheduler_steps"]) == (3, 3 * GBS,
                                                                                 3 * GBS)
    assert start["optimizer_state_entries"] > 0 and _same_weights(start, state)
    # The RNG is where seeding left it, exactly as in the run that started from scratch.
    assert torch.equal(start["rng"], one_rank["save_no_rng"]["start"]["rng"])
    assert [i for i, _ in run["losses"]] == [4, 5, 6]


def test_finetune_loads_weights_only_and_restarts(one_rank):
    run = one_rank["finetune"]
    start = run["start"]
    assert (start["iteration"], start["consumed"], start["scheduler_steps"]) == (0, 0, 0)
    assert start["optimizer_state_entries"] == 0
    assert _same_weights(start, one_rank["file_no_rng"])
    assert [i for i, _ in run["losses"]] == [1, 2] and run["consumed"] == 2 * GBS
    # The first step sees the first batch again, with trained weights: far below a fresh start.
    assert run["losses"][0][1] < one_rank["save_no_rng"]["losses"][0][1] - 0.05


def test_use_checkpoint_args_takes_model_shape_from_checkpoint(one_rank):
    run = one_rank["checkpoint_args"]
    assert "error" not in run, run.get("error")
    assert run["shape"] == (2, 32, 4)  # no size flags given: the file's
    assert run["start"]["iteration"] == 3
    assert _same_weights(run["start"], one_rank["file_no_rng"])
    # Sizes the run gives stay the run's, as in Megatron: a file of another shape is refused.
    error = one_rank["checkpoint_args_run_shape"]["error"]
    assert "--num-layers" in error and "\n" not in error.strip(), error


def test_lr_change_needs_override_or_checkpoint_schedule(one_rank):
    assert re.search(r"learning rate \(--lr\) is 0\.01 in this run but 0\.005 in the checkpoint; "
                     r"pass --override-opt_param-scheduler", one_rank["new_lr_refused"]["error"])
    # Step counts continue from the checkpoint either way; the peak LR is this run's or the
    # checkpoint's. The LR logged after iteration 4 is the schedule's value at 4 x 4 samples.
    for name, max_lr in (("override", 1e-2), ("use_checkpoint_schedule", 5e-3)):
        run = one_rank[name]
        assert run["start"]["max_lr"] == max_lr and run["start"]["scheduler_steps"] == 3 * GBS
        iteration, lr, _, consumed = run["scalars"][0]
        assert (iteration, consumed) == (4, 4 * GBS)
        assert lr == pytest.approx(megatron_cosine_lr(4 * GBS, GBS, 6 * GBS, max_lr, 1e-4),
                                   rel=1e-12)

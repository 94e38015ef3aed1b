"""training_log: FLOPs worked by hand, the log and eval lines, TensorBoard and wandb scalars."""

import math
import re
import sys
import time
import types

import pytest

from megatron.training import log as training_log
from megatron.training.arguments import parse_args, validate_args
from megatron.training.train_state import TrainState


def _args(flags, padded_vocab_size=None, rank=0, world_size=1):
    args = validate_args(parse_args(argv=flags))
    args.padded_vocab_size = padded_vocab_size
    args.rank, args.world_size = rank, world_size
    return args


GPT2_SMALL = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
              "--max-position-embeddings 1024 --micro-batch-size 8 --train-iters 10").split()


def test_flops_plain_gpt_match_closed_form():
    """72 B s l h^2 (1 + s/(6h) + V/(12 l h)): QKV, projection, attention and the 4h MLP per
    layer plus the logits, forward and backward (x3)."""
    args = _args(GPT2_SMALL, padded_vocab_size=50304)
    B, s, layers, h, V = 8, 1024, 12, 768, 50304
    want = 72 * B * s * layers * h ** 2 * (1 + s / (6 * h) + V / (12 * layers * h))
    assert training_log.num_floating_point_operations(args, B) == pytest.approx(want, rel=1e-12)
    # The same as 6 x (matmul parameters) x tokens plus 12 B s^2 l h for attention.
    matmul_params = layers * 12 * h * h + h * V
    attention = 12 * B * s * s * layers * h
    assert want == pytest.approx(6 * matmul_params * B * s + attention, rel=1e-12)


def _matmul_flops_by_hand(B, s, layers, h, heads, kv, groups, ffn, V, gated):
    """Every matmul of a forward pass as 2 x m x n x k, times 3 for forward + backward.

    Attention scores and the weighted sum are counted over the full s x s square (no causal
    halving), as Megatron's count does.
    """
    def mm(m, n, k):
        return 2 * m * n * k

    tokens = B * s
    per_layer = (mm(tokens, h, heads * kv)                  # query
                 + 2 * mm(tokens, h, groups * kv)           # key and value (shared by a group)
                 + B * heads * mm(s, kv, s)                 # scores  q k^T
                 + B * heads * mm(s, s, kv)                 # scores x v
                 + mm(tokens, heads * kv, h)                # output projection
                 + mm(tokens, h, (2 if gated else 1) * ffn)  # h -> ffn (two halves when gated)
                 + mm(tokens, ffn, h))                      # ffn -> h
    logits = mm(tokens, h, V)
    return 3 * (layers * per_layer + logits)


@pytest.mark.parametrize("extra,dims", [
    ([], dict(heads=4, kv=16, groups=4, ffn=256, gated=False)),
    # GQA (2 groups of 4 query heads), SwiGLU, a given ffn size and kv channels != h / heads.
    ("--group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 176 "
     "--kv-channels 24 --num-attention-heads 8".split(),
     dict(heads=8, kv=24, groups=2, ffn=176, gated=True)),
    # SwiGLU with its default ffn size: int(4h * 2/3 / 64) * 64 = 128 for h = 64.
    (["--swiglu"], dict(heads=4, kv=16, groups=4, ffn=128, gated=True)),
])
def test_flops_gqa_swiglu_match_hand_count(extra, dims):
    flags = ("--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 5 --train-iters 10").split()
    args = _args(flags + extra, padded_vocab_size=384)
    want = _matmul_flops_by_hand(5, 32, 3, 64, V=384, **dims)
    assert training_log.num_floating_point_operations(args, 5) == pytest.approx(want, rel=1e-12)


def _log_args():
    args = _args(("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                  "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 32 "
                  "--train-iters 10").split(), padded_vocab_size=128)
    return args


def _at(iteration):
    """The train state the log lines below are written at: 96 samples consumed."""
    return TrainState(iteration=iteration, consumed_train_samples=96)


LOG_LINE = re.compile(
    r"^ iteration +(?P<it>\d+)/ +(?P<total>\d+) \| "
    r"consumed samples: +(?P<consumed>\d+) \| "
    r"elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \| "
    r"(?:[^|]*\| )*?"  # optional throughput fields
    r"learning rate: (?P<lr>[-+.\dE]+) \| "
    r"global batch size: +(?P<gbs>\d+) \| "
    r"lm loss: (?P<loss>[-+.\dE]+) \| "
    r"loss scale: (?P<scale>[\d.]+) \| "
    r"(?:grad norm: (?P<gn>[\d.]+) \| )?"
    r"number of skipped iterations: +(?P<skipped>\d+) \| "
    r"number of nan iterations: +(?P<nan>\d+) \|$")


def test_log_line_keys_order_and_values():
    args = _log_args()
    stats = training_log.IntervalStats()
    stats.add({"lm loss": 2.0}, skipped=False)
    stats.add({"lm loss": 3.0}, skipped=False)
    stats.add({"lm loss": float("inf")}, skipped=True)   # an fp16 overflow with an inf loss
    stats.add({"lm loss": 100.0}, skipped=True)          # skipped: not in the average
    stats.start = time.perf_counter() - 0.4               # 4 iterations in 0.4 s
    line = training_log.format_log_line(args, _at(3), stats, 1.2345e-4, 32, 65536.0, 1.23456)
    m = LOG_LINE.match(line)
    assert m, line
    assert (m["it"], m["total"], m["consumed"], m["gbs"]) == ("3", "10", "96", "32")
    assert line.startswith(" iteration        3/      10 | consumed samples:           96 |")
    assert 100.0 <= float(m["ms"]) < 150.0
    assert m["lr"] == "1.234500E-04" and m["loss"] == "2.500000E+00"
    assert m["scale"] == "65536.0" and m["gn"] == "1.235"
    assert (m["skipped"], m["nan"]) == ("2", "1")
    # No grad norm (a skipped step) means no grad norm field.
    line = training_log.format_log_line(args, _at(3), stats, 1.2345e-4, 32, 65536.0, None)
    assert "grad norm" not in line and LOG_LINE.match(line)


def test_log_line_throughput_fields():
    """Tokens/s and (--log-throughput) TFLOP/s per device follow from the printed time per
    iteration."""
    args = _log_args()
    args.world_size = 2
    args.log_throughput = True
    stats = training_log.IntervalStats()
    stats.add({"lm loss": 1.0}, skipped=False)
    stats.start = time.perf_counter() - 0.5
    line = training_log.format_log_line(args, _at(1), stats, 1e-3, 32, 1.0, 0.5)
    per_iter_s = float(re.search(r"per iteration \(ms\): ([\d.]+)", line)[1]) / 1000.0
    tokens = float(re.search(r"tokens per second per device: ([\d.]+)", line)[1])
    assert tokens == pytest.approx(32 * 16 / per_iter_s / 2, rel=2e-3)
    tflops = float(re.search(r"\(TFLOP/s/GPU\): ([-+.\de]+)", line)[1])
    flops = training_log.num_floating_point_operations(args, 32)
    assert tflops == pytest.approx(flops / per_iter_s / 2 / 1e12, rel=2e-3)
    # Megatron's TFLOP/s of GPT-2 small: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) / time / ranks.
    small = _args(GPT2_SMALL, padded_vocab_size=50304, world_size=8)
    B, s, layers, h, V = 8, 1024, 12, 768, 50304
    by_hand = 72 * B * s * layers * h ** 2 * (1 + s / (6 * h) + V / (12 * layers * h))
    assert training_log.throughput_tflops(small, B, 0.25) == pytest.approx(
        by_hand / 0.25 / 8 / 1e12, rel=1e-12)
    args.log_throughput = False
    assert "TFLOP/s" not in training_log.format_log_line(args, _at(1), stats, 1e-3, 32, 1.0, 0.5)


def test_log_line_params_norm_field():
    """Megatron's place for it: after the grad norm, before the skipped count."""
    args = _log_args()
    stats = training_log.IntervalStats()
    stats.add({"lm loss": 1.0}, skipped=False)
    line = training_log.format_log_line(args, _at(1), stats, 1e-3, 32, 1.0, 0.5,
                                        params_norm=12.3456)
    assert "| grad norm: 0.500 | params norm: 12.346 | number of skipped iterations:" in line


def test_eval_line():
    text = training_log.format_eval_line("iteration 5", {"lm loss": 2.0})
    bar, line, bar2 = text.split("\n")
    assert line == (" validation loss at iteration 5 | lm loss value: 2.000000E+00 | "
                    "lm loss PPL: 7.389056E+00 |")
    assert bar == bar2 == "-" * len(line)
    # Perplexity is capped at exp(20), as Megatron does, so a diverged run still prints.
    line = training_log.format_eval_line("x", {"lm loss": 25.0}).split("\n")[1]
    assert f"lm loss PPL: {math.exp(20):.6E}" in line


class RecordingWriter:
    def __init__(self):
        self.scalars = []
        self.closed = False

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def _scalar_args(*flags, rank=0, world_size=1):
    args = _log_args()
    extra = parse_args(argv=list(flags))
    for key in ("log_batch_size_to_tensorboard", "log_learning_rate_to_tensorboard",
                "log_loss_scale_to_tensorboard", "log_world_size_to_tensorboard",
                "log_validation_ppl_to_tensorboard", "tensorboard_log_interval",
                "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "tensorboard_dir",
                "save"):
        setattr(args, key, getattr(extra, key))
    args.rank, args.world_size = rank, world_size
    return args


def test_train_scalars_names_steps_and_flags():
    writer = RecordingWriter()
    args = _scalar_args("--log-batch-size-to-tensorboard", "--log-world-size-to-tensorboard")
    training_log.write_train_scalars(writer, args, _at(3), {"lm loss": 2.5}, 1e-3, 32, 4096.0, 0.75)
    assert sorted(writer.scalars) == sorted([
        ("learning-rate", 1e-3, 3), ("learning-rate vs samples", 1e-3, 96),
        ("batch-size", 32, 3), ("batch-size vs samples", 32, 96),
        ("lm loss", 2.5, 3), ("lm loss vs samples", 2.5, 96),
        ("loss-scale", 4096.0, 3), ("loss-scale vs samples", 4096.0, 96),
        ("grad-norm", 0.75, 3), ("grad-norm vs samples", 0.75, 96),
        ("world-size", 1, 3)])
    # Megatron's defaults: no batch size unless asked; LR and loss scale unless turned off.
    writer = RecordingWriter()
    args = _scalar_args("--no-log-learnig-rate-to-tensorboard",
                        "--no-log-loss-scale-to-tensorboard")
    training_log.write_train_scalars(writer, args, _at(3), {"lm loss": 2.5}, 1e-3, 32, 4096.0, None)
    assert sorted(writer.scalars) == [("lm loss", 2.5, 3), ("lm loss vs samples", 2.5, 96)]
    # Only every --tensorboard-log-interval iterations.
    writer = RecordingWriter()
    args = _scalar_args("--tensorboard-log-interval", "2")
    training_log.write_train_scalars(writer, args, _at(3), {"lm loss": 2.5}, 1e-3, 32, 1.0, None)
    assert writer.scalars == []


def test_eval_scalars_with_and_without_ppl():
    writer = RecordingWriter()
    training_log.write_eval_scalars(writer, _scalar_args(), _at(7), {"lm loss": 3.0})
    assert writer.scalars == [("lm loss validation", 3.0, 7),
                              ("lm loss validation vs samples", 3.0, 96)]
    writer = RecordingWriter()
    training_log.write_eval_scalars(writer, _scalar_args("--log-validation-ppl-to-tensorboard"),
                                    _at(7), {"lm loss": 3.0})
    assert ("lm loss validation ppl", math.exp(3.0), 7) in writer.scalars
    assert ("lm loss validation ppl vs samples", math.exp(3.0), 96) in writer.scalars


def _fake_wandb():
    fake = types.ModuleType("wandb")
    fake.calls = []
    fake.init = lambda **kw: fake.calls.append(("init", kw))
    fake.log = lambda data, step=None: fake.calls.append(("log", data, step))
    fake.finish = lambda: fake.calls.append(("finish",))
    return fake


def test_wandb_adapter_logs_per_iteration_scalars(monkeypatch, tmp_path):
    fake = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save_dir = tmp_path / "wandb_runs"
    args = _scalar_args("--wandb-project", "proj", "--wandb-exp-name", "exp-1",
                        "--wandb-save-dir", str(save_dir), "--wandb-entity", "team",
                        rank=3, world_size=4)
    writer = training_log.make_scalar_writer(args)
    assert writer is not None and writer.tensorboard is None
    (kind, kwargs), = fake.calls
    assert kind == "init" and save_dir.is_dir()
    assert {k: kwargs[k] for k in ("project", "entity", "name", "dir")} == {
        "project": "proj", "entity": "team", "name": "exp-1", "dir": str(save_dir)}
    assert kwargs["config"]["wandb_project"] == "proj" and kwargs["config"]["hidden_size"] == 32
    fake.calls.clear()
    training_log.write_train_scalars(writer, args, _at(3), {"lm loss": 2.5}, 1e-3, 32, 1.0, 0.5)
    training_log.write_eval_scalars(writer, args, _at(3), {"lm loss": 2.0})
    writer.close()
    assert fake.calls == [("log", {"learning-rate": 1e-3}, 3), ("log", {"lm loss": 2.5}, 3),
                          ("log", {"loss-scale": 1.0}, 3), ("log", {"grad-norm": 0.5}, 3),
                          ("log", {"lm loss validation": 2.0}, 3), ("finish",)]


def test_wandb_only_on_last_rank_and_default_dir(monkeypatch, tmp_path):
    fake = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = _scalar_args("--wandb-project", "proj", rank=0, world_size=2)
    assert training_log.make_scalar_writer(args) is None and fake.calls == []
    args = _scalar_args("--wandb-project", "proj", "--save", str(tmp_path / "ckpt"),
                        rank=1, world_size=2)
    training_log.make_scalar_writer(args)
    assert fake.calls[0][1]["dir"] == str(tmp_path / "ckpt" / "wandb")
    assert fake.calls[0][1]["entity"] is None  # no --wandb-entity: wandb's default entity
    assert (tmp_path / "ckpt" / "wandb").is_dir()


def test_wandb_missing_prints_one_note_and_continues(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    args = _scalar_args("--wandb-project", "proj")
    assert training_log.make_scalar_writer(args) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "--wandb-project proj" in out[0] and "not installed" in out[0]
    # TensorBoard still works alongside.
    args = _scalar_args("--wandb-project", "proj", "--tensorboard-dir", str(tmp_path / "tb"))
    writer = training_log.make_scalar_writer(args)
    assert writer is not None and writer.tensorboard is not None and writer.wandb is None
    writer.close()
    assert len(capsys.readouterr().out.strip().splitlines()) == 1

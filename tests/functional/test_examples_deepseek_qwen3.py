"""``examples/pretrain_deepseek_v3_cpu.sh`` and ``examples/pretrain_qwen3_cpu.sh`` (dense and
MOE=1) run end to end on 2 CPU processes on the standard library's text: the loss falls, the
logged auxiliary losses appear (``mtp_1 loss`` and ``seq_load_balancing_loss`` for DeepSeek-V3,
``load_balancing_loss`` for Qwen3-MoE), torch_dist checkpoints are written, and a rerun that
resumes from the middle checkpoint gives the losses of the run that never stopped.

GPT-2's vocabulary (50304 padded ids) starts near ln(50304) = 10.8; at lr 2e-3 it falls by about
a nat in 12 steps (seen: 10.8 to 9.7), so "the mean of the last three losses is 0.5 below the
mean of the first three" holds with margin while a model that does not learn fails it. The
resumed run rebuilds the same data order and optimizer state, so its losses must equal the
straight run's exactly (both print 7 significant digits).
"""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 12
HALF = ITERS // 2
TIMEOUT_S = 900
LINE = re.compile(r" iteration +(\d+)/ +\d+ \| (.*)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
    subprocess.run([sys.executable, "tools/build_stdlib_corpus.py", "--output", path,
                    "--max-bytes", "400000"], cwd=ROOT, check=True, capture_output=True)
    return path


def _run(script, out_dir, corpus, **env_extra):
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=corpus, TRAIN_ITERS=str(ITERS),
               NUM_LAYERS="2", HIDDEN_SIZE="64", FFN_HIDDEN_SIZE="176", SEQ_LENGTH="64",
               MICRO_BATCH="2", GLOBAL_BATCH="4", LR="2e-3", WARMUP_ITERS="2",
               LOG_INTERVAL="1", EVAL_INTERVAL="1000", SAVE_INTERVAL=str(HALF),
               OMP_NUM_THREADS="1")
    env.update(env_extra)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", script), str(out_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def logged(log):
    """{iteration: {name: value}} of the training lines of a log."""
    out = {}
    for match in map(LINE.search, log.splitlines()):
        if match:
            fields = (f.split(": ") for f in match[2].split("|") if ": " in f)
            out[int(match[1])] = {k.strip(): v.strip() for k, v in fields}
    return out


def test_logged_reads_named_columns():
    log = (" iteration        3/      12 | lm loss: 1.0E+01 | mtp_1 loss: 9.5E+00 |\n"
           "NOTE: x\n")
    assert logged(log) == {3: {"lm loss": "1.0E+01", "mtp_1 loss": "9.5E+00"}}


def _check_trains_and_resumes(script, out_dir, corpus, extra_losses, **env):
    log = _run(script, out_dir, corpus, **env)
    assert "Traceback" not in log, log[-4000:]
    steps = logged(log)
    assert sorted(steps) == list(range(1, ITERS + 1)), log[-3000:]
    for name in ("lm loss",) + extra_losses:
        values = [float(steps[i][name]) for i in sorted(steps)]
        assert all(math.isfinite(v) for v in values), (name, values)
    losses = [float(steps[i]["lm loss"]) for i in sorted(steps)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    ckpt = out_dir / "checkpoints"
    for it in (HALF, ITERS):
        assert (ckpt / f"iter_{it:07d}" / ".metadata").is_file()              # torch_dist
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(HALF))
    resumed_log = _run(script, out_dir, corpus, **env)
    assert f"at iteration {HALF} (torch_dist)" in resumed_log, resumed_log[-3000:]
    resumed = logged(resumed_log)
    assert sorted(resumed) == list(range(HALF + 1, ITERS + 1)), resumed_log[-3000:]
    for it in resumed:
        for name in ("lm loss",) + extra_losses:
            assert resumed[it][name] == steps[it][name], (it, name)
    return log


@pytest.mark.slow
def test_deepseek_v3_example_trains_at_ep2_logs_mtp_and_resumes(tmp_path, corpus):
    log = _check_trains_and_resumes("pretrain_deepseek_v3_cpu.sh", tmp_path / "dsv3", corpus,
                                    ("mtp_1 loss", "seq_load_balancing_loss"))
    assert "data-parallel 2" in log, log[-3000:]
    # The MTP head learns too: its (unscaled) loss falls like the main one.
    mtp = [float(v["mtp_1 loss"]) for _, v in sorted(logged(log).items())]
    assert sum(mtp[-3:]) / 3 < sum(mtp[:3]) / 3 - 0.5, mtp


@pytest.mark.slow
def test_qwen3_example_trains_data_parallel_and_resumes(tmp_path, corpus):
    log = _check_trains_and_resumes("pretrain_qwen3_cpu.sh", tmp_path / "qwen3", corpus, (),
                                    KV_CHANNELS="16")
    assert "data-parallel 2" in log, log[-3000:]
    assert "load_balancing_loss" not in log


@pytest.mark.slow
def test_qwen3_moe_example_trains_at_ep2_and_resumes(tmp_path, corpus):
    _check_trains_and_resumes("pretrain_qwen3_cpu.sh", tmp_path / "qwen3_moe", corpus,
                              ("load_balancing_loss",), MOE="1", KV_CHANNELS="16")

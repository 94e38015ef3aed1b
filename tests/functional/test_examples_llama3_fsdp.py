"""``examples/pretrain_llama3_fsdp_cpu.sh`` (a Llama-3-style GPT with Megatron-LM's FSDP recipe
flags: --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params, meta-device
init, bf16, fsdp_dtensor checkpoints) runs end to end on CPU processes: the loss falls, the
fsdp_dtensor checkpoint it saves at iteration 10 is resumed by a second run of the script, and
the resumed iterations give the losses of an uninterrupted run.

The reference for the resume is the same script trained 20 iterations in one go; the first of
two runs of the same schedule stops at iteration 10 (--exit-interval), and the second must load
iteration 10 (weights, Adam's moments, the data position) and reproduce iterations
11..20. Both runs compute the same sums in the same order on the same shards, so the losses
agree to the last printed digit; 1e-4 relative leaves room for the text format only.

The loss criterion is that of tests/functional/test_examples_llama3.py: a vocabulary of 8192
starts near ln(8192) = 9.0 and at lr 2e-3 falls by more than a nat in 20 steps, so "the mean of
the last three losses is 0.5 below the mean of the first three" holds with margin.
"""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS = re.compile(r" iteration +(\d+)/ +(\d+) \| .*\| lm loss: ([-+.\dEe]+) \|")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
ITERS = 20
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
    subprocess.run([sys.executable, "tools/build_stdlib_corpus.py", "--output", path,
                    "--max-bytes", "400000"], cwd=ROOT, check=True, capture_output=True)
    return path


def _run(out_dir, corpus, iters, *extra, **env_extra):
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=corpus, TRAIN_ITERS=str(iters),
               NUM_LAYERS="2", HIDDEN_SIZE="64", FFN_HIDDEN_SIZE="176", SEQ_LENGTH="64",
               MICRO_BATCH="2", GLOBAL_BATCH="4", LR="2e-3", WARMUP_ITERS="2",
               LOG_INTERVAL="1", EVAL_INTERVAL="1000", SAVE_INTERVAL="10", OMP_NUM_THREADS="1")
    env.update(env_extra)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama3_fsdp_cpu.sh"),
                           str(out_dir), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "error" not in log.lower(), log[-4000:]
    return log


def _losses(log):
    return {int(m[1]): float(m[3]) for m in map(LOSS.search, log.splitlines()) if m}


def _check_learns(losses):
    values = [losses[i] for i in sorted(losses)]
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    assert all(math.isfinite(x) for x in values), values
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3 - 0.5, values


def _check_fsdp_dtensor_checkpoint(ckpt, iteration):
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert (ckpt / f"iter_{iteration:07d}" / ".metadata").is_file()


def test_loaded_iteration_is_read_from_the_log():
    log = "  successfully loaded checkpoint from /x/checkpoints at iteration 10\n"
    assert [int(m[1]) for m in map(LOADED.search, log.splitlines()) if m] == [10]


@pytest.mark.slow
def test_llama3_fsdp_example_trains_saves_and_resumes(tmp_path, corpus):
    whole = _run(tmp_path / "whole", corpus, ITERS)
    assert "data-parallel 2" in whole, whole[-3000:]
    reference = _losses(whole)
    _check_learns(reference)
    _check_fsdp_dtensor_checkpoint(tmp_path / "whole" / "checkpoints", ITERS)

    # The same schedule (20 iterations), stopped after the checkpoint of iteration 10.
    first = _run(tmp_path / "split", corpus, ITERS, "--exit-interval", "10")
    assert not LOADED.search(first)
    second = _run(tmp_path / "split", corpus, ITERS)
    assert [int(m[1]) for m in map(LOADED.search, second.splitlines()) if m] == [10], second
    resumed = _losses(second)
    assert sorted(resumed) == list(range(11, ITERS + 1)), resumed
    for i in resumed:
        assert resumed[i] == pytest.approx(reference[i], rel=1e-4), (i, resumed, reference)
    _check_learns({**_losses(first), **resumed})
    _check_fsdp_dtensor_checkpoint(tmp_path / "split" / "checkpoints", ITERS)


@pytest.mark.slow
def test_llama3_fsdp_example_trains_at_dp4_on_torch_fsdp2(tmp_path, corpus):
    """Four shards, and PyTorch's own flag (--use-torch-fsdp2) in place of Megatron-FSDP's."""
    log = _run(tmp_path / "dp4", corpus, ITERS, NPROC="4", FSDP="torch2", GLOBAL_BATCH="8")
    assert "data-parallel 4" in log, log[-3000:]
    _check_learns(_losses(log))
    _check_fsdp_dtensor_checkpoint(tmp_path / "dp4" / "checkpoints", ITERS)

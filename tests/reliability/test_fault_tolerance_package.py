"""--enable-ft-package: nvidia-resiliency-ext's rank monitor, under its ft_launcher.

* A run reports its sections and, with --calc-ft-timeouts, writes the computed timeouts to
  SAVE/ft_state.json; its losses equal the same run under torchrun without the flag.
* A rank that hangs inside a training step is killed by its monitor once the step section
  outlives its timeout; ft_launcher starts the job again, which resumes from the last
  checkpoint and ends with the losses of a run that never hung.
* Without ft_launcher, or with the flags misused, the run stops with one line.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FT_LAUNCHER = os.path.join(os.path.dirname(sys.executable), "ft_launcher")
TIMEOUTS = ["--ft-param-rank_section_timeouts=setup:300,step:4,checkpointing:300",
            "--ft-param-rank_out_of_section_timeout=300",
            "--ft-param-workload_check_interval=1"]

# pretrain_gpt.py whose rank 1 stops answering in the forward step of iteration 5 (one
# micro-batch per rank and iteration), once: the marker file keeps the restarted job healthy.
HANG_SCRIPT = """
import os, runpy, sys, threading
sys.path.insert(0, {root!r})
import megatron.training.training as training

real_pretrain = training.pretrain


def pretrain(datasets, model_provider, model_type, forward_step, *args, **kwargs):
    calls = [0]

    def hanging_forward_step(data_iterator, model):
        calls[0] += 1
        if os.environ["RANK"] == "1" and calls[0] == 5 and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            print("HANG rank 1", flush=True)
            threading.Event().wait()
        return forward_step(data_iterator, model)

    return real_pretrain(datasets, model_provider, model_type, hanging_forward_step, *args,
                         **kwargs)


training.pretrain = pretrain
sys.argv[0] = os.path.join({root!r}, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(launcher, script, flags, timeout=300):
    proc = subprocess.run(launcher + ["--nproc-per-node", "2", script] + flags, cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _losses(output):
    """iteration -> the 'lm loss' text of its log line (the last attempt's, after a restart)."""
    return {int(m.group(1)): m.group(2) for m in
            re.finditer(r"iteration +(\d+)/ +\d+ \|.*?lm loss: (\S+)", output)}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@pytest.mark.slow
def test_sections_and_computed_timeouts_without_changing_losses(tmp_path, corpus):
    """About 25 s: two 2-rank runs of 20 iterations."""
    pretrain = os.path.join(REPO_ROOT, "pretrain_gpt.py")
    flags = gpt_flags(corpus, 20) + ["--save-interval", "10"]
    rc, out = _launch([FT_LAUNCHER] + TIMEOUTS, pretrain, flags + [
        "--save", str(tmp_path / "ft"), "--enable-ft-package", "--calc-ft-timeouts"])
    assert rc == 0, out[-4000:]
    rc, plain = _launch(TORCHRUN, pretrain, flags + ["--save", str(tmp_path / "plain")])
    assert rc == 0, plain[-4000:]
    assert _losses(out) == _losses(plain) and len(_losses(out)) == 20
    state = json.loads((tmp_path / "ft" / "ft_state.json").read_text())
    timeouts = state["current_timeouts"]["section"]
    # 20 training steps (>= 16) and two foreground saves: both timeouts computed, from times
    # far below the launcher's 4 s and 300 s; setup stays the launcher's (nothing was loaded).
    assert set(timeouts["calculated_sections"]) == {"step", "checkpointing"}
    assert 0 < timeouts["section"]["step"] < 4 and 0 < timeouts["section"]["checkpointing"] < 300
    assert timeouts["section"]["setup"] == 300
    assert "FT: rank monitor connected" in out


@pytest.mark.slow
def test_hung_rank_is_restarted_and_the_run_resumes(tmp_path, corpus):
    """About 40 s: the hang, the 4 s step timeout, a restart from iteration 4, and the
    reference run."""
    marker = tmp_path / "hung_once"
    script = tmp_path / "hanging_pretrain_gpt.py"
    script.write_text(HANG_SCRIPT.format(root=REPO_ROOT, marker=str(marker)))
    flags = gpt_flags(corpus, 8, micro_batch=1, global_batch=2) + ["--save-interval", "2"]
    rc, out = _launch([FT_LAUNCHER, "--max-restarts", "1"] + TIMEOUTS, str(script), flags + [
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--enable-ft-package",
        "--ft-num-warmup-iters", "1"])
    assert rc == 0, out[-6000:]
    assert marker.exists() and "HANG rank 1" in out
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 4\b", out), out[-6000:]
    assert re.search(r"Section 'step' has been open for [\d.]+ seconds\. Timeout is 4\.00", out)
    rc, plain = _launch(TORCHRUN, os.path.join(REPO_ROOT, "pretrain_gpt.py"),
                        flags + ["--save", str(tmp_path / "plain")])
    assert rc == 0, plain[-4000:]
    assert _losses(out) == _losses(plain) and len(_losses(plain)) == 8


@pytest.mark.slow  # about 5 s: a torchrun job
def test_without_ft_launcher_the_run_stops_in_one_line(tmp_path, corpus):
    rc, out = _launch(TORCHRUN, os.path.join(REPO_ROOT, "pretrain_gpt.py"),
                      gpt_flags(corpus, 2) + ["--save", str(tmp_path / "c"),
                                              "--enable-ft-package"])
    assert rc != 0
    assert re.search(r"error: --enable-ft-package: no rank monitor to talk to \(.*"
                     r"FT_RANK_MONITOR_IPC_SOCKET.*\); launch with ft_launcher", out), out[-3000:]
    # torchrun reports the failed worker with its own traceback; the worker printed none.
    assert "rank_monitor_client.py" not in out and 'megatron/training/' not in out


BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data").split()


def test_flag_misuse_is_refused_in_one_line(monkeypatch):
    cases = [(["--calc-ft-timeouts"], "--calc-ft-timeouts configures --enable-ft-package's"),
             (["--ft-num-warmup-iters", "2"], "--ft-num-warmup-iters configures"),
             (["--enable-ft-package"], "--enable-ft-package keeps its computed timeouts in "
                                       "--save"),
             (["--enable-ft-package", "--save", "x", "--ft-num-warmup-iters", "-1"],
              "must be >= 0")]
    for flags, message in cases:
        with pytest.raises(ArgumentsError, match=message):
            validate_args(parse_args(argv=BASE + flags))
    assert validate_args(parse_args(argv=BASE + ["--enable-ft-package", "--save", "x"]))
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.fault_tolerance", None)
    with pytest.raises(ArgumentsError, match="--enable-ft-package needs nvidia-resiliency-ext, "
                                             "which is not installed"):
        validate_args(parse_args(argv=BASE + ["--enable-ft-package", "--save", "x"]))

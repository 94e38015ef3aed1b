"""``--deterministic-mode`` and the start-up memory prediction of a training run.

* The flag sets every switch it documents (environment for cuBLAS and NCCL, PyTorch's
  deterministic algorithms, cuDNN), before the device is touched, and leaves a user's valid
  settings alone; on CPU it changes no number: a run with it logs the losses of a run without.
* A training run prints each stage's predicted memory before building the model, equal to the
  accounting for its flags, and warns when it exceeds the rank's share of the machine.
"""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_RE = re.compile(r"iteration\s+(\d+)/.*\| lm loss: (\S+) \|")

PROBE = """
import os, sys, torch
from megatron.training.determinism import configure_deterministic_mode
before = torch.are_deterministic_algorithms_enabled()
notes = configure_deterministic_mode(sys.argv[1] == "on")
print(repr((before, torch.are_deterministic_algorithms_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("NCCL_ALGO"), notes)))
"""


def _probe(mode: str, **env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(clean, **env))
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_flag_sets_every_documented_switch():
    before, det, cudnn_det, bench, workspace, algo, notes = _probe("on")
    assert (before, det, cudnn_det, bench) == (False, True, True, False)
    assert (workspace, algo) == (":4096:8", "Ring")
    assert len(notes) == 3 and not any("replaced" in n for n in notes)
    # Off: nothing touched.
    assert _probe("off") == (False, False, False, False, None, None, [])


@pytest.mark.slow  # about 6 s
def test_user_settings_kept_when_valid_and_replaced_when_not():
    *_, workspace, algo, notes = _probe("on", CUBLAS_WORKSPACE_CONFIG=":16:8", NCCL_ALGO="Tree")
    assert (workspace, algo) == (":16:8", "Tree")
    *_, workspace, _, notes = _probe("on", CUBLAS_WORKSPACE_CONFIG=":0:0")
    assert workspace == ":4096:8"
    assert any("':0:0'" in n and "replaced" in n for n in notes)


def _args():
    """The training flags below, validated, with the padded vocabulary (as a run has them)."""
    from tools import estimate_memory

    return estimate_memory.parse(gpt_flags("unused", 4) + ["--world-size", "1"])


def _train(tmp_path, extra, env=None):
    prefix = write_counting_corpus(str(tmp_path / "corpus"))
    argv = gpt_flags(prefix, 4, dropout=0.1, extra=extra)
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, [loss for _, loss in LOSS_RE.findall(out.stdout)]


@pytest.mark.slow  # about 8 s: two training runs in subprocesses
def test_cpu_run_unchanged_and_startup_memory_warning(tmp_path):
    plain, plain_losses = _train(tmp_path, [])
    assert len(plain_losses) == 4
    assert "--deterministic-mode" not in plain.stdout
    line = re.search(r"predicted memory before start-up: ([\d.]+) GB", plain.stdout)
    assert line, plain.stdout[-2000:]
    assert "WARNING: pipeline stage" not in plain.stderr
    # The printed prediction is the accounting's for these flags (one stage, 2 micro-batches).
    from megatron.training.memory_accounting import estimate_memory

    args = _args()
    expected = estimate_memory(args, 0, 2).total_bytes / 1024 ** 3
    assert float(line.group(1)) == pytest.approx(expected, abs=0.006)

    # A machine shared by a billion ranks has ~24 bytes each: the run warns and still trains;
    # --deterministic-mode logs what it set and leaves every CPU loss as it was.
    det, det_losses = _train(tmp_path, ["--deterministic-mode"],
                             env={"LOCAL_WORLD_SIZE": "1000000000"})
    assert det_losses == plain_losses
    assert "> --deterministic-mode: CUBLAS_WORKSPACE_CONFIG=:4096:8" in det.stdout
    assert "> --deterministic-mode: torch.use_deterministic_algorithms(True)" in det.stdout
    assert re.search(r"WARNING: pipeline stage 0 is predicted to need [\d.]+ GB per rank, more "
                     r"than MemTotal [\d.]+ GB / 1000000000 ranks per node", det.stderr), \
        det.stderr[-2000:]


def test_startup_check_against_limits(tmp_path):
    from megatron.training.memory_accounting import estimate_memory, startup_memory_check

    args = _args()
    total = estimate_memory(args, 0, 2).total_bytes
    pstate = SimpleNamespace(rank=0, tp_rank=0, pp_rank=0)
    meminfo = tmp_path / "meminfo"
    # Just above and just below the prediction, for 2 ranks per node.
    meminfo.write_text(f"MemTotal: {int(2 * total / 1024) + 2} kB\n")
    assert len(startup_memory_check(args, pstate, 2, 2, str(meminfo))) == 1
    meminfo.write_text(f"MemTotal: {int(2 * total / 1024) - 2} kB\n")
    lines = startup_memory_check(args, pstate, 2, 2, str(meminfo))
    assert len(lines) == 2 and lines[1].startswith("WARNING: pipeline stage 0")
    # No /proc/meminfo (not Linux): the prediction alone.
    assert len(startup_memory_check(args, pstate, 2, 2, str(tmp_path / "absent"))) == 1

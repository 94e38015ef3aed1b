"""--exit-signal-handler-for-training: SIGTERM in the middle of training finishes the checkpoint
save in flight (--async-save), then the process exits with status 0 and one line, no
traceback; without the flag the same signal kills the process. A real subprocess, so the
signal and the exit status are the operating system's."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

pytestmark = pytest.mark.slow  # two training subprocesses

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pretrain_gpt's pretrain(), sending itself SIGTERM inside the third training step.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    import pretrain_gpt
    from megatron.training import training
    real, steps = training.train_step, [0]
    def train_step(*a, **k):
        steps[0] += 1
        if steps[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    training.train_step = train_step
    training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                      argv=sys.argv[1:])
    print("pretrain returned")
""")


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(flags):
    return subprocess.run([sys.executable, "-c", DRIVER] + flags, cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def test_signal_finishes_the_save_and_exits_zero(corpus, tmp_path):
    save = str(tmp_path / "save")
    flags = gpt_flags(corpus, 6, extra=["--save", save, "--save-interval", "2", "--async-save"])
    proc = _run(flags + ["--exit-signal-handler-for-training"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stdout.splitlines() if "--exit-signal-handler-for-training" in l]
    assert lines == ["SIGTERM received: finishing any checkpoint save in flight and exiting "
                     "(--exit-signal-handler-for-training)"]
    assert "pretrain returned" not in proc.stdout  # the run stopped there
    # The save of iteration 2, started before the signal, is complete and published.
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"
    assert {".metadata", "metadata.json"} <= set(os.listdir(os.path.join(save,
                                                                         "iter_0000002")))
    assert not [n for n in os.listdir(save) if n.startswith(".") or n.endswith(".tmp")]

    plain = _run(gpt_flags(corpus, 6, extra=["--save", str(tmp_path / "plain"),
                                             "--save-interval", "2", "--async-save"]))
    assert plain.returncode == -15  # killed by SIGTERM: the flag is what made the difference

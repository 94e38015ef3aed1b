"""Freed host memory kept in the process on CPU (megatron/core/host_memory.py), measured by the
kernel's own count of page faults (``getrusage``) in a fresh interpreter: glibc's settings are
process-wide and cannot be undone, so the pytest process is left alone."""

import os
import subprocess
import sys

import pytest

from megatron.core import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A step's pattern: activations of mixed sizes (1-16 MiB, 344 MiB in all) taken while older
# ones are freed, again and again. Each round's page faults are counted; the first round
# populates the heap either way.
ROUNDS = """
import resource, sys
import torch
from megatron.core import host_memory

SIZES = [4, 1, 3, 0.25, 2, 0.5] * 8                       # x 4 MiB

def faults_of_a_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = []
    for i, size in enumerate(SIZES):
        held.append(torch.ones(int(size * 2 ** 20)))
        if i % 3 == 2:
            held.pop(0)
    del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "keep":
    print("KEPT", host_memory.keep_freed_memory())
print("FAULTS", *[faults_of_a_round() for _ in range(8)], flush=True)
"""


def _faults(mode, **env):
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    return lines.get("KEPT"), [int(v) for v in lines["FAULTS"].split()]


@pytest.mark.skipif(host_memory._libc() is None, reason="needs Linux with glibc")
def test_kept_memory_is_reused_without_page_faults():
    _, plain = _faults("plain")
    kept, faults = _faults("keep")
    assert kept == "True"
    # glibc's default policy gives about 100 MiB back to the kernel in most rounds (25000+
    # faults of 4 KiB pages); kept, the rounds after the first fault a few MiB at most.
    assert sum(plain[2:]) > 60000, plain
    assert sum(faults[2:]) < 0.1 * sum(plain[2:]), (faults, plain)


@pytest.mark.skipif(host_memory._libc() is None, reason="needs Linux with glibc")
def test_the_environment_can_leave_glibc_default():
    kept, faults = _faults("keep", MEGATRON_KEEP_FREED_HOST_MEMORY="0")
    assert kept == "False"
    assert sum(faults[2:]) > 60000, faults


def test_a_wrong_setting_names_the_variable(monkeypatch):
    monkeypatch.setattr(host_memory, "_KEPT", False)
    monkeypatch.setenv(host_memory.ENV, "sometimes")
    with pytest.raises(ValueError, match="MEGATRON_KEEP_FREED_HOST_MEMORY='sometimes'"):
        host_memory.keep_freed_memory()


RELEASE = """
import torch
from megatron.core import host_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

print("KEPT", host_memory.keep_freed_memory())
held = [torch.ones(int(size * 2 ** 20)) for size in [4, 1, 3, 0.25, 2, 0.5] * 8]
del held
before = rss_mib()
print("RELEASED", host_memory.release_freed_memory())
print("RSS", before, rss_mib(), flush=True)
"""


@pytest.mark.skipif(host_memory._libc() is None, reason="needs Linux with glibc")
def test_release_hands_the_kept_memory_back():
    out = subprocess.run([sys.executable, "-c", RELEASE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["KEPT"] == "True" and lines["RELEASED"] == "True"
    before, after = map(float, lines["RSS"].split())
    # 344 MiB were allocated and freed; kept, they stay resident until released.
    assert before - after > 200, (before, after)

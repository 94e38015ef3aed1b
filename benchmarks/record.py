"""``--record``: append what a benchmark printed to ``benchmarks/RESULTS.md`` as a dated section.

A benchmark wraps its ``main`` in :func:`recording`; everything it prints still goes to the
terminal, and with ``--record`` the same text is appended, once the run has finished without an
error, under a heading that names the benchmark, the date, the machine and the exact command.
Run-log lines (those starting with ``#``) are kept together in fenced blocks, so the markdown
tables between them render as tables.
"""

import contextlib
import datetime
import io
import os
import platform
import sys
from typing import Iterator, List

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, real):
        self.real = real
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.real.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.real.flush()


def machine_line() -> str:
    """CPU model, core count, memory and torch version, for the section's heading."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        memory = f", {kb / 1024 ** 2:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        version = f", torch {torch.__version__}"
    except ImportError:
        version = ""
    return f"{model}, {os.cpu_count()} cores{memory}{version}, Python {platform.python_version()}"


def to_markdown(text: str) -> List[str]:
    """Printed output -> markdown: runs of ``#`` log lines become fenced blocks."""
    out: List[str] = []
    in_block = False
    for line in text.rstrip("\n").split("\n"):
        is_log = line.startswith("#")
        if is_log and not in_block:
            out.append("```text")
            in_block = True
        elif not is_log and in_block:
            out.append("```")
            in_block = False
        out.append(line)
    if in_block:
        out.append("```")
    return out


def append_section(title: str, command: str, text: str, path: str = RESULTS) -> None:
    """Append one dated section to ``path``."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = ["", f"### {title}: {stamp}", "",
             f"Machine: {machine_line()}. Command: `{command}`", ""]
    lines += to_markdown(text)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@contextlib.contextmanager
def recording(enabled: bool, title: str, path: str = RESULTS) -> Iterator[None]:
    """Tee stdout; on a clean exit with ``enabled``, append the output to RESULTS.md."""
    command = "python " + " ".join(
        [os.path.relpath(sys.argv[0], os.path.dirname(os.path.dirname(RESULTS)))] + sys.argv[1:])
    if not enabled:
        yield
        return
    tee = _Tee(sys.stdout)
    previous, sys.stdout = sys.stdout, tee
    try:
        yield
    finally:
        sys.stdout = previous
    append_section(title, command, tee.copy.getvalue(), path)
    print(f"# recorded in {os.path.relpath(path)}", flush=True)

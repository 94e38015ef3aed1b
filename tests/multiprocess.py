"""Run a test body on N gloo ranks on CPU and report each rank's failure with its rank.

Usage::

    def body(x):                          # module-level, so a rank can import it
        rank = torch.distributed.get_rank()
        ...
        return something_picklable

    results = run_on_ranks(body, 4, x)    # list indexed by rank

Each rank is a fresh process, forked from a server that has already imported torch and the
project and given the parent's environment, working folder and import path, with
``torch.distributed`` initialised over a file store in a private temporary folder (no ports to
collide), ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set as torchrun would, one intra-op thread (the machine may have fewer cores than ranks), and the
device forced to CPU. If any rank raises, the others are stopped and an ``AssertionError`` lists
each failing rank's traceback.
"""

import datetime
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Callable, List

import torch

DEFAULT_TIMEOUT_S = 300


# Ranks are forked from one server process that has already imported torch and the project
# (``forkserver``), so a rank starts in milliseconds instead of re-importing torch; everything a
# fresh process would take from its parent (environment, working folder, import path) is handed
# to each rank explicitly. A rank's stdout and stderr go to files that the parent copies to its
# own when the ranks are done, so pytest's capture (and a failing test's report) shows them.
#
# The list also holds what a rank would otherwise import on first use, each time: torch_dist
# checkpoints and FSDP2 pull in torch.distributed.checkpoint / fsdp / tensor (about 700 modules,
# sympy among them: 1-2 s a rank), and torch.optim's first step imports torch._dynamo (about a
# second). A pytest process has one forkserver and the first test to start a rank fixes its
# preloads, so every helper that forks ranks (``tests/reliability/launch.py`` too) goes through
# :func:`forkserver_context`.
PRELOAD = ["torch", "torch.distributed", "numpy", "torch._dynamo", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor", "megatron.core.parallel_state",
           "megatron.training.training", "megatron.checkpoint.load", "pretrain_gpt"]
_context = None


def forkserver_context():
    """The ``forkserver`` multiprocessing context every test helper forks its ranks from."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _worker(fn, rank, world_size, tmpdir, args, kwargs, parent=None):
    if parent is not None:
        environ, cwd, path = parent
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(tmpdir, f"{name}_rank{rank}.txt"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    import torch.distributed as dist

    from megatron.core import device, parallel_state

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    device.configure("cpu")
    err_path = os.path.join(tmpdir, f"error_rank{rank}.txt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}", rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        result = fn(*args, **kwargs)
        torch.save(result, os.path.join(tmpdir, f"result_rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        with open(err_path + ".tmp", "w") as f:
            f.write(traceback.format_exc())
        os.replace(err_path + ".tmp", err_path)
        raise SystemExit(1)
    finally:
        parallel_state.destroy_model_parallel()
    # Tear down only after every rank has finished, so no rank exits mid-collective.
    dist.barrier()
    dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S,
                 **kwargs) -> List:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    tmpdir = tempfile.mkdtemp(prefix="mp_test_")
    ctx = forkserver_context()
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, tmpdir, args, kwargs, parent),
                         daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if any(f.startswith("error_rank") and f.endswith(".txt") for f in os.listdir(tmpdir)):
                # Give the failing rank's peers a moment to report their own errors, then stop.
                time.sleep(1.0)
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        timed_out = time.monotonic() > deadline
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(10)
        errors = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"error_rank{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- rank {r} of {world_size} failed:\n{f.read()}")
        if errors:
            raise AssertionError("\n".join(errors))
        if timed_out:
            raise AssertionError(f"ranks did not finish within {timeout} s")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks {bad} exited with codes "
                                 f"{[procs[r].exitcode for r in bad]} and no traceback")
        return [torch.load(os.path.join(tmpdir, f"result_rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        _copy_rank_output(tmpdir, world_size)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _copy_rank_output(tmpdir: str, world_size: int) -> None:
    """Every rank's stdout and stderr, rank by rank, onto this process's."""
    for fd, name, stream in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
        stream.flush()
        for r in range(world_size):
            path = os.path.join(tmpdir, f"{name}_rank{r}.txt")
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                data = memoryview(f.read())
            while data:
                data = data[os.write(fd, data):]

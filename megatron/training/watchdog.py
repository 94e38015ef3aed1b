"""--hang-dump-timeout-s: when a step hangs, every rank leaves its stacks on disk and the job
stops, naming the rank(s) the others wait for.

The training loop marks where each rank is: ``phase(iteration, "train-step")`` before a step and
``phase(iteration, "after-step")`` before the evaluation, logging and saving that follow; each
mark is written to the process group's own key-value store (the one ``torch.distributed`` was
initialised with) and re-arms this rank's deadline. A thread on every rank checks the deadline
and a shared "dump" key a few times a second. When this rank's phase has lasted longer than the
timeout, or another rank has set the dump key, it

1. writes ``hang_rank<R>.txt`` in the dump folder (--hang-dump-dir, else --save, else
   --tensorboard-dir, else the working folder): a header (rank, host, iteration, phase), then
   the Python stack of every thread (``faulthandler.dump_traceback(all_threads=True)``);
2. publishes where its training thread is: its iteration and phase, and whether it is blocked
   inside a ``torch.distributed`` call (which one, from where), or in the ``.wait()`` of an
   asynchronous communication handle (pipeline sends and receives, overlapped reductions), or
   is somewhere else;
3. sets the dump key, so ranks that are not (yet) over their deadline dump too;
4. waits a few seconds for every rank's entry; the lowest rank that answered prints the verdict;
5. ends the process with exit code :data:`HANG_EXIT_CODE` (torchrun then stops the rest).

The verdict names as behind: ranks at an earlier iteration or phase than the furthest rank,
ranks that are not inside a collective while others are (they never arrived at it), and ranks
that did not answer (their Python is stuck; their stack file may be missing). Without the flag
nothing here runs: no thread, no store traffic.
"""

import dis
import faulthandler
import json
import os
import socket
import sys
import sysconfig
import threading
import time
from typing import Dict, List, Optional

import torch.distributed as dist

HANG_EXIT_CODE = 3
PHASES = ("before-training", "train-step", "after-step")
_KEY_PREFIX = "megatron_hang_watchdog/"
# How long a rank waits for the others' entries once a dump has started.
ANSWER_WAIT_S = 10.0
# How the process ends after a dump (a test replaces it to stay alive).
_exit = os._exit


def dump_dir(args) -> str:
    """Where the stack files go (see the module docstring)."""
    return args.hang_dump_dir or args.save or args.tensorboard_dir or os.getcwd()


def _place(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _outside_stdlib(frame):
    """The innermost frame of ``frame``'s stack that is not Python's own library (a thread
    waiting on an Event is at the code that waits, not inside threading.py)."""
    stdlib = sysconfig.get_paths()["stdlib"]

    def in_stdlib(path):
        return (path.startswith(stdlib) and "site-packages" not in path
                and "dist-packages" not in path)

    innermost = frame
    while frame is not None and in_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    return frame or innermost


def _method_called(frame) -> Optional[str]:
    """The name of the method ``frame`` is calling now (the last attribute it loaded)."""
    name = None
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset > frame.f_lasti:
            break
        if instruction.opname in ("LOAD_METHOD", "LOAD_ATTR"):
            name = instruction.argval
    return name


def _where(frame) -> Dict[str, str]:
    """Where a thread stands: the innermost ``torch.distributed`` call on its stack (it waits
    in a collective) and its caller; or a ``.wait()`` on an asynchronous communication handle
    (a compiled method: no Python frame below the caller); else its innermost frame outside
    Python's library."""
    innermost = frame
    collective = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path and collective is None:
            collective = frame
        elif collective is not None and "/torch/distributed/" not in path:
            return {"collective": collective.f_code.co_name, "at": _place(frame)}
        frame = frame.f_back
    if innermost is None:
        return {"collective": "", "at": "unknown"}
    if _method_called(innermost) == "wait" and _outside_stdlib(innermost) is innermost:
        return {"collective": "wait", "at": _place(innermost)}
    return {"collective": "", "at": _place(_outside_stdlib(innermost))}


def verdict(states: Dict[int, dict], world_size: int,
            marks: Optional[Dict[int, str]] = None) -> List[str]:
    """The lines naming the ranks behind, from the entries of the ranks that answered.

    Args:
        states: rank -> {"iteration", "phase", "collective", "at"} (rank's own entry).
        world_size: every rank of the job; those absent from ``states`` did not answer.
        marks: rank -> the last "iteration phase" a silent rank recorded in the store.
    """
    def progress(state):
        return (state["iteration"], PHASES.index(state["phase"]))

    furthest = max((progress(s) for s in states.values()), default=None)
    waiting = {r for r, s in states.items() if s["collective"]}
    behind = {r for r, s in states.items() if progress(s) < furthest}
    if waiting:
        behind |= {r for r, s in states.items() if not s["collective"]}
    silent = [r for r in range(world_size) if r not in states]
    named = sorted(behind | set(silent))
    lines = []
    if named:
        lines.append(f"hang watchdog: rank(s) {', '.join(map(str, named))} did not arrive "
                     "where the others wait")
    else:
        lines.append("hang watchdog: every rank is at the same point; none is behind")
    for rank in sorted(states):
        s = states[rank]
        if s["collective"] == "wait":
            place = f"waiting for an asynchronous communication (.wait()) at {s['at']}"
        elif s["collective"]:
            place = f"waiting in torch.distributed.{s['collective']} called at {s['at']}"
        else:
            place = f"not in a collective, at {s['at']}"
        lines.append(f"  rank {rank}: iteration {s['iteration']} {s['phase']}, {place}")
    for rank in silent:
        last = (marks or {}).get(rank)
        lines.append(f"  rank {rank}: no answer (its Python does not run; stack file may be "
                     f"missing); last recorded: {last or 'nothing'}")
    return lines


class HangWatchdog:
    """The per-rank watchdog thread and the marks of the training loop."""

    def __init__(self, args, store=None):
        self.rank, self.world_size = args.rank, args.world_size
        self.timeout_s = float(args.hang_dump_timeout_s)
        self.folder = dump_dir(args)
        os.makedirs(self.folder, exist_ok=True)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(_KEY_PREFIX, base)
        self.poll_s = min(1.0, self.timeout_s / 10.0)
        self._lock = threading.Lock()
        self._mark = None            # (iteration, phase, monotonic start)
        self._trainer = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def phase(self, iteration: int, name: str) -> None:
        """This rank reached ``name`` of ``iteration``; the deadline starts again."""
        with self._lock:
            self._mark = (iteration, name, time.monotonic())
            self._trainer = threading.get_ident()
        self.store.set(f"progress/{self.rank}", f"{iteration} {name}")

    def close(self) -> None:
        """Disarm and stop the thread (end of training)."""
        with self._lock:
            self._mark = None
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                mark = self._mark
            overdue = mark is not None and time.monotonic() - mark[2] > self.timeout_s
            if overdue or self._dump_requested():
                self._dump_and_exit(mark)
                return

    def _dump_requested(self) -> bool:
        try:
            return self.store.check(["dump"])
        except Exception:  # noqa: BLE001 - a store gone with the job; its collectives fail too
            return False

    def _state(self, mark) -> dict:
        frame = sys._current_frames().get(self._trainer)
        state = _where(frame)
        iteration, phase = (mark[0], mark[1]) if mark is not None else (0, PHASES[0])
        state.update(iteration=iteration, phase=phase)
        return state

    def _write_stacks(self, state) -> str:
        path = os.path.join(self.folder, f"hang_rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world_size} on {socket.gethostname()} "
                    f"(pid {os.getpid()}): iteration {state['iteration']} {state['phase']}, "
                    f"over {self.timeout_s:g} s (--hang-dump-timeout-s)\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path

    def _collect(self) -> Dict[int, dict]:
        deadline = time.monotonic() + ANSWER_WAIT_S
        keys = [f"state/{r}" for r in range(self.world_size)]
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.05)
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)
                if self.store.check([k])}

    def _dump_and_exit(self, mark) -> None:
        """Stacks to the file first; then the exchange through the store, which may fail
        when the job is already coming apart; the process ends either way."""
        state = self._state(mark)
        path = self._write_stacks(state)
        try:
            self._report(state, path)
        except Exception as err:  # noqa: BLE001 - the stacks are written; end as promised
            print(f"hang watchdog: rank {self.rank} wrote its stacks to {path} but could not "
                  f"reach the other ranks through the store ({err})", file=sys.stderr,
                  flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        _exit(HANG_EXIT_CODE)

    def _report(self, state: dict, path: str) -> None:
        """Publish this rank's entry, wait for the others', print the verdict (lowest rank
        that answered), and wait until every answering rank has printed too."""
        self.store.set(f"state/{self.rank}", json.dumps(state))
        self.store.set("dump", str(self.rank))
        print(f"hang watchdog: rank {self.rank} wrote its stacks to {path}", file=sys.stderr,
              flush=True)
        states = self._collect()
        if self.rank == min(states, default=self.rank):
            marks = {r: self.store.get(f"progress/{r}").decode()
                     for r in range(self.world_size)
                     if r not in states and self.store.check([f"progress/{r}"])}
            print("\n".join(verdict(states, self.world_size, marks)), file=sys.stderr,
                  flush=True)
            print(f"hang watchdog: stack files in {self.folder}; stopping the job",
                  file=sys.stderr, flush=True)
        self.store.add("done", 1)
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline and int(self.store.add("done", 0)) < len(states):
            time.sleep(0.05)


class _Off:
    """Without --hang-dump-timeout-s: no thread, no store traffic."""

    def phase(self, iteration: int, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def build(args):
    """A :class:`HangWatchdog` with --hang-dump-timeout-s, else an object that does nothing."""
    if args.hang_dump_timeout_s is None:
        return _Off()
    return HangWatchdog(args)

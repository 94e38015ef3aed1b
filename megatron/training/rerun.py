"""Result validation for long runs: Megatron's rerun state machine and the weight-hash check.

``--rerun-mode validate_results``: when a step's result is rejected (a loss or a gradient not
finite under --check-for-nan-in-loss-and-grad; a loss or gradient norm at least 10x the largest
of the first 100 seen, under --check-for-spiky-loss / --check-for-large-grads; or an error put
there by --error-injection-rate), the forward and backward passes of that step run again before
the optimizer step, on the same micro-batches (replayed by :class:`ReplayIterator`) and from the
same RNG states. Each rank that rejected its result compares the two runs bit for bit:

* different (a transient fault): the rank is named as suspect, the step is saved (the weights
  before its optimizer step) and every rank exits with
  :data:`EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (17), so the scheduler replaces the node.
* the same (a reproducible result): the message names the iteration, the rank and the values;
  the machine's state is saved with the checkpoint and every rank exits with
  :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE` (16). Resumed (on another node), the step runs once
  more and is compared with the first result: a different value means the first device was
  persistently faulty, the same value a real numerical problem; either way the run stops with
  exit code 17 and says which. The checkpoint names the node and device that produced the
  result (Megatron's ``suspicious_node`` / ``suspicious_device``); a run resumed on that same
  node and device saves nothing and exits with 16 again, so the scheduler resumes the same
  checkpoint elsewhere, as Megatron does.

What a scheduler reads to place the next attempt is what Megatron writes: the exit code, and
with --result-rejected-tracker-filename one line per event naming the node, device, job and
rank (``status=first_rerun_not_reproducible``: a transient fault there, leave that node out).

Rejections of the spike checks are not fatal: they are re-run and reported, and training goes
on. ``--rerun-mode report_stats`` re-runs every step once and reports, every
:data:`REPORTING_INTERVAL` iterations, how far the re-runs' results were from the first runs'
(relative difference; a deterministic run has all identical). ``disabled`` keeps the checks'
plain behaviour (stop at once, :mod:`megatron.training.numerics`).

The machine's state is saved under Megatron's checkpoint key ``rerun_state_machine``
(``mode``, ``state``, ``current_iteration`` and the per-rank ``sharded`` dict with Megatron's
field names), only while a re-run from the checkpoint is pending, as Megatron does. In the
torch format it is a top-level entry of each rank file; in torch_dist it is laid out as
Megatron-Core lays it out (:func:`megatron.checkpoint.torch_dist._rerun_shards`): the common
part in ``common_state``, each rank's part in ``rerun_state_machine_state/shard_<rank>_<world>``.
"""

import hashlib
import math
import os
import random
import re
from enum import IntEnum
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint.state import rng_state_snapshot, set_rng_state_snapshot
from megatron.core import device

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
CHECKPOINT_KEY = "rerun_state_machine"
REPORTING_INTERVAL = 2
SPIKE_FACTOR = 10.0  # Megatron's threshold for spiky losses and large gradients
MAX_VALUE_SAMPLES = 100


class RerunState(IntEnum):
    """Megatron's states (the values its checkpoints hold)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunExit(Exception):
    """Raised by the training step on every rank: save (when ``checkpoint``), then exit with
    ``code``."""

    def __init__(self, code: int, checkpoint: bool, message: str):
        super().__init__(message)
        self.code, self.checkpoint = code, checkpoint


class ReplayIterator:
    """A data iterator whose micro-batches of the current step can be read again.

    :meth:`rewind` replays the step's micro-batches from the first; :meth:`advance` forgets
    them at the start of the next step. Nothing else changes: the wrapped iterator is read
    exactly as often as without the wrapper.
    """

    def __init__(self, inner):
        self.inner = inner
        self.saved: List[object] = []
        self.replay_pos: Optional[int] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay_pos is not None:
            if self.replay_pos >= len(self.saved):
                raise RuntimeError("rerun: the re-run read more micro-batches than the first run")
            item = self.saved[self.replay_pos]
            self.replay_pos += 1
            return item
        item = next(self.inner)
        self.saved.append(item)
        return item

    def rewind(self) -> None:
        self.replay_pos = 0

    def advance(self) -> None:
        self.saved, self.replay_pos = [], None


def wrap_iterators(data_iterator):
    """``data_iterator`` (one, a list per model chunk, or None) with every iterator wrapped."""
    if isinstance(data_iterator, list):
        return [wrap_iterators(d) for d in data_iterator]
    return None if data_iterator is None else ReplayIterator(data_iterator)


def _iterators(data_iterator) -> List[ReplayIterator]:
    items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    return [d for d in items if isinstance(d, ReplayIterator)]


def same_values(a: List[float], b: List[float]) -> bool:
    """Bit-for-bit equality of two result lists, a nan equal to a nan."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def relative_difference(a: List[float], b: List[float]) -> float:
    """The largest relative difference between two result lists (0.0: identical)."""
    if same_values(a, b):
        return 0.0
    if len(a) != len(b) or any(math.isfinite(x) != math.isfinite(y) for x, y in zip(a, b)):
        return math.inf
    return max(abs(x - y) / max(abs(x + y) / 2, 1e-30) for x, y in zip(a, b) if x != y)


class ErrorInjector:
    """--error-injection-rate / --error-injection-type: on a validated step a rank rejects its
    (correct) result with probability 1/rate, and the re-runs then see what the type says:
    ``transient_error`` a different result in place; ``persistent_error`` the same in place and
    a different one after the resume; ``correct_result`` the same both times.

    The draws come from a generator of their own (seeded alike on every rank, the rank added as
    Megatron does, so with rate <= world size one rank a draw is hit), never from the training
    RNG streams.
    """

    def __init__(self, rate: int, kind: str, seed: int, rank: int):
        self.rate, self.kind, self.rank = rate, kind, rank
        self.rng = random.Random(seed)
        self.injected: Optional[str] = None

    def maybe_inject(self) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.rng.randint(0, self.rate - 1) + self.rank) % self.rate != 0:
            return False
        self.injected = self.kind
        print(f"rank {self.rank}: injecting a {self.kind} (--error-injection-type)", flush=True)
        return True

    def rerun_matches(self, state: RerunState, actual: bool) -> bool:
        """Whether a re-run's result counts as the same as the first (``actual``: whether it
        is) once an injected error is taken into account."""
        if self.injected is None:
            return actual
        if state == RerunState.RERUNNING_IN_PLACE:
            if self.injected == "transient_error":
                self.injected = None
                return False
            return True
        matches = self.injected == "correct_result"
        self.injected = None
        return matches

    def state_dict(self) -> dict:
        return {"error_injection_rate": self.rate, "error_injection_type": self.kind,
                "injected_error_type": self.injected}

    def load_state_dict(self, state: dict) -> None:
        self.rate = int(state["error_injection_rate"])
        self.kind = _plain(state["error_injection_type"])
        injected = state.get("injected_error_type")
        self.injected = None if injected is None else _plain(injected)


def _plain(value) -> str:
    """A diagnostic as its string (Megatron's files hold its ``str`` enum, or a stand-in)."""
    value = getattr(value, "value", value)
    return str(value)


class Stats:
    """--rerun-mode report_stats: the relative differences seen between runs of one result."""

    def __init__(self):
        self.samples: List[float] = []

    def line(self) -> str:
        n, same = len(self.samples), sum(1 for s in self.samples if s == 0.0)
        if n == 0:
            return "no samples"
        ordered = sorted(self.samples)
        pick = {p: ordered[min(n - 1, int(n * p))] for p in (0.5, 0.9, 0.99)}
        return (f"{n}/{same} total/identical samples, rel. variability: "
                f"avg= {sum(ordered) / n:.3E}, p50= {pick[0.5]:.3E}, p90= {pick[0.9]:.3E}, "
                f"p99= {pick[0.99]:.3E}, max: {ordered[-1]:.3E}")


class StepRun:
    """What one run of a step's forward and backward passes gives the machine."""

    def __init__(self, logged, findings: List[str], losses: List[float],
                 grad_sumsq: Optional[float]):
        self.logged, self.findings = logged, findings
        self.losses, self.grad_sumsq = losses, grad_sumsq

    @property
    def values(self) -> List[float]:
        return self.losses + ([] if self.grad_sumsq is None else [self.grad_sumsq])


def _reduce_any(flags: List[bool]) -> List[bool]:
    tensor = torch.tensor([int(f) for f in flags], device=device.current_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def node_and_device() -> Tuple[str, int]:
    """(node, device) of this rank, as Megatron records a suspect: the host name and the
    accelerator's index (on CPU, the local rank)."""
    dev = device.current_device()
    index = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
    return os.uname()[1], index


def _fmt(values: List[float]) -> str:
    return "[" + ", ".join(repr(v) for v in values) + "]"


class RerunStateMachine:
    """One rank's machine; see the module docstring. Built by :func:`build` from the flags."""

    def __init__(self, mode: str, injector: ErrorInjector, rank: int, *,
                 check_nan: bool, check_spiky_loss: bool, check_large_grads: bool,
                 tracker_filename: Optional[str] = None):
        self.mode, self.injector, self.rank = mode, injector, rank
        # Megatron's state_save_func / state_restore_func: what else a step's passes change
        # (set by the training loop, see set_step_state).
        self.state_save_func: Optional[Callable[[], object]] = None
        self.state_restore_func: Optional[Callable[[object], None]] = None
        self.check_nan, self.check_spiky_loss = check_nan, check_spiky_loss
        self.check_large_grads = check_large_grads
        self.tracker_filename = tracker_filename
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.first_iteration_complete = False
        self.rerun_requested = False
        self.initial_result: Optional[List[float]] = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}
        self.stats = Stats()

    def set_step_state(self, save: Callable[[], object],
                       restore: Callable[[object], None]) -> None:
        """What a step's forward and backward passes change besides the gradients and the
        RNG states (e.g. the token counts of the routers, the auxiliary-loss sums): ``save()``
        is taken before the first run and ``restore(saved)`` before every re-run, so a re-run
        starts where the first run did."""
        self.state_save_func, self.state_restore_func = save, restore

    def _snapshot(self) -> dict:
        return {"rng": rng_state_snapshot(),
                "other": self.state_save_func() if self.state_save_func else None}

    def _restore(self, snapshot: dict) -> None:
        set_rng_state_snapshot(snapshot["rng"])
        if self.state_restore_func is not None:
            self.state_restore_func(snapshot["other"])

    @property
    def validates_grads(self) -> bool:
        return self.check_nan or self.check_large_grads

    # ---- the step -------------------------------------------------------------------------
    def run_step(self, body: Callable[[], StepRun], data_iterator, iteration: int,
                 stop_plainly: Callable[[List[str]], None]):
        """Run the step's passes (``body``) once, or again as the mode asks; returns the
        logged losses of the run whose gradients stand. ``stop_plainly(findings)`` stops
        every rank as the disabled mode does (the first iteration of a process, as Megatron:
        no re-run before one optimizer step was taken). Raises :class:`RerunExit`."""
        iterators = _iterators(data_iterator)
        for it in iterators:
            it.advance()
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return self._rerun_from_checkpoint(body, iteration)
        snapshot = self._snapshot()
        self.current_iteration, self.state = iteration, RerunState.INITIAL_RUN
        first = body()
        if self.mode == "report_stats":
            second = self._again(body, snapshot, iterators)
            self.stats.samples.append(relative_difference(first.values, second.values))
            self._maybe_report_stats(iteration)
            return self._done(second)
        fatal, spike = self._judge(first)
        any_fatal, any_spike = _reduce_any([fatal, spike])
        if not (any_fatal or any_spike):
            return self._done(first)
        if not self.first_iteration_complete:
            if any_fatal:
                self.state = RerunState.NOT_RUNNING_YET
                stop_plainly(first.findings)
            return self._done(first)
        self.rerun_requested, self.initial_result = fatal or spike, first.values
        if self.rerun_requested:
            self._track("initial_run", first.values)
        second = self._again(body, snapshot, iterators)
        return self._decide_in_place(first, second, any_fatal, fatal, iteration, snapshot)

    def _again(self, body, snapshot, iterators) -> StepRun:
        self._restore(snapshot)
        for it in iterators:
            it.rewind()
        self.state = RerunState.RERUNNING_IN_PLACE
        return body()

    def _done(self, run: StepRun):
        self.state = RerunState.NOT_RUNNING_YET
        self.first_iteration_complete = True
        self.rerun_requested, self.initial_result = False, None
        return run.logged

    def _judge(self, run: StepRun):
        """(fatal, spike): whether this rank rejects the run's result."""
        fatal = bool(run.findings) and self.check_nan
        if self.first_iteration_complete and self.injector.maybe_inject():
            fatal = True
        spike = False
        if self.check_spiky_loss and run.losses:
            spike = self._unexpectedly_large(max(abs(v) for v in run.losses), "loss")
        if self.check_large_grads and run.grad_sumsq is not None:
            spike = self._unexpectedly_large(math.sqrt(abs(run.grad_sumsq)), "grads") or spike
        return fatal, spike and not fatal

    def _unexpectedly_large(self, value: float, context: str) -> bool:
        """At least :data:`SPIKE_FACTOR` x the largest of the first :data:`MAX_VALUE_SAMPLES`
        values seen (not finite values are the nan check's)."""
        if not math.isfinite(value):
            return False
        seen = self.large_value_counts.get(context, 0)
        if seen < MAX_VALUE_SAMPLES:
            self.large_value_counts[context] = seen + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            return False
        return value >= self.max_values[context] * SPIKE_FACTOR

    def _decide_in_place(self, first: StepRun, second: StepRun, any_fatal: bool, fatal: bool,
                         iteration: int, snapshot: dict):
        outcome = None
        if self.rerun_requested:
            same = self.injector.rerun_matches(RerunState.RERUNNING_IN_PLACE,
                                               same_values(first.values, second.values))
            self._track("first_rerun_reproducible" if same else "first_rerun_not_reproducible",
                        second.values)
            outcome = (self.rank, same, fatal, os.uname()[1], _fmt(first.values),
                       _fmt(second.values))
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        outcomes = [o for o in outcomes if o is not None]
        where = f"iteration {iteration}: result validation (--rerun-mode validate_results)"
        if not any_fatal:  # spikes only: reported, and training goes on
            if self.rank == 0:
                for rank, same, _, node, a, b in outcomes:
                    print(f"{where}: rank {rank} (node {node}): unexpectedly large value "
                          f"(--check-for-spiky-loss / --check-for-large-grads), first run {a}, "
                          f"re-run {b}: {'reproducible' if same else 'not reproducible'}; "
                          "training goes on", flush=True)
            return self._done(second)
        self._restore(snapshot)  # a checkpoint now holds the step's starting state
        transient = [o for o in outcomes if o[2] and not o[1]]
        if transient:
            self._done(second)
            named = "; ".join(f"rank {r} (node {n}): first run {a}, re-run {b}"
                              for r, _, _, n, a, b in transient)
            raise RerunExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, True, (
                f"{where}: the rejected result was not reproducible on the same rank: a "
                f"transient fault; suspect rank(s) {[o[0] for o in transient]}: {named}. "
                "Saving a checkpoint before this step's optimizer step and exiting with code "
                f"{EXIT_CODE_FAILED_ON_RESULT_VALIDATION}; resume on other nodes"))
        self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self.suspicious_node, self.suspicious_device = (
            node_and_device() if self.rerun_requested else (None, None))
        named = "; ".join(f"rank {r} (node {n}): {a}, re-run {b}"
                          for r, _, f, n, a, b in outcomes if f)
        raise RerunExit(EXIT_CODE_RESUME_TO_DISAMBIGUATE, True, (
            f"{where}: the rejected result was reproduced in place: {named}. Saving a "
            "checkpoint before this step's optimizer step and exiting with code "
            f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE}: resume it on other nodes to tell a persistent "
            "device fault from a real numerical problem"))

    def _rerun_from_checkpoint(self, body, iteration: int):
        self._refuse_the_same_place(iteration)
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT
        run = body()
        outcome = None
        if self.rerun_requested:
            same = self.injector.rerun_matches(RerunState.RERUNNING_FROM_CHECKPOINT,
                                               same_values(self.initial_result, run.values))
            self._track("second_rerun_reproducible" if same else "second_rerun_not_reproducible",
                        run.values)
            outcome = (self.rank, same, self.suspicious_node, _fmt(self.initial_result),
                       _fmt(run.values))
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        parts = []
        for rank, same, node, a, b in (o for o in outcomes if o is not None):
            parts.append(
                f"rank {rank}: the result {a} is reproduced on this run: a real numerical "
                "problem (the model or the data), not a device fault" if same else
                f"rank {rank}: the result first seen on node {node} ({a}) is {b} on this run: "
                f"a persistent fault of that node's device")
        self._done(run)
        raise RerunExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False, (
            f"iteration {iteration}: result validation, re-run from the checkpoint: "
            + "; ".join(parts) + f". Exiting with code {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}"))

    def _refuse_the_same_place(self, iteration: int) -> None:
        """A rank that re-checks its own result on the node and device that produced it (the
        scheduler gave the job the same place again) learns nothing: as Megatron does, every
        rank exits with :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE` again and saves nothing, so
        the same checkpoint is resumed once more, elsewhere."""
        here = node_and_device()
        same = self.rerun_requested and (self.suspicious_node, self.suspicious_device) == here
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.rank, here) if same else None)
        named = [f"rank {r} (node {n}, device {d})" for r, (n, d) in
                 (o for o in everyone if o is not None)]
        if not named:
            return
        self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
        raise RerunExit(EXIT_CODE_RESUME_TO_DISAMBIGUATE, False, (
            f"iteration {iteration}: result validation, re-run from the checkpoint: "
            f"rescheduled on the node and device whose result it re-checks: "
            f"{'; '.join(named)}. Nothing saved; exiting with code "
            f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE}: resume the same checkpoint again on other "
            "nodes"))

    # ---- reports --------------------------------------------------------------------------
    def _track(self, status: str, values: List[float]) -> None:
        """--result-rejected-tracker-filename: one line per event, in Megatron's format."""
        if self.tracker_filename is None:
            return
        import datetime

        node, index = node_and_device()
        with open(self.tracker_filename, "a") as f:
            f.write(f"ts={datetime.datetime.now()} node={node} device={index} "
                    f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={self.rank} "
                    f"iteration={self.current_iteration} status={status} result={_fmt(values)} "
                    f"message='{_message(self)}'\n")

    def _maybe_report_stats(self, iteration: int) -> None:
        if iteration % REPORTING_INTERVAL != 0:
            return
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.stats.samples)
        if self.rank == 0:
            merged = Stats()
            merged.samples = [s for samples in everyone for s in samples]
            print(f"iteration {iteration}: rerun statistics (--rerun-mode report_stats), loss "
                  f"and gradient re-run vs first run: {merged.line()}", flush=True)

    # ---- checkpoint -----------------------------------------------------------------------
    def _sharded(self) -> dict:
        return {"rerun_requested": self.rerun_requested,
                "checkpoint_requested": self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT,
                "restart_again_requested": False, "continue_requested": False,
                "error_injector_checkpoint": self.injector.state_dict(),
                "failed_validation_call": None, "initial_result": self.initial_result,
                "suspicious_node": self.suspicious_node,
                "suspicious_device": self.suspicious_device,
                "data_iterator_checkpoints": None,
                "large_value_counts": dict(self.large_value_counts),
                "max_values": dict(self.max_values)}

    def state_dict(self) -> Optional[dict]:
        """Collective. The entry of Megatron's checkpoint key ``rerun_state_machine``: None
        unless a re-run from the checkpoint is pending; ``sharded`` is this rank's part, and
        ``sharded_by_rank`` every rank's (a file is written by one rank of the replicas)."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self._sharded())
        if self.state == RerunState.NOT_RUNNING_YET:
            return None
        return {"mode": self.mode, "state": int(self.state),
                "current_iteration": self.current_iteration, "sharded": everyone[self.rank],
                "sharded_by_rank": everyone}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Take a checkpoint's ``rerun_state_machine`` entry (this project's or Megatron's,
        whose enums arrive as stand-ins); nothing pending, or this run's mode disabled, leaves
        the machine fresh."""
        if not state or self.mode == "disabled":
            return
        saved_state = int(getattr(state.get("state"), "value", state.get("state")) or 0)
        if saved_state != RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return
        by_rank = state.get("sharded_by_rank")
        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = by_rank[self.rank] if by_rank and len(by_rank) == world else state["sharded"]
        self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self.current_iteration = int(state["current_iteration"])
        self.rerun_requested = bool(sharded["rerun_requested"])
        self.initial_result = (None if sharded["initial_result"] is None
                               else [float(v) for v in sharded["initial_result"]])
        self.suspicious_node = sharded["suspicious_node"]
        self.suspicious_device = sharded.get("suspicious_device")
        self.injector.load_state_dict(sharded["error_injector_checkpoint"])
        self.large_value_counts = dict(sharded.get("large_value_counts") or {})
        self.max_values = dict(sharded.get("max_values") or {})
        self.first_iteration_complete = True


def _message(machine: RerunStateMachine) -> str:
    checks = [name for name, on in (("inf or nan", machine.check_nan),
                                    ("spiky loss", machine.check_spiky_loss),
                                    ("large grads", machine.check_large_grads)) if on]
    return ", ".join(checks) or "error injection"


def tracker_iterations_to_skip(path: Optional[str]) -> List[int]:
    """Iterations a --result-rejected-tracker-filename file rejects, which a later run skips
    (added to --iterations-to-skip), by Megatron's rule: a result reproduced on its second
    re-run, or one rejected twice on the same rank and iteration with re-runs disabled. A
    missing file (a first run) rejects nothing; a line of another form is passed over."""
    if path is None or not os.path.exists(path):
        return []
    pattern = re.compile(r"ts=.+ node=.+ device=.+ jobID=.+ rank=(\d+) iteration=(\d+) "
                         r"status=(\S+) ")
    skip, seen = set(), set()
    with open(path) as f:
        for line in f:
            match = pattern.search(line)
            if match is None:
                continue
            rank, iteration = int(match[1]), int(match[2])
            status = match[3].rsplit(".", 1)[-1].lower()  # "rerun_disabled" or its enum name
            if status == "second_rerun_reproducible":
                skip.add(iteration)
            elif status == "rerun_disabled":
                if (rank, iteration) in seen:
                    skip.add(iteration)
                seen.add((rank, iteration))
    return sorted(skip)


def build(args, rank: int) -> Optional[RerunStateMachine]:
    """The machine the flags ask for, or None when nothing is validated (every check off and
    no error injection: the step runs as it always did)."""
    mode = args.rerun_mode
    checks = (args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss
              or args.check_for_large_grads or args.error_injection_rate > 0)
    if mode == "disabled" or not checks:
        return None
    if args.result_rejected_tracker_filename is not None:
        try:
            with open(args.result_rejected_tracker_filename, "a"):
                pass
        except OSError as err:
            raise SystemExit(f"--result-rejected-tracker-filename "
                             f"{args.result_rejected_tracker_filename}: cannot append ({err})")
    injector = ErrorInjector(args.error_injection_rate, args.error_injection_type, args.seed,
                             rank)
    return RerunStateMachine(mode, injector, rank,
                             check_nan=args.check_for_nan_in_loss_and_grad,
                             check_spiky_loss=args.check_for_spiky_loss,
                             check_large_grads=args.check_for_large_grads,
                             tracker_filename=args.result_rejected_tracker_filename)


class WeightHashMismatchError(RuntimeError):
    """--check-weight-hash-across-dp-replicas-interval found replicas whose weights differ."""


def _digests(model) -> List[tuple]:
    """``(name, kind, digest)`` of each parameter; kind: ``dense``, ``expert``, ``shard``
    (a weight shard, whose replicas are its weight-shard data-parallel group) or
    ``expert_shard`` (an expert's, over the expert weight-shard data-parallel group)."""
    out = []
    for c, chunk in enumerate(model):
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            data = param.detach().contiguous().cpu().view(-1).view(torch.uint8)
            expert = not getattr(param, "allreduce", True)
            kind = "expert" if expert else "dense"
            if getattr(param, "weight_shards", 1) > 1:
                kind = "expert_shard" if expert else "shard"
            out.append((name if len(model) == 1 else f"{name} (model chunk {c})", kind,
                        hashlib.sha256(data.numpy().tobytes()).hexdigest()))
    return out


def _mismatches(items: List[tuple], group) -> List[str]:
    if group is None or dist.get_world_size(group) == 1:
        return []
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, items, group=group)
    ranks = dist.get_process_group_ranks(group)
    found = []
    for i, (name, _) in enumerate(items):
        digests = [theirs[i][1] for theirs in everyone]
        if len(set(digests)) > 1:
            found.append(f"{name}: " + ", ".join(
                f"rank {r} {d[:12]}" for r, d in zip(ranks, digests)))
    return found


def check_weight_hashes(model, optimizer, pstate, iteration: int) -> None:
    """Collective: every data-parallel replica hashes its weights (SHA-256 of each parameter's
    bytes; experts over their expert-data-parallel group); any difference stops every rank with
    one message naming the parameters and each rank's hash. Weight shards are compared over
    their weight-shard data-parallel group (the ranks holding the same rows)."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()
    digests = _digests(model)
    groups = {"dense": pstate.dp_cp_group, "expert": getattr(pstate, "expert_dp_group", None),
              "shard": getattr(pstate, "weight_shard_dp_group", None),
              "expert_shard": getattr(pstate, "expert_weight_shard_dp_group", None)}
    found = []
    for kind, group in groups.items():
        found += _mismatches([(n, d) for n, k, d in digests if k == kind], group)
    if not _reduce_any([bool(found)])[0]:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    seen = list(dict.fromkeys(m for mine in everyone for m in mine))
    raise WeightHashMismatchError(
        f"iteration {iteration}: weights differ across data-parallel replicas "
        f"(--check-weight-hash-across-dp-replicas-interval): " + "; ".join(seen[:5])
        + (f"; and {len(seen) - 5} more" if len(seen) > 5 else ""))

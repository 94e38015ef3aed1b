"""--log-straggler: name the slowest and fastest ranks at every --log-interval.

Each rank times its own work: the forward step (``forward_step_func``: reading the batch and
the model's forward, Megatron's "round-trip time", Rtt) and, when --timing-log-level measures
them, the forward-backward and optimizer sections and the batch generator (the project's
:class:`~megatron.training.timers.Timers`). The wall time of a whole step would not do: in
synchronous training every rank waits for the slowest one at the gradient reduction, so every
rank's step takes as long.

At each --log-interval the per-iteration averages are gathered from every rank, and rank 0
prints Megatron's line::

    [2026-12-05 08:30:00] | MnRtt/Rnk: 3.10ms/0 | MxRtt/Rnk: 210.52ms/2 | ...
        ... | MnEtpt/Rnk: 0.00TF/2 | MxEtpt/Rnk: 0.01TF/0

(one line, wrapped here): ``value unit / rank`` for the minimum and maximum of each measure, and Etpt, the estimated
TFLOP/s of each rank (the model FLOPs of an iteration over the world size, over three times the
forward time, as Megatron estimates it from a forward-only timing). With
--straggler-minmax-count N (1 < N < world size) two more lines list the N ranks with the lowest
and the N with the highest Etpt. The rank holding the TensorBoard writer adds the same minima
and maxima, and their ranks, under ``straggler/``.

--straggler-ctrlr-port: rank 0 listens on that port of localhost (only); any HTTP request
(``curl localhost:65535``) asks to turn the report off or on, and every rank switches together
at the next --log-interval. --disable-straggler-on-startup starts with the report off. Without
--log-straggler nothing here runs: no timing, no thread, no socket.
"""

import datetime
import socket
import threading
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import device

# (timer name, Megatron's short field, TensorBoard name) of the sections the timers measure.
SECTIONS = (("forward-backward", "FwdBwd", "ForwardBackwardTime"),
            ("optimizer", "Optim", "OptimizerTime"),
            ("batch-generator", "DRtt", "BatchLoadLatency"))
# Columns of one rank's row: forward time, each section's time (nan: not measured), Etpt.
COLUMNS = ("Rtt",) + tuple(short for _, short, _ in SECTIONS) + ("Etpt",)
TENSORBOARD_NAMES = {"Rtt": "RoundTripTime", "Etpt": "Throughput",
                     **{short: name for _, short, name in SECTIONS}}
UNITS = {"Etpt": "TF"}


def _with_rank(value: float, rank: int, unit: str = "") -> str:
    return f"{value:.2f}{unit}/{rank}"


def format_report(rows: Sequence[Sequence[float]], count: int,
                  now: Optional[datetime.datetime] = None) -> List[str]:
    """Megatron's straggler lines from every rank's row (indexed by rank; columns as
    :data:`COLUMNS`, nan where a section is not measured).

    Args:
        rows: per rank: forward ms, section ms..., estimated TFLOP/s.
        count: --straggler-minmax-count; with 1 < count < ranks, the two ranked lines follow.
    """
    now = now or datetime.datetime.now()
    parts = [f"[{now.strftime('%Y-%m-%d %H:%M:%S')}]"]
    for column, name in enumerate(COLUMNS):
        values = [row[column] for row in rows]
        if any(v != v for v in values):   # nan: this section is not measured
            continue
        low = min(range(len(values)), key=lambda r: (values[r], r))
        high = max(range(len(values)), key=lambda r: (values[r], -r))
        unit = UNITS.get(name, "ms")
        parts.append(f"Mn{name}/Rnk: {_with_rank(values[low], low, unit)}")
        parts.append(f"Mx{name}/Rnk: {_with_rank(values[high], high, unit)}")
    lines = [" | ".join(parts)]
    world = len(rows)
    if 1 < count < world:
        etpt = COLUMNS.index("Etpt")
        ranked = sorted(range(world), key=lambda r: (rows[r][etpt], r))
        lines.append(f"^^^^ Bottom {count} Ranks with lowest  Etpt(TF):"
                     + "".join(f" {_with_rank(rows[r][etpt], r)}," for r in ranked[:count]))
        lines.append(f"^^^^ Top    {count} Ranks with highest Etpt(TF):"
                     + "".join(f" {_with_rank(rows[r][etpt], r)},"
                               for r in ranked[world - count:]))
    return lines


def write_scalars(writer, rows: Sequence[Sequence[float]], iteration: int) -> None:
    """``straggler/Min<Name>`` and ``straggler/Max<Name>`` with their ``-rank`` companions."""
    for column, name in enumerate(COLUMNS):
        values = [row[column] for row in rows]
        if any(v != v for v in values):
            continue
        for label, pick in (("Min", min), ("Max", max)):
            rank = pick(range(len(values)), key=lambda r: values[r])
            tag = f"straggler/{label}{TENSORBOARD_NAMES[name]}"
            writer.add_scalar(tag, values[rank], iteration)
            writer.add_scalar(tag + "-rank", rank, iteration)


class ToggleServer:
    """Rank 0's control port: any HTTP request flips the report at the next --log-interval."""

    def __init__(self, port: int, detector: "StragglerDetector"):
        self.detector = detector
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="straggler-ctrlr",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                except OSError:
                    pass
                state = self.detector.request_toggle()
                body = f"Will turn StragglerDetector {state} at next logging interval"
                conn.sendall((f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: "
                              f"{len(body)}\r\n\r\n{body}").encode())
                print(f"> straggler report: {body}", flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()


class StragglerDetector:
    """Per-rank timing and the report at every --log-interval (collective: every rank calls
    :meth:`after_iteration` at every iteration)."""

    def __init__(self, args, timers, flops_per_iteration: Callable[[int], float]):
        self.rank, self.world_size = args.rank, args.world_size
        self.count = args.straggler_minmax_count
        self.log_interval = args.log_interval
        self.timers = timers
        self.flops_per_iteration = flops_per_iteration
        self.enabled = not args.disable_straggler_on_startup
        self._toggle = False
        self._lock = threading.Lock()
        self._forward_s = 0.0
        self._iterations = 0
        self.server = None
        if self.rank == 0:
            self.server = self._start_server(args.straggler_ctrlr_port)

    def _start_server(self, port: int) -> Optional[ToggleServer]:
        try:
            server = ToggleServer(port, self)
        except OSError as err:
            print(f"WARNING: --straggler-ctrlr-port {port}: cannot listen ({err.strerror}); "
                  "the straggler report cannot be turned on or off while running", flush=True)
            return None
        state = "ON" if self.enabled else "OFF"
        print(f"> straggler report {state}; toggle it with an HTTP request to "
              f"localhost:{server.port}", flush=True)
        return server

    def request_toggle(self) -> str:
        """Note a request to flip the report; returns the state it will switch to."""
        with self._lock:
            self._toggle = not self._toggle
            return "ON" if self.enabled != self._toggle else "OFF"

    def timed(self, forward_step_func: Callable) -> Callable:
        """``forward_step_func``, its calls timed on this rank while the report is on."""
        def forward_step(*args, **kwargs):
            if not self.enabled:
                return forward_step_func(*args, **kwargs)
            start = time.perf_counter()
            try:
                return forward_step_func(*args, **kwargs)
            finally:
                self._forward_s += time.perf_counter() - start

        return forward_step

    def _row(self, batch_size: int) -> List[float]:
        per_iteration = max(1, self._iterations)
        forward_ms = self._forward_s * 1000.0 / per_iteration
        row = [forward_ms]
        for name, _, _ in SECTIONS:
            seconds = self.timers.seconds(name) if self.timers is not None else None
            row.append(float("nan") if seconds is None else seconds * 1000.0 / per_iteration)
        flops = self.flops_per_iteration(batch_size)
        row.append(flops / self.world_size / (3.0 * forward_ms / 1000.0) / 1e12
                   if forward_ms > 0 else 0.0)
        return row

    def _gather(self, row: List[float]) -> List[List[float]]:
        local = torch.tensor(row, dtype=torch.float64, device=device.current_device())
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local)
        return [r.tolist() for r in rows]

    def _switch(self) -> None:
        """Every rank takes rank 0's pending toggle (one broadcast)."""
        with self._lock:
            flip, self._toggle = self._toggle, False
        flag = torch.tensor([int(flip)], device=device.current_device())
        dist.broadcast(flag, 0)
        if flag.item():
            self.enabled = not self.enabled
            if self.rank == 0:
                print(f"> straggler report {'ON' if self.enabled else 'OFF'}", flush=True)

    def after_iteration(self, iteration: int, batch_size: int, writer=None) -> None:
        """Count the iteration; at a --log-interval report (if on), then apply a toggle.

        Call it before the console line: that resets the timers of the sections.
        """
        self._iterations += 1
        if iteration % self.log_interval != 0:
            return
        if self.enabled:
            rows = self._gather(self._row(batch_size))
            if self.rank == 0:
                for line in format_report(rows, self.count):
                    print(line, flush=True)
            if writer is not None:
                write_scalars(writer, rows, iteration)
        self._forward_s, self._iterations = 0.0, 0
        self._switch()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class _Off:
    """Without --log-straggler: nothing is timed, gathered or started."""

    def timed(self, forward_step_func: Callable) -> Callable:
        return forward_step_func

    def after_iteration(self, iteration: int, batch_size: int, writer=None) -> None:
        pass

    def close(self) -> None:
        pass


def build(args, timers, flops_per_iteration: Callable[[int], float]):
    """A :class:`StragglerDetector` with --log-straggler, else an object that does nothing."""
    if not args.log_straggler:
        return _Off()
    return StragglerDetector(args, timers, flops_per_iteration)

"""Named wall-clock timers, logged at ``--timing-log-level`` (0: none, 1: coarse, 2: fine)."""

import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import device


class _Timer:
    def __init__(self, name: str = "", owner=None):
        self.elapsed_s = 0.0
        self._start = None
        self.name, self.owner = name, owner
        self._nvtx_open = False

    def start(self, barrier_group=None):
        if self._start is not None:
            raise RuntimeError("timer already started")
        if barrier_group is not None:
            dist.barrier(group=barrier_group)
        device.synchronize()
        if self.owner is not None and self.owner.nvtx:
            torch.cuda.nvtx.range_push(self.name)        # --nvtx-ranges, while profiling
            self._nvtx_open = True
        self._start = time.perf_counter()

    def stop(self):
        if self._start is None:
            raise RuntimeError("timer was not started")
        device.synchronize()
        self.elapsed_s += time.perf_counter() - self._start
        self._start = None
        if self._nvtx_open:
            torch.cuda.nvtx.range_pop()
            self._nvtx_open = False

    def elapsed(self, reset: bool = True) -> float:
        running = self._start is not None
        if running:
            self.stop()
        value = self.elapsed_s
        if reset:
            self.elapsed_s = 0.0
        if running:
            self.start()
        return value


class _NullTimer:
    def start(self, barrier_group=None):
        pass

    def stop(self):
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class Timers:
    """``timers('name', log_level=1).start()``; timers above the configured level cost nothing."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax"):
        self.log_level = log_level
        self.log_option = log_option
        self._timers: Dict[str, _Timer] = {}
        self._null = _NullTimer()
        # Set by the profiler (--nvtx-ranges) while it profiles: timed phases become NVTX ranges.
        self.nvtx = False

    def __call__(self, name: str, log_level: int = 0):
        if log_level > self.log_level:
            return self._null
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(name, self)
        return timer

    def seconds(self, name: str):
        """Seconds ``name`` has accumulated since it was last reset, leaving it running and
        unreset; None when the timer is not measured at this --timing-log-level."""
        timer = self._timers.get(name)
        return None if timer is None else timer.elapsed(reset=False)

    def _min_max_ms(self, names: List[str], normalizer: float, reset: bool):
        """(min, max) over ranks of each timer's milliseconds / ``normalizer``; collective."""
        # On the run's device: NCCL reduces only device tensors.
        local = torch.tensor([self._timers[n].elapsed(reset) * 1000.0 / normalizer
                              for n in names], dtype=torch.float64,
                             device=device.current_device())
        high, low = local.clone(), local.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return low, high

    def write(self, names: List[str], writer, iteration: int, normalizer: float = 1.0) -> None:
        """--log-timers-to-tensorboard: ``<name>-time``, the max over ranks in seconds per
        iteration, without resetting the timers (the console line does that). Collective: every
        rank calls it; the one with a writer writes."""
        names = [n for n in names if n in self._timers]
        if not names:
            return
        _, high = self._min_max_ms(names, normalizer, reset=False)
        if writer is not None:
            for i, name in enumerate(names):
                writer.add_scalar(f"{name}-time", float(high[i]) / 1000.0, iteration)

    def log_string(self, names: List[str], normalizer: float = 1.0) -> str:
        """Milliseconds per timer; max (and min) over ranks as ``--timing-log-option`` says."""
        names = [n for n in names if n in self._timers]
        if not names:
            return ""
        low, high = self._min_max_ms(names, normalizer, reset=True)
        if self.log_option == "max":
            parts = [f"{name}: {high[i]:.2f}" for i, name in enumerate(names)]
            return "max time across ranks (ms): " + " | ".join(parts)
        parts = [f"{name}: ({low[i]:.2f}, {high[i]:.2f})" for i, name in enumerate(names)]
        return "(min, max) time across ranks (ms): " + " | ".join(parts)

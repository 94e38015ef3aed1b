"""Number of micro-batches per iteration: constant, ramped up (``--rampup-batch-size``) or
stepped (``--step-batch-size-schedule``)."""

from typing import List, Optional, Tuple

from megatron.training.arguments import ArgumentsError
from megatron.training.validation import parse_step_batch_size_schedule

__all__ = ["NumMicroBatchesCalculator", "calculator_from_args", "parse_step_batch_size_schedule"]


class NumMicroBatchesCalculator:
    """Global batch size and micro-batch count as a function of consumed samples.

    With ``rampup = [start, increment, ramp_samples]`` the global batch grows from ``start`` by
    ``increment`` every ``ramp_samples / ((global - start) / increment)`` samples until it reaches
    ``global_batch_size``, as Megatron's ramp-up does; after ``ramp_samples`` it stays constant.
    With ``step_schedule = [(threshold_samples, batch), ...]`` the global batch is the batch of
    the last threshold reached (consumed >= threshold). With ``decrease_batch_size_if_needed`` a
    constant global batch runs rounded down to a multiple of micro batch x data-parallel size
    (``current_running_global_batch_size``), and consumed samples count the running batch.

    Raises:
        ArgumentsError: ramp-up values that cannot work, naming the flags and values.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: Optional[List[int]] = None,
                 step_schedule: Optional[List[Tuple[int, int]]] = None,
                 decrease_batch_size_if_needed: bool = False):
        self.global_batch_size = global_batch_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup = rampup
        self.step_schedule = step_schedule
        self.decrease = decrease_batch_size_if_needed
        if decrease_batch_size_if_needed and (rampup is not None or step_schedule is not None):
            other = "--rampup-batch-size" if rampup is not None else "--step-batch-size-schedule"
            raise ArgumentsError(f"--decrease-batch-size-if-needed cannot be combined with "
                                 f"{other}")
        if decrease_batch_size_if_needed and global_batch_size < self.micro_times_dp:
            raise ArgumentsError(
                f"--decrease-batch-size-if-needed: --global-batch-size ({global_batch_size}) "
                f"is smaller than --micro-batch-size x data-parallel size "
                f"({self.micro_times_dp}), so no micro-batch would run")
        if step_schedule is not None:
            self.global_batch_size = step_schedule[-1][1]
        if rampup is not None:
            self._check_rampup(rampup)
        self.current_global_batch_size = global_batch_size
        self.update(0, check=step_schedule is None)

    def _check_rampup(self, rampup: List[int]) -> None:
        start, increment, ramp_samples = rampup
        if start <= 0 or increment <= 0 or ramp_samples < 0:
            raise ArgumentsError(
                f"--rampup-batch-size {' '.join(str(v) for v in rampup)}: start and "
                "increment must be > 0 and ramp-up samples >= 0")
        diff = self.global_batch_size - start
        if diff < 0 or diff % increment != 0:
            raise ArgumentsError(
                f"--global-batch-size ({self.global_batch_size}) minus the --rampup-batch-size "
                f"start ({start}) must be a non-negative multiple of the increment "
                f"({increment})")
        for size in range(start, self.global_batch_size + 1, increment):
            if size % self.micro_times_dp != 0:
                raise ArgumentsError(
                    f"--rampup-batch-size: batch size {size} of the ramp is not divisible "
                    f"by --micro-batch-size x data-parallel size ({self.micro_times_dp})")
        steps = diff // increment
        self.samples_per_increment = ramp_samples / steps if steps else 0.0

    def _step_batch(self, consumed_samples: int, check: bool = True) -> int:
        batch = self.step_schedule[0][1]
        for threshold, size in self.step_schedule:
            if consumed_samples < threshold:
                break
            batch = size
        if check and batch % self.micro_times_dp != 0:
            raise ArgumentsError(
                f"--step-batch-size-schedule: batch size {batch} (from {consumed_samples} "
                f"consumed samples on) is not divisible by --micro-batch-size x data-parallel "
                f"size ({self.micro_times_dp})")
        return batch

    def update(self, consumed_samples: int, check: bool = True) -> None:
        if self.rampup is not None:
            start, increment, ramp_samples = self.rampup
            if consumed_samples > ramp_samples or self.samples_per_increment == 0:
                size = self.global_batch_size
            else:
                size = start + int(consumed_samples / self.samples_per_increment) * increment
                size = min(size, self.global_batch_size)
            self.current_global_batch_size = size
        elif self.step_schedule is not None:
            self.current_global_batch_size = self._step_batch(consumed_samples, check)
        running = self.current_global_batch_size
        if self.decrease:  # Megatron's rule: round down to whole micro-batches on every rank
            running -= running % self.micro_times_dp
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // self.micro_times_dp

    def iterations_for_samples(self, train_samples: int) -> int:
        """Whole iterations that fit in ``train_samples`` (ramp-up or steps included); a last
        batch that would go past ``train_samples`` is not run."""
        if self.step_schedule is not None:
            return self._step_iterations(train_samples)
        if self.rampup is None:  # Megatron divides by the nominal batch here
            return train_samples // self.global_batch_size
        ramp_samples = self.rampup[2]
        consumed, iterations = 0, 0
        while consumed <= ramp_samples:
            self.update(consumed)
            if consumed + self.current_global_batch_size > train_samples:
                self.update(0)
                return iterations
            consumed += self.current_global_batch_size
            iterations += 1
        self.update(0)
        # Past the ramp every batch is the full global batch.
        return iterations + (train_samples - consumed) // self.global_batch_size

    def _step_iterations(self, train_samples: int) -> int:
        """Iterations of a step schedule, one segment at a time (a schedule may span millions
        of iterations): a segment's batch runs while consumed is below the next threshold and
        the batch still fits in ``train_samples``."""
        consumed, iterations = 0, 0
        ends = [t for t, _ in self.step_schedule[1:]] + [None]
        for (_, batch), end in zip(self.step_schedule, ends):
            if end is not None and consumed >= end:
                continue  # an earlier batch stepped over this whole segment
            fit = max(0, (train_samples - consumed) // batch)
            starts = fit + 1 if end is None else -(-(end - consumed) // batch)
            n = min(fit, starts)
            consumed += n * batch
            iterations += n
            if fit < starts:
                break  # the next batch of this size would go past train_samples
        return iterations

    def check_reachable(self, consumed_samples: int, train_samples: int) -> None:
        """Before training: every step-schedule batch the run will use, from
        ``consumed_samples`` to ``train_samples``, divides into micro-batches. Batches of
        segments already passed (a run resumed on more ranks) are not checked, as in Megatron."""
        if self.step_schedule is None:
            return
        ends = [t for t, _ in self.step_schedule[1:]] + [None]
        for (threshold, batch), end in zip(self.step_schedule, ends):
            if (end is None or end > consumed_samples) and threshold < train_samples:
                self._step_batch(max(threshold, consumed_samples))


def calculator_from_args(args, data_parallel_size: int) -> NumMicroBatchesCalculator:
    """The run's calculator from its flags (``validate_args`` has parsed the schedule)."""
    return NumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, data_parallel_size,
        args.rampup_batch_size, getattr(args, "step_batch_size_samples", None),
        args.decrease_batch_size_if_needed)

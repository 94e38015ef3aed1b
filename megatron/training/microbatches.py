"""Number of micro-batches per iteration, constant or ramped up (``--rampup-batch-size``)."""

from typing import List, Optional

from megatron.training.arguments import ArgumentsError


class NumMicroBatchesCalculator:
    """Global batch size and micro-batch count as a function of consumed samples.

    With ``rampup = [start, increment, ramp_samples]`` the global batch grows from ``start`` by
    ``increment`` every ``ramp_samples / ((global - start) / increment)`` samples until it reaches
    ``global_batch_size``, as Megatron's ramp-up does; after ``ramp_samples`` it stays constant.

    Raises:
        ArgumentsError: ramp-up values that cannot work, naming the flags and values.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: Optional[List[int]] = None):
        self.global_batch_size = global_batch_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup = rampup
        if rampup is not None:
            start, increment, ramp_samples = rampup
            if start <= 0 or increment <= 0 or ramp_samples < 0:
                raise ArgumentsError(
                    f"--rampup-batch-size {' '.join(str(v) for v in rampup)}: start and "
                    "increment must be > 0 and ramp-up samples >= 0")
            diff = global_batch_size - start
            if diff < 0 or diff % increment != 0:
                raise ArgumentsError(
                    f"--global-batch-size ({global_batch_size}) minus the --rampup-batch-size "
                    f"start ({start}) must be a non-negative multiple of the increment "
                    f"({increment})")
            for size in range(start, global_batch_size + 1, increment):
                if size % self.micro_times_dp != 0:
                    raise ArgumentsError(
                        f"--rampup-batch-size: batch size {size} of the ramp is not divisible "
                        f"by --micro-batch-size x data-parallel size ({self.micro_times_dp})")
            steps = diff // increment
            self.samples_per_increment = ramp_samples / steps if steps else 0.0
        self.current_global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.rampup is not None:
            start, increment, ramp_samples = self.rampup
            if consumed_samples > ramp_samples or self.samples_per_increment == 0:
                size = self.global_batch_size
            else:
                size = start + int(consumed_samples / self.samples_per_increment) * increment
                size = min(size, self.global_batch_size)
            self.current_global_batch_size = size
        self.num_micro_batches = self.current_global_batch_size // self.micro_times_dp

    def iterations_for_samples(self, train_samples: int) -> int:
        """Whole iterations that fit in ``train_samples`` (ramp-up included); a last batch that
        would go past ``train_samples`` is not run."""
        if self.rampup is None:
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

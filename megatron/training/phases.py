"""``--phase-transition-iterations``: training in phases, each with its own data blend.

The flag holds Megatron's comma-separated iterations, e.g. ``"1000,3000"`` (sorted, as Megatron
sorts them). A run saves a checkpoint and exits when it completes a transition iteration; it is
then restarted from that checkpoint with the next phase's data flags (``--data-path`` ...).
Each phase's train dataset is built for that phase alone: its sample count is the samples from
the phase's first iteration to the next transition (or the end of training), and the loader
starts at the samples the run has consumed since the phase began, so the first batch after a
transition is sample 0 of the new blend. Iterations, the learning-rate schedule and the logged
consumed samples stay global. The global batch size must be constant: transitions are
iterations, and samples are iterations times the batch.
"""

from typing import List, Optional, Sequence

FLAG = "--phase-transition-iterations"


def parse(value) -> Optional[List[int]]:
    """Megatron's value (``"t1,t2,..."``, or a list already parsed) as sorted iterations; None
    when not given. Raises ValueError (naming the flag) for anything else."""
    if value is None or value == "":
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    iterations = []
    for item in items:
        text = str(item).strip()
        try:
            iterations.append(int(text))
        except ValueError:
            raise ValueError(f"{FLAG} {value!r}: {text!r} is not an iteration; expected "
                             "comma-separated integers, e.g. 1000,3000") from None
    iterations.sort()
    if iterations[0] <= 0:
        raise ValueError(f"{FLAG} {value!r}: iterations must be > 0, got {iterations[0]}")
    repeated = sorted({t for t in iterations if iterations.count(t) > 1})
    if repeated:
        raise ValueError(f"{FLAG} {value!r}: iterations must be strictly increasing; "
                         f"{repeated} given more than once")
    return iterations


def _bounds(iteration: int, transitions: Sequence[int], global_batch_size: int,
            total_samples: int):
    """(first sample, end sample) of the phase holding ``iteration``, as Megatron computes it:
    the boundaries are 0, each transition x the batch, and the total; the phase starts at the
    last boundary at or before the current sample and ends at the first one after it."""
    boundaries = [0] + [t * global_batch_size for t in transitions] + [total_samples]
    current = iteration * global_batch_size
    start = max(b for b in boundaries if b <= current)
    after = [b for b in boundaries if b > current]
    return start, (min(after) if after else start)


def phase_train_samples(iteration: int, transitions: Sequence[int], global_batch_size: int,
                        total_samples: int) -> int:
    """Samples of the train dataset of the phase that ``iteration`` (completed iterations, the
    checkpoint's) lies in."""
    start, end = _bounds(iteration, transitions, global_batch_size, total_samples)
    return end - start


def phase_consumed_samples(iteration: int, transitions: Sequence[int],
                           global_batch_size: int) -> int:
    """Samples the current phase's loader has already given: those since its first iteration."""
    last = max([0] + [t for t in transitions if t <= iteration])
    return (iteration - last) * global_batch_size


def exit_reason(iteration: int, transitions: Sequence[int]) -> Optional[str]:
    """Why the run stops after ``iteration``, if it is a transition."""
    if iteration in transitions:
        return (f"reached {FLAG} {iteration}: restart from the checkpoint with the next "
                "phase's data flags")
    return None

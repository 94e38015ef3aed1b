"""--override-ckpt-iteration: the position N iterations make (samples, schedule), also under a
batch-size ramp, and the flag's checks."""

import pytest

from megatron.checkpoint.config import CheckpointConfig
from megatron.core.config import ConfigError
from megatron.training.arguments import parse_args
from megatron.training.microbatches import NumMicroBatchesCalculator
from megatron.training.train_state import TrainState
from megatron.training.training import override_checkpoint_iteration, samples_after


class _Schedule:
    def __init__(self):
        self.num_steps, self.steps = 123, []

    def step(self, increment):
        self.num_steps += increment
        self.steps.append(increment)


def test_constant_batch():
    calc = NumMicroBatchesCalculator(16, 2, 2)
    assert samples_after(5, calc) == 80
    assert samples_after(0, calc) == 0


def test_rampup_follows_the_ramp():
    """--rampup-batch-size 4 4 32 up to 16, Megatron's rule: three increments over 32 samples,
    one every 32/3 samples, batch = 4 + 4 * floor(consumed / (32/3)). By hand: consumed 0, 4, 8
    -> 4; 12, 20 -> 8; 28 -> 12: 4 + 4 + 4 + 8 + 8 + 12 = 40 after six iterations."""
    calc = NumMicroBatchesCalculator(16, 2, 2, rampup=[4, 4, 32])
    assert samples_after(6, calc) == 40
    assert samples_after(9, calc) == 40 + 16 + 16 + 16  # consumed 40 -> 4 + 4 * 3 = 16


def test_state_and_schedule_take_the_position():
    calc = NumMicroBatchesCalculator(8, 2, 1)
    state = TrainState(iteration=2, consumed_train_samples=16, skipped_train_samples=8)
    sched = _Schedule()
    override_checkpoint_iteration(state, sched, calc,
                                  CheckpointConfig(override_ckpt_iteration=10))
    assert (state.iteration, state.consumed_train_samples) == (10, 80)
    assert sched.num_steps == 80 and sched.steps == [80]
    # Without the flag nothing moves.
    override_checkpoint_iteration(state, sched, calc, CheckpointConfig())
    assert (state.iteration, sched.num_steps) == (10, 80)


def test_parses_as_megatron_and_refuses_negative():
    assert parse_args(argv=["--override-ckpt-iteration", "7"]).override_ckpt_iteration == 7
    assert parse_args(argv=[]).override_ckpt_iteration is None
    with pytest.raises(ConfigError, match=r"--override-ckpt-iteration must be >= 0, got -1"):
        CheckpointConfig(override_ckpt_iteration=-1)

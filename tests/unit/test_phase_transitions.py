"""--phase-transition-iterations: the flag's parsing and refusals, each phase's dataset size and
loader start against a naive walk over the run's iterations, the data loaders built for a
restart, the exit at a transition and the checkpoint's batch-size check."""

import argparse
import types

import pytest
import torch

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.saved_args import check_args
from megatron.training import phases, training
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.configs import TrainingConfig
from megatron.training.train_state import TrainState

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 10 --eval-interval 5 --eval-iters 1 --mock-data").split()


def _validated(*extra):
    base = BASE
    if "--train-samples" in extra:
        at = BASE.index("--train-iters")
        base = BASE[:at] + BASE[at + 2:]
    return validate_args(parse_args(argv=base + list(extra)))


def test_flag_is_parsed_as_megatron_does():
    assert _validated("--phase-transition-iterations", "8, 2, 5").phase_transition_iterations \
        == [2, 5, 8]
    assert _validated().phase_transition_iterations is None


@pytest.mark.parametrize("value,extra,message", [
    ("3,x", [], "'x' is not an iteration"),
    ("0,4", [], "must be > 0"),
    ("4,2,4", [], "strictly increasing; \\[4\\] given more than once"),
    ("4", ["--train-samples", "40", "--rampup-batch-size", "2", "2", "8"],
     "drop --rampup-batch-size"),
])
def test_bad_values_are_refused_in_one_line(value, extra, message):
    with pytest.raises(ArgumentsError, match=message) as err:
        _validated("--phase-transition-iterations", value, *extra)
    assert "--phase-transition-iterations" in str(err.value) and "\n" not in str(err.value)


def _naive(restart, transitions, train_iters, gbs):
    """Walk every step of the whole run: step k (iteration k -> k + 1) belongs to the phase
    numbered by the transitions at or before k. A run restarted after ``restart`` completed
    iterations builds its phase's steps' samples and has consumed those of its earlier steps."""
    phase = [sum(t <= k for t in transitions) for k in range(train_iters)]
    mine = sum(t <= restart for t in transitions)
    size = gbs * sum(p == mine for p in phase)
    start = gbs * sum(p == mine for p in phase[:restart])
    return size, start


@pytest.mark.parametrize("transitions", [[3], [3, 7], [1, 2, 9], [5, 12]])
def test_phase_sizes_and_starts_match_a_walk_over_the_run(transitions):
    train_iters, gbs = 10, 4
    for restart in range(train_iters):
        size, start = _naive(restart, transitions, train_iters, gbs)
        assert phases.phase_train_samples(restart, transitions, gbs, train_iters * gbs) == size
        assert phases.phase_consumed_samples(restart, transitions, gbs) == start


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": torch.tensor([i])}


def _first_train_batch(args, iteration):
    asked = []

    def provider(num_samples):
        asked.append(list(num_samples))
        return _Ids(num_samples[0]), None, None

    pstate = types.SimpleNamespace(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
    data = types.SimpleNamespace(micro_batch_size=2, dataloader_type="single", num_workers=0,
                                 seed=1234)
    state = TrainState(iteration=iteration, consumed_train_samples=iteration * 4)
    train, _, _ = training.build_data_iterators(provider, args, pstate, state, data)
    return asked[0][0], next(train)["text"].view(-1).tolist()


def test_a_restart_builds_its_phases_data_and_starts_where_the_phase_stands():
    args = _validated("--phase-transition-iterations", "3,7")
    assert _first_train_batch(args, 0) == (12, [0, 1])    # phase 1: iterations 1..3
    assert _first_train_batch(args, 3) == (16, [0, 1])    # phase 2 starts at its sample 0
    assert _first_train_batch(args, 5) == (16, [8, 9])    # resumed inside phase 2
    assert _first_train_batch(args, 7) == (12, [0, 1])    # phase 3: iterations 8..10


def test_without_the_flag_the_loaders_are_unchanged():
    args = _validated()
    assert _first_train_batch(args, 0) == (40, [0, 1])
    assert _first_train_batch(args, 5) == (40, [20, 21])


def test_the_run_exits_after_each_transition_only():
    config = TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=10,
                            eval_interval=5, eval_iters=1, phase_transition_iterations=(3, 7))
    stops = [i for i in range(1, 11) if training._should_exit(i, config, 0.0, None)]
    assert stops == [3, 7]


def test_a_checkpoint_of_another_batch_size_is_refused():
    args = _validated("--phase-transition-iterations", "3")
    saved = argparse.Namespace(**{**vars(args), "global_batch_size": 8})
    with pytest.raises(CheckpointError, match="--global-batch-size 4"):
        check_args(saved, args, "ckpt/iter_0000003")
    check_args(argparse.Namespace(**vars(args)), args, "ckpt/iter_0000003")
    check_args(saved, _validated(), "ckpt/iter_0000003")  # no phases: no check

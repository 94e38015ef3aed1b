"""--exit-signal-handler-for-dataloader: a loader worker that receives the run's exit signal
lives on (the signal is noted) with the flag, and dies of it without."""

import os
import signal

import pytest
import torch

from megatron.data.samplers import build_pretraining_data_loader, exit_signal_worker_init


class _SignalsItself(torch.utils.data.Dataset):
    """Item 0 sends the exit signal to the worker reading it, as a scheduler signalling the
    whole process group would; every item is its own index."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.tensor([i])


def _read_all(worker_init_fn):
    loader = build_pretraining_data_loader(_SignalsItself(), 0, 2, 0, 1, num_workers=1,
                                           worker_init_fn=worker_init_fn)
    return [batch.flatten().tolist() for batch in loader]


def test_worker_survives_the_exit_signal_with_the_handler():
    assert _read_all(exit_signal_worker_init(signal.SIGTERM)) == [[0, 1], [2, 3], [4, 5],
                                                                  [6, 7]]


def test_worker_dies_of_it_without():
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        _read_all(None)


@pytest.mark.parametrize("flags,installed", [
    (["--exit-signal-handler", "--exit-signal-handler-for-dataloader"], True),
    (["--exit-signal-handler-for-dataloader"], False),   # as in Megatron: needs the handler
    (["--exit-signal-handler"], False)])
def test_run_wiring(monkeypatch, flags, installed):
    import types

    from megatron.training import training
    from megatron.training.arguments import parse_args
    from megatron.training.train_state import TrainState

    seen = []
    monkeypatch.setattr(training, "build_pretraining_data_loader",
                        lambda *a, worker_init_fn=None, **k: seen.append(worker_init_fn))
    args = parse_args(argv=flags + ["--micro-batch-size", "2", "--train-iters", "4"])
    args.global_batch_size = 2
    pstate = types.SimpleNamespace(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
    data = types.SimpleNamespace(micro_batch_size=2, dataloader_type="single", num_workers=1,
                                 seed=1)
    training.build_data_iterators(lambda n: [None, None, None], args, pstate, TrainState(),
                                  data)
    assert len(seen) == 3
    assert all((f is not None) == installed for f in seen)

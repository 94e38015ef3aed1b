"""Shared fixtures: reset global torch state and the environment around every test; slow and GPU
markers."""

import os
import random

import numpy as np
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (MEGATRON_RUN_SLOW=1 does the same)")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("MEGATRON_RUN_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def reset_torch_state():
    """Every test starts from the same global state and leaves none behind: torch's defaults,
    the seeds, the parallel groups, and ``os.environ`` (code run in-process, such as a run's
    start-up, sets variables for torch to read; one left behind changed what a later test's
    subprocess saw, depending on which tests shared the process)."""
    import torch.distributed as dist

    from megatron.core import device, parallel_state

    torch.set_default_dtype(torch.float32)
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    device.reset()
    parallel_state.destroy_model_parallel()
    environ = dict(os.environ)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    torch.set_default_dtype(torch.float32)
    parallel_state.destroy_model_parallel()
    device.reset()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""Process-wide handles for the training harness and users' own scripts.

Megatron's users write ``args = get_args()`` inside their model and dataset providers, so the
harness keeps these few handles. Code under ``megatron/core`` never reads them: it is handed what
it needs explicitly.
"""

import contextlib
from typing import Any, Optional

_ARGS = None
_TOKENIZER = None
_TIMERS = None
_TENSORBOARD_WRITER = None
_PARALLEL_STATE = None


def _check(value, name):
    if value is None:
        raise RuntimeError(f"{name} is not set; it is set by megatron.training.training.pretrain()")
    return value


def get_args():
    return _check(_ARGS, "args")


def get_tokenizer():
    return _check(_TOKENIZER, "tokenizer")


def get_timers():
    return _check(_TIMERS, "timers")


def get_tensorboard_writer() -> Optional[Any]:
    return _TENSORBOARD_WRITER


def get_parallel_state():
    return _check(_PARALLEL_STATE, "parallel state")


def set_global_variables(args=None, tokenizer=None, timers=None, tensorboard_writer=None,
                         parallel_state=None) -> None:
    global _ARGS, _TOKENIZER, _TIMERS, _TENSORBOARD_WRITER, _PARALLEL_STATE
    if args is not None:
        _ARGS = args
    if tokenizer is not None:
        _TOKENIZER = tokenizer
    if timers is not None:
        _TIMERS = timers
    if tensorboard_writer is not None:
        _TENSORBOARD_WRITER = tensorboard_writer
    if parallel_state is not None:
        _PARALLEL_STATE = parallel_state


def unset_global_variables() -> None:
    global _ARGS, _TOKENIZER, _TIMERS, _TENSORBOARD_WRITER, _PARALLEL_STATE
    _ARGS = _TOKENIZER = _TIMERS = _TENSORBOARD_WRITER = _PARALLEL_STATE = None


@contextlib.contextmanager
def parallel_state_of_stage(stage):
    """While an old-style model provider (one without a ``vp_stage`` parameter) builds the
    chunk of a virtual pipeline stage, :func:`get_parallel_state` answers for that stage."""
    global _PARALLEL_STATE
    previous, _PARALLEL_STATE = _PARALLEL_STATE, stage
    try:
        yield
    finally:
        _PARALLEL_STATE = previous

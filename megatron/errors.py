"""Turn mistakes in users' input into one clear line and an exit code, not a traceback.

Every reader of user input raises an error type that carries a message naming the flag, file or
line: those are listed here. Anything else is a bug and keeps its traceback. An error may carry
its own ``exit_code`` (2 for a refused target or --save folder, like a bad flag), and an error
that every rank raises with the same message (``every_rank_raises = True``: a verdict rank 0
reached and broadcast) is printed by rank 0 alone.
"""

import contextlib
import os
import sys


def user_error_types() -> tuple:
    from megatron.convert.schema import ConversionError
    from megatron.core.config import ConfigError
    from megatron.core.msc import ObjectStorageError
    from megatron.data.dataset_utils import DataError
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.tokenizer.tokenizer import TokenizerError
    from megatron.training.arguments import ArgumentsError
    from megatron.training.checkpointing import CheckpointError
    from megatron.training.distillation.logits_files import LogitsFileError
    from megatron.training.fault_tolerance import FaultToleranceError

    return (ArgumentsError, ConfigError, CheckpointError, ConversionError, DataError,
            IndexedDatasetError, LogitsFileError, ObjectStorageError, FaultToleranceError,
            TokenizerError, FileNotFoundError, NotADirectoryError, PermissionError)


@contextlib.contextmanager
def exit_on_user_error(prog: str = None, exit_code: int = 1):
    """Print ``prog: error: message`` for a user's mistake and exit with ``exit_code`` (or the
    error's own ``exit_code``)."""
    try:
        yield
    except user_error_types() as err:
        name = prog or os.path.basename(sys.argv[0]) or "megatron"
        rank = os.environ.get("RANK")
        if rank in (None, "0") or not getattr(err, "every_rank_raises", False):
            where = f" [rank {rank}]" if rank not in (None, "0") else ""
            print(f"{name}{where}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(getattr(err, "exit_code", exit_code)) from None

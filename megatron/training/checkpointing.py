"""The harness's checkpoint entry points, at Megatron-LM's module path.

``megatron.training.checkpointing`` is where Megatron-LM's users and this project's harness find
:func:`save_checkpoint`, :func:`load_checkpoint` and their companions. The work is done by the
checkpoint package: :mod:`megatron.checkpoint.save` and :mod:`megatron.checkpoint.load` (either
format), :mod:`megatron.checkpoint.publish` (staging, atomic rename, tracker, crash points),
:mod:`megatron.checkpoint.save_lock` (one run per --save folder),
:mod:`megatron.checkpoint.layout` (Megatron's folder and file names). Only public names are
offered here.
"""

from megatron.checkpoint.layout import (CHECKPOINT_VERSION, TRACKER_FILENAME, CheckpointError,
                                        checkpoint_dir_name, checkpoint_file, expert_ranks,
                                        load_state_file, rank_dir_name, read_tracker, saved_layout,
                                        saved_sizes)
from megatron.checkpoint.load import (load_args_from_checkpoint, load_checkpoint,
                                      load_model_weights, null_tokenizer_eod_from_checkpoint)
from megatron.checkpoint.non_persistent import save_non_persistent
from megatron.checkpoint.publish import (CRASH_ENV, CRASH_POINTS, check_save_dir,
                                         clean_interrupted_saves, crash_point)
from megatron.checkpoint.save import AsyncCheckpointSaver, save_checkpoint
from megatron.checkpoint.save_lock import (
    LOCK_FILENAME, SaveDirLockedError, SaveLock, lock_save_dir)
from megatron.checkpoint.saved_args import checkpoint_args, megatron_args
from megatron.checkpoint.torch_dist import check_savable as check_torch_dist_savable

__all__ = [
    "AsyncCheckpointSaver", "CHECKPOINT_VERSION", "CRASH_ENV", "CRASH_POINTS", "CheckpointError",
    "LOCK_FILENAME", "SaveDirLockedError", "SaveLock", "TRACKER_FILENAME", "check_save_dir",
    "check_torch_dist_savable",
    "checkpoint_args", "checkpoint_dir_name", "checkpoint_file", "clean_interrupted_saves",
    "crash_point", "expert_ranks", "load_args_from_checkpoint", "load_checkpoint",
    "load_model_weights", "load_state_file", "lock_save_dir", "megatron_args",
    "null_tokenizer_eod_from_checkpoint", "rank_dir_name",
    "read_tracker", "save_checkpoint", "save_non_persistent", "saved_layout", "saved_sizes"]

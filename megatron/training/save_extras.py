"""What happens around a checkpoint save besides the save: --save-retain-interval, --log-progress.

:func:`prune_checkpoints` removes the checkpoints --save-retain-interval does not keep;
:func:`append_progress` writes Megatron's ``progress.txt`` lines into the --save folder.
"""

import datetime
import os
import re
import shutil
from typing import List

from megatron.checkpoint.layout import read_tracker

_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
PROGRESS_FILENAME = "progress.txt"


def prune_checkpoints(save_dir: str, retain_interval: int) -> List[str]:
    """Delete the checkpoints of ``save_dir`` that --save-retain-interval does not keep.

    Kept: the one the tracker names (the latest complete checkpoint) and every one whose
    iteration is a multiple of ``retain_interval``. Only complete ``iter_NNNNNNN`` folders
    older than the tracked one are touched, so a save in progress or a newer one is never
    removed.

    Returns:
        the folders removed.
    """
    tracked = read_tracker(save_dir)
    if tracked is None or tracked[1]:
        return []
    latest = tracked[0]
    removed = []
    for name in sorted(os.listdir(save_dir)):
        match = _ITERATION_DIR.match(name)
        if match is None:
            continue
        iteration = int(match.group(1))
        if iteration < latest and iteration % retain_interval != 0:
            shutil.rmtree(os.path.join(save_dir, name))
            removed.append(name)
    return removed


def append_progress(save_dir: str, world_size: int, text: str) -> None:
    """One line of Megatron's ``SAVE/progress.txt``: time, job id, GPU count, then ``text``."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    job_id = os.environ.get("SLURM_JOB_ID", "")
    with open(os.path.join(save_dir, PROGRESS_FILENAME), "a") as f:
        f.write(f"{now}\tJob ID: {job_id}\t# GPUs: {world_size}\t{text}\n")


def saved_checkpoint_progress(iteration: int, floating_point_operations: float,
                              tokens: int) -> str:
    """The ``progress.txt`` text of a saved checkpoint (Megatron's fields, without the
    throughput ones)."""
    return (f"Saved checkpoint\tIteration: {iteration}\tFloating-point operations: "
            f"{floating_point_operations:.2e}\tTokens (in billions): {tokens / 10 ** 9:.2f}")

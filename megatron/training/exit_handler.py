"""--exit-signal-handler-for-training: SIGINT or SIGTERM anywhere in ``pretrain`` ends the run
in order, with one line and exit status 0, instead of a traceback from wherever it struck.

As Megatron-LM does it: a checkpoint save still being written in the background
(``--async-save``) is finished and published first, the process group is left, and the process
exits with status 0. No new checkpoint is written; that is ``--exit-signal-handler``'s job,
whose handler takes over inside the training loop (saving at the end of the iteration) and
hands back after it. A forked data-loader worker that inherits this handler dies of the signal
as it would without it.
"""

import os
import signal
from typing import Optional

import torch.distributed as dist

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ACTIVE: Optional["TrainingExitHandler"] = None


class TrainingExitHandler:
    """Installed for the length of ``pretrain``; :meth:`release` restores the previous
    handlers. ``saver``: the run's background checkpoint saver, once there is one."""

    def __init__(self):
        self.saver = None
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a forked worker: behave as without the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.release()  # a second signal acts as it would without the flag
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            print(f"{signal.Signals(signum).name} received: finishing any checkpoint save in "
                  "flight and exiting (--exit-signal-handler-for-training)", flush=True)
        if self.saver is not None and self.saver.in_flight is not None:
            self.saver.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(0)

    def release(self) -> None:
        global _ACTIVE
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if _ACTIVE is self:
            _ACTIVE = None


def install(args) -> Optional[TrainingExitHandler]:
    """The handler, installed, when ``args.exit_signal_handler_for_training``; else None."""
    global _ACTIVE
    if not getattr(args, "exit_signal_handler_for_training", False):
        return None
    _ACTIVE = TrainingExitHandler()
    return _ACTIVE


def watch_saver(saver) -> None:
    """Tell the installed handler (if any) which background saver to finish."""
    if _ACTIVE is not None:
        _ACTIVE.saver = saver

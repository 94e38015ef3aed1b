"""--enable-ft-package: hang detection by nvidia-resiliency-ext's rank monitor.

A run launched by ``ft_launcher`` (nvidia-resiliency-ext's torchrun) has a rank-monitor process
beside each rank. The rank tells its monitor when each timed *section* of the run opens and
closes; a section open longer than its timeout (or too long a time outside every section) makes
the launcher stop the job's ranks and, within ``--max-restarts``, start them again, and the run
resumes from ``--save``'s last checkpoint. The sections, as in Megatron-LM:

- ``setup``: from the monitor's start to the first training or evaluation step;
- ``step``: each training and each evaluation step, after ``--ft-num-warmup-iters`` of each
  (the first steps are slower; they fall in the time outside the sections);
- ``checkpointing``: each save, and each publishing of a background (``--async-save``) save.

``--calc-ft-timeouts`` replaces the launcher's timeouts by ones computed from the times the run
saw: after each foreground save and when the run ends, for the sections seen often enough (setup
once a checkpoint was loaded, step after 16 training steps, checkpointing after a foreground
save; the time outside the sections only at the end of a run that saw all of them). Rank 0
writes them to ``SAVE/ft_state.json``, which the next run reads back.

Only ``ft_launcher``'s environment has a monitor to talk to: started by plain ``torchrun`` the
flag stops the run with one line saying so.
"""

import json
import os
from typing import Optional

from megatron.training.utils import print_rank_0

SECTIONS = ("setup", "step", "checkpointing")
STATE_FILE = "ft_state.json"
MIN_STEPS_FOR_STEP_TIMEOUT = 16
LAUNCH_HINT = ("launch with ft_launcher (nvidia-resiliency-ext) instead of torchrun, e.g. "
               "ft_launcher --nproc-per-node 8 --ft-param-rank_section_timeouts="
               "setup:600,step:180,checkpointing:420 --ft-param-rank_out_of_section_timeout=300 "
               "pretrain_gpt.py ...")


class FaultToleranceError(RuntimeError):
    """The rank monitor cannot be used: not launched by ft_launcher, or sections missing."""


class _Off:
    """No --enable-ft-package: every hook does nothing."""

    def train_step_start(self): pass
    def train_step_end(self): pass
    def eval_step_start(self): pass
    def eval_step_end(self): pass
    def checkpointing_start(self): pass
    def checkpointing_end(self, finalization: bool = False): pass
    def checkpoint_loaded(self, persistent: bool): pass
    def shutdown(self): pass


class FaultTolerance(_Off):
    """The sections of one run, reported to this rank's monitor."""

    def __init__(self, client, save_dir: str, rank: int, calc_timeouts: bool, warmup: int,
                 async_save: bool):
        self.client = client
        self.state_path = os.path.join(save_dir, STATE_FILE)
        self.rank = rank
        self.calc_timeouts = calc_timeouts
        self.warmup = warmup
        self.async_save = async_save
        self.setup_open = False
        self.train_steps = 0
        self.eval_steps = 0
        self.saves = 0
        self.persistent_loaded = False

    def start(self) -> None:
        if os.path.isfile(self.state_path):
            with open(self.state_path) as f:
                self.client.load_state_dict(json.load(f))
            print_rank_0(f"FT: timeouts read from {self.state_path}")
        try:
            self.client.init_workload_monitoring()
        except Exception as err:  # the package's own error type, with its reason
            raise FaultToleranceError(f"--enable-ft-package: no rank monitor to talk to "
                                      f"({err}); {LAUNCH_HINT}") from None
        missing = [s for s in SECTIONS if s not in self.client.cfg.rank_section_timeouts]
        if missing:
            self.client.shutdown_workload_monitoring()
            raise FaultToleranceError(
                f"--enable-ft-package: ft_launcher was given no timeout for the section(s) "
                f"{', '.join(missing)}; pass --ft-param-rank_section_timeouts="
                "setup:600,step:180,checkpointing:420 (seconds) to ft_launcher")
        print_rank_0(f"FT: rank monitor connected; timeouts {self.client.section_timeouts}")
        self.client.start_section("setup")
        self.setup_open = True

    def _close_setup(self) -> None:
        if self.setup_open:
            self.client.end_section("setup")
            self.setup_open = False

    def train_step_start(self) -> None:
        self._close_setup()
        self.eval_steps = 0  # each evaluation warms up again, as in Megatron
        if self.train_steps >= self.warmup:
            self.client.start_section("step")

    def train_step_end(self) -> None:
        if self.train_steps >= self.warmup:
            self.client.end_section("step")
        self.train_steps += 1

    def eval_step_start(self) -> None:
        self._close_setup()
        if self.eval_steps >= self.warmup:
            self.client.start_section("step")

    def eval_step_end(self) -> None:
        if self.eval_steps >= self.warmup:
            self.client.end_section("step")
        self.eval_steps += 1

    def checkpointing_start(self) -> None:
        self.client.start_section("checkpointing")

    def checkpointing_end(self, finalization: bool = False) -> None:
        self.client.end_section("checkpointing")
        if not finalization:
            self.saves += 1
            self._update_timeouts(closing=False)

    def checkpoint_loaded(self, persistent: bool) -> None:
        self.persistent_loaded = persistent

    def shutdown(self) -> None:
        self._update_timeouts(closing=True)
        self.client.shutdown_workload_monitoring()
        print_rank_0("FT: rank monitor closed")

    def _update_timeouts(self, closing: bool) -> None:
        if not self.calc_timeouts:
            return
        sections = []
        if self.persistent_loaded:
            sections.append("setup")
        if self.train_steps >= MIN_STEPS_FOR_STEP_TIMEOUT:
            sections.append("step")
        if self.saves and not self.async_save:  # background saves vary too much to time
            sections.append("checkpointing")
        out_of_section = closing and {"setup", "step"} <= set(sections) and self.saves > 0
        if not sections and not out_of_section:
            return
        self.client.calculate_and_set_section_timeouts(selected_sections=sections,
                                                       calc_out_of_section=out_of_section)
        if self.rank == 0:
            tmp = f"{self.state_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.client.state_dict(), f)
            os.replace(tmp, self.state_path)
            print_rank_0(f"FT: timeouts of {', '.join(sections) or 'no section'}"
                         f"{' and outside the sections' if out_of_section else ''} computed "
                         f"and saved to {self.state_path}: {self.client.section_timeouts}")


_current = _Off()


def current():
    """The run's hooks: no-ops unless :func:`setup` started the monitoring."""
    return _current


def setup(args) -> None:
    """After the process group exists: connect to this rank's monitor, open ``setup``."""
    global _current
    if not getattr(args, "enable_ft_package", False):
        _current = _Off()
        return
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    os.makedirs(args.save, exist_ok=True)
    ft = FaultTolerance(RankMonitorClient(), args.save, args.rank, args.calc_ft_timeouts,
                        args.ft_num_warmup_iters, args.async_save)
    ft.start()
    _current = ft


def shutdown() -> None:
    """At the end of the run (also after an error): compute the timeouts if asked, disconnect."""
    global _current
    ft, _current = _current, _Off()
    ft.shutdown()


def check_flags(args) -> Optional[str]:
    """The one-line reason the fault-tolerance flags cannot run, or None."""
    if not args.enable_ft_package:
        for flag, given in (("--calc-ft-timeouts", args.calc_ft_timeouts),
                            ("--ft-num-warmup-iters", args.ft_num_warmup_iters != 5)):
            if given:
                return f"{flag} configures --enable-ft-package's rank monitor; add that flag"
        return None
    try:
        import nvidia_resiliency_ext.fault_tolerance  # noqa: F401
    except ImportError as err:
        return (f"--enable-ft-package needs nvidia-resiliency-ext, which is not installed "
                f"({err}); pip install nvidia-resiliency-ext, then {LAUNCH_HINT}")
    if not args.save:
        return ("--enable-ft-package keeps its computed timeouts in --save and restarts resume "
                "from it; give --save")
    if args.ft_num_warmup_iters < 0:
        return f"--ft-num-warmup-iters {args.ft_num_warmup_iters} must be >= 0"
    return None

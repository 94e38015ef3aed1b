"""The enum types Megatron-Core's rerun state machine records in a checkpoint.

A torch_dist checkpoint stores the machine's state as pickled objects (``common_state`` and
``rerun_state_machine_state/shard_*``). Megatron-Core pickles its own enums there, by this
module path and these class names; writing ours under the same path and names lets Megatron's
loader get its own types back, and this project reads them (and Megatron's) by name only, as
inert stand-ins (:mod:`megatron.checkpoint.safe_unpickle`). The machine itself lives in
:mod:`megatron.training.rerun`.
"""

from enum import Enum


class RerunMode(str, Enum):
    """``--rerun-mode``; Megatron names report_stats ``report_determinism_stats`` here."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """Where the machine stands (the values Megatron's checkpoints hold)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunDiagnostic(str, Enum):
    """``--error-injection-type``: what an injected error looks like to the re-runs."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


def mode_for_checkpoint(mode: str) -> RerunMode:
    """The Megatron enum member for this project's ``--rerun-mode`` value."""
    return RerunMode.REPORT_DETERMINISM_STATS if mode == "report_stats" else RerunMode(mode)


def mode_from_checkpoint(value) -> str:
    """This project's ``--rerun-mode`` value for a checkpoint's mode (a member, a stand-in or
    a string)."""
    value = str(getattr(value, "value", value))
    return "report_stats" if value == RerunMode.REPORT_DETERMINISM_STATS.value else value

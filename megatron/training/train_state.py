"""The state of one training run: where it is, what it has seen, what it has logged.

The parsed flags (``args``) say how to train; :class:`TrainState` says how far a run has got. It is
made by :func:`megatron.training.training.pretrain`, advanced by the training loop and evaluation,
and saved and restored by checkpointing under Megatron's keys: the iteration at the top level of a
checkpoint, the consumed samples inside its ``args`` namespace (``args.consumed_train_samples``,
``args.consumed_valid_samples``), so Megatron-LM reads a run's position from this project's files
and this project from Megatron-LM's.
"""

import argparse
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class TrainState:
    """A run's position and records; what :func:`~megatron.training.training.pretrain` returns.

    Attributes:
        iteration: iterations completed (the checkpoint's ``iteration``).
        consumed_train_samples: training samples read so far; the sampler resumes after them and
            a batch-size ramp-up follows them.
        consumed_valid_samples: validation samples read so far; the validation sampler resumes
            after them.
        skipped_train_samples: training samples read and dropped by --iterations-to-skip
            (included in ``consumed_train_samples``).
        loss_spike_history: the last ``--loss-spike-window`` losses of steps taken.
        train_loss_history: ``(iteration, lm loss)`` of every iteration this process ran (the
            loss is None on ranks that do not hold the last pipeline stage); not saved.
        exit_requested: the loop stopped early (a signal, --exit-interval,
            --exit-duration-in-mins); the end-of-training evaluation is then skipped.
        do_train, do_valid, do_test: whether each split has data (agreed over tensor-parallel
            ranks).
        final_valid_losses, final_test_losses: the end-of-training evaluations, when run
            (the first validation set's with --multiple-validation-sets).
        valid_losses_per_set: with --full-validation or --multiple-validation-sets, the
            latest evaluation's losses of each set, by its logged name
            (``validation-0``, ``validation-NAME``, or ``validation``); not saved.
        rerun: the run's :class:`~megatron.training.rerun.RerunStateMachine` (None: results
            are not validated).
        rerun_checkpoint: the machine's checkpoint entry (Megatron's key
            ``rerun_state_machine``): set before a save the machine asks for, read after a load.
        max_attention_logit: the model's largest attention logit of the last step, with
            --qk-clip or --log-max-attention-logit (None without them); not saved.
    """

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    loss_spike_history: List[float] = field(default_factory=list)
    train_loss_history: List[Tuple[int, Optional[float]]] = field(default_factory=list)
    exit_requested: bool = False
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False
    final_valid_losses: Optional[Dict[str, float]] = None
    final_test_losses: Optional[Dict[str, float]] = None
    valid_losses_per_set: Optional[Dict[str, Dict[str, float]]] = None
    rerun: Optional[object] = None
    rerun_checkpoint: Optional[dict] = None
    max_attention_logit: Optional[float] = None

    def saved_args_fields(self) -> Dict[str, object]:
        """What a checkpoint's ``args`` namespace records of this run: Megatron's two counters,
        and the losses --skip-iterations-with-loss-spike compares with, so a resumed run decides
        as the first did (copies: a background save may still be writing them while training
        goes on)."""
        fields = {"consumed_train_samples": self.consumed_train_samples,
                  "consumed_valid_samples": self.consumed_valid_samples,
                  "skipped_train_samples": self.skipped_train_samples,
                  "loss_spike_history": list(self.loss_spike_history)}
        if self.rerun_checkpoint is not None:  # a re-run from this checkpoint is pending
            fields["rerun_state_machine"] = self.rerun_checkpoint
        return fields

    def restore_from_saved_args(self, saved: Optional[argparse.Namespace]) -> None:
        """Take the training position a checkpoint's ``args`` records (0 and no losses for what
        it lacks: a file written before the field existed)."""
        self.consumed_train_samples = getattr(saved, "consumed_train_samples", 0) or 0
        self.consumed_valid_samples = getattr(saved, "consumed_valid_samples", 0) or 0
        self.skipped_train_samples = getattr(saved, "skipped_train_samples", 0) or 0
        self.loss_spike_history = list(getattr(saved, "loss_spike_history", None) or [])
        self.rerun_checkpoint = getattr(saved, "rerun_state_machine", None)

"""Offline knowledge distillation for GPT pretraining: a teacher run saves its top-K
log-probabilities per sample (``--logits-save-*``), a student run trains against them
(``--logits-load-*``). See :mod:`megatron.training.distillation.run`."""

from megatron.training.distillation.checks import distillation_flags_problem
from megatron.training.distillation.logits_files import LogitsFileError
from megatron.training.distillation.run import Distillation, setup, with_sample_index

__all__ = ["Distillation", "LogitsFileError", "setup", "distillation_flags_problem",
           "with_sample_index"]

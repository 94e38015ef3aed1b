"""Saving a teacher's top-K log-probabilities during a run, and training a student on them.

A GPT run with ``--logits-save-dir`` writes, for every train micro-batch it runs forward, each
sample's top-K (``--logits-save-top-k``, optionally cut by ``--logits-save-top-p`` /
``--logits-save-top-p-min-k``) log-probabilities and their token ids, as Megatron-LM's
zstd-compressed tars, one per data-parallel rank and iteration
(:mod:`~megatron.training.distillation.logits_files`); training goes on as usual. A run with
``--logits-load-dir`` (tars written here or by Megatron-LM) finds each sample's by its position
in the train stream (:mod:`~megatron.training.distillation.shards`) and trains on

    (1 - alpha) * lm_loss + alpha * kd_loss,      alpha = --logits-load-kd-loss-alpha,

``kd_loss`` the masked token mean of :func:`~megatron.training.distillation.kd_loss.
topk_forward_kl`. Evaluation uses the LM loss alone. With ``--logits-load-ignore-errors`` a
micro-batch whose teacher data is missing or corrupt trains on the LM loss (one warning per
file) instead of stopping the run.

The model hands its logits to a :class:`LogitsCapture` (``GPTModel.logits_observer``); the
batch carries each sample's dataset index (``sample_index``): with ``--dataloader-type single``
its position in the train stream.
"""

import warnings
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.training.distillation import logits_files, shards
from megatron.training.distillation.kd_loss import topk_forward_kl
from megatron.training.distillation.logits_files import LogitsFileError


class LogitsCapture:
    """Set as ``GPTModel.logits_observer``: keeps each training forward's logits ``[s, b,
    V/tp]`` until the micro-batch's loss function takes them. ``keeps_logits``: the model
    then computes its cross entropy out of place, so the logits stay valid for a second loss."""

    def __init__(self, keeps_logits: bool):
        self.keeps_logits = keeps_logits
        self._held: List[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> None:
        self._held.append(logits if self.keeps_logits else logits.detach())

    def pop(self) -> Optional[torch.Tensor]:
        return self._held.pop(0) if self._held else None


class WithSampleIndex(torch.utils.data.Dataset):
    """A dataset whose items also carry ``sample_index``: the index they were asked for."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        item = dict(self.dataset[idx])
        item["sample_index"] = np.int64(idx)
        return item

    def __getattr__(self, name):
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_sample_index(datasets):
    """Wrap each dataset (or list of validation sets) of ``datasets``; None stays None."""
    def wrap(ds):
        if ds is None:
            return None
        if isinstance(ds, (list, tuple)):
            return [wrap(d) for d in ds]
        return WithSampleIndex(ds)
    return tuple(wrap(ds) for ds in datasets)


class Distillation:
    """What a GPT run with ``--logits-save-dir`` or ``--logits-load-dir`` adds to each
    training micro-batch's loss function."""

    def __init__(self, args, pstate):
        self.pstate = pstate
        self.save_dir, self.load_dir = args.logits_save_dir, args.logits_load_dir
        self.alpha = args.logits_load_kd_loss_alpha
        self.ignore_errors = args.logits_load_ignore_errors
        self.capture = LogitsCapture(keeps_logits=self.load_dir is not None)
        self._warned = set()
        vocab, seq = args.padded_vocab_size, args.seq_length
        if self.save_dir is not None:
            self.top_k, self.top_p = args.logits_save_top_k, args.logits_save_top_p
            self.min_k = args.logits_save_top_p_min_k
            self.dtype = logits_files.SAVE_DTYPES[args.logits_save_dtype]
            logits_files.zstd()   # a missing package is named before training starts
            self.writer = shards.TeacherWriter(
                self.save_dir, logits_files.meta_bytes(args, pstate.dp_size), pstate.dp_rank,
                pstate.dp_size, args.micro_batch_size, args.global_batch_size)
        if self.load_dir is not None:
            logits_files.zstd()
            identifiers = logits_files.dataset_identifiers(args)
            expected = (logits_files.dataset_hash(identifiers), identifiers)
            self.reader = shards.TeacherReader(
                shards.ShardSet(self.load_dir, expected), seq, vocab,
                args.logits_load_decode_threads, args.logits_load_prefetch_factor)

    def attach(self, model) -> None:
        """Have ``model`` (a GPTModel) hand its training logits to this run's capture."""
        model.logits_observer = self.capture

    def loss_func(self, lm_loss_func: Callable, loss_mask: torch.Tensor,
                  sample_index: Optional[torch.Tensor], output_tensor: torch.Tensor):
        """The micro-batch's loss: ``lm_loss_func(output_tensor)`` (its ``(loss, logged)``),
        with the teacher's logits saved, or the distillation term mixed in."""
        logits = self.capture.pop()
        lm = lm_loss_func(output_tensor)
        if logits is None:  # evaluation: no logits captured
            return lm
        full = tensor_parallel.gather_from_tensor_model_parallel_region(
            logits, self.pstate.tp_group).transpose(0, 1)                     # [b, s, V]
        indices = [int(i) for i in sample_index.tolist()]
        if self.save_dir is not None:
            self._save(full.detach(), indices)
        if self.load_dir is None:
            return lm
        return self._mix(lm, full, loss_mask, indices)

    def _save(self, logits: torch.Tensor, indices: List[int]) -> None:
        if self.pstate.tp_rank != 0:
            return
        with torch.no_grad():   # the micro-batch's top-K together, as Megatron-LM cuts top-p
            values, ids = logits_files.top_logprobs(logits, self.top_k, self.top_p, self.min_k)
            self.writer.add(values.to(self.dtype), ids, indices)

    def _teacher_kl(self, logits: torch.Tensor, indices: List[int]) -> Optional[torch.Tensor]:
        """Per-token KL ``[b, s]``, or None when the files failed and errors are ignored."""
        try:
            teacher, ids = self.reader.get(indices)
        except LogitsFileError as err:
            if not self.ignore_errors:
                raise
            if str(err) not in self._warned:
                self._warned.add(str(err))
                warnings.warn(f"{err}; --logits-load-ignore-errors: this micro-batch trains "
                              "on the LM loss alone", stacklevel=2)
            return None
        return topk_forward_kl(logits, teacher.to(logits.device), ids.to(logits.device))

    def _mix(self, lm, logits, loss_mask, indices):
        loss, logged = lm
        kl = self._teacher_kl(logits, indices)
        ok = kl is not None
        if ok:
            mask = loss_mask.reshape(-1).float()
            kd = torch.sum(kl.reshape(-1) * mask) / mask.sum().clamp(min=1.0)
            total = (1.0 - self.alpha) * loss + self.alpha * kd
        else:
            kd, total = torch.zeros_like(loss), loss
        shown = torch.stack([kd.detach() * ok, total.detach(),
                             torch.tensor(float(ok), device=loss.device)])
        if self.pstate.dp_size > 1:
            dist.all_reduce(shown, group=self.pstate.dp_group)
        logged = dict(logged)
        logged["logits distillation loss"] = shown[0] / shown[2].clamp(min=1.0)
        logged["total loss"] = shown[1] / self.pstate.dp_size
        return total, logged


_ACTIVE = [None, None]   # [args, Distillation] of the current run


def setup(args, pstate) -> Optional[Distillation]:
    """This run's :class:`Distillation` (built once per ``args``), or None without the flags."""
    if args.logits_save_dir is None and args.logits_load_dir is None:
        return None
    if _ACTIVE[0] is not args:
        _ACTIVE[:] = [args, Distillation(args, pstate)]
    return _ACTIVE[1]

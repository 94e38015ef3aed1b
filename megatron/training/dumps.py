"""Megatron-LM's debugging dumps of one training iteration, written into the --save folder.

Every ``--save-*-interval N`` fires on the iterations that are multiples of N (counted from 1,
as logged). Tensors go to ``SAVE/LABEL/iter_NNNNNNN/mp_rank_XX[_PPP][_EEE].pth``, the rank
part named like the checkpoint's rank folder, one file per model-parallel rank written by the
rank of expert-data-parallel rank 0. Each file is a ``torch.save`` of
``{"model_chunk<i>": {key: tensor}}`` holding only tensors and plain values, so
``torch.load(path, weights_only=True)`` reads it. The labels and keys:

- ``params`` (--save-params-interval): every parameter's ``data`` after the optimizer step;
  keys are the parameter names.
- ``wgrads`` (--save-wgrads-interval): every parameter's gradient after the data-parallel
  reduction, before the optimizer step (what the optimizer reads, ``main_grad``).
- ``activations`` (--save-activations-interval): the inputs (``NAME/input<i>``), outputs
  (``NAME/output<i>``) and keyword arguments (``NAME/<kwarg>``) of every linear, embedding and
  MoE-router module in the forward passes of the iteration; a later micro-batch overwrites an
  earlier one, so the last micro-batch's remain.
- ``dgrads`` (--save-dgrads-interval): the gradients with respect to the outputs
  (``NAME/output<i>``) and inputs (``NAME/input<i>``) of every linear module in the backward
  passes (the last micro-batch's remain).

--save-tokens-per-expert-interval appends JSON lines to ``SAVE/tokens_per_expert/rank<R>.jsonl``
(one file per global rank): ``{"iter": N, "block": "decoder", "layer": L, "tpe": [[...], ...]}``
with, for each MoE layer (``L`` its index in this stage's ``decoder.layers``), the number of
tokens each local expert received in each micro-batch.
"""

import json
import os
import re
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from megatron.checkpoint.layout import expert_ranks, rank_dir_name
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding)
from megatron.model.module import Float16Module
from megatron.model.moe.router import TopKRouter

LINEAR_TYPES = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear)
ACTIVATION_TYPES = LINEAR_TYPES + (torch.nn.Embedding, VocabParallelEmbedding, TopKRouter)
_PLAIN = (bool, int, float, str)
# The decoder's MoE experts (``decoder.layers.L.mlp.experts``, or ``encoder.`` in the legacy
# module tree); multi-token prediction's own layers are not counted.
_MOE_EXPERTS = re.compile(r"(?:.*\.)?(?:decoder|encoder)\.layers\.(\d+)\.mlp\.experts")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside the data-parallel and half-precision wrappers."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def due(interval: Optional[int], iteration: int) -> bool:
    return interval is not None and iteration % interval == 0


def dump_path(save_dir: str, label: str, iteration: int, pstate) -> str:
    """``SAVE/LABEL/iter_NNNNNNN/mp_rank_...pth`` of this rank."""
    ep_rank, ep_size, _ = expert_ranks(pstate)
    name = rank_dir_name(pstate.tp_rank, pstate.pp_rank, pstate.pp_size, ep_rank, ep_size)
    return os.path.join(save_dir, label, f"iter_{iteration:07d}", name + ".pth")


def save_dump(save_dir: str, label: str, iteration: int, state: Dict[str, dict], pstate) -> None:
    """Write ``state`` on the ranks of expert-data-parallel rank 0 (a temporary name, then a
    rename, so a reader never sees half a file)."""
    if expert_ranks(pstate)[2] != 0:
        return
    path = dump_path(save_dir, label, iteration, pstate)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({chunk: dict(values) for chunk, values in state.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def parameter_state(model_chunks, attr: str) -> Dict[str, dict]:
    """``{"model_chunk<i>": {name: getattr(param, attr) on the CPU}}`` where it is set."""
    state: Dict[str, dict] = defaultdict(dict)
    for i, chunk in enumerate(model_chunks):
        for name, param in unwrap(chunk).named_parameters():
            value = getattr(param, attr, None)
            if value is None and attr == "main_grad":
                value = param.grad
            if value is not None:
                state[f"model_chunk{i}"][name] = value.detach().cpu().clone()
    return state


def _plain(value):
    """A tensor on the CPU, a plain value as it is, anything else None (not saved)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value if isinstance(value, _PLAIN) else None


class _Recorder:
    """Hooks on the named modules of the model chunks, removed by :meth:`remove`."""

    def __init__(self):
        self.state: Dict[str, dict] = defaultdict(dict)
        self.handles: List = []

    def _put(self, chunk: str, key: str, value) -> None:
        value = _plain(value)
        if value is not None:
            self.state[chunk][key] = value

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class ActivationRecorder(_Recorder):
    """Forward hooks keeping the inputs, outputs and keyword arguments of the modules."""

    def __init__(self, model_chunks):
        super().__init__()
        for i, chunk in enumerate(model_chunks):
            for name, module in unwrap(chunk).named_modules():
                if isinstance(module, ACTIVATION_TYPES):
                    self.handles.append(module.register_forward_hook(
                        self._hook(f"model_chunk{i}", name), with_kwargs=True))

    def _hook(self, chunk: str, name: str):
        def hook(_module, args, kwargs, output):
            for idx, value in enumerate(args if isinstance(args, tuple) else (args,)):
                self._put(chunk, f"{name}/input{idx}", value)
            for idx, value in enumerate(output if isinstance(output, tuple) else (output,)):
                if isinstance(value, torch.Tensor):
                    self._put(chunk, f"{name}/output{idx}", value)
            for key, value in kwargs.items():
                self._put(chunk, f"{name}/{key}", value)
        return hook


class DataGradRecorder(_Recorder):
    """Backward hooks keeping the gradients of the linear modules' outputs and inputs."""

    def __init__(self, model_chunks):
        super().__init__()
        for i, chunk in enumerate(model_chunks):
            for name, module in unwrap(chunk).named_modules():
                if isinstance(module, LINEAR_TYPES):
                    self.handles.append(module.register_full_backward_hook(
                        self._hook(f"model_chunk{i}", name)))

    def _hook(self, chunk: str, name: str):
        def hook(_module, grad_input, grad_output):
            for idx, grad in enumerate(grad_output):
                if grad is not None:
                    self._put(chunk, f"{name}/output{idx}", grad)
            for idx, grad in enumerate(grad_input):
                if grad is not None:
                    self._put(chunk, f"{name}/input{idx}", grad)
        return hook


class TokensPerExpertRecorder(_Recorder):
    """Forward hooks on the MoE experts modules, keeping each micro-batch's token counts."""

    def __init__(self, model_chunks):
        super().__init__()
        self.records: Dict[int, List[List[int]]] = defaultdict(list)
        for chunk in model_chunks:
            for name, module in unwrap(chunk).named_modules():
                match = _MOE_EXPERTS.fullmatch(name)
                if match is not None:
                    self.handles.append(module.register_forward_hook(
                        self._hook(int(match.group(1)))))

    def _hook(self, layer: int):
        def hook(_module, args, _output):
            if len(args) > 1:
                self.records[layer].append([int(n) for n in args[1]])
        return hook

    def append_to(self, save_dir: str, iteration: int, rank: int) -> None:
        if not self.records:
            return
        folder = os.path.join(save_dir, "tokens_per_expert")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
            for layer, counts in sorted(self.records.items()):
                f.write(json.dumps({"iter": iteration, "block": "decoder", "layer": layer,
                                    "tpe": counts}) + "\n")
        self.records.clear()


class IterationDumps:
    """The dumps one training iteration writes, by the --save-*-interval flags.

    Usage in the step: :meth:`before_passes` before the forward and backward passes,
    :meth:`after_passes` after the gradients are reduced, :meth:`after_step` after the
    optimizer step. Nothing is hooked or written on an iteration no flag fires on.
    """

    def __init__(self, args, iteration: Optional[int]):
        self.save_dir = args.save
        self.rank = getattr(args, "rank", 0)
        self.iteration = iteration
        due_on = (lambda interval: iteration is not None and due(interval, iteration))
        self.params = due_on(args.save_params_interval)
        self.wgrads = due_on(args.save_wgrads_interval)
        self.activations = due_on(args.save_activations_interval)
        self.dgrads = due_on(args.save_dgrads_interval)
        self.tpe = due_on(args.save_tokens_per_expert_interval)
        self.recorders: Dict[str, _Recorder] = {}

    def before_passes(self, model_chunks) -> None:
        for label, wanted, kind in (("activations", self.activations, ActivationRecorder),
                                    ("dgrads", self.dgrads, DataGradRecorder),
                                    ("tokens_per_expert", self.tpe, TokensPerExpertRecorder)):
            if wanted:
                self.recorders[label] = kind(model_chunks)

    def cancel(self) -> None:
        """Remove the hooks without writing (the passes failed)."""
        for recorder in self.recorders.values():
            recorder.remove()
        self.recorders.clear()

    def after_passes(self, model_chunks, pstate) -> None:
        for label, recorder in self.recorders.items():
            recorder.remove()
            if isinstance(recorder, TokensPerExpertRecorder):
                recorder.append_to(self.save_dir, self.iteration, self.rank)
            elif recorder.state:
                save_dump(self.save_dir, label, self.iteration, recorder.state, pstate)
        self.recorders.clear()
        if self.wgrads:
            save_dump(self.save_dir, "wgrads", self.iteration,
                      parameter_state(model_chunks, "main_grad"), pstate)

    def after_step(self, model_chunks, pstate) -> None:
        if self.params:
            save_dump(self.save_dir, "params", self.iteration,
                      parameter_state(model_chunks, "data"), pstate)

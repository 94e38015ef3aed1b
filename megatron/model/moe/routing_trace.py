"""Routing trace (``--moe-routing-trace-path``): the experts every MoE router chose in training,
written per rank in Megatron-Core's router-trace format for offline analysis of the routing.

Files in the trace folder, one set per global rank ``r``:

* ``router_trace_rank{r}.jsonl``: one JSON record per router call of a traced iteration::

      {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
       "num_tokens": 32, "topk": 2, "top_indices": [[0, 3], [1, 2], ...]}

  ``step`` counts the traced iterations from 0; ``layer`` is the 0-based layer in the whole
  model; a multi-token-prediction layer has ``"block": "mtp"``, ``"mtp_idx"`` its depth and
  ``"layer": 0``. ``top_indices`` ``[num_tokens, topk]`` are the experts in the router's
  routing map (what the token dispatcher uses), each token's in ascending expert order; the
  tokens are the router input's ``[s, b]`` positions flattened in that order.
* ``hidden_states_rank{r}.bin`` (``--moe-routing-trace-capture-hidden-states``): each router
  input ``[num_tokens, h]`` as bfloat16 bytes; the record gains ``hs_offset``, ``hs_bytes``,
  ``hs_shape``.
* ``logits_rank{r}.bin`` (``--moe-routing-trace-capture-logits``): the router's logits
  ``[num_tokens, E]`` (its linear map of that input, without input jitter or forced logits) as
  bfloat16 bytes; the record gains ``logit_offset``, ``logit_bytes``, ``logit_shape``.
* ``router_state_rank{r}.pt`` (``--moe-routing-trace-dump-weights``): per router, its state
  when the trace first saw it: ``{"weight": [E, h] float32, "bias": [E] float32 or None,
  "expert_bias": [E] float32 or None, "score_function": str, "topk": int}``, keyed by ``layer``
  (an MTP router by ``("mtp", mtp_idx, layer)``); written when the trace stops.

Records are written once per iteration (:meth:`RoutingTracer.advance_step`, after the
forward-backward and the optimizer step), in the order the routers ran: micro-batch by
micro-batch, layer by layer. Tracing stops after ``--moe-routing-trace-max-training-iters``
iterations (all of them when unset).

Where this differs from Megatron-Core's tracer, on purpose:

* the forwards of evaluation and of activation recomputation are not recorded (Megatron's hook
  records them under the current step: the recomputed routing twice, the validation tokens as
  if they were training tokens);
* ``layer`` is the index in the whole model, where Megatron's reads the index within the
  pipeline stage's layer list (the same at one stage; at several, or with virtual stages,
  Megatron's numbers repeat).

As in Megatron, a router call in which the capacity dropped some token's choice
(``--moe-expert-capacity-factor``) has no ``[num_tokens, topk]`` list and writes no record; a
rank says so once.
"""

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import device
from megatron.model.moe.router import TopKRouter

_MTP_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")

Identity = Tuple[str, Optional[int], int]       # (block, mtp_idx, layer)


def router_identity(module_name: str, router: TopKRouter) -> Identity:
    """``("decoder", None, layer_number - 1)``, or ``("mtp", depth, 0)`` for the router of an
    MTP layer (named ``...mtp.layers.<depth>...``)."""
    match = _MTP_LAYER.search(module_name)
    if match:
        return "mtp", int(match.group(1)), 0
    return "decoder", None, router.layer_number - 1


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (an activation recomputation)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _bf16_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.int16).numpy().tobytes()


def read_sidecar(record: dict, trace_dir: str, kind: str) -> torch.Tensor:
    """The bfloat16 tensor a record points to: ``kind`` ``"hs"`` (hidden states) or
    ``"logit"`` (logits)."""
    name = {"hs": "hidden_states", "logit": "logits"}[kind]
    with open(os.path.join(trace_dir, f"{name}_rank{record['rank']}.bin"), "rb") as f:
        f.seek(record[f"{kind}_offset"])
        data = bytearray(f.read(record[f"{kind}_bytes"]))
    return torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16).reshape(
        record[f"{kind}_shape"])


class RoutingTracer:
    """Forward hooks on the routers of a model that record their choices (module docstring).

    Args:
        output_dir: the trace folder (created); this rank's files in it are truncated.
        rank: the global rank, in every file name and record.
        max_steps: iterations to trace; None: all.
        capture_hidden_states / capture_logits / dump_weights: the optional files.
    """

    def __init__(self, output_dir: str, rank: int, max_steps: Optional[int] = None,
                 capture_hidden_states: bool = False, capture_logits: bool = False,
                 dump_weights: bool = False):
        self.output_dir = output_dir
        self.rank = rank
        self.max_steps = max_steps
        self.capture_hidden_states = capture_hidden_states
        self.capture_logits = capture_logits
        self.dump_weights = dump_weights
        self.step = 0
        self.stopped = False
        self._pending: List[dict] = []
        self._router_state: Dict[object, dict] = {}
        self._handles = []
        self._warned_drop = False
        os.makedirs(output_dir, exist_ok=True)
        self.trace_path = self._path("router_trace_rank{}.jsonl")
        self.sidecars = {"hs": (self._path("hidden_states_rank{}.bin"), capture_hidden_states),
                         "logit": (self._path("logits_rank{}.bin"), capture_logits)}
        self._offsets = {"hs": 0, "logit": 0}
        for path, on in [(self.trace_path, True), *self.sidecars.values()]:
            if on:
                open(path, "wb").close()

    def _path(self, pattern: str) -> str:
        return os.path.join(self.output_dir, pattern.format(self.rank))

    def attach(self, model_chunks) -> int:
        """Hook every :class:`TopKRouter` of ``model_chunks``; returns how many."""
        for chunk in model_chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    identity = router_identity(name, module)
                    self._handles.append(module.register_forward_hook(
                        lambda mod, inputs, outputs, ident=identity:
                        self._on_router(mod, inputs, outputs, ident)))
        return len(self._handles)

    def _on_router(self, router: TopKRouter, inputs, outputs, identity: Identity) -> None:
        if self.stopped or not router.training or _in_backward():
            return
        hidden = inputs[0].detach()
        hidden = hidden.reshape(-1, hidden.size(-1))                          # [T, h]
        block, mtp_idx, layer = identity
        record = {"step": self.step, "stage": "pre_dispatch", "block": block, "layer": layer,
                  "rank": self.rank}
        if mtp_idx is not None:
            record["mtp_idx"] = mtp_idx
        # Copied now (the tensors may be reused), read at the iteration's end.
        record["_map"] = outputs[1].detach().to("cpu", non_blocking=True)     # [T, E]
        record["_topk"] = router.topk
        if self.capture_hidden_states:
            record["_hs"] = hidden.to("cpu", torch.bfloat16, non_blocking=True)
        if self.capture_logits:
            with torch.no_grad():
                logits = router.logits(hidden)                                # [T, E]
            record["_logit"] = logits.to("cpu", torch.bfloat16, non_blocking=True)
        if self.dump_weights:
            self._keep_state(router, layer if block == "decoder" else identity)
        self._pending.append(record)

    def _keep_state(self, router: TopKRouter, key) -> None:
        if key in self._router_state:
            return

        def as_float(tensor):
            return None if tensor is None else tensor.detach().to("cpu", torch.float32).clone()

        self._router_state[key] = {
            "weight": as_float(router.weight), "bias": as_float(router.bias),
            "expert_bias": as_float(router.expert_bias),
            "score_function": router.moe_config.moe_router_score_function,
            "topk": router.topk}

    def _top_indices(self, routing_map: torch.Tensor, topk: int) -> Optional[torch.Tensor]:
        """``[T, k]`` expert ids of a routing map, or None where a choice was dropped."""
        if not bool((routing_map.sum(dim=1) == topk).all()):
            if not self._warned_drop:
                self._warned_drop = True
                print(f"NOTE: rank {self.rank}: --moe-routing-trace-path skips the router calls "
                      "in which --moe-expert-capacity-factor dropped a token's choice",
                      flush=True)
            return None
        return routing_map.nonzero()[:, 1].view(-1, topk)

    def _write_pending(self) -> None:
        device.synchronize()   # the non-blocking copies
        lines = []
        for record in self._pending:
            indices = self._top_indices(record.pop("_map"), record.pop("_topk"))
            if indices is None:
                continue
            record.update(num_tokens=indices.size(0), topk=indices.size(1))
            for kind, (path, on) in self.sidecars.items():
                if on:
                    self._append_sidecar(record, kind, path)
            record["top_indices"] = indices.tolist()
            lines.append(json.dumps(record) + "\n")
        self._pending = []
        with open(self.trace_path, "a") as f:
            f.writelines(lines)

    def _append_sidecar(self, record: dict, kind: str, path: str) -> None:
        tensor = record.pop("_" + kind)
        data = _bf16_bytes(tensor)
        with open(path, "ab") as f:
            f.write(data)
        record.update({f"{kind}_offset": self._offsets[kind], f"{kind}_bytes": len(data),
                       f"{kind}_shape": list(tensor.shape)})
        self._offsets[kind] += len(data)

    def advance_step(self) -> None:
        """After an iteration: write its records; stop after ``max_steps`` iterations."""
        if self.stopped:
            return
        self._write_pending()
        self.step += 1
        if self.max_steps is not None and self.step >= self.max_steps:
            self.close()

    def close(self) -> None:
        """Stop: unhook, drop what an unfinished iteration recorded, write the router state."""
        if self.stopped:
            return
        self.stopped = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._pending = []
        if self.dump_weights:
            torch.save(self._router_state, self._path("router_state_rank{}.pt"))


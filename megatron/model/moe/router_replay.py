"""Routing replay (``--moe-enable-routing-replay``): record the experts each router chose in one
pass and make a later pass choose the same ones.

Megatron-Core's semantics: every router of a model built with the flag holds one
:class:`RouterReplay`; nothing changes until an action is set. With ``record`` the router
routes as usual and keeps its top-k expert ids ``[T, k]``; with ``replay_forward`` it takes the
ids handed to it (:func:`set_replay_data`) instead of its own top-k, and with
``replay_backward`` the oldest ids not yet replayed by a recomputation (each
``replay_forward`` target is queued for the activation recomputation of the same pass). On
replay the probabilities are those of the replayed experts under the router's current logits,
weighed as the top-k router weighs its own choice (softmax over the chosen logits, or over all
with pre-softmax; sigmoid / sqrtsoftplus scores normalised over the chosen; times the scaling
factor), so the gradient still reaches the router. Typical use: reinforcement learning, where
the training pass must route as the rollout (inference) pass did.

The routers of a model are found in module order (:func:`router_replays`); lists of ids follow
that order, one ``[tokens, topk]`` tensor per MoE layer of this rank. Top-k routing only:
sinkhorn and quantile balancing choose by other rules and refuse the flag.
"""

import enum
from typing import Iterable, List, Optional

import torch


class RouterReplayAction(enum.Enum):
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


class RouterReplay:
    """One router's recorded ids, ids to replay, and current action."""

    def __init__(self):
        self.action: Optional[RouterReplayAction] = None
        self.recorded: Optional[torch.Tensor] = None
        self.target: Optional[torch.Tensor] = None
        self.backward_queue: List[torch.Tensor] = []

    def set_target(self, indices: torch.Tensor) -> None:
        self.target = indices
        self.backward_queue.append(indices)

    def clear(self) -> None:
        self.recorded, self.target, self.backward_queue = None, None, []

    def replayed_indices(self, num_tokens: int, topk: int, num_experts: int,
                         device) -> Optional[torch.Tensor]:
        """The ids ``[T, k]`` this pass must use, or None to route normally."""
        if self.action == RouterReplayAction.REPLAY_FORWARD:
            indices = self.target
        elif self.action == RouterReplayAction.REPLAY_BACKWARD:
            if not self.backward_queue:
                raise RuntimeError("--moe-enable-routing-replay: replay_backward with no "
                                   "replayed forward left to recompute")
            indices = self.backward_queue.pop(0)
        else:
            return None
        if indices is None:
            raise RuntimeError("--moe-enable-routing-replay: replay_forward with no expert ids "
                               "set (set_replay_data)")
        if tuple(indices.shape) != (num_tokens, topk):
            raise ValueError(f"--moe-enable-routing-replay: replayed expert ids have shape "
                             f"{tuple(indices.shape)}, the router needs ({num_tokens}, {topk})")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_experts):
            raise ValueError(f"--moe-enable-routing-replay: replayed expert ids must be in "
                             f"[0, {num_experts})")
        return indices.to(device=device, dtype=torch.long)

    def record(self, indices: torch.Tensor) -> None:
        if self.action == RouterReplayAction.RECORD:
            self.recorded = indices.detach().clone()


def router_replays(modules: Iterable[torch.nn.Module]) -> List[RouterReplay]:
    """The :class:`RouterReplay` of every router in ``modules`` (model chunks), in module
    order."""
    found = []
    for module in modules:
        for sub in module.modules():
            replay = getattr(sub, "router_replay", None)
            if isinstance(replay, RouterReplay):
                found.append(replay)
    return found


def set_router_replay_action(modules, action: Optional[RouterReplayAction]) -> None:
    """Set (None: clear) the action of every router in ``modules``."""
    for replay in router_replays(modules):
        replay.action = action


def set_replay_data(modules, indices: List[torch.Tensor]) -> None:
    """Hand each router its expert ids to replay, one tensor per router in module order."""
    replays = router_replays(modules)
    if len(indices) != len(replays):
        raise ValueError(f"--moe-enable-routing-replay: {len(indices)} tensors of expert ids "
                         f"for {len(replays)} routers")
    for replay, ids in zip(replays, indices):
        replay.set_target(ids)


def get_recorded_data(modules) -> List[Optional[torch.Tensor]]:
    """The ids each router recorded (``[T, k]``, None where it recorded nothing)."""
    return [replay.recorded for replay in router_replays(modules)]


def clear_replay_data(modules) -> None:
    """Forget every recorded and replayed id (the actions stay)."""
    for replay in router_replays(modules):
        replay.clear()

"""Named RNG streams for tensor parallelism, and activation checkpointing that replays them.

Dropout must differ between tensor-parallel ranks inside a parallel region (each rank holds a
different slice of the activations) and agree outside one (every rank holds the same
activations). The device generator (``megatron.core.device``: the CUDA generator on GPU, torch's
default CPU generator on CPU) is the shared "default" stream; :class:`CudaRNGStatesTracker`
keeps extra named streams and ``fork(name)`` swaps one in for the duration of a block.

:func:`model_parallel_cuda_manual_seed` sets Megatron's layout: the default stream from
``seed`` on every rank, and the stream ``'model-parallel-rng'`` from ``seed + 2718 + tp_rank``.
"""

import contextlib
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core import device
from megatron.core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_TENSOR_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if device.is_cuda() else torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if device.is_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed_device_rng(seed: int) -> None:
    if device.is_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named device-RNG streams that can be swapped in with :meth:`fork`.

    The name says CUDA for Megatron users; on CPU the streams are states of torch's default CPU
    generator. Each stream is stored as a generator state tensor, so :meth:`get_states` /
    :meth:`set_states` round-trip through a checkpoint.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()
        self.seed_of_: Dict[str, int] = {}
        # The default stream's seed (set by model_parallel_cuda_manual_seed): streams derived
        # from it later do not depend on whoever reseeded the default generator since.
        self.default_seed: Optional[int] = None

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of every stream's state, by name (for checkpoints)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the streams' states (seeds already registered are kept)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the default stream is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"RNG tracker: stream {name!r} already exists")
        self.seeds_.add(seed)
        self.seed_of_[name] = seed
        outside = _get_device_rng_state()
        _seed_device_rng(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(outside)

    def add_if_missing(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` unless it exists. States loaded from a
        checkpoint saved before the stream existed replace the streams without it; the stream
        then starts again from ``seed`` (which it may already have registered)."""
        if name in self.states_:
            return
        if self.seed_of_.get(name) == seed:
            self.seeds_.discard(seed)
        self.add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw from stream ``name`` inside the block; its advanced state is kept for next time."""
        if name not in self.states_:
            raise KeyError(f"RNG tracker: no stream named {name!r} (known: "
                           f"{sorted(self.states_)}); call model_parallel_cuda_manual_seed first")
        outside = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(outside)


RNGStatesTracker = CudaRNGStatesTracker

# One registry per process, like the device generator it complements.
_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """This process's RNG stream tracker."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int) -> None:
    """Seed the default device stream with ``seed`` and the tensor-parallel stream
    ``'model-parallel-rng'`` with ``seed + 2718 + tp_rank``.

    Call on every rank after the process groups exist; the pipeline-stage offset Megatron adds
    to ``seed`` is the caller's business.
    """
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _seed_device_rng(seed)
    tracker.default_seed = seed
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + _TENSOR_MODEL_PARALLEL_SEED_OFFSET + tp_rank)


def _rng_snapshot() -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    return torch.get_rng_state(), _get_device_rng_state(), get_cuda_rng_tracker().get_states()


def _rng_restore(snapshot) -> None:
    cpu_state, device_state, tracker_states = snapshot
    torch.set_rng_state(cpu_state)
    _set_device_rng_state(device_state)
    get_cuda_rng_tracker().set_states(tracker_states)


def rng_snapshot():
    """The host, device and tracker RNG states, for code that runs a computation again with
    the random numbers it drew the first time (see :func:`rng_restore`)."""
    return _rng_snapshot()


def rng_restore(snapshot) -> None:
    """Set the RNG states of a :func:`rng_snapshot`."""
    _rng_restore(snapshot)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping its activations; recompute them in backward.

    Forward snapshots the CPU, device and tracker RNG states; backward restores that snapshot
    around the recompute (so every dropout mask is drawn again bit for bit) and then puts back
    whatever states were current when backward started.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, tp_group, *args):
        ctx.run_function = run_function
        ctx.distribute = distribute_saved_activations
        ctx.tp_group = tp_group
        ctx.rng_snapshot = _rng_snapshot()
        outputs = run_function(*args)

        is_tensor = [torch.is_tensor(a) for a in args]
        ctx.is_tensor = is_tensor
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.non_tensors = [None if t else a for a, t in zip(args, is_tensor)]
        tensors = [a for a, t in zip(args, is_tensor) if t]
        if distribute_saved_activations:
            if not is_tensor[0]:
                raise ValueError("checkpoint(distribute_saved_activations=True) needs a tensor "
                                 "as the first argument")
            ctx.input_0_shape = args[0].shape
            # Keep only this rank's 1/tp of the first input; the full tensor can be freed.
            tensors[0] = split_tensor_into_1d_equal_chunks(args[0].detach(), tp_group,
                                                           new_buffer=True)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() supports .backward() only, not torch.autograd.grad()")
        saved = list(ctx.saved_tensors)
        if ctx.distribute:
            saved[0] = gather_split_1d_tensor(saved[0], ctx.tp_group).view(ctx.input_0_shape)
        saved_iter = iter(saved)
        inputs = []
        for is_tensor, needs_grad, other in zip(ctx.is_tensor, ctx.input_requires_grad,
                                                ctx.non_tensors):
            inputs.append(next(saved_iter).detach().requires_grad_(needs_grad) if is_tensor
                          else other)

        surrounding = _rng_snapshot()
        _rng_restore(ctx.rng_snapshot)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _rng_restore(surrounding)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(inp.grad if torch.is_tensor(inp) else None for inp in inputs)
        return (None, None, None) + grads


def checkpoint(function, distribute_saved_activations: bool, *args,
               tp_group: Optional[Any] = None):
    """Activation checkpointing that replays RNG exactly: ``function(*args)``, recomputed in
    backward.

    Args:
        function: the block to run; takes ``*args`` and returns a tensor or tuple of tensors.
        distribute_saved_activations: keep only ``1 / tp`` of the first argument (flattened,
            this rank's share) and all-gather it back in backward. Needs ``tp_group=`` and a first
            argument whose element count the tp size divides; a saving only when every rank of
            the group holds the same first argument (no sequence parallelism).
        *args: the block's inputs (tensors or plain values).
        tp_group: the tensor-parallel group, for ``distribute_saved_activations``.

    As with any function-based checkpoint, gradients reach the parameters used inside
    ``function`` only if at least one tensor argument requires grad.
    """
    if distribute_saved_activations and tp_group is None:
        raise ValueError("checkpoint(distribute_saved_activations=True) needs tp_group=, the "
                         "tensor-parallel group the first input is shared across")
    return CheckpointFunction.apply(function, distribute_saved_activations, tp_group, *args)

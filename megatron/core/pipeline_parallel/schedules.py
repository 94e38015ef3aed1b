"""Forward/backward schedules over the micro-batches of one iteration.

A forward step function has Megatron's contract::

    output_tensor, loss_func = forward_step_func(data_iterator, model)
    loss, logged = loss_func(output_tensor)      # loss: scalar mean over the micro-batch
    loss, num_tokens, logged = loss_func(output_tensor)   # or: the sum over num_tokens tokens

The schedule divides each micro-batch loss by the number of micro-batches (so gradients are those
of the mean over the global batch); a loss given as a sum is first divided by its ``num_tokens``,
or, with ``calculate_per_token_loss``, left a sum (``--calculate-per-token-loss``: the tokens of
all micro-batches are counted into the returned :class:`MicroBatchLosses`' ``num_tokens``, and
``finalize_model_grads`` divides the gradients by their total over the data-parallel ranks).
Then the loss is scaled for fp16 through ``grad_scale_func`` and backward runs; gradient
reduction across data-parallel ranks is deferred through ``no_sync_func`` until the last
micro-batch of each model chunk. Only the last pipeline stage computes losses, so
only there is the returned list of logged values non-empty.

Three schedules, chosen by :func:`get_forward_backward_func`:

* :func:`forward_backward_no_pipelining`: one stage; forward and backward of each micro-batch.
* :func:`forward_backward_pipelining_without_interleaving` (1F1B): stage ``r`` of ``p`` runs
  ``w = min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  runs the ``w`` remaining backwards. At most ``w + 1 <= p`` micro-batches hold activations at
  once, and the sent outputs themselves are freed at once (only their autograd graph is kept).
  Order of operations for ``p = 4``, ``m = 8`` (``Fi`` / ``Bi``: forward / backward of
  micro-batch ``i``; ``recvF`` / ``sendF``: activation from the previous / to the next stage;
  ``sendB`` / ``recvB``: gradient to the previous / from the next stage; ``+`` joins what one
  exchange does; ``|`` separates warm-up, steady state and cool-down)::

    stage 0: F0 sendF F1 sendF F2 sendF | F3 sendF+recvB B0 F4 sendF+recvB B1 ...
             F7 sendF+recvB B4 | recvB B5 recvB B6 recvB B7
    stage 1: recvF F0 sendF recvF F1 sendF | recvF F2 sendF+recvB B0 recvF+sendB
             F3 sendF+recvB B1 recvF+sendB ... F7 sendF+recvB B5 sendB |
             recvB B6 sendB recvB B7 sendB
    stage 2: recvF F0 sendF | recvF F1 sendF+recvB B0 recvF+sendB ...
             F7 sendF+recvB B6 sendB | recvB B7 sendB
    stage 3: | recvF F0 B0 recvF+sendB F1 B1 recvF+sendB ... F7 B7 sendB |

  In time, with a forward taking one unit and a backward two (free communication), the step
  takes ``(m + p - 1) x 3`` units, of which ``(p - 1) x 3`` idle on every stage: a bubble of
  ``(p - 1) / m`` of the useful work::

    st 0: F0F1F2F3            B0B0F4B1B1F5B2B2F6B3B3F7B4B4  B5B5  B6B6  B7B7
    st 1:   F0F1F2        B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5  B6B6  B7B7
    st 2:     F0F1    B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6  B7B7
    st 3:       F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7

* :func:`forward_backward_pipelining_with_interleaving`: each rank holds ``v`` model chunks
  (virtual stages); the layers are dealt round-robin, so chunk ``c`` of stage ``r`` is virtual
  stage ``c * p + r``. Forwards go through the chunks in groups of ``g`` micro-batches
  (``--microbatch-group-size-per-virtual-pipeline-stage``, by default ``p``, and then ``m``
  must be a multiple of ``p``; :func:`get_schedule_table`), which cuts the bubble to
  ``(p - 1) / (m v)`` for ``v`` times more messages. Stage ``r`` runs
  ``min(2 (p - r - 1) + (v - 1) g, m v)`` warm-up forwards (all of them when ``m == p``), then
  alternates, then drains. For ``p = 2``, ``v = 2``, ``m = 4``
  (``Fc.i``: chunk ``c``, micro-batch ``i``)::

    stage 0: F0.0 F0.1 F1.0 F1.1 | F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 | B1.2 B1.3 B0.2 B0.3
    stage 1: F0.0 F0.1 | F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 | B0.2 B0.3

  Chunk 0 of stage 0 takes the data; chunk 1 of stage 0 takes its input from chunk 0 of the last
  stage, over the wrap-around of the pipeline ring.

:func:`pipeline_order` lists, for any stage, the forwards and backwards in the order these
schedules run them.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.autograd.variable import Variable

from megatron.core.pipeline_parallel.p2p_communication import MessageShapes, P2PCommunicator

ModelArg = Union[torch.nn.Module, Sequence[torch.nn.Module]]
NoSyncArg = Union[None, Callable, Sequence[Callable]]


class MicroBatchLosses(list):
    """What a schedule returns: the logged values of each micro-batch on this stage (a list),
    and ``num_tokens``, the token counts that three-value loss functions returned, summed (0
    where no loss is computed or the loss functions return two values)."""

    def __init__(self, values=()):
        super().__init__(values)
        self.num_tokens = 0


def _loss_for_backward(outputs, num_microbatches: int, per_token: bool, forward_only: bool,
                       losses: MicroBatchLosses) -> torch.Tensor:
    """The loss backward starts from, out of what a loss function returned; its logged values
    and token count go to ``losses``."""
    if len(outputs) == 3:
        loss, num_tokens, logged = outputs
        losses.num_tokens = losses.num_tokens + num_tokens
        if not (per_token or forward_only):
            loss = loss / torch.clamp(num_tokens, min=1)
    elif len(outputs) == 2:
        loss, logged = outputs
    else:
        raise ValueError(f"a loss function returns (loss, logged) or (loss, num_tokens, "
                         f"logged), got {len(outputs)} values")
    losses.append(logged)
    if forward_only or (per_token and len(outputs) == 3):
        return loss
    return loss / num_microbatches


# ---------------------------------------------------------------------- no pipelining

def forward_backward_step(forward_step_func, data_iterator, model, num_microbatches: int,
                          forward_only: bool, grad_scale_func: Optional[Callable],
                          per_token: bool, losses: MicroBatchLosses) -> None:
    """Forward and (unless ``forward_only``) backward of one micro-batch on a single stage;
    its logged values go to ``losses``."""
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    loss = _loss_for_backward(loss_func(output_tensor), num_microbatches, per_token,
                              forward_only, losses)
    if not forward_only:
        if grad_scale_func is not None:
            loss = grad_scale_func(loss)
        loss.backward()


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Iterator,
                                   model: ModelArg, num_microbatches: int,
                                   forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   no_sync_func: Optional[Callable] = None,
                                   calculate_per_token_loss: bool = False,
                                   **_pipeline_kwargs) -> MicroBatchLosses:
    """All micro-batches on one stage; returns each micro-batch's logged values.

    Pipeline-only keywords (``communicator``, ``tensor_shape``, ...) are accepted and ignored, so
    a caller can pass the same keywords to whichever schedule it got.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("forward_backward_no_pipelining takes exactly one model chunk")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    if isinstance(no_sync_func, (list, tuple)):
        no_sync_func = no_sync_func[0]
    no_sync = no_sync_func if no_sync_func is not None else contextlib.nullcontext
    logged = MicroBatchLosses()
    step = (forward_step_func, data_iterator, model, num_microbatches, forward_only,
            grad_scale_func, calculate_per_token_loss, logged)
    with no_sync():
        for _ in range(num_microbatches - 1):
            forward_backward_step(*step)
    # The last micro-batch's backward runs with reduction enabled.
    forward_backward_step(*step)
    return logged


# ---------------------------------------------------------------------- shared pieces

def get_attr_wrapped_model(model: torch.nn.Module, attr: str):
    """``attr`` of ``model`` or of the first module down its ``.module`` chain that has it.

    The data-parallel wrapper does not forward ``set_input_tensor``; the model inside does.
    """
    module = model
    while module is not None:
        if hasattr(module, attr):
            return getattr(module, attr)
        module = getattr(module, "module", None)
    raise AttributeError(f"{type(model).__name__} (and the modules it wraps) has no {attr!r}")


def deallocate_output_tensor(output: Optional[torch.Tensor]) -> None:
    """Free the data of an output already sent to the next stage, keeping its autograd graph.

    Backward of this stage needs only ``output.grad_fn`` and the gradient the next stage sends
    back, not the ``[s, b, h]`` values, which the next stage now holds. Views are left alone:
    their storage belongs to another tensor.
    """
    if output is None or output._base is not None or output.numel() <= 1:
        return
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward from ``output`` with ``grad_output``, also when ``output``'s data was freed.

    ``torch.autograd.backward`` compares the gradient's shape with the tensor's current shape,
    which :func:`deallocate_output_tensor` changed; the engine itself checks the shape recorded in
    the graph, which is still right.
    """
    if output.grad_fn is None:
        raise RuntimeError("pipeline stage output has no grad_fn; it must depend on parameters "
                           "or on the received input")
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


class _GradSync:
    """Keeps each chunk's ``no_sync`` context open, and closes a chunk's context just before its
    last backward so that backward may start the chunk's gradient reduction.

    A single callable (or None) covers all chunks and is closed before the last backward of the
    step; a list gives one per chunk.
    """

    def __init__(self, no_sync_func: NoSyncArg, num_chunks: int):
        if no_sync_func is None or callable(no_sync_func):
            self.funcs = [no_sync_func]
            self.shared = True
        else:
            self.funcs = list(no_sync_func)
            self.shared = False
            if len(self.funcs) != num_chunks:
                raise ValueError(f"no_sync_func has {len(self.funcs)} entries for "
                                 f"{num_chunks} model chunks")
        self.stacks = [contextlib.ExitStack() for _ in self.funcs]

    def __enter__(self):
        for func, stack in zip(self.funcs, self.stacks):
            if func is not None:
                stack.enter_context(func())
        return self

    def enable(self, chunk: int, last_of_step: bool) -> None:
        """Called before a chunk's last backward of the step."""
        if self.shared:
            if last_of_step:
                self.stacks[0].close()
        else:
            self.stacks[chunk].close()

    def __exit__(self, *exc):
        for stack in self.stacks:
            stack.close()
        return False


@dataclass
class _Run:
    """What one schedule run on one stage needs, and the micro-batch bookkeeping it keeps."""

    forward_step_func: Callable
    data_iterators: List
    chunks: List[torch.nn.Module]
    num_microbatches: int
    forward_only: bool
    grad_scale_func: Optional[Callable]
    comm: P2PCommunicator
    tensor_shape: Tuple[int, ...]
    grad_sync: _GradSync
    set_virtual_pp_rank: Optional[Callable[[int], None]] = None
    per_token: bool = False
    losses: MicroBatchLosses = field(default_factory=MicroBatchLosses)
    backwards_done: List[int] = field(default_factory=list)
    loss_stage_tensor_shape: Optional[Tuple[int, ...]] = None
    mtp_stage: Optional[int] = None

    def __post_init__(self):
        self.backwards_done = [0] * len(self.chunks)

    def _stage_shape(self, chunk: Optional[int], stage_from_last: int) -> Tuple[int, ...]:
        if chunk is None or self.loss_stage_tensor_shape is None:
            return self.tensor_shape
        stage = chunk * self.comm.pp_size + self.comm.pp_rank
        last = self.comm.pp_size * len(self.chunks) - 1
        # The wide messages run from the MTP stage's output to the loss stage's input, through
        # any (empty) stages between them.
        source = last - 1 if self.mtp_stage is None else self.mtp_stage
        wide = source + 1 - stage_from_last <= stage <= last - stage_from_last
        return self.loss_stage_tensor_shape if wide else self.tensor_shape

    def input_shape(self, chunk: Optional[int]) -> Tuple[int, ...]:
        """The shape of ``chunk``'s input (and of its gradient): ``loss_stage_tensor_shape``
        into the stages after ``mtp_stage`` when given (a standalone MTP stage hands on
        ``[(1+K)s, b, h]``, which stages between it and the loss pass along), else
        ``tensor_shape``; None: no message, ``tensor_shape``."""
        return self._stage_shape(chunk, 0)

    def output_shape(self, chunk: Optional[int]) -> Tuple[int, ...]:
        """The shape of ``chunk``'s output (and of its gradient): ``loss_stage_tensor_shape``
        out of ``mtp_stage`` and the stages after it but the last when given, else
        ``tensor_shape``."""
        return self._stage_shape(chunk, 1)

    def boundary_shape(self, next_stage: bool) -> Tuple[int, ...]:
        """Without virtual stages: the shape of the messages between this stage and the next
        (``next_stage``) or the previous one."""
        return self.output_shape(0) if next_stage else self.input_shape(0)

    def shapes(self, send: Optional[int] = None, send_grad: Optional[int] = None,
               recv: Optional[int] = None, recv_grad: Optional[int] = None) -> MessageShapes:
        """The shapes of one exchange that sends chunk ``send``'s output and chunk
        ``send_grad``'s input gradient and receives chunk ``recv``'s input and chunk
        ``recv_grad``'s output gradient (None where no such message goes)."""
        return MessageShapes(self.output_shape(send), self.input_shape(send_grad),
                             self.input_shape(recv), self.output_shape(recv_grad))

    def is_first_virtual(self, chunk: int) -> bool:
        return self.comm.is_first_stage and chunk == 0

    def is_last_virtual(self, chunk: int) -> bool:
        return self.comm.is_last_stage and chunk == len(self.chunks) - 1

    def _select(self, chunk: int) -> None:
        if self.set_virtual_pp_rank is not None:
            self.set_virtual_pp_rank(chunk)

    def forward(self, chunk: int, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Forward of one micro-batch through ``chunk``; the scaled-down loss on the last
        virtual stage, the activation to send elsewhere."""
        self._select(chunk)
        model = self.chunks[chunk]
        get_attr_wrapped_model(model, "set_input_tensor")(input_tensor)
        output_tensor, loss_func = self.forward_step_func(self.data_iterators[chunk], model)
        if not self.is_last_virtual(chunk):
            return output_tensor
        return _loss_for_backward(loss_func(output_tensor), self.num_microbatches,
                                  self.per_token, self.forward_only, self.losses)

    def backward(self, chunk: int, input_tensor: Optional[torch.Tensor],
                 output_tensor: torch.Tensor,
                 output_tensor_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward of one micro-batch through ``chunk``; returns the gradient of its input."""
        self._select(chunk)
        self.backwards_done[chunk] += 1
        if self.backwards_done[chunk] == self.num_microbatches:
            last_of_step = sum(self.backwards_done) == self.num_microbatches * len(self.chunks)
            self.grad_sync.enable(chunk, last_of_step)
        if output_tensor_grad is None:
            if self.grad_scale_func is not None:
                output_tensor = self.grad_scale_func(output_tensor)
            torch.autograd.backward(output_tensor)
        else:
            custom_backward(output_tensor, output_tensor_grad)
        return None if input_tensor is None else input_tensor.grad


def _as_list(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} model chunks")
        return list(value)
    return [value] * n


def _make_run(forward_step_func, data_iterator, model, num_microbatches, forward_only,
              grad_scale_func, no_sync_func, communicator, tensor_shape,
              set_virtual_pp_rank, per_token: bool, loss_stage_tensor_shape=None,
              mtp_stage: Optional[int] = None) -> _Run:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if communicator is None or tensor_shape is None:
        raise ValueError("pipeline schedules need communicator=<P2PCommunicator> and "
                         "tensor_shape=(seq, micro batch, hidden) of the stage activations")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    return _Run(forward_step_func=forward_step_func,
                data_iterators=_as_list(data_iterator, len(chunks), "data_iterator"),
                chunks=chunks, num_microbatches=num_microbatches, forward_only=forward_only,
                grad_scale_func=grad_scale_func, comm=communicator,
                tensor_shape=tuple(tensor_shape),
                grad_sync=_GradSync(no_sync_func, len(chunks)),
                set_virtual_pp_rank=set_virtual_pp_rank, per_token=per_token,
                loss_stage_tensor_shape=(None if loss_stage_tensor_shape is None
                                         else tuple(loss_stage_tensor_shape)),
                mtp_stage=mtp_stage)


# ---------------------------------------------------------------------- 1F1B

def _one_f_one_b_warmup(run: _Run, num_warmup: int, inputs: list, outputs: list) -> None:
    """Forwards only: receive, compute, send; keep what backward will need."""
    for _ in range(num_warmup):
        input_tensor = run.comm.recv_forward(run.boundary_shape(False))
        output_tensor = run.forward(0, input_tensor)
        run.comm.send_forward(output_tensor, run.boundary_shape(True))
        if not run.forward_only:
            inputs.append(input_tensor)
            outputs.append(output_tensor)
            deallocate_output_tensor(output_tensor if not run.comm.is_last_stage else None)


def _one_f_one_b_steady(run: _Run, num_steady: int, inputs: list, outputs: list) -> None:
    """One forward, then the backward of the oldest micro-batch in flight, ``num_steady`` times."""
    comm, prev_shape, next_shape = run.comm, run.boundary_shape(False), run.boundary_shape(True)
    input_tensor = comm.recv_forward(prev_shape) if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output_tensor = run.forward(0, input_tensor)
        if run.forward_only:
            comm.send_forward(output_tensor, next_shape)
            if not last:
                input_tensor = comm.recv_forward(prev_shape)
            continue
        output_tensor_grad = comm.send_forward_recv_backward(output_tensor, next_shape)
        inputs.append(input_tensor)
        outputs.append(output_tensor)
        deallocate_output_tensor(output_tensor if not comm.is_last_stage else None)
        input_tensor, output_tensor = inputs.pop(0), outputs.pop(0)
        input_tensor_grad = run.backward(0, input_tensor, output_tensor, output_tensor_grad)
        if last:
            comm.send_backward(input_tensor_grad, prev_shape)
            input_tensor = None
        else:
            input_tensor = comm.send_backward_recv_forward(input_tensor_grad, prev_shape)


def _one_f_one_b_cooldown(run: _Run, num_warmup: int, inputs: list, outputs: list) -> None:
    """The backwards of the micro-batches still in flight."""
    if run.forward_only:
        return
    for _ in range(num_warmup):
        input_tensor, output_tensor = inputs.pop(0), outputs.pop(0)
        output_tensor_grad = run.comm.recv_backward(run.boundary_shape(True))
        input_tensor_grad = run.backward(0, input_tensor, output_tensor, output_tensor_grad)
        run.comm.send_backward(input_tensor_grad, run.boundary_shape(False))


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator, model: ModelArg, num_microbatches: int,
        forward_only: bool = False, grad_scale_func: Optional[Callable] = None,
        no_sync_func: NoSyncArg = None, communicator: Optional[P2PCommunicator] = None,
        tensor_shape: Optional[Sequence[int]] = None,
        set_virtual_pp_rank: Optional[Callable[[int], None]] = None,
        calculate_per_token_loss: bool = False,
        loss_stage_tensor_shape: Optional[Sequence[int]] = None,
        mtp_stage: Optional[int] = None) -> MicroBatchLosses:
    """1F1B over the stages of ``communicator``'s pipeline (one model chunk per rank).

    Args:
        forward_step_func: ``(data_iterator, model) -> (output, loss_func)``.
        data_iterator: this stage's micro-batches (may be None where the stage reads nothing).
        model: this stage's model (or a one-element list), wrapped for data parallelism or not.
        num_microbatches: micro-batches in the step.
        forward_only: evaluation: no backward, nothing kept.
        grad_scale_func: the loss scaler (fp16), applied to the loss before backward.
        no_sync_func: the model's ``no_sync`` context; left just before the last backward.
        communicator: this rank's :class:`P2PCommunicator`.
        tensor_shape: ``(s, b, h)`` of the activations between stages (``s/tp`` with sequence
            parallelism).
        set_virtual_pp_rank: accepted for a uniform signature; called with 0.
        calculate_per_token_loss: a loss function's summed loss is not divided by its token
            count nor by the number of micro-batches (``--calculate-per-token-loss``).
        loss_stage_tensor_shape: the shape of the messages into the last stage when it is not
            ``tensor_shape`` (a standalone MTP stage sends ``[(1+K)s, b, h]``); None: the same.
        mtp_stage: with ``loss_stage_tensor_shape``, the stage (in running order) that sends
            it; the stages between it and the last pass it on. None: the stage before the last.

    Returns:
        The logged values of each micro-batch on the last stage; an empty list elsewhere.
    """
    run = _make_run(forward_step_func, data_iterator, model, num_microbatches, forward_only,
                    grad_scale_func, no_sync_func, communicator, tensor_shape,
                    set_virtual_pp_rank, calculate_per_token_loss, loss_stage_tensor_shape,
                    mtp_stage)
    if len(run.chunks) != 1:
        raise ValueError("1F1B takes one model chunk per rank; use the interleaved schedule "
                         f"for {len(run.chunks)} chunks")
    num_warmup = min(communicator.pp_size - communicator.pp_rank - 1, num_microbatches)
    inputs: list = []
    outputs: list = []
    with run.grad_sync:
        _one_f_one_b_warmup(run, num_warmup, inputs, outputs)
        _one_f_one_b_steady(run, num_microbatches - num_warmup, inputs, outputs)
        _one_f_one_b_cooldown(run, num_warmup, inputs, outputs)
    return run.losses


# ---------------------------------------------------------------------- interleaved

def get_schedule_table(num_microbatches: int, vp_size: int,
                       group_size: int) -> List[Tuple[int, int]]:
    """``(micro-batch, chunk)`` of each forward of a stage, in order (Megatron's schedule table).

    The micro-batches are cut into groups of ``group_size``
    (``--microbatch-group-size-per-virtual-pipeline-stage``); each group goes through chunk 0,
    then chunk 1, ... before the next group starts; the last group may be shorter. For
    ``m = 5``, ``v = 2``, ``group_size = 3``::

        forward k    0 1 2 3 4 5 6 7 8 9
        micro-batch  0 1 2 0 1 2 3 4 3 4
        chunk        0 0 0 1 1 1 0 0 1 1

    The ``k``-th backward runs the same micro-batch on chunk ``v - 1 - chunk``.
    """
    bounds = list(range(0, num_microbatches, group_size)) + [num_microbatches]
    return [(mb, chunk) for first, stop in zip(bounds, bounds[1:])
            for chunk in range(vp_size) for mb in range(first, stop)]


def check_microbatch_group_size(group_size: int, pp_size: int, num_microbatches: int) -> None:
    """Megatron's limits on the group size: ``p <= group_size <= m``, and the micro-batches left
    over after whole groups (``m mod group_size``) either none or at least ``p``, since fewer
    would leave stages waiting on each other."""
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(
            f"{flag} ({group_size}) must lie between --pipeline-model-parallel-size ({pp_size}) "
            f"and the number of micro-batches ({num_microbatches})")
    tail = num_microbatches % group_size
    if 0 < tail < pp_size:
        raise ValueError(
            f"the number of micro-batches ({num_microbatches}) leaves {tail} after whole groups "
            f"of {flag} ({group_size}); that remainder must be 0 or at least "
            f"--pipeline-model-parallel-size ({pp_size})")


def interleaved_num_warmup(pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int,
                           forward_only: bool = False, group_size: Optional[int] = None) -> int:
    """Forwards a stage runs before its first backward under the interleaved schedule
    (``group_size``: micro-batches per chunk group, ``pp_size`` when None)."""
    total = num_microbatches * vp_size
    if forward_only or num_microbatches == pp_size:
        return total
    group_size = pp_size if group_size is None else group_size
    return min((pp_size - pp_rank - 1) * 2 + (vp_size - 1) * group_size, total)


@dataclass
class _InterleavedState:
    """Per-chunk queues (received inputs, outputs kept for backward, received gradients), the
    schedule table and how many inputs of each chunk were already released."""

    input_tensors: List[list]
    output_tensors: List[list]
    output_tensor_grads: List[list]
    table: List[Tuple[int, int]] = field(default_factory=list)
    released: List[int] = field(default_factory=list)

    def chunk(self, k: int, forward: bool) -> int:
        """The chunk of the ``k``-th forward or backward (``k`` taken modulo the step)."""
        chunk = self.table[k % len(self.table)][1]
        return chunk if forward else len(self.input_tensors) - 1 - chunk


def _interleaved_state(vp_size: int, table: List[Tuple[int, int]]) -> _InterleavedState:
    return _InterleavedState([[] for _ in range(vp_size)], [[] for _ in range(vp_size)],
                             [[] for _ in range(vp_size)], table, [0] * vp_size)


def _interleaved_forward(run: _Run, st: _InterleavedState, k: int) -> torch.Tensor:
    mb, chunk = st.table[k]
    if run.is_first_virtual(chunk) and len(st.input_tensors[chunk]) == len(
            st.output_tensors[chunk]):
        st.input_tensors[chunk].append(None)
    # With groups larger than p, the first stage receives inputs of a chunk ahead of use.
    output_tensor = run.forward(chunk, st.input_tensors[chunk][mb - st.released[chunk]])
    st.output_tensors[chunk].append(output_tensor)
    if run.forward_only:
        st.input_tensors[chunk].pop(0)
        st.released[chunk] += 1
        st.output_tensors[chunk].pop()
    return output_tensor


def _interleaved_backward(run: _Run, st: _InterleavedState, k: int) -> Optional[torch.Tensor]:
    chunk = st.chunk(k, False)
    if run.is_last_virtual(chunk) and not st.output_tensor_grads[chunk]:
        st.output_tensor_grads[chunk].append(None)
    input_tensor = st.input_tensors[chunk].pop(0)
    st.released[chunk] += 1
    output_tensor = st.output_tensors[chunk].pop(0)
    output_tensor_grad = st.output_tensor_grads[chunk].pop(0)
    return run.backward(chunk, input_tensor, output_tensor, output_tensor_grad)


def _interleaved_recv_chunk(run: _Run, st: _InterleavedState, k: int,
                            forward: bool) -> Tuple[bool, int]:
    """Whether a tensor arrives after the ``k``-th forward (backward), and for which chunk.

    On the first stage the next input of chunk ``c > 0`` is the output of the last stage's chunk
    ``c - 1`` for the forward ``p - 1`` steps back; on the last stage the next gradient of chunk
    ``c < v - 1`` is the first stage's input gradient of chunk ``c + 1``, likewise. Elsewhere it
    belongs to the next forward (backward).
    """
    p, v = run.comm.pp_size, len(run.chunks)
    leading = run.comm.is_first_stage if forward else run.comm.is_last_stage
    if not leading:
        return True, st.chunk(k + 1, forward)
    if k < p - 1:
        return False, st.chunk(k + 1, forward)
    chunk = st.chunk(k - (p - 1), forward)
    if chunk == (v - 1 if forward else 0):
        return False, chunk
    return True, chunk + 1 if forward else chunk - 1


def _interleaved_warmup(run: _Run, st: _InterleavedState, num_warmup: int,
                        all_warmup: bool) -> None:
    """Forwards through the chunks; the last one also receives the first gradient."""
    comm = run.comm
    v = len(run.chunks)
    total = len(st.table)
    st.input_tensors[0].append(comm.recv_forward(run.input_shape(0)))
    for k in range(num_warmup):
        chunk = st.chunk(k, True)
        output_tensor = _interleaved_forward(run, st, k)
        recv_prev, next_chunk = _interleaved_recv_chunk(run, st, k, True)
        recv_prev = recv_prev and k != total - 1
        to_send = None if run.is_last_virtual(chunk) else output_tensor
        if k == num_warmup - 1 and not run.forward_only and not all_warmup:
            input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                to_send, None, recv_prev, not comm.is_last_stage,
                run.shapes(send=chunk, recv=next_chunk, recv_grad=v - 1))
            st.output_tensor_grads[v - 1].append(output_tensor_grad)
        else:
            input_tensor = comm.send_forward_recv_forward(
                to_send, recv_prev, run.shapes(send=chunk, recv=next_chunk))
        if recv_prev:
            st.input_tensors[next_chunk].append(input_tensor)
        if not run.forward_only:
            deallocate_output_tensor(to_send)


def _interleaved_steady(run: _Run, st: _InterleavedState, num_warmup: int,
                        num_steady: int) -> None:
    """One forward and one backward per step, then one exchange in all four directions."""
    for i in range(num_steady):
        forward_k, backward_k = i + num_warmup, i
        output_tensor = _interleaved_forward(run, st, forward_k)
        input_tensor_grad = _interleaved_backward(run, st, backward_k)
        forward_chunk, backward_chunk = st.chunk(forward_k, True), st.chunk(backward_k, False)
        if run.is_last_virtual(forward_chunk):
            output_tensor = None
        if run.is_first_virtual(backward_chunk):
            input_tensor_grad = None
        recv_prev, next_forward = _interleaved_recv_chunk(run, st, forward_k, True)
        recv_next, next_backward = _interleaved_recv_chunk(run, st, backward_k, False)
        if i == num_steady - 1:
            recv_prev = False
        input_tensor, output_tensor_grad = run.comm.send_forward_backward_recv_forward_backward(
            output_tensor, input_tensor_grad, recv_prev, recv_next,
            run.shapes(forward_chunk, backward_chunk, next_forward, next_backward))
        deallocate_output_tensor(output_tensor)
        if recv_prev:
            st.input_tensors[next_forward].append(input_tensor)
        if recv_next:
            st.output_tensor_grads[next_backward].append(output_tensor_grad)


def _interleaved_cooldown(run: _Run, st: _InterleavedState, num_steady: int,
                          all_warmup: bool) -> None:
    """The remaining backwards, passing gradients back through the chunks."""
    if run.forward_only:
        return
    comm = run.comm
    v = len(run.chunks)
    total = len(st.table)
    if all_warmup:
        st.output_tensor_grads[v - 1].append(comm.recv_backward(run.output_shape(v - 1)))
    for k in range(num_steady, total):
        input_tensor_grad = _interleaved_backward(run, st, k)
        recv_next, next_chunk = _interleaved_recv_chunk(run, st, k, False)
        recv_next = recv_next and k != total - 1
        output_tensor_grad = comm.send_backward_recv_backward(
            input_tensor_grad, recv_next,
            run.shapes(send_grad=st.chunk(k, False), recv_grad=next_chunk))
        if recv_next:
            st.output_tensor_grads[next_chunk].append(output_tensor_grad)


def _group_size(group_size: Optional[int], pp_size: int, num_microbatches: int) -> int:
    if group_size is None:
        if num_microbatches % pp_size != 0:
            raise ValueError(
                f"the interleaved pipeline schedule needs the number of micro-batches "
                f"(--global-batch-size / (--micro-batch-size x data-parallel size) = "
                f"{num_microbatches}) to be a multiple of --pipeline-model-parallel-size "
                f"({pp_size}), or --microbatch-group-size-per-virtual-pipeline-stage")
        return pp_size
    check_microbatch_group_size(group_size, pp_size, num_microbatches)
    return group_size


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model: Sequence[torch.nn.Module],
        num_microbatches: int, forward_only: bool = False,
        grad_scale_func: Optional[Callable] = None, no_sync_func: NoSyncArg = None,
        communicator: Optional[P2PCommunicator] = None,
        tensor_shape: Optional[Sequence[int]] = None,
        set_virtual_pp_rank: Optional[Callable[[int], None]] = None,
        calculate_per_token_loss: bool = False,
        microbatch_group_size_per_vp_stage: Optional[int] = None,
        loss_stage_tensor_shape: Optional[Sequence[int]] = None,
        mtp_stage: Optional[int] = None) -> MicroBatchLosses:
    """The interleaved 1F1B schedule over ``len(model)`` chunks per rank.

    Args are those of :func:`forward_backward_pipelining_without_interleaving`, except:
        data_iterator: one iterator per chunk (or one shared by all).
        model: the chunks of this rank, chunk ``c`` being virtual stage ``c * p + pp_rank``.
        no_sync_func: one ``no_sync`` per chunk (each left before its chunk's last backward), or
            one callable for all.
        set_virtual_pp_rank: called with the chunk index before each forward and backward, so
            the forward step function can ask the parallel state which virtual stage it is on.
        microbatch_group_size_per_vp_stage: micro-batches each chunk runs before the next chunk
            starts (:func:`get_schedule_table`); None: the pipeline size.
        loss_stage_tensor_shape: the shape of the messages into the last virtual stage (the
            last chunk of the last rank) when it is not ``tensor_shape`` (a standalone MTP
            stage sends ``[(1+K)s, b, h]``); None: the same.
        mtp_stage: the virtual stage that sends it (None: the one before the last); the
            (empty) virtual stages between it and the last pass it on.
    """
    run = _make_run(forward_step_func, data_iterator, model, num_microbatches, forward_only,
                    grad_scale_func, no_sync_func, communicator, tensor_shape,
                    set_virtual_pp_rank, calculate_per_token_loss, loss_stage_tensor_shape,
                    mtp_stage)
    p, v, m = communicator.pp_size, len(run.chunks), num_microbatches
    group_size = _group_size(microbatch_group_size_per_vp_stage, p, m)
    num_warmup = interleaved_num_warmup(p, communicator.pp_rank, m, v, forward_only, group_size)
    all_warmup = num_warmup >= m * v and not forward_only
    st = _interleaved_state(v, get_schedule_table(m, v, group_size))
    try:
        with run.grad_sync:
            _interleaved_warmup(run, st, num_warmup, all_warmup)
            _interleaved_steady(run, st, num_warmup, m * v - num_warmup)
            _interleaved_cooldown(run, st, m * v - num_warmup, all_warmup)
    finally:
        if set_virtual_pp_rank is not None:
            set_virtual_pp_rank(0)
    return run.losses


# ---------------------------------------------------------------------- order and choice

def pipeline_order(pp_size: int, pp_rank: int, num_microbatches: int,
                   vp_size: Optional[int] = None, forward_only: bool = False,
                   group_size: Optional[int] = None) -> List[Tuple[str, int, int]]:
    """``("F" | "B", chunk, micro-batch)`` in the order the schedule runs them on ``pp_rank``
    (``group_size``: --microbatch-group-size-per-virtual-pipeline-stage, with ``vp_size``)."""
    m = num_microbatches
    if pp_size == 1:
        kinds = "F" if forward_only else "FB"
        return [(kind, 0, i) for i in range(m) for kind in kinds]
    v = vp_size or 1
    table = ([(i, 0) for i in range(m)] if vp_size is None else
             get_schedule_table(m, v, _group_size(group_size, pp_size, m)))
    if forward_only:
        num_warmup = m * v
    elif vp_size is None:
        num_warmup = min(pp_size - pp_rank - 1, m)
    else:
        num_warmup = interleaved_num_warmup(pp_size, pp_rank, m, v, group_size=group_size)
    steps = [("F", k) for k in range(num_warmup)]
    for i in range(m * v - num_warmup):
        steps += [("F", num_warmup + i), ("B", i)]
    steps += [("B", k) for k in range(m * v - num_warmup, m * v)]
    return [(kind, table[k][1] if kind == "F" else v - 1 - table[k][1], table[k][0])
            for kind, k in steps]


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None):
    """The schedule for this layout."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size is not None:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

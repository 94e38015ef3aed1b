"""Send activations forward and gradients backward between neighbouring pipeline stages.

Every message has a shape both sides know in advance (``[s, b, h]``, or ``[s/tp, b, h]`` with
sequence parallelism) and the communicator's dtype, so no shape is ever exchanged: the receiver
allocates its buffer and posts the receive straight away.

The stages of one pipeline form a ring over ``pp_group``: ``next_rank`` of the last stage is the
first stage and ``prev_rank`` of the first stage is the last. Plain 1F1B never uses the wrap-around
(the ``recv_forward`` / ``send_backward`` family does nothing on the first stage and the
``send_forward`` / ``recv_backward`` family nothing on the last); the interleaved schedule does,
since the first stage's chunk ``v`` takes its input from the last stage's chunk ``v - 1``.

One exchange posts all of its sends and receives at once and then waits for all of them, so two
neighbours that both send and receive in the same step cannot deadlock. Posting order, the same
on every rank::

    send to next (activation), receive from prev (activation),
    send to prev (gradient),   receive from next (gradient)

With two stages ``next == prev``; a rank sending both an activation and a gradient to its peer then
sends them in the order the peer receives them. Activations and gradients also travel under two
different tags (honoured by gloo), so their streams can never be confused.

Functions keep Megatron's names: ``recv_forward``, ``recv_backward``, ``send_forward``,
``send_backward``, ``send_forward_recv_backward``, ``send_backward_recv_forward`` (1F1B) and
``send_forward_recv_forward``, ``send_backward_recv_backward``,
``send_forward_backward_recv_forward_backward`` (interleaved).
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

ACTIVATION_TAG = 0
GRADIENT_TAG = 1

Shape = Sequence[int]


class MessageShapes(NamedTuple):
    """The shape of each of the four messages of one exchange, where they differ (a standalone
    MTP stage hands the loss stage ``[(1+K)s, b, h]`` while every other boundary carries
    ``[s, b, h]``, and one interleaved exchange may cross both kinds of boundary)."""

    send_next: Shape
    send_prev: Shape
    recv_prev: Shape
    recv_next: Shape


def _message_shapes(tensor_shape: Union[Shape, MessageShapes]) -> MessageShapes:
    if isinstance(tensor_shape, MessageShapes):
        return MessageShapes(*(tuple(int(d) for d in shape) for shape in tensor_shape))
    shape = tuple(int(d) for d in tensor_shape)
    return MessageShapes(shape, shape, shape, shape)


class P2PCommunicator:
    """Pipeline point-to-point communication of one rank.

    Args:
        pp_group: the pipeline-parallel process group (``ParallelState.pp_group``).
        pp_ranks: the global ranks of ``pp_group`` in stage order (``ParallelState.pp_ranks``).
        pp_rank: this rank's stage, an index into ``pp_ranks``.
        dtype: dtype of every activation and gradient sent (the model's activation dtype).
        device: where receive buffers are allocated (CPU for gloo, the rank's GPU for NCCL).
        batch_p2p_comm: post the operations of one exchange with
            ``torch.distributed.batch_isend_irecv``; False posts them one by one with
            ``isend`` / ``irecv`` in the same order (both work on gloo and NCCL).
    """

    def __init__(self, *, pp_group, pp_ranks: Sequence[int], pp_rank: int, dtype: torch.dtype,
                 device, batch_p2p_comm: bool = True):
        if not 0 <= pp_rank < len(pp_ranks):
            raise ValueError(f"pp_rank {pp_rank} is outside the pipeline {list(pp_ranks)}")
        self.pp_group = pp_group
        self.pp_ranks = list(pp_ranks)
        self.pp_rank = pp_rank
        self.pp_size = len(self.pp_ranks)
        self.next_rank = self.pp_ranks[(pp_rank + 1) % self.pp_size]
        self.prev_rank = self.pp_ranks[(pp_rank - 1) % self.pp_size]
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_p2p_comm = batch_p2p_comm

    @classmethod
    def from_parallel_state(cls, pstate, dtype: torch.dtype, device,
                            batch_p2p_comm: bool = True) -> "P2PCommunicator":
        """The communicator of this rank's pipeline in ``pstate`` (a ``ParallelState``)."""
        return cls(pp_group=pstate.pp_group, pp_ranks=pstate.pp_ranks, pp_rank=pstate.pp_rank,
                   dtype=dtype, device=device, batch_p2p_comm=batch_p2p_comm)

    @property
    def is_first_stage(self) -> bool:
        """This rank is the first physical stage (virtual stages ignored)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank is the last physical stage (virtual stages ignored)."""
        return self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------ the one primitive

    def communicate(self, *, tensor_send_next: Optional[torch.Tensor],
                    tensor_send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
                    tensor_shape: Union[Shape, MessageShapes]
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One exchange with the neighbours; returns (tensor from prev, tensor from next).

        Args:
            tensor_send_next: activation for the next stage, or None.
            tensor_send_prev: gradient for the previous stage, or None.
            recv_prev: receive an activation from the previous stage.
            recv_next: receive a gradient from the next stage.
            tensor_shape: the shape of every message, or a :class:`MessageShapes` with each
                message's own.

        A received activation is a fresh leaf with ``requires_grad=True``, so backward fills its
        ``.grad`` with the gradient to send back.
        """
        shapes = _message_shapes(tensor_shape)
        for name, tensor, shape in (("activation", tensor_send_next, shapes.send_next),
                                    ("gradient", tensor_send_prev, shapes.send_prev)):
            if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != self.dtype):
                raise ValueError(
                    f"pipeline stage {self.pp_rank}: {name} to send has shape "
                    f"{tuple(tensor.shape)} and dtype {tensor.dtype}, but stages exchange "
                    f"{shape} {self.dtype} (seq-length, micro-batch-size, hidden-size; "
                    f"seq-length / tensor-model-parallel-size with --sequence-parallel)")
        from_prev = self._empty(shapes.recv_prev, requires_grad=True) if recv_prev else None
        from_next = self._empty(shapes.recv_next, requires_grad=False) if recv_next else None
        if (tensor_send_next is None and tensor_send_prev is None and from_prev is None
                and from_next is None):
            return None, None
        self._exchange(tensor_send_next, tensor_send_prev, from_prev, from_next)
        return from_prev, from_next

    def _empty(self, shape: Tuple[int, ...], requires_grad: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device,
                           requires_grad=requires_grad)

    def _exchange(self, send_next, send_prev, recv_prev, recv_next) -> None:
        """Post the operations in the documented order and wait for all of them."""
        plan: List[Tuple[object, torch.Tensor, int, int]] = []
        if send_next is not None:
            plan.append((dist.isend, _sendable(send_next), self.next_rank, ACTIVATION_TAG))
        if recv_prev is not None:
            plan.append((dist.irecv, recv_prev.detach(), self.prev_rank, ACTIVATION_TAG))
        if send_prev is not None:
            plan.append((dist.isend, _sendable(send_prev), self.prev_rank, GRADIENT_TAG))
        if recv_next is not None:
            plan.append((dist.irecv, recv_next, self.next_rank, GRADIENT_TAG))
        if self.batch_p2p_comm:
            requests = dist.batch_isend_irecv(
                [dist.P2POp(op, tensor, peer, self.pp_group, tag)
                 for op, tensor, peer, tag in plan])
        else:
            requests = [op(tensor, peer, group=self.pp_group, tag=tag)
                        for op, tensor, peer, tag in plan]
        for request in requests:
            request.wait()
        if self.device.type == "cuda":
            # batch_isend_irecv can race with the next kernels reading the buffers.
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ 1F1B (physical stages)

    def recv_forward(self, tensor_shape: Shape) -> Optional[torch.Tensor]:
        """The previous stage's activation (None on the first stage)."""
        if self.is_first_stage:
            return None
        return self.communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                                recv_next=False, tensor_shape=tensor_shape)[0]

    def recv_backward(self, tensor_shape: Shape) -> Optional[torch.Tensor]:
        """The next stage's gradient of this stage's output (None on the last stage)."""
        if self.is_last_stage:
            return None
        return self.communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                                recv_next=True, tensor_shape=tensor_shape)[1]

    def send_forward(self, output_tensor: Optional[torch.Tensor],
                     tensor_shape: Optional[Shape] = None) -> None:
        """Give this stage's output to the next stage (nothing on the last stage)."""
        if self.is_last_stage or output_tensor is None:
            return
        self.communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                         recv_next=False, tensor_shape=tensor_shape or output_tensor.shape)

    def send_backward(self, input_tensor_grad: Optional[torch.Tensor],
                      tensor_shape: Optional[Shape] = None) -> None:
        """Give the gradient of this stage's input to the previous stage (nothing on the first)."""
        if self.is_first_stage or input_tensor_grad is None:
            return
        self.communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                         recv_prev=False, recv_next=False,
                         tensor_shape=tensor_shape or input_tensor_grad.shape)

    def send_forward_recv_backward(self, output_tensor: Optional[torch.Tensor],
                                   tensor_shape: Shape) -> Optional[torch.Tensor]:
        """Send an output forward and receive its gradient from the next stage, in one exchange."""
        if self.is_last_stage:
            return None
        return self.communicate(tensor_send_next=output_tensor, tensor_send_prev=None,
                                recv_prev=False, recv_next=True, tensor_shape=tensor_shape)[1]

    def send_backward_recv_forward(self, input_tensor_grad: Optional[torch.Tensor],
                                   tensor_shape: Shape) -> Optional[torch.Tensor]:
        """Send a gradient back and receive the next activation from the previous stage."""
        if self.is_first_stage:
            return None
        return self.communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                recv_prev=True, recv_next=False, tensor_shape=tensor_shape)[0]

    # ------------------------------------------------------------------ interleaved (ring)

    def send_forward_recv_forward(self, output_tensor: Optional[torch.Tensor], recv_prev: bool,
                                  tensor_shape: Union[Shape, MessageShapes]) -> Optional[torch.Tensor]:
        """Send an activation to the next rank and/or receive one from the previous rank."""
        return self.communicate(tensor_send_next=output_tensor, tensor_send_prev=None,
                                recv_prev=recv_prev, recv_next=False,
                                tensor_shape=tensor_shape)[0]

    def send_backward_recv_backward(self, input_tensor_grad: Optional[torch.Tensor],
                                    recv_next: bool,
                                    tensor_shape: Union[Shape, MessageShapes]) -> Optional[torch.Tensor]:
        """Send a gradient to the previous rank and/or receive one from the next rank."""
        return self.communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                recv_prev=False, recv_next=recv_next,
                                tensor_shape=tensor_shape)[1]

    def send_forward_backward_recv_forward_backward(
            self, output_tensor: Optional[torch.Tensor],
            input_tensor_grad: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
            tensor_shape: Union[Shape, MessageShapes]
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """All four directions in one exchange; returns (activation in, gradient in)."""
        return self.communicate(tensor_send_next=output_tensor,
                                tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
                                recv_next=recv_next, tensor_shape=tensor_shape)


def _sendable(tensor: torch.Tensor) -> torch.Tensor:
    """The data of ``tensor`` as a contiguous tensor outside autograd."""
    return tensor.detach().contiguous()

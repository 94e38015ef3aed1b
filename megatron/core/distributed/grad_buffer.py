"""One contiguous gradient buffer per gradient dtype, cut into buckets that are reduced as units.

Every trainable parameter ``p`` gets ``p.main_grad``: a view of a slice of :attr:`GradBuffer.data`.
Parameters are laid out in the order they are given (the DDP wrapper passes them in reverse
``module.parameters()`` order, roughly the order backward produces their gradients), back to back,
and the buffer is cut into buckets without ever splitting a parameter::

    params (given order):  p3 (6)     p2 (4)     p1 (8)      p0 (3)
    buffer:               [0 ......6 ......10 ...........18 ....21 pad 22]   dp_size = 2
    bucket_size = 10:     |---- bucket 0 -----|---- bucket 1 --------------|

A bucket closes as soon as it holds at least ``bucket_size`` elements. The buffer's length is
rounded up to a multiple of the data-parallel size (the padding belongs to the last bucket), and
with ``use_distributed_optimizer`` every bucket's length is, so that a distributed optimizer can
give each data-parallel rank an equal contiguous shard of each bucket.

A bucket's reduction is one all-reduce over the data-parallel group of its whole slice. With
``use_distributed_optimizer`` it is a reduce-scatter instead: data-parallel rank ``r`` of ``D``
receives the average of slice ``[r*n/D, (r+1)*n/D)`` of the bucket (its shard, the only part its
optimizer reads) while the rest of its copy keeps its own, unreduced values. That mode also gives
each parameter marked ``shared_embedding`` (a word embedding tied across pipeline stages) a bucket
of its own, so the first and last stage shard it identically and the embedding all-reduce that
follows the data-parallel reduction adds matching, reduced slices.

Half-precision buffers (``--grad-reduce-in-bf16``, or fp16 parameters without
``--accumulate-allreduce-grads-in-fp32``) have two refinements. A parameter listed in
``fp32_local_params`` gets ``main_grad`` as an fp32 tensor of its own: micro-batches accumulate
there, the sum is rounded into its slice of the buffer just before the bucket's reduction, and the
reduced slice is copied back afterwards (the slice stays at ``main_grad_copy_in_grad_buffer``).
``reduce_scatter_with_fp32_accumulation`` makes the distributed optimizer's reduce-scatter an
all-to-all in the buffer's dtype after which each rank sums the dp-size pieces of its shard in
fp32 and rounds once, instead of the backend rounding every partial sum.

Buckets are always launched in index order, on every rank, whatever order their gradients complete
in: collectives on one group must be issued in the same order on all ranks, and this makes that
hold even if backward visited parameters in a different order on different ranks.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import collectives


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter and each bucket lives in a buffer (element offsets, end exclusive)."""

    param_ranges: List[Tuple[int, int]]
    bucket_ranges: List[Tuple[int, int]]
    bucket_params: List[List[int]]  # for each bucket, indices into the given parameter order
    numel: int  # padded length of the buffer
    numel_unpadded: int  # elements that belong to parameters


def compute_buffer_layout(numels: Sequence[int], bucket_size: Optional[int], dp_size: int,
                          pad_buckets: bool = False,
                          own_bucket: Sequence[int] = ()) -> BufferLayout:
    """Lay parameters of the given sizes back to back and cut the result into buckets.

    Args:
        numels: number of elements of each parameter, in buffer order.
        bucket_size: a bucket closes once it holds at least this many elements; None means one
            bucket for everything.
        dp_size: data-parallel size; the buffer length is rounded up to a multiple of it.
        pad_buckets: also round every bucket's length up to a multiple of ``dp_size`` (needed by a
            distributed optimizer, which shards each bucket evenly over data-parallel ranks).
        own_bucket: indices of parameters that get a bucket to themselves (the bucket open
            before one is closed first).
    """
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size (--ddp-bucket-size) must be >= 1 element, got {bucket_size}")
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    param_ranges: List[Tuple[int, int]] = []
    bucket_ranges: List[Tuple[int, int]] = []
    bucket_params: List[List[int]] = []
    offset = bucket_start = 0
    current: List[int] = []
    alone = set(own_bucket)

    def close_bucket() -> None:
        nonlocal offset, bucket_start, current
        end = _round_up(offset, dp_size) if pad_buckets else offset
        bucket_ranges.append((bucket_start, end))
        bucket_params.append(current)
        offset = bucket_start = end
        current = []

    for index, numel in enumerate(numels):
        if index in alone and current:
            close_bucket()
        param_ranges.append((offset, offset + numel))
        offset += numel
        current.append(index)
        if index in alone or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close_bucket()
    total = _round_up(offset, dp_size)
    if current:
        bucket_ranges.append((bucket_start, total))
        bucket_params.append(current)
    elif bucket_ranges and bucket_ranges[-1][1] != total:
        bucket_ranges[-1] = (bucket_ranges[-1][0], total)
    return BufferLayout(param_ranges, bucket_ranges, bucket_params, total, sum(numels))


def _reduce_scatter(shard: torch.Tensor, data: torch.Tensor, group, async_op: bool):
    """Reduce-scatter ``data`` over ``group`` into ``shard`` (this rank's slice of ``data``
    itself: every backend we run on reduces in place); returns a handle when asynchronous.

    The asynchronous form calls the backend's op directly; a backend without it falls back to the
    synchronous wrapper of :mod:`megatron.core.collectives`.
    """
    if async_op:
        native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            return native(shard, data, group=group, async_op=True)
        except (RuntimeError, NotImplementedError) as err:
            if "support" not in str(err).lower() and not isinstance(err, NotImplementedError):
                raise
    collectives.reduce_scatter_tensor(shard, data, group)
    return None


class _Fp32AccumulatedReduceScatter:
    """A reduce-scatter done as an all-to-all plus a local fp32 sum; ``wait()`` completes it.

    After the all-to-all, ``received`` holds ``[dp size, shard numel]``: row ``i`` is rank
    ``i``'s copy of this rank's shard, in the buffer's dtype. Their fp32 sum, rounded once to the
    buffer's dtype, is written into ``shard``.
    """

    def __init__(self, shard: torch.Tensor, data: torch.Tensor, group, async_op: bool):
        self.shard = shard
        self.received = torch.empty_like(data)  # [dp size * shard numel]
        self.handle = dist.all_to_all_single(self.received, data, group=group, async_op=async_op)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        pieces = self.received.view(-1, self.shard.numel())      # [dp size, shard numel]
        self.shard.copy_(pieces.sum(dim=0, dtype=torch.float32))


def _reduce_scatter_fp32_accumulated(shard: torch.Tensor, data: torch.Tensor, group,
                                     async_op: bool):
    """Like :func:`_reduce_scatter`, summing in fp32 whatever the buffer's dtype; returns the
    handle to wait on when asynchronous."""
    work = _Fp32AccumulatedReduceScatter(shard, data, group, async_op)
    if async_op:
        return work
    work.wait()
    return None


class Bucket:
    """Parameters whose gradients are reduced together, and the slice of the buffer they share.

    Args:
        index: position of this bucket in its buffer (launch order).
        params: the parameters whose ``main_grad`` lies in ``data``.
        data: 1-D view of the buffer, ``[bucket numel]``.
        offset: start of ``data`` within the buffer, in elements.
        dp_group: data-parallel process group the reduction runs over.
        overlap_grad_reduce: launch the reduction asynchronously (``async_op=True``).
        use_distributed_optimizer: reduce-scatter (each rank gets only its shard averaged)
            instead of all-reduce; ``data`` must then hold a multiple of the dp size.
        average_over: the sum over ``dp_group`` is divided by this (default: its size). Expert
            gradients are summed over the expert-data-parallel group but averaged over the
            data x context-parallel ranks, whose losses they carry.
        fp32_accumulation: with ``use_distributed_optimizer``, sum the shards in fp32
            (:func:`_reduce_scatter_fp32_accumulated`).
        fp32_main_grads: ``(fp32 main_grad, its slice of data)`` of the parameters that
            accumulate locally in fp32: copied in before the reduction, back after it.
    """

    def __init__(self, index: int, params: List[torch.nn.Parameter], data: torch.Tensor,
                 offset: int, dp_group, overlap_grad_reduce: bool,
                 use_distributed_optimizer: bool = False, average_over: Optional[int] = None,
                 fp32_accumulation: bool = False,
                 fp32_main_grads: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()):
        self.index = index
        self.params = list(params)
        self.data = data
        self.offset = offset
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.average_over = self.dp_size if average_over is None else average_over
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.fp32_accumulation = fp32_accumulation
        self.fp32_main_grads = list(fp32_main_grads)
        if use_distributed_optimizer and data.numel() % self.dp_size != 0:
            raise ValueError(f"bucket {index} holds {data.numel()} elements, not a multiple of the "
                             f"data-parallel size {self.dp_size}; a distributed optimizer cannot "
                             "shard it")
        self.params_with_grad = set()
        self.communication_handle = None
        self.communication_issued = False

    def reset(self) -> None:
        """Forget which gradients arrived and the last reduction, ready for the next step."""
        self.params_with_grad = set()
        self.communication_handle = None
        self.communication_issued = False

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        self.params_with_grad.add(param)

    def is_ready(self) -> bool:
        """Whether every parameter's last-micro-batch gradient is in the buffer."""
        return len(self.params_with_grad) == len(self.params)

    def shard_range(self, dp_rank: Optional[int] = None) -> Tuple[int, int]:
        """``(start, end)`` within this bucket of data-parallel rank ``dp_rank``'s shard
        (default: this rank's); the bucket is cut into dp-size equal, contiguous shards."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        size = self.data.numel() // self.dp_size
        return rank * size, (rank + 1) * size

    def start_grad_sync(self) -> None:
        """Average this bucket over the data-parallel group: divide by dp size, then all-reduce
        (or reduce-scatter into this rank's shard, with ``use_distributed_optimizer``).

        Dividing before the sum (pre-divide) keeps every partial sum within the range of a single
        rank's gradient, so a reduction in fp16 or bf16 cannot overflow however many ranks take
        part; gloo has no ``ReduceOp.AVG`` to do it for us. For a power-of-two dp size the division
        is exact, so pre- and post-dividing give the same bits there.
        """
        if self.communication_issued:
            return
        self.communication_issued = True
        for main_grad, in_buffer in self.fp32_main_grads:
            in_buffer.copy_(main_grad)
        if self.average_over != 1:
            self.data.div_(self.average_over)
        if self.dp_size == 1:
            return
        if self.use_distributed_optimizer:
            start, end = self.shard_range()
            reduce_scatter = (_reduce_scatter_fp32_accumulated if self.fp32_accumulation
                              else _reduce_scatter)
            self.communication_handle = reduce_scatter(
                self.data[start:end], self.data, self.dp_group, self.overlap_grad_reduce)
        else:
            self.communication_handle = dist.all_reduce(
                self.data, group=self.dp_group, async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Make sure the reduction was issued and has completed."""
        self.start_grad_sync()
        if self.communication_handle is not None:
            self.communication_handle.wait()
            self.communication_handle = None
        for main_grad, in_buffer in self.fp32_main_grads:
            main_grad.copy_(in_buffer)


class GradBuffer:
    """A contiguous gradient buffer for parameters of one gradient dtype, and its buckets.

    Args:
        params: trainable parameters, in the order to lay them out (reverse model order).
        dtype: dtype of the buffer (``main_grad``).
        dp_group: data-parallel process group.
        bucket_size: elements per bucket (a bucket closes once it holds at least this many);
            None for one bucket.
        overlap_grad_reduce: start each bucket's all-reduce asynchronously as soon as all its
            gradients of the last micro-batch are in; otherwise reduce in ``finish_grad_sync``.
        use_distributed_optimizer: pad every bucket to a multiple of the dp size and
            reduce-scatter it, so a distributed optimizer finds its shard of each bucket averaged
            (the rest of this rank's buffer is left unreduced); parameters marked
            ``shared_embedding`` get a bucket each.
        average_over: what each bucket's sum is divided by (default: the dp group's size);
            see :class:`Bucket`.
        fp32_accumulation: with ``use_distributed_optimizer``, each bucket's reduce-scatter
            sums in fp32 (``--ddp-reduce-scatter-with-fp32-accumulation``).
        fp32_local_params: parameters whose ``main_grad`` is an fp32 tensor of their own when
            ``dtype`` is not fp32 (``--ddp-param-name-patterns-for-fp32-local-accumulation``).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype, dp_group,
                 bucket_size: Optional[int], overlap_grad_reduce: bool,
                 use_distributed_optimizer: bool = False, average_over: Optional[int] = None,
                 fp32_accumulation: bool = False,
                 fp32_local_params: Sequence[torch.nn.Parameter] = ()):
        self.params = list(params)
        if not self.params:
            raise ValueError("a GradBuffer needs at least one parameter")
        if dp_group is None:
            raise ValueError("a GradBuffer needs the process group its buckets are reduced "
                             "over (dp_group), got None")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"all parameters of one gradient buffer must be on one device, "
                             f"found {sorted(str(d) for d in devices)}")
        self.dtype = dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.average_over = average_over
        self.is_last_microbatch = True

        own_bucket = []
        if use_distributed_optimizer:
            own_bucket = [i for i, p in enumerate(self.params)
                          if getattr(p, "shared_embedding", False)]
        layout = compute_buffer_layout([p.numel() for p in self.params], bucket_size,
                                       self.dp_size, pad_buckets=use_distributed_optimizer,
                                       own_bucket=own_bucket)
        self.numel = layout.numel
        self.numel_unpadded = layout.numel_unpadded
        self.data = torch.zeros(layout.numel, dtype=dtype, device=devices.pop())  # [numel]

        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        # param -> (start, end, bucket index): what a distributed optimizer needs to shard.
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
        local = set(fp32_local_params) if dtype != torch.float32 else set()
        self.fp32_main_grads: List[torch.Tensor] = []
        for index, ((start, end), members) in enumerate(zip(layout.bucket_ranges,
                                                            layout.bucket_params)):
            pairs = []
            for i in members:
                param = self.params[i]
                p_start, p_end = layout.param_ranges[i]
                param.main_grad = self.data[p_start:p_end].view(param.shape)
                self.param_index_map[param] = (p_start, p_end, index)
                if param in local:
                    param.main_grad_copy_in_grad_buffer = param.main_grad
                    param.main_grad = torch.zeros_like(param.main_grad, dtype=torch.float32)
                    pairs.append((param.main_grad, param.main_grad_copy_in_grad_buffer))
                    self.fp32_main_grads.append(param.main_grad)
            bucket = Bucket(index, [self.params[i] for i in members], self.data[start:end],
                            start, dp_group, overlap_grad_reduce, use_distributed_optimizer,
                            average_over, fp32_accumulation, pairs)
            self.buckets.append(bucket)
            for i in members:
                self.param_to_bucket[self.params[i]] = bucket
        self._next_bucket = 0  # every bucket before this one has been launched

    def reset(self) -> None:
        """Zero the buffer (every ``main_grad``) and forget the last reduction."""
        self.data.zero_()
        for main_grad in self.fp32_main_grads:
            main_grad.zero_()
        self._reset_communication()

    def scale(self, factor: float) -> None:
        """Multiply every gradient this buffer holds by ``factor`` (after the reduction)."""
        self.data.mul_(factor)
        for main_grad in self.fp32_main_grads:
            main_grad.mul_(factor)

    def _reset_communication(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Note that ``param``'s last-micro-batch gradient is in the buffer (overlap mode).

        Launches, in index order, every bucket whose gradients are all in and whose predecessors
        have been launched.
        """
        self.param_to_bucket[param].register_grad_ready(param)
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].is_ready():
            self.buckets[self._next_bucket].start_grad_sync()
            self._next_bucket += 1

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet, in index order."""
        for bucket in self.buckets[self._next_bucket:]:
            bucket.start_grad_sync()
        self._next_bucket = len(self.buckets)

    def finish_grad_sync(self) -> None:
        """Launch what is left, wait for every bucket, and get ready for the next step."""
        self.start_grad_sync()
        for bucket in self.buckets:
            bucket.finish_grad_sync()
        self._reset_communication()

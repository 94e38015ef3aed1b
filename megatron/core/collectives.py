"""Collectives that work on every backend we run on, with explicit process groups.

Tensor- and sequence-parallel code needs two "flat tensor" collectives: all-gather into one
output tensor, and reduce-scatter from one input tensor. NCCL has both natively. gloo grew them
late: in torch 2.13 gloo runs ``all_gather_single`` (the new name of ``all_gather_into_tensor``)
and ``reduce_scatter_single`` (``reduce_scatter_tensor``), while older torch releases reject them
on gloo with a "does not support" error. So each wrapper here tries the native op once per
backend; if the backend says it is unsupported, the wrapper remembers that and from then on uses a
fallback built from ops every backend has:

- all-gather: list-based ``all_gather`` writing straight into views of the output;
- reduce-scatter: ``all_reduce`` of a copy of the input, then this rank's slice;
- all-to-all with per-rank split sizes (token dispatch of mixture-of-experts layers): one
  point-to-point send and receive per peer.

Every rank of a group shares one backend and one torch, so all ranks take the same path.
:func:`forced_fallback` makes the fallback path run on purpose (tests, or a backend that
misreports its support).

Groups: ``None`` means "no group" -- a single process, size 1, rank 0 -- so single-process code
runs without ``torch.distributed``. It never silently means the world group.
"""

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# (backend name, op name) -> whether the native op worked; filled on first use.
_NATIVE_WORKS: Dict[Tuple[str, str], bool] = {}
_FORCE_FALLBACK = False


def get_group_size(group) -> int:
    """Number of ranks in ``group``; 1 when ``group`` is None."""
    if group is None:
        return 1
    return dist.get_world_size(group)


def get_group_rank(group) -> int:
    """This process's rank inside ``group``; 0 when ``group`` is None."""
    if group is None:
        return 0
    return dist.get_rank(group)


@contextlib.contextmanager
def forced_fallback():
    """Inside this block every wrapper uses its fallback path, whatever the backend supports."""
    global _FORCE_FALLBACK
    previous = _FORCE_FALLBACK
    _FORCE_FALLBACK = True
    try:
        yield
    finally:
        _FORCE_FALLBACK = previous


def _is_unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or "support" in text


def _native_op(name: str):
    # torch 2.13 renamed the *_tensor collectives to *_single; older releases have only the old
    # names. Look the op up at call time so either works.
    new, old = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
                "all_to_all": ("all_to_all_single", "all_to_all_single")}[name]
    return getattr(dist, new, None) or getattr(dist, old)


def _try_native(name: str, group, use_native: Optional[bool], call) -> bool:
    """Run ``call(native_op)`` if this backend can; return whether it ran."""
    if use_native is False or (use_native is None and _FORCE_FALLBACK):
        return False
    key = (dist.get_backend(group), name)
    if use_native is None and _NATIVE_WORKS.get(key) is False:
        return False
    try:
        call(_native_op(name))
    except (RuntimeError, NotImplementedError) as err:
        if use_native or not _is_unsupported(err):
            raise
        _NATIVE_WORKS[key] = False
        return False
    _NATIVE_WORKS[key] = True
    return True


def _check_shapes(what: str, big: torch.Tensor, small: torch.Tensor, world: int) -> None:
    if big.numel() != small.numel() * world:
        raise ValueError(
            f"{what}: the large tensor must hold group size ({world}) x the small one's "
            f"{small.numel()} elements, got {big.numel()} (shapes {tuple(big.shape)} and "
            f"{tuple(small.shape)})")
    if big.dtype != small.dtype:
        raise ValueError(f"{what}: dtypes differ ({big.dtype} vs {small.dtype})")


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group,
                           use_native: Optional[bool] = None) -> torch.Tensor:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (rank order).

    Args:
        output: contiguous, ``group size`` times the elements of ``input``.
        input: this rank's piece.
        group: the process group (None: a single process, so ``output`` becomes ``input``).
        use_native: True forces the backend's op, False forces the fallback, None decides.

    Returns:
        ``output``.
    """
    world = get_group_size(group)
    _check_shapes("all_gather_into_tensor", output, input, world)
    if not output.is_contiguous():
        raise ValueError("all_gather_into_tensor: the output must be contiguous")
    input = input.contiguous()
    if world == 1:
        output.view(-1).copy_(input.view(-1))
        return output
    flat_out = output.view(-1)
    if _try_native("all_gather", group, use_native,
                   lambda op: op(flat_out, input.view(-1), group=group)):
        return output
    dist.all_gather(list(flat_out.chunk(world)), input.view(-1), group=group)
    return output


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group,
                          op=dist.ReduceOp.SUM,
                          use_native: Optional[bool] = None) -> torch.Tensor:
    """Reduce ``input`` over the group and keep this rank's dim-0 slice in ``output``.

    ``input`` is split into ``group size`` equal slices along its flattened (dim-0 major) order;
    rank ``r`` receives the reduction of every rank's slice ``r``.

    Args:
        output: this rank's slice, ``1 / group size`` of ``input``'s elements.
        input: the same shape on every rank. Not modified.
        group: the process group (None: a single process, so ``output`` becomes ``input``).
        op: the reduction (sum by default).
        use_native: True forces the backend's op, False forces the fallback, None decides.

    Returns:
        ``output``.
    """
    world = get_group_size(group)
    _check_shapes("reduce_scatter_tensor", input, output, world)
    if world == 1:
        output.view(-1).copy_(input.reshape(-1))
        return output
    flat_in = input.contiguous().view(-1)
    if output.is_contiguous():
        target = output
    else:
        target = torch.empty_like(output, memory_format=torch.contiguous_format)
    if not _try_native("reduce_scatter", group, use_native,
                       lambda fn: fn(target.view(-1), flat_in, op=op, group=group)):
        reduced = flat_in.clone()
        dist.all_reduce(reduced, op=op, group=group)
        target.view(-1).copy_(reduced.chunk(world)[get_group_rank(group)])
    if target is not output:
        output.copy_(target)
    return output


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; a no-op for a group of one."""
    if get_group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None,
                      use_native: Optional[bool] = None) -> torch.Tensor:
    """Send dim-0 piece ``j`` of ``input`` to rank ``j``; piece ``i`` of ``output`` comes from
    rank ``i`` (rank order).

    Args:
        output: contiguous; ``sum(output_split_sizes)`` rows (or as many as ``input``).
        input: this rank's rows, cut into ``input_split_sizes`` pieces (equal pieces if None).
        group: the process group (None: a single process, so ``output`` becomes ``input``).
        output_split_sizes: rows received from each rank; None: equal pieces. Must match what
            each peer's ``input_split_sizes`` says it sends here; a piece may be empty.
        input_split_sizes: rows sent to each rank; None: equal pieces.
        use_native: True forces the backend's op, False forces the fallback, None decides.

    Returns:
        ``output``.
    """
    world = get_group_size(group)
    for what, sizes, tensor in (("input", input_split_sizes, input),
                                ("output", output_split_sizes, output)):
        if sizes is not None and (len(sizes) != world or sum(sizes) != tensor.size(0)):
            raise ValueError(f"all_to_all_single: {what}_split_sizes {list(sizes)} must have "
                             f"{world} entries summing to the {what}'s {tensor.size(0)} rows")
    if output.dtype != input.dtype or tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} {output.dtype} and "
                         f"input {tuple(input.shape)} {input.dtype} differ beyond dim 0")
    if not output.is_contiguous():
        raise ValueError("all_to_all_single: the output must be contiguous")
    for what, tensor in (("input", input), ("output", output)):
        sizes = input_split_sizes if what == "input" else output_split_sizes
        if sizes is None and tensor.size(0) % world:
            raise ValueError(f"all_to_all_single: without split sizes the {what}'s "
                             f"{tensor.size(0)} rows must divide into {world} equal pieces")
    input = input.contiguous()
    if world == 1:
        output.copy_(input)
        return output
    if _try_native("all_to_all", group, use_native,
                   lambda op: op(output, input, output_split_sizes, input_split_sizes,
                                 group=group)):
        return output
    _all_to_all_by_p2p(output, input, group, output_split_sizes, input_split_sizes)
    return output


def _all_to_all_by_p2p(output, input, group, output_split_sizes, input_split_sizes) -> None:
    world, rank = get_group_size(group), get_group_rank(group)
    sends = list(input.split(input_split_sizes or [input.size(0) // world] * world))
    recvs = list(output.split(output_split_sizes or [output.size(0) // world] * world))
    ops = []
    for peer in range(world):
        if peer == rank:
            recvs[peer].copy_(sends[peer])
            continue
        peer_global = dist.get_global_rank(group, peer)
        # Both ends know each piece's size (the split sizes are exchanged first), so an empty
        # piece is skipped on both sides.
        if sends[peer].numel():
            ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), peer_global, group))
        if recvs[peer].numel():
            ops.append(dist.P2POp(dist.irecv, recvs[peer], peer_global, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

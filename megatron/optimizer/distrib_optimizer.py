"""Distributed optimizer (``--use-distributed-optimizer``): optimizer state sharded over DP.

Every data-parallel (DP) rank holds the whole model, but only ``1 / dp`` of the fp32 main
parameters and optimizer state (ZeRO stage 1). The shards come from the layout of the gradient
buffers of :class:`~megatron.core.distributed.DistributedDataParallel`: each bucket of a buffer is
cut into ``dp`` equal contiguous ranges and DP rank ``r`` owns range ``r`` of every bucket (with
one bucket, the default without ``--overlap-grad-reduce``, that is buffer range
``[r*n/dp, (r+1)*n/dp)``). A parameter that straddles a boundary is split into pieces, each
optimised by the rank owning it. Example, one bucket of 12 elements on 2 ranks::

    buffer:   [ p2 (5)        | p1 (4)   | p0 (3)   ]
    rank 0:   [ p2[0:5] p1[0:1] ]                       pieces of p2 and p1
    rank 1:                     [ p1[1:4] p0[0:3] ]     pieces of p1 and p0

One step:

1. The DP wrapper reduce-scatters each bucket, so this rank's shard of the gradient buffer holds
   the gradient averaged over DP (the rest of the buffer is never read).
2. The shard's gradients become the ``.grad`` of the fp32 main pieces: views of the buffer when it
   is fp32, fp32 copies otherwise.
3. fp16: unscale and look for inf/nan; the flag is reduced over the DP group and the model-parallel
   group, since each rank sees only its shard. A step skipped anywhere is skipped everywhere.
4. Gradient norm: each rank sums the squares of its pieces, counting each parameter once across
   the model (tensor-parallel duplicates on TP rank 0 only, ``shared`` copies of a tied embedding
   never), then the sums are added over the DP group and the model-parallel group.
5. The torch optimizer steps on the pieces.
6. Updated pieces are rounded into the model's parameters and every bucket's parameters are
   all-gathered over DP, so each rank again holds the whole updated model. The model's parameters
   live in one contiguous buffer per gradient buffer, laid out like it, so the gather of a bucket
   is one collective. With ``--overlap-param-gather`` the gathers are launched asynchronously
   and each module's forward pre-hook waits only for the buckets holding its own parameters.

fp32 models keep no copy of their parameters: a main piece is a view of the model parameter's
storage. fp16/bf16 models keep fp32 main pieces.

Expert parallelism (``--expert-model-parallel-size`` > 1): the experts' gradients live in the DP
wrapper's ``expert_grad_buffers``, reduced over the expert-data-parallel group. Every buffer is
sharded over its own group (``GradBuffer.dp_group``): a dense parameter's pieces tile it over the
DP (x CP) ranks, an expert's over the expert-DP ranks, and each bucket's updated parameters are
gathered over that same group. (Where the expert-DP ranks are the DP x CP ranks, as with
``tp = 2``, ``expert_tp = 1``, ``ep = 2``, the experts stay in the dense buffers and are sharded
over DP.) The gradient norm and zero count add the dense pieces over DP, then the
model-parallel group (TP x PP); the expert pieces, counted at the expert-TP rank, over
expert-DP, then the expert model-parallel group (expert TP x EP x PP) alone: together the ranks
holding every expert shard once. With the default expert layout the experts count as dense
pieces. The inf/nan flag is a max over DP, then the model-parallel group: together every rank
of the world. With world 4, ``dp = 4`` and ``ep = 2`` (expert-DP groups ``[0, 2] [1, 3]``, EP
and expert model-parallel groups ``[0, 1] [2, 3]``), rank 1 optimises a quarter of each dense
bucket and half of each bucket of its two local experts, shared with rank 3.

Checkpoints (:meth:`DistributedOptimizer.state_dict`, a collective over the DP group): the
shards are gathered to DP rank 0 and saved unsharded, per parameter in model order, so a run with
any DP size can load them; each rank then cuts out its own pieces. With expert parallelism the
state is whole on every rank whose expert-DP rank is 0 (Megatron's writers of one file per
(TP, PP, EP) rank): the dense pieces are all-gathered over DP, the local experts' gathered over
expert-DP, and ``param_state`` holds the dense parameters and this EP rank's local experts::

    {"optimizer": {"param_groups": [{hyper-parameters..., "step": n, "params": [0, 1, ...]}]},
     "param_state": [[{"param": fp32 main, "exp_avg": ..., "exp_avg_sq": ...}, ...], ...],
     "grad_scaler": {...}}                                  (fp16 / --loss-scale only)

``param_state[g][i]`` belongs to the i-th parameter of param group ``g`` (the order of
:func:`~megatron.optimizer.builder.get_param_groups`); its tensors have the parameter's shape.
With ``--use-precision-aware-optimizer`` the torch optimizer keeps the moments narrow
(:mod:`~megatron.optimizer.precision_aware_adam`); they are read out and saved unscaled in fp32
all the same, and stored narrow again on load.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .clip_grads import (clip_grads_with_norm_fp32, get_grads_for_norm, is_expert_parallel,
                         param_counts_here)
from .config import OptimizerConfig
from .grad_scaler import MegatronGradScaler
from .optimizer import (MainValues, MegatronOptimizer, StepResult, copy_parallel_attributes,
                        in_separate_norm_group, main_value, split_by_norm_group)
from megatron.core import collectives, device
from megatron.core.config import ConfigError

logger = logging.getLogger(__name__)

# Parameter attributes that say "used outside its own module's forward": their buckets are
# gathered before the chunk's forward starts when parameter gathers overlap the forward.
_USED_OUTSIDE_OWN_MODULE = ("shared", "shared_embedding")


@dataclass
class ShardPiece:
    """The part of one model parameter that this DP rank optimises.

    Offsets are in elements: ``param_start:param_end`` within the flattened parameter, and
    ``buffer_start:buffer_end`` within its gradient buffer (and the parameter buffer laid out
    like it).
    """

    model_param: torch.nn.Parameter
    buffer_key: Tuple[int, torch.dtype, bool]  # (model chunk index, gradient dtype, expert?)
    bucket_index: int
    param_start: int
    param_end: int
    buffer_start: int
    buffer_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def _shard_pieces(buffer_key, grad_buffer, dp_rank: int) -> Dict[torch.nn.Parameter, ShardPiece]:
    """This rank's piece of every parameter of ``grad_buffer`` that intersects its shards."""
    pieces = {}
    for param, (p_start, p_end, bucket_index) in grad_buffer.param_index_map.items():
        bucket = grad_buffer.buckets[bucket_index]
        s_start, s_end = bucket.shard_range(dp_rank)
        start = max(p_start, bucket.offset + s_start)
        end = min(p_end, bucket.offset + s_end)
        if start < end:
            pieces[param] = ShardPiece(param, buffer_key, bucket_index, start - p_start,
                                       end - p_start, start, end)
    return pieces


def _check_chunk(index: int, chunk, dp_size: int) -> None:
    """The chunk must be a DP wrapper whose every bucket can be cut into as many shards as its
    buffer's group has ranks (``dp_size`` for the dense buffers)."""
    if not hasattr(chunk, "grad_buffers"):
        raise ConfigError(
            f"--use-distributed-optimizer needs every model chunk wrapped in "
            f"DistributedDataParallel (its gradient buffer defines the shards); model chunk "
            f"{index} is a {type(chunk).__name__}")
    if chunk.dp_size != dp_size:
        raise ConfigError(f"model chunk {index} is data-parallel over {chunk.dp_size} ranks, the "
                          f"optimizer's dp_group over {dp_size}")
    buffers = list(chunk.grad_buffers.values()) + list(
        getattr(chunk, "expert_grad_buffers", {}).values())
    uneven = [(b.data.numel(), buf.dp_size) for buf in buffers for b in buf.buckets
              if b.data.numel() % buf.dp_size]
    if uneven:
        raise ConfigError(
            f"--use-distributed-optimizer: model chunk {index} has gradient buckets of "
            f"(elements, group size) {uneven[:3]}, not multiples of their data-parallel "
            "group's size; build DistributedDataParallel with use_distributed_optimizer=True")
    if not chunk.use_distributed_optimizer and dp_size > 1:
        logger.warning("--use-distributed-optimizer: model chunk %d was wrapped without "
                       "use_distributed_optimizer=True, so its gradients are all-reduced in full "
                       "rather than reduce-scattered (correct, but more communication)", index)


class DistributedOptimizer(MegatronOptimizer):
    """Megatron's optimizer interface over main params and state sharded across DP ranks.

    Args:
        config: the run's :class:`OptimizerConfig`.
        model_chunks: this rank's model chunks, each a ``DistributedDataParallel``.
        param_groups: groups of model parameters with their hyper-parameters
            (:func:`~megatron.optimizer.builder.get_param_groups`).
        build_optimizer: ``groups -> torch optimizer``; called once with the same groups, their
            ``params`` replaced by this rank's fp32 main pieces (possibly none).
        grad_scaler: loss scaler (required with ``--fp16``), or None.
        dp_group: data-parallel group; None: the model chunks' own ``dp_group``.
        model_parallel_group: TP x PP group (see :class:`MegatronOptimizer`).
        tp_rank: this rank's tensor-parallel rank.
        expert_model_parallel_group: expert TP x EP x PP
            (``ParallelState.expert_model_parallel_group``), over which the expert pieces'
            share of the norm and zero count is completed after expert-DP; required (possibly
            a group of one) when the model chunks have expert gradient buffers.
        expert_tp_rank: this rank's expert-TP rank; None: ``tp_rank``.
        overlap_param_gather: gather updated parameters asynchronously, waiting in each module's
            forward pre-hook (``--overlap-param-gather``); otherwise gather at the end of step().
    """

    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[torch.nn.Module],
                 param_groups: List[dict],
                 build_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
                 grad_scaler: Optional[MegatronGradScaler] = None, *, dp_group=None,
                 model_parallel_group=None, tp_rank: int = 0,
                 expert_model_parallel_group=None, expert_tp_rank: Optional[int] = None,
                 overlap_param_gather: bool = False):
        if config.fp16 and grad_scaler is None:
            raise ValueError("--fp16 needs a loss scaler (dynamic, or --loss-scale)")
        self.model_chunks = list(model_chunks)
        if dp_group is None:
            dp_group = getattr(self.model_chunks[0], "dp_group", None)
        self.dp_group = dp_group
        self.dp_size = collectives.get_group_size(dp_group)
        self.dp_rank = collectives.get_group_rank(dp_group)
        for index, chunk in enumerate(self.model_chunks):
            _check_chunk(index, chunk, self.dp_size)
        self.expert_dp_group = self._expert_dp_group(expert_model_parallel_group)
        self.grad_scaler = grad_scaler
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device.current_device())
        self.overlap_param_gather = overlap_param_gather
        self.num_successful_steps = 0

        # (chunk index, gradient dtype, expert?) -> buffer; the dense buffers of a chunk first.
        self.grad_buffers = {}
        for i, chunk in enumerate(self.model_chunks):
            for expert, buffers in ((False, chunk.grad_buffers),
                                    (True, getattr(chunk, "expert_grad_buffers", {}))):
                for dtype, buf in buffers.items():
                    self.grad_buffers[(i, dtype, expert)] = buf
        self.param_buffers = {key: self._build_param_buffers(buf)
                              for key, buf in self.grad_buffers.items()}
        pieces: Dict[torch.nn.Parameter, ShardPiece] = {}
        for key, buf in self.grad_buffers.items():
            pieces.update(_shard_pieces(key, buf, collectives.get_group_rank(buf.dp_group)))

        # Model-order groups; per group, this rank's (piece, main param) pairs.
        self.model_param_groups: List[List[torch.nn.Parameter]] = []
        self.shard_groups: List[List[Tuple[ShardPiece, torch.Tensor]]] = []
        shard_param_groups = []
        for group in param_groups:
            self._check_group(group)
            shards = [(pieces[p], self._make_main_param(pieces[p]))
                      for p in group["params"] if p in pieces]
            self.model_param_groups.append(list(group["params"]))
            self.shard_groups.append(shards)
            shard_param_groups.append({**group, "params": [main for _, main in shards]})
        optimizer = build_optimizer(shard_param_groups)
        super().__init__(optimizer, config, model_parallel_group=model_parallel_group,
                         tp_rank=tp_rank, use_main_grad=True,
                         expert_model_parallel_group=expert_model_parallel_group,
                         expert_tp_rank=expert_tp_rank)
        # Pieces of expert buffers must be summed over expert-DP, not DP, whatever the groups.
        self.experts_apart = self.experts_apart or self.expert_dp_group is not None

        self._pending_gathers: Dict[Tuple[Tuple[int, torch.dtype, bool], int], list] = {}
        self._hook_handles = []
        if overlap_param_gather:
            self._register_forward_pre_hooks()

    # -- construction ------------------------------------------------------------------------

    def _expert_dp_group(self, expert_model_parallel_group):
        """The chunks' expert-data-parallel group when experts have buffers of their own.

        Such chunks need the expert model-parallel group. It may have one rank (``tp = 2``,
        ``expert_tp = ep = pp = 1``: expert-DP spans the stage and each rank holds whole
        experts), so only None is refused, not a group of one."""
        groups = {id(getattr(c, "expert_dp_group", None)): getattr(c, "expert_dp_group", None)
                  for c in self.model_chunks}
        if len(groups) != 1:
            raise ConfigError("--use-distributed-optimizer: the model chunks were wrapped with "
                              "different expert-data-parallel groups")
        group = next(iter(groups.values()))
        if group is not None and expert_model_parallel_group is None:
            raise ConfigError(
                "--use-distributed-optimizer: the model chunks keep expert gradients over an "
                "expert-data-parallel group, but the optimizer got no "
                "expert_model_parallel_group; pass ParallelState.expert_model_parallel_group, "
                "or the experts' norm would miss the other ranks' experts")
        return group

    @property
    def saves_param_state(self) -> bool:
        """Whether :meth:`state_dict` returns the whole ``param_state`` on this rank: DP rank 0,
        or with expert parallelism every rank whose expert-DP rank is 0."""
        if self.expert_dp_group is not None:
            return collectives.get_group_rank(self.expert_dp_group) == 0
        return self.dp_rank == 0

    def param_shard_group(self, param: torch.nn.Parameter):
        """The group over which ``param`` is sharded: the DP (x CP) group for a dense parameter,
        the expert-DP group for an expert's. Its ranks hold every copy of ``param``, and their
        pieces (at most one each, see :meth:`local_param_state`) tile it exactly once."""
        for buf in self.grad_buffers.values():
            if param in buf.param_index_map:
                return buf.dp_group
        raise KeyError(f"a parameter of shape {tuple(param.shape)} is in no gradient buffer")

    def _check_group(self, group: dict) -> None:
        for param in group["params"]:
            if not any(param in buf.param_index_map for buf in self.grad_buffers.values()):
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is in the "
                                 "optimizer's param groups but in no gradient buffer of the "
                                 "model chunks")

    @staticmethod
    @torch.no_grad()
    def _build_param_buffers(grad_buffer) -> Dict[torch.dtype, torch.Tensor]:
        """Move the buffer's parameters into contiguous storage laid out like ``grad_buffer``.

        One buffer per parameter dtype (normally exactly one). Each parameter's ``.data`` becomes
        a view of it, so a bucket's parameters can be all-gathered in one collective.
        """
        dtypes = sorted({p.dtype for p in grad_buffer.param_index_map}, key=str)
        where = grad_buffer.data.device
        buffers = {dtype: torch.zeros(grad_buffer.numel, dtype=dtype, device=where)  # [numel]
                   for dtype in dtypes}
        for param, (start, end, _) in grad_buffer.param_index_map.items():
            view = buffers[param.dtype][start:end].view(param.shape)
            view.copy_(param.data)
            param.data = view
        return buffers

    @torch.no_grad()
    def _make_main_param(self, piece: ShardPiece) -> torch.Tensor:
        """The fp32 tensor the torch optimizer updates for ``piece``: ``[piece numel]``."""
        model_flat = piece.model_param.detach().view(-1)
        if piece.model_param.dtype == torch.float32:
            main = model_flat[piece.param_start:piece.param_end]  # shares the model's storage
        elif piece.model_param.dtype in (torch.float16, torch.bfloat16):
            main = model_flat[piece.param_start:piece.param_end].to(torch.float32, copy=True)
        else:
            raise TypeError(f"parameters must be fp16, bf16 or fp32, got "
                            f"{piece.model_param.dtype} for a parameter of shape "
                            f"{tuple(piece.model_param.shape)}")
        copy_parallel_attributes(piece.model_param, main)
        return main

    def _shards(self):
        return [pair for group in self.shard_groups for pair in group]

    # -- gradients ---------------------------------------------------------------------------

    def _copy_model_grads_to_main_grads(self) -> None:
        # --main-grads-dtype bf16: the optimizer (norm, clipping, step) sees bf16 values of the
        # reduced gradients, whatever dtype the gradient buffer reduced them in.
        narrow = self.config.main_grads_dtype == "bf16"
        for piece, main in self._shards():
            grad = self.grad_buffers[piece.buffer_key].data[piece.buffer_start:piece.buffer_end]
            own = getattr(piece.model_param, "main_grad", None)
            if own is not None and own.dtype != grad.dtype:
                # An fp32 main_grad of its own (fp32 local accumulation): it holds the reduced
                # slice and whatever was summed into it after the data-parallel reduction.
                grad = own.view(-1)[piece.param_start:piece.param_end]
            if narrow:
                grad = grad.to(torch.bfloat16)
            main.grad = grad if grad.dtype == torch.float32 else grad.float()
            piece.model_param.grad = None

    def _main_grads(self) -> List[torch.Tensor]:
        return [main.grad for _, main in self._shards() if main.grad is not None]

    def _all_reduce_dp_then_mp(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """Reduce over the DP group, then the model-parallel group: over every rank that holds
        a part of the model's optimizer state. Every rank gets the same bits."""
        collectives.all_reduce(tensor, self.dp_group, op=op)
        collectives.all_reduce(tensor, self.model_parallel_group, op=op)
        return tensor

    def _unscale_and_check_for_nan(self, grads: List[torch.Tensor],
                                   inv_scale: torch.Tensor) -> bool:
        """Unscale this rank's shard of the gradients; True if any shard anywhere overflowed.

        A max over DP, then the model-parallel group, reaches every rank of the world, so the
        expert pieces need no reduction of their own."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=device.current_device())
        if grads:
            local = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, local,
                                                             inv_scale.to(grads[0].device))
            found_inf.copy_(local)
        self._all_reduce_dp_then_mp(found_inf, dist.ReduceOp.MAX)
        return found_inf.item() > 0

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return get_grads_for_norm(self.get_parameters(), tp_rank=self.tp_rank,
                                  expert_tp_rank=self.expert_tp_rank)

    def _expert_mains(self, expert: bool) -> List[torch.Tensor]:
        return [main for _, main in self._shards() if is_expert_parallel(main) == expert]

    def _all_reduce_expert_dp_then_expert_mp(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """The experts' counterpart of :meth:`_all_reduce_dp_then_mp`: over the group the
        expert pieces are sharded over (expert-DP, or DP where the experts share the dense
        buffers), then the expert model-parallel group (the ranks holding the other expert
        shards)."""
        shard_group = self.expert_dp_group if self.expert_dp_group is not None else self.dp_group
        collectives.all_reduce(tensor, shard_group, op=op)
        collectives.all_reduce(tensor, self.expert_model_parallel_group, op=op)
        return tensor

    def _square_sum(self, params: List[torch.Tensor]) -> torch.Tensor:
        grads = get_grads_for_norm(params, tp_rank=self.tp_rank,
                                   expert_tp_rank=self.expert_tp_rank)
        total = torch.zeros(1, dtype=torch.float32, device=device.current_device())
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            total += torch.stack(norms).pow(2.0).sum().to(total.device)
        return total

    def get_grad_norm(self, tagged: bool = False) -> float:
        """The 2-norm of the whole model's gradient, from every rank's shard; of the
        parameters in a separate norm group (``tagged``) or of the others."""
        keep = ((lambda m: in_separate_norm_group(m) == tagged)
                if self.has_separate_norm_group() else (lambda m: True))
        if not self.experts_apart:
            total = self._square_sum([m for m in self.get_parameters() if keep(m)])
            self._all_reduce_dp_then_mp(total, dist.ReduceOp.SUM)
            return float(total.item()) ** 0.5
        dense = [m for m in self._expert_mains(False) if keep(m)]
        total = self._all_reduce_dp_then_mp(self._square_sum(dense), dist.ReduceOp.SUM)
        experts = self._all_reduce_expert_dp_then_expert_mp(
            self._square_sum([m for m in self._expert_mains(True) if keep(m)]),
            dist.ReduceOp.SUM)
        return float((total + experts).item()) ** 0.5

    def _reduce_any(self, flag: torch.Tensor) -> torch.Tensor:
        return self._all_reduce_dp_then_mp(flag, dist.ReduceOp.MAX)

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        if not self.has_separate_norm_group():
            clip_grads_with_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
            return grad_norm
        untagged, tagged = split_by_norm_group(self.get_parameters())
        clip_grads_with_norm_fp32(untagged, clip_grad, grad_norm)
        clip_grads_with_norm_fp32(tagged, clip_grad, self.get_grad_norm(tagged=True))
        return grad_norm

    def _zero_count(self, mains: List[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device.current_device())
        for main in mains:
            if main.grad is not None and param_counts_here(
                    main, tp_rank=self.tp_rank, expert_tp_rank=self.expert_tp_rank):
                total += main.grad.numel() - torch.count_nonzero(main.grad).to(total.device)
        return total

    def count_zeros(self) -> int:
        if not self.experts_apart:
            total = self._zero_count([main for _, main in self._shards()])
            return int(self._all_reduce_dp_then_mp(total, dist.ReduceOp.SUM).item())
        dense = self._all_reduce_dp_then_mp(self._zero_count(self._expert_mains(False)),
                                            dist.ReduceOp.SUM)
        experts = self._all_reduce_expert_dp_then_expert_mp(
            self._zero_count(self._expert_mains(True)), dist.ReduceOp.SUM)
        return int(dense.item()) + int(experts.item())

    # -- the step ----------------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the main pieces' gradients (views of the DP buffer, zeroed by the DP wrapper)."""
        for piece, main in self._shards():
            main.grad = None
            piece.model_param.grad = None

    @torch.no_grad()
    def step(self) -> StepResult:
        self.finish_param_sync()
        self._copy_model_grads_to_main_grads()
        main_grads = self._main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_nan(main_grads, self.grad_scaler.inv_scale)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        elif self.config.check_for_nan_in_loss_and_grad:
            self._raise_if_not_finite(main_grads)
        grad_norm, num_zeros_in_grad = self._step_with_ready_grads()
        self.num_successful_steps += 1
        self._copy_main_params_to_model_params()
        self.start_param_sync()
        if not self.overlap_param_gather:
            self.finish_param_sync()
        return True, grad_norm, num_zeros_in_grad

    @torch.no_grad()
    def scale_param_rows(self, factors) -> None:
        """As :meth:`MegatronOptimizer.scale_param_rows`: each rank scales the rows of its
        main pieces (a piece may start and end inside a row), then the model weights are
        gathered again from the main pieces, so every replica holds the same values."""
        self.finish_param_sync()
        shards = {id(piece.model_param): (piece, main) for piece, main in self._shards()}
        for param, factor in factors:
            if id(param) not in shards:
                continue                                  # no piece of it on this rank
            piece, main = shards[id(param)]
            row_size = param[0].numel()
            rows = torch.arange(piece.param_start, piece.param_end,
                                device=main.device) // row_size
            main.mul_(factor.to(device=main.device, dtype=main.dtype)[rows])
        self._copy_main_params_to_model_params()
        self.start_param_sync()
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def _copy_main_params_to_model_params(self) -> None:
        for piece, main in self._shards():
            if piece.model_param.dtype != torch.float32:  # fp32 mains are the model's storage
                flat = piece.model_param.detach().view(-1)
                flat[piece.param_start:piece.param_end].copy_(main)

    @torch.no_grad()
    def reload_model_params(self, main_values: Optional[MainValues] = None) -> None:
        self.finish_param_sync()
        for piece, main in self._shards():
            if piece.model_param.dtype != torch.float32:
                source = main_value(piece.model_param, main_values)
                main.copy_(source.reshape(-1)[piece.param_start:piece.param_end])

    # -- parameter all-gather ----------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Launch the all-gather of every bucket's updated parameters, in forward order (last
        bucket first: buckets follow the backward order), each over its buffer's group.
        Asynchronous where the backend allows."""
        for key, grad_buffer in self.grad_buffers.items():
            if grad_buffer.dp_size == 1:
                continue
            for bucket in reversed(grad_buffer.buckets):
                handles = []
                for param_buffer in self.param_buffers[key].values():
                    handles.append(self._gather_bucket(param_buffer, bucket))
                self._pending_gathers[(key, bucket.index)] = handles

    def _gather_bucket(self, param_buffer: torch.Tensor, bucket):
        """All-gather one bucket's parameters; returns ``(handle or None, input)``."""
        out = param_buffer[bucket.offset:bucket.offset + bucket.data.numel()]  # [bucket numel]
        start, end = bucket.shard_range()
        shard = out[start:end].clone()  # [bucket numel / dp]; the gather overwrites ``out``
        if self.overlap_param_gather:
            native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            try:
                return native(out, shard, group=bucket.dp_group, async_op=True), shard
            except (RuntimeError, NotImplementedError) as err:
                if "support" not in str(err).lower() and not isinstance(err, NotImplementedError):
                    raise
        collectives.all_gather_into_tensor(out, shard, bucket.dp_group)
        return None, shard

    def _finish_bucket(self, key) -> None:
        for handle, _ in self._pending_gathers.pop(key, ()):
            if handle is not None:
                handle.wait()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight; afterwards the model is whole."""
        for key in list(self._pending_gathers):
            self._finish_bucket(key)

    def _register_forward_pre_hooks(self) -> None:
        """Each module waits for the buckets of its own parameters before its forward; the chunk
        waits first for parameters that are used outside their module (tied embeddings)."""
        where = {}
        for key, grad_buffer in self.grad_buffers.items():
            for param, (_, _, bucket_index) in grad_buffer.param_index_map.items():
                where[param] = (key, bucket_index)

        def wait_for(params):
            for param in params:
                key = where.get(param)
                if key is not None and key in self._pending_gathers:
                    self._finish_bucket(key)

        for chunk in self.model_chunks:
            outside = [p for p in chunk.parameters()
                       if any(getattr(p, a, False) for a in _USED_OUTSIDE_OWN_MODULE)]
            self._hook_handles.append(chunk.register_forward_pre_hook(
                lambda module, args, params=outside: wait_for(params)))
            for module in chunk.modules():
                own = list(module.parameters(recurse=False))
                if own:
                    self._hook_handles.append(module.register_forward_pre_hook(
                        lambda module, args, params=own: wait_for(params)))

    # -- checkpoints -------------------------------------------------------------------------

    def _state_value(self, main: torch.Tensor, name: str) -> Optional[torch.Tensor]:
        """``name`` of ``main``'s optimizer state as fp32 values (a precision-aware optimizer
        keeps it narrower); None before the first step."""
        unscaled = getattr(self.optimizer, "unscaled_state", None)
        if unscaled is not None:
            return unscaled(main, name)
        return self.optimizer.state.get(main, {}).get(name)

    def _state_keys(self) -> Tuple[str, ...]:
        if self.config.optimizer == "adam":
            return ("exp_avg", "exp_avg_sq")
        if self.config.optimizer == "lion":
            return ("exp_avg",)
        return ("momentum_buffer",) if self.config.sgd_momentum > 0 else ()

    def state_dict(self) -> dict:
        """The unsharded optimizer state; a collective over the DP group (and the expert-DP
        group with expert parallelism).

        Every DP rank must call it; the full ``param_state`` is returned where
        :attr:`saves_param_state` (DP rank 0; with expert parallelism every expert-DP rank 0,
        its local experts included) and is None elsewhere.
        """
        self.finish_param_sync()
        groups = self.group_metadata()
        for meta, model_params in zip(groups, self.model_param_groups):
            meta["params"] = list(range(len(model_params)))
        state_dict = {"optimizer": {"param_groups": groups},
                      "param_state": self._gather_param_state()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def group_metadata(self) -> List[dict]:
        """Each group's hyper-parameters (no tensors) and the step count, in model order."""
        groups = []
        for group in self.optimizer.param_groups:
            meta = {k: v for k, v in group.items() if k != "params"}
            meta["step"] = self.num_successful_steps
            groups.append(meta)
        return groups

    def local_param_state(self) -> List[List[Optional[dict]]]:
        """This rank's own state, without communication: per group, aligned with
        ``model_param_groups``, None for a parameter this rank holds no piece of, else
        ``{"start": s, "end": e, "param": main[e - s], <state name>: [e - s]}`` for the
        elements ``s:e`` of the flattened parameter (fp32; zeros before the first step)."""
        self.finish_param_sync()
        out = []
        for model_params, shards in zip(self.model_param_groups, self.shard_groups):
            mine = {piece.model_param: (piece, main) for piece, main in shards}
            row = []
            for param in model_params:
                if param not in mine:
                    row.append(None)
                    continue
                piece, main = mine[param]
                entry = {"start": piece.param_start, "end": piece.param_end,
                         "param": main.detach()}
                for name in self._state_keys():
                    value = self._state_value(main, name)
                    entry[name] = (value.detach() if value is not None
                                   else torch.zeros_like(main, dtype=torch.float32))
                row.append(entry)
            out.append(row)
        return out

    def load_local_param_state(self, groups: List[dict],
                               read: Callable[[int, int, int, int], dict],
                               grad_scaler: Optional[dict] = None) -> None:
        """Load state given piece by piece: ``read(group, index, start, end)`` returns
        ``{"param": [end - start], <state name>: [end - start]}`` for the elements
        ``start:end`` of parameter ``index`` of ``group`` (model order), so each rank reads only
        its own share. ``groups``: hyper-parameters per group (``step`` among them)."""
        if len(groups) != len(self.model_param_groups):
            raise ValueError(f"optimizer checkpoint has {len(groups)} param groups, this "
                             f"model has {len(self.model_param_groups)}")
        self.finish_param_sync()
        step = max((int(g.get("step", 0)) for g in groups), default=0)
        with torch.no_grad():
            for g, (group, meta) in enumerate(zip(self.optimizer.param_groups, groups)):
                group.update({k: v for k, v in meta.items() if k not in ("params", "step")})
                index = {p: i for i, p in enumerate(self.model_param_groups[g])}
                for piece, main in self.shard_groups[g]:
                    values = read(g, index[piece.model_param], piece.param_start,
                                  piece.param_end)
                    self._set_piece(main, values, step)
        self.num_successful_steps = step
        self._load_grad_scaler({} if grad_scaler is None else {"grad_scaler": grad_scaler})

    def _local_bucket_state(self, key, bucket, names) -> torch.Tensor:
        """This rank's shard of ``bucket`` for each of ``names``: ``[len(names), shard numel]``,
        fp32, zero where no parameter lies (padding)."""
        start, end = bucket.shard_range()
        base = bucket.offset + start
        local = torch.zeros(len(names), end - start, dtype=torch.float32,
                            device=self.grad_buffers[key].data.device)
        for piece, main in self._shards():
            if piece.buffer_key != key or piece.bucket_index != bucket.index:
                continue
            for row, name in enumerate(names):
                value = main if name == "param" else self._state_value(main, name)
                if value is not None:
                    local[row, piece.buffer_start - base:piece.buffer_end - base] = value
        return local

    def _gather_bucket_state(self, local: torch.Tensor, group,
                             to_all: bool) -> Optional[torch.Tensor]:
        """``[names, bucket numel]`` from every rank's ``[names, shard]`` of ``group``: on its
        rank 0 (on every rank with ``to_all``), None elsewhere."""
        size, rank = collectives.get_group_size(group), collectives.get_group_rank(group)
        if size == 1:
            return local
        if to_all:
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=group)
            return torch.cat(parts, dim=1)
        parts = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        dist.gather(local, parts, dst=dist.get_global_rank(group, 0), group=group)
        return torch.cat(parts, dim=1) if parts is not None else None

    def _gather_param_state(self) -> Optional[List[List[dict]]]:
        """Gather every bucket's shards over its buffer's group to the ranks that
        :attr:`saves_param_state` and cut them into per-parameter tensors.

        Dense buckets go to DP rank 0; with expert parallelism to every rank of the DP group
        (each expert-DP rank 0 among them needs them), expert buckets to expert-DP rank 0."""
        names = ("param",) + self._state_keys()
        saves = self.saves_param_state
        per_param: Dict[torch.nn.Parameter, dict] = {}
        for key, grad_buffer in self.grad_buffers.items():
            to_all = self.expert_dp_group is not None and not key[2]
            for bucket in grad_buffer.buckets:
                local = self._local_bucket_state(key, bucket, names)  # [names, shard]
                full = self._gather_bucket_state(local, grad_buffer.dp_group, to_all)
                if full is None or not saves:  # full: [names, bucket numel]
                    continue
                for param in bucket.params:
                    start, end, _ = grad_buffer.param_index_map[param]
                    rel = slice(start - bucket.offset, end - bucket.offset)
                    per_param[param] = {name: full[row, rel].reshape(param.shape).cpu().clone()
                                        for row, name in enumerate(names)}
        if not saves:
            return None
        return [[per_param[p] for p in group] for group in self.model_param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an unsharded state (any DP size saved it); this rank keeps its own pieces.

        With expert parallelism the state is the one of this rank's EP coordinate (the dense
        parameters and this EP rank's local experts, as :meth:`state_dict` returns it on its
        expert-DP rank 0); every rank of that coordinate loads the same state."""
        if "param_state" not in state_dict:
            raise KeyError("optimizer checkpoint has no 'param_state': it was not saved with "
                           "--use-distributed-optimizer; drop the flag to load it, or pass "
                           f"--no-load-optim (found keys {sorted(state_dict)})")
        if state_dict["param_state"] is None:
            raise ValueError("optimizer checkpoint has param_state None: it is the state_dict() "
                             "of a data-parallel rank other than 0 (expert-data-parallel rank "
                             "other than 0 with expert parallelism), which holds no state")
        saved_groups = state_dict["optimizer"]["param_groups"]
        param_state = state_dict["param_state"]
        self._check_saved_layout(saved_groups, param_state)
        self.finish_param_sync()
        step = max((int(g.get("step", 0)) for g in saved_groups), default=0)
        with torch.no_grad():
            for g, (group, meta) in enumerate(zip(self.optimizer.param_groups, saved_groups)):
                group.update({k: v for k, v in meta.items() if k not in ("params", "step")})
                index = {p: i for i, p in enumerate(self.model_param_groups[g])}
                for piece, main in self.shard_groups[g]:
                    saved = param_state[g][index[piece.model_param]]
                    self._load_piece(piece, main, saved, step)
        self.num_successful_steps = step
        self._load_grad_scaler(state_dict)

    def _check_saved_layout(self, saved_groups, param_state) -> None:
        if len(saved_groups) != len(self.model_param_groups) or \
                len(param_state) != len(self.model_param_groups):
            raise ValueError(f"optimizer checkpoint has {len(param_state)} param groups, this "
                             f"model has {len(self.model_param_groups)}")
        for g, (saved, params) in enumerate(zip(param_state, self.model_param_groups)):
            if len(saved) != len(params):
                raise ValueError(f"optimizer checkpoint group {g} has {len(saved)} params, this "
                                 f"model has {len(params)}")
            for i, (entry, param) in enumerate(zip(saved, params)):
                missing = {"param", *self._state_keys()} - set(entry)
                if missing:
                    raise KeyError(f"optimizer checkpoint group {g} param {i} lacks "
                                   f"{sorted(missing)}")
                if tuple(entry["param"].shape) != tuple(param.shape):
                    raise ValueError(f"optimizer checkpoint group {g} param {i} has shape "
                                     f"{tuple(entry['param'].shape)}, this model's is "
                                     f"{tuple(param.shape)}")

    def _load_piece(self, piece: ShardPiece, main: torch.Tensor, saved: dict, step: int) -> None:
        cut = slice(piece.param_start, piece.param_end)
        self._set_piece(main, {name: saved[name].reshape(-1)[cut]
                               for name in ("param",) + self._state_keys()}, step)

    def _set_piece(self, main: torch.Tensor, values: dict, step: int) -> None:
        """Main copy and state of one piece from flat tensors of its length."""
        main.copy_(values["param"].reshape(-1))
        state = self.optimizer.state[main]
        state.clear()
        if step == 0:
            return
        narrow = getattr(self.optimizer, "set_unscaled_state", None)
        for name in self._state_keys():
            value = values[name].reshape(-1).to(main.device, torch.float32)
            if narrow is not None:
                narrow(main, name, value)
            else:
                state[name] = value.clone()
        if self.config.optimizer == "adam":
            state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _load_grad_scaler(self, state_dict: dict) -> None:
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                logger.warning("optimizer checkpoint has no grad scaler state; "
                               "keeping the current loss scale")
        elif self.grad_scaler is None:
            logger.warning("optimizer checkpoint has grad scaler state but this run has no "
                           "loss scaler (bf16 without --loss-scale); ignoring it")
        else:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

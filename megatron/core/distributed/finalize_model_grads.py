"""Everything that must happen to gradients between the last backward and the optimizer step.

1. Data parallel: each chunk's ``finish_grad_sync()`` averages ``main_grad`` over its dp group.
2. Sequence parallel: parameters replicated across tensor-parallel ranks but fed with only this
   rank's part of the sequence (LayerNorm weights and biases, marked ``param.sequence_parallel =
   True`` by the model) hold a partial gradient on each TP rank; they are summed over the TP group.
   So are, with or without sequence parallelism, parameters replicated across TP ranks but fed
   with only this rank's heads (``--qk-layernorm``'s norms, marked ``param.sum_grad_over_tp =
   True``).
3. Pipeline parallel with tied embeddings: the word embedding (first stage) and the output layer
   (last stage) are one logical weight held twice; both copies' gradients are summed over the
   embedding group so the two copies take the same optimizer step and stay equal.
4. ``--calculate-per-token-loss``: the losses were sums over tokens and the data-parallel
   reduction summed them; the token count of the step (known on the last pipeline stage) is sent
   to every stage, summed over the data-parallel ranks, and the gradients are divided by it: the
   gradient of the mean over every token of the global batch.
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.collectives import get_group_size
from megatron.core.distributed.torch_fsdp2 import local_tensor


def _grad_of(param: torch.nn.Parameter, what: str) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None and param.grad is not None:
        # Sharded by FSDP2: this rank's shard, laid out alike on every TP rank.
        grad = local_tensor(param.grad)
    if grad is None:
        raise RuntimeError(f"{what} has neither main_grad nor grad; wrap the model chunk in "
                           f"DistributedDataParallel and run backward before finalize_model_grads")
    return grad


def _allreduce_layernorm_grads(model_chunks: Sequence[torch.nn.Module], tp_group,
                               sequence_parallel: bool = True) -> None:
    """Sum over the tensor-parallel group the gradients of parameters marked ``sum_grad_over_tp``,
    and, when ``sequence_parallel``, of those marked ``sequence_parallel``.

    The gradients are packed into one flat tensor per dtype, so there is one collective per dtype
    rather than one per parameter.
    """
    grads_by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            marked = getattr(param, "sum_grad_over_tp", False) or (
                sequence_parallel and getattr(param, "sequence_parallel", False))
            if param.requires_grad and marked:
                grad = _grad_of(param, f"TP-replicated parameter {name!r}")
                grads_by_dtype.setdefault(grad.dtype, []).append(grad)
    if not grads_by_dtype or get_group_size(tp_group) == 1:
        return
    for grads in grads_by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numels]
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _find_shared_embedding_weight(chunk: torch.nn.Module) -> Optional[torch.nn.Parameter]:
    """The tied word-embedding / output weight of a chunk, or None when it has none.

    Looks on the chunk and then down its chain of ``.module`` wrappers (DistributedDataParallel,
    a half-precision wrapper, ...) for a ``shared_embedding_or_output_weight()`` method.
    """
    module = chunk
    while module is not None:
        method = getattr(module, "shared_embedding_or_output_weight", None)
        if method is not None:
            shared = getattr(module, "shares_embedding_over_stages",
                             getattr(module, "share_embeddings_and_output_weights", True))
            return method() if shared else None
        module = getattr(module, "module", None)
    return None


def _allreduce_word_embedding_grads(model_chunks: Sequence[torch.nn.Module], embedding_group,
                                    is_first_stage: bool, is_last_stage: bool,
                                    pp_size: int, in_embedding_group: Optional[bool] = None
                                    ) -> None:
    """Sum the tied embedding weight's gradient over the stages of the embedding group (the
    first and last, and a standalone MTP stage's copy)."""
    if in_embedding_group is None:
        in_embedding_group = is_first_stage or is_last_stage
    if pp_size <= 1 or not in_embedding_group:
        return
    holders = ([0] if is_first_stage else []) + ([len(model_chunks) - 1] if is_last_stage else [])
    # A standalone MTP stage keeps a copy too: on a middle rank, or in a last chunk beside the
    # first stage's embedding (virtual stages).
    holders += [i for i, chunk in enumerate(model_chunks) if _holds_mtp_stage(chunk)]
    weights = []
    for i in sorted(set(holders)) or [0]:
        weight = _find_shared_embedding_weight(model_chunks[i])
        if weight is not None and all(weight is not w for w in weights):
            weights.append(weight)
    if not weights:
        return
    if embedding_group is None:
        raise ValueError("finalize_model_grads: pipeline-model-parallel size is "
                         f"{pp_size} and this stage holds a tied embedding weight, so "
                         "embedding_group=<ParallelState.embedding_group> is required, got None")
    grads = [_grad_of(weight, "the shared embedding/output weight") for weight in weights]
    total = grads[0]
    for grad in grads[1:]:       # this rank's copies first, then the sum over the group
        total += grad
    dist.all_reduce(total, group=embedding_group)
    for grad in grads[1:]:
        grad.copy_(total)


def _holds_mtp_stage(chunk: torch.nn.Module) -> bool:
    """A (wrapped) chunk is a standalone MTP stage (its model's ``mtp_standalone`` and MTP
    block), whose copy of the word embedding is kept in step with the first stage's."""
    module = chunk
    while module is not None:
        if hasattr(module, "mtp_standalone"):
            return bool(module.mtp_standalone) and getattr(module, "mtp", None) is not None
        module = getattr(module, "module", None)
    return False


def _divide_by_token_count(model_chunks: Sequence[torch.nn.Module], num_tokens, pp_group,
                           dp_group) -> None:
    """Divide every gradient by the step's token count over the whole global batch: the count
    this stage's loss functions returned (on the last stage; anything elsewhere), taken from the
    last stage of the pipeline and summed over ``dp_group``."""
    params = (p for chunk in model_chunks for p in chunk.parameters())
    dev = next(params, torch.empty(0)).device   # the gradients' device (FSDP2: no buffers)
    count = torch.as_tensor(num_tokens, dtype=torch.int64, device=dev).clone().reshape(())
    if pp_group is not None and get_group_size(pp_group) > 1:
        dist.broadcast(count, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    if dp_group is not None and get_group_size(dp_group) > 1:
        dist.all_reduce(count, group=dp_group)
    total = int(count.item())
    if total > 0:
        for chunk in model_chunks:
            chunk.scale_gradients(1.0 / total)


def finalize_model_grads(model_chunks: Sequence[torch.nn.Module], *, tp_group,
                         embedding_group=None, is_first_stage: bool = True,
                         is_last_stage: bool = True, pp_size: int = 1,
                         sequence_parallel: bool = False, num_tokens=None, pp_group=None,
                         dp_group=None, in_embedding_group: Optional[bool] = None) -> None:
    """Finish every gradient reduction of a step; afterwards ``main_grad`` is ready to step on.

    Args:
        model_chunks: this rank's model chunks (one, or several with virtual pipeline stages),
            each wrapped in :class:`DistributedDataParallel`.
        tp_group: tensor-parallel process group.
        embedding_group: group of the first and last pipeline stage of this pipeline
            (``ParallelState.embedding_group``); needed when ``pp_size > 1``.
        is_first_stage / is_last_stage: whether this rank is the first / last physical pipeline
            stage (virtual stages ignored).
        in_embedding_group: whether this rank is in ``embedding_group`` (a standalone MTP
            stage's is, with its copy of the word embedding; the untied loss stage beside it
            is not); None: the first and the last stage are.
        pp_size: pipeline-model-parallel size.
        sequence_parallel: whether ``--sequence-parallel`` is on; then parameters with
            ``param.sequence_parallel = True`` have their gradients summed over ``tp_group``
            (those marked ``sum_grad_over_tp`` always are).
        num_tokens: with ``--calculate-per-token-loss``, the schedule's ``num_tokens`` (the
            tokens this stage's loss functions counted); the gradients are then divided by its
            sum over the global batch, which ``pp_group`` (this rank's pipeline) and
            ``dp_group`` (its data x context-parallel group, the one the gradients were
            summed over) collect. None: the gradients are left as averaged.

    Tied embeddings: with ``pp_size > 1`` the first stage's first chunk and the last stage's last
    chunk are asked for ``shared_embedding_or_output_weight()``, found on the chunk or on any
    module reached through its ``.module`` attributes. It must return the word-embedding weight
    (first stage) or the output-layer weight (last stage) when they are tied, and None when they
    are not (a module attribute ``share_embeddings_and_output_weights = False`` also means untied).
    Both stages must agree, since the sum is a collective over the embedding group. A chunk
    without the method is treated as untied. A module attribute
    ``shares_embedding_over_stages`` overrides ``share_embeddings_and_output_weights``: a model
    with untied weights whose last stage keeps a copy of the input table (multi-token
    prediction) sets it True and returns that copy there.
    """
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is None:
            raise TypeError(f"finalize_model_grads expects model chunks wrapped in "
                            f"DistributedDataParallel, got {type(chunk).__name__}")
        finish()
    _allreduce_layernorm_grads(model_chunks, tp_group, sequence_parallel)
    _allreduce_word_embedding_grads(model_chunks, embedding_group, is_first_stage,
                                    is_last_stage, pp_size, in_embedding_group)
    if num_tokens is not None:
        _divide_by_token_count(model_chunks, num_tokens, pp_group, dp_group)

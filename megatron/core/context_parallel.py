"""Context parallelism: every sequence split over the ranks of the context-parallel (cp) group.

A sequence of ``s`` tokens is cut into ``2 * cp`` chunks of ``s / (2 cp)`` tokens; cp rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r``, in that order, so that under a causal mask every rank
does the same amount of attention work. Everything outside attention is per token and runs on
the local ``s / cp`` tokens unchanged; attention needs the keys and values of the whole sequence,
which three methods provide (Megatron's ``--cp-comm-type``):

* ``p2p``: key/value blocks travel around the ring of cp ranks, one step at a time; each rank
  attends its queries to the block in hand and merges the partial results by their
  log-sum-exp, so the result equals attention over the whole sequence;
* ``all_gather``: every rank gathers all key/value blocks at once, then the same computation;
* ``a2a``: an all-to-all trades the sequence split for a head split (each rank gets the whole
  sequence for ``heads / cp`` heads), full attention runs locally, and a second all-to-all
  trades back;
* ``a2a+p2p`` (Megatron's hierarchical context parallelism, ``--hierarchical-context-parallel-sizes
  a n``): the cp group is cut into an inner all-to-all group of ``a`` neighbouring cp ranks and an
  outer ring of ``n`` ranks (``cp = a n``). The all-to-all gives each rank ``heads / a`` heads of
  its inner group's ``2 a`` chunks; their key/value blocks then travel around the outer ring as
  in ``p2p``, and a second all-to-all trades back.

Masks are causal by global token position (the chunk order is taken into account), or an
explicit boolean mask (True = masked) over the local queries and all ``s`` keys (what
``--reset-attention-mask`` gives: built on the whole sequence, then split by query rows). ``a2a``
attends for every query, so it all-gathers the mask's rows first; its scores are ``[s, s]`` per
head anyway. A query row that no key may see gives zeros, never NaN. Gradients flow through
every exchange (the backward of a ring step sends the key/value gradients the other way).

A softmax offset (attention sinks: one extra logit per head in the denominator) is one more
partial result to merge: output zero, log-sum-exp the offset. Sliding windows need nothing here:
the caller passes them as an explicit mask by global position (:func:`window_mask_rows`).

Shapes follow the model: ``[s_local, b, heads, head_dim]`` in, ``[s_local, b, heads *
value_head_dim]`` out; keys and values may have different head dims (multi-latent attention's
keys carry the rotary part, its values do not).
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.collectives import (all_gather_into_tensor, get_group_rank,
                                       get_group_size)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class ContextParallelError(ValueError):
    """A sequence, head count or mask that context parallelism cannot split; names the flag."""


# -- which tokens a rank holds ------------------------------------------------------------------

def check_sequence_length(seq_length: int, cp_size: int) -> None:
    """``seq_length`` must split into ``2 * cp_size`` equal chunks."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ContextParallelError(
            f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size = "
            f"{2 * cp_size} (each sequence is cut into 2 x {cp_size} equal chunks)")


def chunk_positions(seq_length: int, cp_size: int, cp_rank: int,
                    device=None) -> torch.Tensor:
    """The global positions of the tokens cp rank ``cp_rank`` holds, in its local order:
    chunk ``cp_rank`` then chunk ``2 cp_size - 1 - cp_rank``. ``[seq_length / cp_size]``."""
    check_sequence_length(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last * chunk, (last + 1) * chunk, device=device)
    return torch.cat([first, second])


def split_for_cp_rank(tensor: torch.Tensor, dim: int, cp_size: int,
                      cp_rank: int) -> torch.Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (a sequence dimension)."""
    if cp_size == 1:
        return tensor
    return tensor.index_select(dim, chunk_positions(tensor.size(dim), cp_size, cp_rank,
                                                    tensor.device))


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]], cp_size: int,
                              cp_rank: int) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's part of a GPT batch: ``[b, s]`` tensors (tokens, labels, loss mask, position
    ids) keep its tokens; an ``attention_mask`` ``[b, 1, s, s]`` keeps its query rows and every
    key column."""
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
        elif key == "attention_mask":
            out[key] = split_for_cp_rank(value, 2, cp_size, cp_rank)
        else:
            out[key] = split_for_cp_rank(value, 1, cp_size, cp_rank)
    return out


# -- attention over blocks of keys, merged by log-sum-exp ---------------------------------------

def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     masked: Optional[torch.Tensor], scale: float, dropout_p: float
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[b, np, sq, hn]`` over one block of keys ``[b, np, sk, hn]``
    (fp32 or wider): the block's normalised output ``[b, np, sq, hn]`` and log-sum-exp ``[b, np, sq, 1]``
    (-inf for a row that sees no key of the block, whose output is then zero)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale                 # [b, np, sq, sk]
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).detach()                     # softmax ignores it
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)                                    # masked: 0
    total = weights.sum(dim=-1, keepdim=True)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights, v) / safe_total
    lse = torch.where(seen, peak + torch.log(safe_total),
                      torch.full_like(total, float("-inf")))
    return out, lse


def _merge(parts: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine per-block results into attention over all the blocks' keys."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])                         # [n, b, np, sq, 1]
    peak = lses.amax(dim=0).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(lses - peak)                                      # -inf rows: 0
    total = weights.sum(dim=0)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = sum(w * o for w, (o, _) in zip(weights, parts))
    return out / safe_total


def _sink_part(offset: torch.Tensor, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The softmax offset ``[np]`` as a partial result shaped like the output ``like``
    ``[b, np, sq, hv]``: no output, log-sum-exp = the offset."""
    b, heads, sq, _ = like.shape
    lse = offset.to(like.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
    return torch.zeros_like(like), lse


def window_mask_rows(seq_length: int, cp_size: int, cp_rank: int, window,
                     device=None) -> torch.Tensor:
    """Bool ``[1, 1, s_local, s]``, True where this rank's query may not see a key: later
    positions, or further than ``window = (left, right)`` allows (``--window-size``, -1: no
    limit; right is 0 for causal attention)."""
    q_pos = chunk_positions(seq_length, cp_size, cp_rank, device)[:, None]
    k_pos = torch.arange(seq_length, device=device)[None, :]
    masked = k_pos > q_pos + max(window[1], 0)
    if window[0] >= 0:
        masked |= k_pos < q_pos - window[0]
    return masked[None, None]


def _causal_relation(q_pos: torch.Tensor, k_pos: torch.Tensor) -> str:
    """``"none"`` (no query sees a key), ``"all"`` (every query sees every key) or
    ``"some"``, for contiguous position ranges."""
    if int(k_pos.min()) > int(q_pos.max()):
        return "none"
    if int(k_pos.max()) <= int(q_pos.min()):
        return "all"
    return "some"


def _halves(rows: int) -> List[Tuple[int, int]]:
    """This rank's own two chunks of ``rows`` local tokens, as ``(start, stop)`` rows."""
    half = rows // 2
    return [(0, half), (half, 2 * half)]


def _attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_pos: torch.Tensor, k_chunks: Sequence[Tuple[int, int]],
            mask: Optional[torch.Tensor], scale: float, dropout_p: float,
            q_chunks: Optional[Sequence[Tuple[int, int]]] = None
            ) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], bool]:
    """The partial results of the query chunks (``q_chunks``, default this rank's two halves)
    over one set of key chunks (``k_chunks``); each chunk is ``(start, stop)`` rows holding a
    contiguous position range.

    Causal (``mask`` None): pairs of chunks that cannot see each other are skipped and pairs
    that see each other whole need no mask. With an explicit mask every pair is computed.
    Returns the parts per query chunk (None where nothing was seen) and whether ``k`` was used.
    """
    parts, used = [], False
    for start, stop in (_halves(q.size(2)) if q_chunks is None else q_chunks):
        rows = slice(start, stop)
        qc, qc_pos = q[:, :, rows], q_pos[rows]
        keep, needs_mask = [], False
        for k_start, k_stop in k_chunks:
            if mask is None:
                relation = _causal_relation(qc_pos, k_pos[k_start:k_stop])
                if relation == "none":
                    continue
                needs_mask |= relation == "some"
            keep.append((k_start, k_stop))
        if not keep:
            parts.append(None)
            continue
        used = True
        index = torch.cat([torch.arange(a, b, device=k.device) for a, b in keep])
        kc, vc, kc_pos = k.index_select(2, index), v.index_select(2, index), k_pos[index]
        if mask is not None:
            masked = mask[:, :, rows].index_select(3, kc_pos)
        elif needs_mask:
            masked = (kc_pos[None, :] > qc_pos[:, None])[None, None]      # [1, 1, sq, sk]
        else:
            masked = None
        parts.append(_block_attention(qc, kc, vc, masked, scale, dropout_p))
    return parts, used


def _to_bhsd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, np, hn]`` -> ``[b, np, s, hn]`` in fp32 (fp64 stays fp64)."""
    return t.permute(1, 2, 0, 3).to(torch.promote_types(t.dtype, torch.float32))


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    groups = t.size(2)
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=2)


# -- exchanges ----------------------------------------------------------------------------------

def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _shift(tensor: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send ``tensor`` to the cp rank ``step`` ahead; return what the rank ``step`` behind
    sent."""
    size, rank = get_group_size(group), get_group_rank(group)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, _global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, received, _global_rank(group, (rank - step) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingStep(torch.autograd.Function):
    """Forward: pass a block one rank along the ring; backward: pass its gradient back."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _shift(tensor, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1), None


def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Equal pieces of dim 0: piece j goes to cp rank j, piece j of the result came from it."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


class _SequenceToHeads(torch.autograd.Function):
    """``[s_local, b, np, hn]`` -> ``[cp * s_local, b, np / cp, hn]``: the whole sequence (rank
    by rank) for this rank's share of the heads."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _sequence_to_heads(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse of :class:`_SequenceToHeads`."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _heads_to_sequence(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def _sequence_to_heads(tensor: torch.Tensor, group) -> torch.Tensor:
    cp = get_group_size(group)
    s, b, heads, hn = tensor.shape
    pieces = tensor.reshape(s, b, cp, heads // cp, hn).permute(2, 0, 1, 3, 4)
    return _all_to_all(pieces, group).reshape(cp * s, b, heads // cp, hn)


def _heads_to_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    cp = get_group_size(group)
    full, b, share, hn = tensor.shape
    s = full // cp
    pieces = _all_to_all(tensor.reshape(cp, s, b, share, hn), group)    # [cp (heads), s, ...]
    return pieces.permute(1, 2, 0, 3, 4).reshape(s, b, cp * share, hn)


# -- the entry point ----------------------------------------------------------------------------

def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                               cp_group, comm_type: str = "p2p",
                               attention_mask: Optional[torch.Tensor] = None,
                               softmax_scale: Optional[float] = None,
                               dropout_p: float = 0.0,
                               softmax_offset: Optional[torch.Tensor] = None,
                               hierarchical_groups: Optional[Tuple[object, object]] = None
                               ) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence.

    Args:
        query: ``[s_local, b, np, hn]``, this rank's tokens (:func:`chunk_positions` order).
        key: ``[s_local, b, ng, hn]`` with ``np`` a multiple of ``ng`` (grouped-query
            attention shares each key/value head among ``np / ng`` query heads).
        value: ``[s_local, b, ng, hv]`` (``hv`` may differ from ``hn``).
        cp_group: the context-parallel group.
        comm_type: ``p2p``, ``all_gather``, ``a2a`` or ``a2a+p2p`` (see the module docstring).
        attention_mask: None for causal attention, else bool ``[b or 1, 1, s_local, s]``
            (True = masked; this rank's query rows, every key column in global order).
        softmax_scale: multiplies the scores; default ``1 / sqrt(hn)``.
        dropout_p: attention dropout on the probabilities (the caller's RNG stream).
        softmax_offset: ``[np]``, one extra logit per head in the softmax denominator, or None.
        hierarchical_groups: for ``a2a+p2p``, the (inner all-to-all, outer ring) groups of
            :func:`hierarchical_cp_groups`.

    Returns:
        ``[s_local, b, np * hv]`` in the query's dtype.
    """
    if comm_type not in COMM_TYPES:
        raise ContextParallelError(f"--cp-comm-type {comm_type!r}: expected one of "
                                   f"{', '.join(COMM_TYPES)}")
    cp = get_group_size(cp_group)
    s_local, b, heads, hn = query.shape
    seq = s_local * cp
    check_sequence_length(seq, cp)
    scale = 1.0 / math.sqrt(hn) if softmax_scale is None else softmax_scale
    if attention_mask is not None and (attention_mask.dim() != 4 or tuple(
            attention_mask.shape[-2:]) != (s_local, seq) or attention_mask.size(1) != 1):
        raise ContextParallelError(f"a context-parallel attention mask must be [b or 1, 1, "
                                   f"{s_local}, {seq}] (this rank's {s_local} queries, all "
                                   f"{seq} keys), got {tuple(attention_mask.shape)}")
    if comm_type == "a2a":
        out = _a2a_attention(query, key, value, cp_group, attention_mask, scale, dropout_p,
                             softmax_offset)
        return out.to(query.dtype)
    if comm_type == "a2a+p2p":
        out = _hierarchical_attention(query, key, value, cp_group, hierarchical_groups,
                                      attention_mask, scale, dropout_p, softmax_offset)
        return out.to(query.dtype)
    q = _to_bhsd(query)
    key, value = _expand_groups(key, heads), _expand_groups(value, heads)
    # Keys and values travel as one tensor, side by side on the last dim.
    kv = torch.cat([key, value], dim=-1)                                  # [s_l, b, np, hn+hv]
    if comm_type == "all_gather":
        kv = gather_from_sequence_parallel_region(kv, cp_group)           # [s, b, np, hn+hv]
        ranks = [list(range(cp))]
    else:
        ranks = [[(get_group_rank(cp_group) - step) % cp] for step in range(cp)]
    q_pos = chunk_positions(seq, cp, get_group_rank(cp_group), query.device)
    results = _ring(q, q_pos, _halves(s_local), kv, hn, ranks, seq, cp,
                    None if comm_type == "all_gather" else cp_group, attention_mask, scale,
                    dropout_p)
    out = _merge_chunks(results, q, _halves(s_local), value.size(-1), softmax_offset)
    return out.permute(2, 0, 1, 3).reshape(s_local, b, -1).to(query.dtype)


def _ring(q, q_pos, q_chunks, kv, hn, ranks, seq, cp, ring_group, mask, scale, dropout_p):
    """The partial results of each query chunk over the key/value blocks of ``ranks`` (one
    list of cp ranks per step: the block in hand holds their tokens, rank by rank); between
    steps the block moves one rank along ``ring_group`` (None: a single step)."""
    chunk = seq // (2 * cp)
    results: List[List[Tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in q_chunks]
    for step, sources in enumerate(ranks):
        k_pos = torch.cat([chunk_positions(seq, cp, r, q.device) for r in sources])
        k_chunks = [(i * chunk, (i + 1) * chunk) for i in range(2 * len(sources))]
        parts, used = _attend(q, q_pos, _to_bhsd(kv[..., :hn]), _to_bhsd(kv[..., hn:]),
                              k_pos, k_chunks, mask, scale, dropout_p, q_chunks)
        # Every ring step's block must reach the backward on every rank (its gradient goes
        # back along the ring): under the causal mask the later query chunks see each other
        # rank's earlier key chunks whole, and an explicit mask computes every pair.
        assert used or ring_group is None, "a ring step's key/value block went unused"
        for c, part in enumerate(parts):
            if part is not None:
                results[c].append(part)
        if step < len(ranks) - 1:
            kv = _RingStep.apply(kv, ring_group)
    return results


def _merge_chunks(results, q: torch.Tensor, q_chunks, hv: int,
                  softmax_offset: Optional[torch.Tensor]) -> torch.Tensor:
    """Each query chunk's partial results (plus the softmax offset's term) merged, the chunks
    side by side: ``[b, np, sq, hv]``; a chunk that saw nothing is zeros."""
    outs = []
    for (start, stop), parts in zip(q_chunks, results):
        b, heads = q.shape[:2]
        like = q.new_zeros(b, heads, stop - start, hv)
        parts = list(parts)
        if softmax_offset is not None:
            parts.append(_sink_part(softmax_offset, like))
        outs.append(_merge(parts) if parts else like)
    return torch.cat(outs, dim=2)


def hierarchical_cp_groups(cp_ranks: Sequence[int], sizes: Sequence[int]
                           ) -> Tuple[List[List[int]], List[List[int]]]:
    """The inner (all-to-all) and outer (ring) groups of one cp group's global ranks, for
    ``--hierarchical-context-parallel-sizes a n``: inner groups are ``a`` neighbouring cp
    ranks, outer groups the cp ranks ``a`` apart. cp ranks ``[0, 1, 2, 3]`` with ``2 2``::

        inner: [0, 1] [2, 3]        outer: [0, 2] [1, 3]
    """
    if len(sizes) != 2 or sizes[0] * sizes[1] != len(cp_ranks):
        raise ContextParallelError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: expected two "
            f"sizes whose product is --context-parallel-size {len(cp_ranks)}")
    inner, outer = sizes
    return ([list(cp_ranks[o * inner:(o + 1) * inner]) for o in range(outer)],
            [list(cp_ranks[j::inner]) for j in range(inner)])


def _hierarchical_attention(query, key, value, cp_group, groups, attention_mask, scale,
                            dropout_p, softmax_offset):
    """``a2a+p2p``: all-to-all over the inner group, a ring over the outer group."""
    if groups is None:
        raise ContextParallelError("--cp-comm-type a2a+p2p needs "
                                   "--hierarchical-context-parallel-sizes")
    a2a_group, p2p_group = groups
    cp, inner, outer = (get_group_size(g) for g in (cp_group, a2a_group, p2p_group))
    s_local, b, heads, hn = query.shape
    if inner * outer != cp or heads % inner:
        raise ContextParallelError(
            f"--cp-comm-type a2a+p2p: --hierarchical-context-parallel-sizes {inner} {outer} "
            f"must multiply to --context-parallel-size {cp}, and the first must divide the "
            f"{heads} attention heads of a tensor-parallel rank")
    j, o = get_group_rank(a2a_group), get_group_rank(p2p_group)
    seq = s_local * cp
    if key.size(2) % inner:
        key, value = _expand_groups(key, heads), _expand_groups(value, heads)
    q = _SequenceToHeads.apply(query, a2a_group)                          # [a s_l, b, np/a, hn]
    share = q.size(2)
    k = _expand_groups(_SequenceToHeads.apply(key, a2a_group), share)
    v = _expand_groups(_SequenceToHeads.apply(value, a2a_group), share)
    kv = torch.cat([k, v], dim=-1)                                        # [a s_l, b, np/a, ..]

    def members(outer_rank):
        return [outer_rank * inner + i for i in range(inner)]

    q_pos = torch.cat([chunk_positions(seq, cp, r, query.device) for r in members(o)])
    chunk = seq // (2 * cp)
    q_chunks = [(i * chunk, (i + 1) * chunk) for i in range(2 * inner)]
    mask = None if attention_mask is None else _gather_mask_rows(attention_mask, a2a_group)
    ranks = [members((o - step) % outer) for step in range(outer)]
    qb = _to_bhsd(q)
    results = _ring(qb, q_pos, q_chunks, kv, hn, ranks, seq, cp, p2p_group, mask, scale,
                    dropout_p)
    offset = None if softmax_offset is None else softmax_offset[j * share:(j + 1) * share]
    out = _merge_chunks(results, qb, q_chunks, value.size(-1), offset)    # [b, np/a, a s_l, hv]
    out = out.permute(2, 0, 1, 3).to(query.dtype).contiguous()            # [a s_l, b, np/a, hv]
    out = _HeadsToSequence.apply(out, a2a_group)                          # [s_l, b, np, hv]
    return out.reshape(s_local, b, -1)


def _gather_mask_rows(mask: torch.Tensor, group) -> torch.Tensor:
    """Every cp rank's query rows of a ``[b, 1, s_local, s]`` mask, rank by rank: ``[b, 1,
    cp * s_local, s]`` (sent as bytes: a bool all-gather is not on every backend)."""
    cp = get_group_size(group)
    mine = mask.to(torch.uint8).contiguous()
    rows = torch.empty((cp, *mine.shape), dtype=torch.uint8, device=mine.device)
    all_gather_into_tensor(rows, mine, group)                            # [cp, b, 1, s_l, s]
    b, _, s_local, seq = mine.shape
    return rows.permute(1, 2, 0, 3, 4).reshape(b, 1, cp * s_local, seq).bool()


def _a2a_attention(query, key, value, cp_group, attention_mask, scale, dropout_p,
                   softmax_offset=None):
    cp = get_group_size(cp_group)
    s_local, b, heads, hn = query.shape
    if heads % cp:
        raise ContextParallelError(f"--cp-comm-type a2a splits the {heads} attention heads of "
                                   f"a tensor-parallel rank over --context-parallel-size {cp}; "
                                   "they must divide evenly (or use p2p / all_gather)")
    groups = key.size(2)
    if groups % cp:
        key, value = _expand_groups(key, heads), _expand_groups(value, heads)
    seq = s_local * cp
    q = _SequenceToHeads.apply(query, cp_group)                          # [s, b, np/cp, hn]
    k = _SequenceToHeads.apply(key, cp_group)
    v = _SequenceToHeads.apply(value, cp_group)
    k = _expand_groups(k, q.size(2))
    v = _expand_groups(v, q.size(2))
    # The gathered sequence is rank by rank, each rank's tokens in its chunk order.
    pos = torch.cat([chunk_positions(seq, cp, j, query.device) for j in range(cp)])
    if attention_mask is None:
        masked = (pos[None, :] > pos[:, None])[None, None]               # [1, 1, s, s]
    else:
        masked = _gather_mask_rows(attention_mask, cp_group).index_select(3, pos)  # [b,1,s,s]
    out, lse = _block_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), masked, scale,
                                dropout_p)
    if softmax_offset is not None:
        # This rank holds heads [rank * share, (rank + 1) * share) of the sequence-to-heads swap.
        share, rank = q.size(2), get_group_rank(cp_group)
        mine = softmax_offset[rank * share:(rank + 1) * share]
        out = _merge([(out, lse), _sink_part(mine, out)])
    out = out.permute(2, 0, 1, 3).to(query.dtype)                        # [s, b, np/cp, hv]
    out = _HeadsToSequence.apply(out.contiguous(), cp_group)             # [s_l, b, np, hv]
    return out.reshape(s_local, b, -1)


__all__ = ["COMM_TYPES", "ContextParallelError", "check_sequence_length", "chunk_positions",
           "split_for_cp_rank", "get_batch_on_this_cp_rank", "context_parallel_attention",
           "hierarchical_cp_groups", "window_mask_rows"]

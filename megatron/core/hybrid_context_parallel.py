"""Hybrid (per-sequence, dynamic) context parallelism: Megatron's ``--hybrid-context-parallel``.

With packed variable-length samples, a fixed context-parallel size wastes work: a short sequence
split over many ranks spends its time in exchanges. Here every sequence of a global batch gets its
own context-parallel size over the combined data-parallel x context-parallel ranks (``n`` of them,
a power of two): the smallest power of two ``p`` with ``p * max_seqlen_per_dp_cp_rank >= length``
(Megatron's ``--max-seqlen-per-dp-cp-rank``). A deterministic scheduler then deals the sequences
to groups of ranks so that every rank has about the same attention work, estimated as
``length**2 / cp``.

The schedule is a list of *rounds* (Megatron calls them groups). Inside a round every rank runs
its sequences in order; a sequence with cp size ``c`` runs on ``c`` neighbouring ranks which all
hold it; between rounds the ranks meet at a barrier, because the rank sets change. One round is
built from the sequences still unplaced, longest first:

1. the sequences are cut, in order, into ``k`` buckets (``k``: how many distinct cp sizes they
   need) of about equal total work: a bucket is closed before a sequence that would take it over
   1.1 x the mean, or when the sequences left are needed to fill the remaining buckets (Megatron
   counts the remaining buckets as ``k - 2 * closed``; we keep its rule so schedules agree);
2. repeatedly the head of the first bucket that fits is placed: on the least-loaded existing rank
   set of its cp size, or on a new set of the lowest free ranks when that set is less loaded;
3. once a sequence smaller than the round's first one has been placed, the round closes as soon
   as the spread of loads is within 5 % of the largest;
4. the most-loaded set gives back its last sequence while that narrows the spread;
5. idle ranks are filled by doubling the cp size of the first smallest set (the sets after it
   move up), until every rank has work.

Sequences not placed go to the next round, in their order. Worked example: 4 ranks, 16 tokens
per rank, sequences (id: length) 0: 64, 1: 16, 2: 16, 3..6: 8, 7: 32 (cp sizes 4, 1, 1, 1, 2)::

    round 0   rank 0: [0]   rank 1: [0]   rank 2: [0]        rank 3: [0]
    round 1   rank 0: [7]   rank 1: [7]   rank 2: [1, 3, 5]  rank 3: [2, 4, 6]

Sequence 0 needs every rank; in round 1 sequence 7 takes ranks 0-1 (work 32**2 / 2 = 512) and
the short ones are dealt to the least-loaded single ranks (256 + 64 + 64 each).
 A sequence always runs on
neighbouring ranks, usually an aligned block (ranks ``[i c, (i + 1) c)``), but step 5 can shift a
set off that grid (seen with 16 ranks), so the runner makes one process group per block the
schedule uses rather than Megatron's fixed aligned blocks.
"""

from collections import deque
from typing import Dict, List, Sequence, Tuple

BALANCE_SLACK = 0.05
BUCKET_OVERFILL = 1.1


class HybridContextParallelError(ValueError):
    """A sequence or layout that hybrid context parallelism cannot schedule; names the flag."""


def cp_size_for(seq_length: int, max_seqlen_per_rank: int) -> int:
    """The smallest power of two ``p`` with ``p * max_seqlen_per_rank >= seq_length`` (>= 1)."""
    size = 1
    while size * max_seqlen_per_rank < seq_length:
        size *= 2
    return size


def workload(seq_length: int, cp_size: int) -> float:
    """Relative attention work of one rank on a sequence split over ``cp_size`` ranks."""
    return seq_length * seq_length / cp_size


class _Round:
    """The state of one round being built over ``n`` ranks."""

    def __init__(self, n: int):
        self.ids: List[List[int]] = [[] for _ in range(n)]
        self.lengths: List[List[int]] = [[] for _ in range(n)]
        self.load = [0.0] * n
        self.free = [True] * n
        self.members: Dict[int, List[int]] = {}   # set id -> ranks, in creation order

    def sizes(self) -> Dict[int, int]:
        return {gid: len(ranks) for gid, ranks in self.members.items()}

    def fits(self, need: int) -> bool:
        return need in self.sizes().values() or sum(self.free) >= need

    def place(self, sample_id: int, length: int, need: int) -> None:
        existing = [gid for gid, size in self.sizes().items() if size == need]
        best, best_load = None, float("inf")
        for gid in existing:                              # first of the least loaded wins
            load = max(self.load[r] for r in self.members[gid])
            if load < best_load:
                best, best_load = gid, load
        free = [r for r in range(len(self.free)) if self.free[r]]
        if len(free) >= need:
            fresh = sorted(free, key=lambda r: self.load[r])[:need]
            if self.load[fresh[-1]] < best_load:
                best = len(self.members)
                self.members[best] = fresh
                for r in fresh:
                    self.free[r] = False
        cost = workload(length, need)
        for r in self.members[best]:
            self.ids[r].append(sample_id)
            self.lengths[r].append(length)
            self.load[r] += cost

    def spread_ok(self) -> bool:
        return max(self.load) - min(self.load) <= BALANCE_SLACK * max(self.load)


def _buckets(items: List[Tuple[int, int]], max_len: int) -> List[deque]:
    """Cut ``items`` (sample id, length), in order, into buckets of about equal work."""
    k = len({cp_size_for(length, max_len) for _, length in items})
    target = sum(workload(length, cp_size_for(length, max_len)) for _, length in items) / k
    buckets, current, current_work = [], [], 0.0
    for i, (sample_id, length) in enumerate(items):
        work = workload(length, cp_size_for(length, max_len))
        closed = len(buckets)
        if current and (current_work + work > target * BUCKET_OVERFILL
                        or len(items) - i <= k - 2 * closed):
            buckets.append(deque(current))
            current, current_work = [], 0.0
        current.append((sample_id, length))
        current_work += work
    if current:
        buckets.append(deque(current))
    return buckets


def _fill_round(rnd: _Round, buckets: List[deque], max_len: int) -> None:
    """Steps 2 and 3 of the module docstring: place bucket heads until none fits or balanced."""
    first_need, check_balance = None, False
    while buckets:
        chosen = next((b for b in buckets if b and rnd.fits(cp_size_for(b[0][1], max_len))),
                      None)
        if chosen is None:
            return
        sample_id, length = chosen.popleft()
        need = cp_size_for(length, max_len)
        first_need = need if first_need is None else first_need
        rnd.place(sample_id, length, need)
        while buckets and not buckets[0]:
            buckets.pop(0)
        check_balance = check_balance or need < first_need
        if check_balance and buckets and rnd.spread_ok():
            return


def _trim(rnd: _Round, leftovers: List[Tuple[int, int]], max_len: int) -> None:
    """Step 4: the most-loaded set gives back its last sequence while the spread narrows."""
    while True:
        top, low = max(rnd.load), min(rnd.load)
        if rnd.spread_ok() or low == 0:
            return
        r = rnd.load.index(top)
        if len(rnd.ids[r]) <= 1:
            return
        members = next(m for m in rnd.members.values() if r in m)
        cost = workload(rnd.lengths[r][-1], cp_size_for(rnd.lengths[r][-1], max_len))
        projected = [load - cost if i in members else load for i, load in enumerate(rnd.load)]
        if max(projected) - min(projected) >= top - low:
            return
        leftovers.append((rnd.ids[r][-1], rnd.lengths[r][-1]))
        for m in members:
            rnd.ids[m].pop()
            rnd.lengths[m].pop()
            rnd.load[m] -= cost


def _widen(rnd: _Round) -> None:
    """Step 5: double the first smallest set (later sets move up) until no rank is idle."""
    n = len(rnd.ids)
    while any(not ids for ids in rnd.ids):
        smallest = min(len(m) for m in rnd.members.values())
        grow = min(2 * smallest, n) - smallest
        gid = next(g for g, m in rnd.members.items() if len(m) == smallest)
        start, end = rnd.members[gid][0], rnd.members[gid][-1]
        idle = next(r for r, ids in enumerate(rnd.ids) if not ids)
        if idle + grow > n:
            raise HybridContextParallelError(
                "--hybrid-context-parallel: cannot widen a rank set over idle ranks; "
                "try a smaller --max-seqlen-per-dp-cp-rank")
        moved = list(range(end + 1, idle))
        ids, lengths, load = rnd.ids[:], rnd.lengths[:], rnd.load[:]
        for r in range(start, end + grow + 1):
            ids[r], lengths[r] = rnd.ids[end], rnd.lengths[end]
            load[r] = workload(rnd.lengths[end][0], smallest + grow)
        for i, r in enumerate(moved):
            ids[end + grow + 1 + i] = rnd.ids[r]
            lengths[end + grow + 1 + i] = rnd.lengths[r]
            load[end + grow + 1 + i] = rnd.load[r]
        rnd.ids, rnd.lengths, rnd.load = ids, lengths, load
        for g in list(rnd.members):
            if g == gid:
                rnd.members[g] = list(range(start, end + grow + 1))
            elif g > gid:
                rnd.members[g] = [r + grow for r in rnd.members[g]]


def _next_round(items: List[Tuple[int, int]], max_len: int, n: int
                ) -> Tuple[List[List[int]], List[Tuple[int, int]]]:
    """One round: the sample ids each rank runs, and the (id, length) pairs left over."""
    rnd = _Round(n)
    buckets = _buckets(items, max_len)
    _fill_round(rnd, buckets, max_len)
    leftovers = [item for bucket in buckets for item in bucket]
    _trim(rnd, leftovers, max_len)
    _widen(rnd)
    return rnd.ids, leftovers


def schedule_hybrid_cp(seq_lengths: Sequence[int], max_seqlen_per_rank: int,
                       dp_cp_size: int) -> List[List[List[int]]]:
    """Deal the sequences of one global batch to the data x context-parallel ranks.

    Args:
        seq_lengths: the length of every sequence of the global batch; sample ``i`` has id ``i``.
        max_seqlen_per_rank: ``--max-seqlen-per-dp-cp-rank``.
        dp_cp_size: data-parallel x context-parallel size (a power of two).

    Returns:
        ``rounds[j][rank]``: the ids rank ``rank`` runs in round ``j``, in order. A sequence's
        cp size in a round is the number of ranks whose list holds it.
    """
    if dp_cp_size < 1 or dp_cp_size & (dp_cp_size - 1):
        raise HybridContextParallelError(
            f"--hybrid-context-parallel needs data-parallel x context-parallel size to be a "
            f"power of two, got {dp_cp_size}")
    if max_seqlen_per_rank is None or max_seqlen_per_rank < 1:
        raise HybridContextParallelError(
            f"--hybrid-context-parallel needs --max-seqlen-per-dp-cp-rank >= 1, got "
            f"{max_seqlen_per_rank}")
    for i, length in enumerate(seq_lengths):
        if length < 1 or cp_size_for(length, max_seqlen_per_rank) > dp_cp_size:
            raise HybridContextParallelError(
                f"sequence {i} of the global batch has {length} tokens: more than "
                f"{dp_cp_size} ranks x --max-seqlen-per-dp-cp-rank {max_seqlen_per_rank} "
                f"(or empty)")
    items = sorted(enumerate(seq_lengths), key=lambda item: item[1], reverse=True)
    rounds = []
    while items:
        ids, items = _next_round(items, max_seqlen_per_rank, dp_cp_size)
        rounds.append(ids)
    return rounds


def ranks_of(round_ids: List[List[int]], sample_id: int) -> List[int]:
    """The ranks (indices into the data x context group) that run ``sample_id`` in a round."""
    return [r for r, ids in enumerate(round_ids) if sample_id in ids]

"""The hybrid context-parallel scheduler (megatron/core/hybrid_context_parallel.py) against a naive,
flat transcription of Megatron's documented rule (rank-group ids in a list, loads recomputed from
the assignment, float cp-size formula), on random global batches; plus the properties the runner
relies on: every sequence runs exactly once, on a power-of-two block of neighbouring ranks at least
its cp size, and no rank is idle in a round.
"""

import math
import random

import pytest

from megatron.core.hybrid_context_parallel import (HybridContextParallelError, cp_size_for,
                                                   ranks_of,
                                                   schedule_hybrid_cp)


def _need(length, m):
    return max(1, 2 ** math.ceil(math.log2(length / m)))


def _work(length, m):
    return length * length / _need(length, m)


def _naive_buckets(items, m):
    k = len({_need(length, m) for _, length in items})
    target = sum(_work(length, m) for _, length in items) / k
    out, cur, acc, remaining_k = [], [], 0.0, k
    for i, (sid, length) in enumerate(items):
        if cur and (acc + _work(length, m) > 1.1 * target or len(items) - i <= remaining_k - len(out)):
            out.append(list(cur))
            cur, acc = [], 0.0
            remaining_k -= 1
        cur.append((sid, length))
        acc += _work(length, m)
    return out + ([cur] if cur else [])


def _naive_round(items, m, n):
    buckets = _naive_buckets(items, m)
    ids, lens, times, gid_of, sizes, members = ([[] for _ in range(n)], [[] for _ in range(n)],
                                                [0.0] * n, [None] * n, [], [])
    first = None
    balance = False
    while buckets:
        pick = None
        for b in buckets:
            if b:
                need = _need(b[0][1], m)
                if need in sizes or gid_of.count(None) >= need:
                    pick = b
                    break
        if pick is None:
            break
        sid, length = pick.pop(0)
        need = _need(length, m)
        first = first or need
        cands = [(max(times[r] for r in members[g]), g) for g in range(len(sizes)) if sizes[g] == need]
        best_load, best = min(cands, key=lambda t: t[0]) if cands else (float("inf"), None)
        free = sorted([r for r in range(n) if gid_of[r] is None], key=lambda r: times[r])
        if len(free) >= need and times[free[need - 1]] < best_load:
            best = len(sizes)
            sizes.append(need)
            members.append(free[:need])
            for r in free[:need]:
                gid_of[r] = best
        for r in members[best]:
            ids[r].append(sid)
            lens[r].append(length)
            times[r] += _work(length, m)
        while buckets and not buckets[0]:
            del buckets[0]
        if need < first:
            balance = True
        if balance and buckets and max(times) - min(times) <= 0.05 * max(times):
            break
    left = [x for b in buckets for x in b]
    while max(times) - min(times) > 0.05 * max(times) and min(times) > 0:
        r = times.index(max(times))
        if len(ids[r]) <= 1:
            break
        g, cost = gid_of[r], _work(lens[r][-1], m)
        proj = [t - cost if gid_of[i] == g else t for i, t in enumerate(times)]
        if max(proj) - min(proj) >= max(times) - min(times):
            break
        left.append((ids[r][-1], lens[r][-1]))
        for i in members[g]:
            ids[i].pop()
            lens[i].pop()
            times[i] -= cost
    while not all(ids):
        small = min(sizes)
        grow = min(2 * small, n) - small
        g = sizes.index(small)
        lo, hi = members[g][0], members[g][-1]
        hole = [bool(x) for x in ids].index(False)
        new_ids = ids[:lo] + [ids[hi]] * (hi - lo + 1 + grow) + ids[hi + 1:hole]
        new_lens = lens[:lo] + [lens[hi]] * (hi - lo + 1 + grow) + lens[hi + 1:hole]
        ids = (new_ids + [[]] * n)[:n]
        lens = (new_lens + [[]] * n)[:n]
        sizes[g] += grow
        members = [list(range(lo, hi + grow + 1)) if j == g else
                   ([r + grow for r in mem] if j > g else mem) for j, mem in enumerate(members)]
    return ids, left


def _naive_schedule(lengths, m, n):
    items = sorted(enumerate(lengths), key=lambda x: -x[1])
    out = []
    while items:
        ids, items = _naive_round(items, m, n)
        out.append(ids)
    return out


def test_cp_size_is_the_next_power_of_two_of_length_over_the_per_rank_maximum():
    for m in (1, 3, 8, 100):
        for length in range(1, 40 * m, max(1, m // 3)):
            assert cp_size_for(length, m) == _need(length, m)
    assert [cp_size_for(x, 16) for x in (1, 16, 17, 32, 33, 64, 65)] == [1, 1, 2, 2, 4, 4, 8]


def test_a_worked_batch():
    # 64 tokens at 16 per rank needs all 4 ranks alone; then 32 on two ranks beside the shorts.
    assert schedule_hybrid_cp([64, 16, 16, 8, 8, 8, 8, 32], 16, 4) == [
        [[0], [0], [0], [0]], [[7], [7], [1, 3, 5], [2, 4, 6]]]
    # one short sequence alone is widened over every rank rather than leaving ranks idle
    assert schedule_hybrid_cp([16], 16, 4) == [[[0], [0], [0], [0]]]


@pytest.mark.parametrize("seed", range(6))
def test_schedule_equals_the_naive_rule_and_every_sequence_runs_once(seed):
    rng = random.Random(seed)
    for _ in range(150):
        n, m = rng.choice([1, 2, 4, 8, 16]), rng.choice([4, 8, 16, 64])
        lengths = [rng.randint(1, n * m) for _ in range(rng.randint(1, 24))]
        rounds = schedule_hybrid_cp(lengths, m, n)
        assert rounds == _naive_schedule(lengths, m, n), (lengths, m, n)
        assert rounds == schedule_hybrid_cp(list(lengths), m, n)       # deterministic
        seen = []
        for rnd in rounds:
            assert all(rnd), "a rank is idle in a round"
            for sid in sorted({i for ids in rnd for i in ids}):
                block = ranks_of(rnd, sid)
                assert len(block) >= cp_size_for(lengths[sid], m)
                assert block == list(range(block[0], block[0] + len(block)))
                assert len(block) & (len(block) - 1) == 0
                seen.append(sid)
        assert sorted(seen) == list(range(len(lengths)))


def test_bad_input_names_the_flag():
    with pytest.raises(HybridContextParallelError, match="max-seqlen-per-dp-cp-rank 16"):
        schedule_hybrid_cp([65], 16, 4)
    with pytest.raises(HybridContextParallelError, match="power of two, got 6"):
        schedule_hybrid_cp([8], 16, 6)
    with pytest.raises(HybridContextParallelError, match="--max-seqlen-per-dp-cp-rank >= 1"):
        schedule_hybrid_cp([8], None, 4)


SFT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 48 "
       "--max-position-embeddings 48 --micro-batch-size 1 --train-iters 10 --sft "
       "--tokenizer-type SFTTokenizer --tokenizer-model tok --calculate-per-token-loss "
       "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank 12").split()


def _validate(argv, world_size=4):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=argv)
    args.world_size = world_size
    return validate_args(args)


def test_the_flags_validate_on_four_data_parallel_ranks():
    args = _validate(SFT)
    assert args.hybrid_context_parallel and args.max_seqlen_per_dp_cp_rank == 12
    assert args.data_parallel_size == 4 and args.dataloader_type == "single"


@pytest.mark.parametrize("change, world, message", [
    ({"--calculate-per-token-loss": None}, 4, "must be used with --calculate-per-token-loss"),
    ({"--micro-batch-size": "2"}, 4, "needs --micro-batch-size 1, got 2"),
    ({"--dataloader-type": "cyclic"}, 4, "needs --dataloader-type single, got cyclic"),
    ({"--max-seqlen-per-dp-cp-rank": "11"}, 4, "--seq-length 48 exceeds 4 x "
                                              "--max-seqlen-per-dp-cp-rank 11"),
    ({"--max-seqlen-per-dp-cp-rank": None}, 4, "needs --max-seqlen-per-dp-cp-rank >= 1"),
    ({"--pipeline-model-parallel-size": "2"}, 4, "does not support pipeline parallelism"),
    ({"--tensor-model-parallel-size": "2"}, 8, "with tensor parallelism is not built yet"),
    ({"--max-seqlen-per-dp-cp-rank": "16"}, 3, "power-of-two data-parallel size, got 3"),
    ({"--cp-comm-type": "a2a+p2p"}, 4, "a2a\\+p2p is not built yet"),
    ({"--eval-micro-batch-size": "2", "--global-batch-size": "8"}, 4,
     "needs --eval-micro-batch-size 1, got 2"),
    ({"--hybrid-context-parallel": None}, 4,
     "--max-seqlen-per-dp-cp-rank is read only with --hybrid-context-parallel"),
])
def test_what_megatron_requires_and_what_is_not_built_is_refused(change, world, message):
    from megatron.training.arguments import ArgumentsError

    argv = list(SFT)
    for flag, value in change.items():
        i = argv.index(flag) if flag in argv else None
        if i is not None:
            del argv[i:i + (2 if argv[i + 1:i + 2] and not argv[i + 1].startswith("--")
                            else 1)]
        if value is not None:
            argv += [flag, value]
    with pytest.raises(ArgumentsError, match=message):
        _validate(argv, world)

"""Hidden-state mixing of multi-token prediction (``--mtp-hsm``), as Megatron-Core does it.

Without mixing, MTP depth K (0-based) takes the hidden state depth K - 1 produced (depth 0:
the main model's). With mixing, in training only (an MTP block in eval mode, and so every
evaluation and generation, is unchanged), each depth K >= 1 takes, independently for every
token, a uniformly random pick among the states accumulated so far:

* the history starts with the main model's hidden state (detached under
  ``--mtp-detach-heads``) and each depth appends its output;
* before depth K >= 1 mixes, every entry but the newest is shifted left one more place along
  the sequence, the way the tokens are: entry J (0: the main model's, J: depth J - 1's output)
  has then moved K - J places, so at place i it has read the tokens up to i + K, as the
  newest state (depth K - 1's output, not shifted) has. The shifted entries replace the
  unshifted ones in the history, so the shifts accumulate from depth to depth;
* a place whose shifted entry has no continuation takes zeros there (the end of the
  sequence, of a packed sequence, and under sequence parallelism the end of this rank's
  slice: the shift stays on the rank, see :func:`roll_history`); where the pick falls on an
  all-zero older state the newest state is used instead;
* the pick is uniform over the K + 1 states (the K shifted older ones and the newest);
  gradients flow to the picked states. Under context parallelism without sequence
  parallelism the shift takes each chunk's last place from the rank holding the next chunk,
  and, as through Megatron-Core's send/receive, no gradient goes back to that rank.

The picks of one depth are drawn at once, ``randint(K + 1)`` over the whole sequence of this
data-parallel replica (``owners x s`` places, ``owners`` = sequence-parallel x
context-parallel ranks, each holding ``s`` places), and each owner keeps its own slice,
``owner = cp_rank x sp_size + sp_rank``: tensor-parallel ranks that hold the same places pick
the same states, and the slices together are one draw of the whole. Note that under context
parallelism a slice is a stretch of the draw, not the places of the owner's two chunks.

The draws come from a stream of their own in the RNG tracker, ``'mtp-hsm-rng'``, seeded per
data-parallel replica with the default stream's seed (``--seed`` plus the pipeline stage's
offset) ``+ 2**40 + dp_rank``. The tracker's states go into checkpoints and into the RNG
snapshots that recomputation and reruns restore, so a resumed run draws what the
uninterrupted one did (the mixing itself sits outside the recomputed layers). Without seeded
streams (a model used outside training) the default stream is drawn from, as Megatron-Core
does.
"""

import contextlib
from typing import Optional, Tuple

import torch

from megatron.core import device
from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.model.sequence_shift import roll_left

HSM_RNG_TRACKER_NAME = "mtp-hsm-rng"
HSM_SEED_OFFSET = 1 << 40


def hsm_seed(dp_rank: int) -> int:
    """The mixing stream's seed on a replica: the default stream's seed + 2**40 + dp_rank
    (the seed the streams were set up with; without them the device generator's)."""
    initial = get_cuda_rng_tracker().default_seed
    if initial is None:
        initial = torch.cuda.initial_seed() if device.is_cuda() else torch.initial_seed()
    return (initial + HSM_SEED_OFFSET + dp_rank) % (2 ** 63 - 1)


def add_hsm_stream(seed: int) -> bool:
    """Create the mixing stream from ``seed`` unless it exists; False (nothing created) when
    the tracker has no seeded streams."""
    tracker = get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return False
    tracker.add_if_missing(HSM_RNG_TRACKER_NAME, seed)
    return True


def hsm_rng_context(seed: int):
    """Draw from the mixing stream (created from ``seed`` if it is missing) inside the block;
    without seeded streams, from the default stream."""
    if not add_hsm_stream(seed):
        return contextlib.nullcontext()
    return get_cuda_rng_tracker().fork(HSM_RNG_TRACKER_NAME)


def sequence_owner(sp_group, cp_group) -> Tuple[int, int]:
    """``(owners, owner)``: how many ranks split this replica's sequence (sequence-parallel
    ranks, None when off, times context-parallel ranks) and which of them this rank is."""
    sp_size = get_group_size(sp_group)
    owner = get_group_rank(cp_group) * sp_size + get_group_rank(sp_group)
    return sp_size * get_group_size(cp_group), owner


def draw_picks(num_states: int, seq: int, batch: int, owners: int, owner: int,
               rng_seed: int, on: torch.device) -> torch.Tensor:
    """``[seq, batch]`` picks in ``[0, num_states)``: this owner's slice of one draw over the
    replica's ``owners x seq`` places."""
    with hsm_rng_context(rng_seed):
        picks = torch.randint(num_states, (owners * seq, batch), device=on)
    return picks[owner * seq:(owner + 1) * seq]


def mix_hidden_states(older: torch.Tensor, newest: torch.Tensor,
                      picks: torch.Tensor) -> torch.Tensor:
    """Each place's picked state.

    Args:
        older: ``[n, s, b, h]`` the shifted older states.
        newest: ``[s, b, h]`` the previous depth's output.
        picks: ``[s, b]`` in ``[0, n]``: ``n`` is the newest state; an older state that is
            all zeros at that place also gives the newest.

    Returns:
        ``[s, b, h]``; gradients flow to the picked states.
    """
    n, hidden = older.size(0), older.size(-1)
    older_pick = picks.clamp(max=n - 1).unsqueeze(0).unsqueeze(-1)            # [1, s, b, 1]
    chosen = torch.gather(older, 0, older_pick.expand(1, -1, -1, hidden))[0]  # [s, b, h]
    chosen_is_zero = torch.gather(older.eq(0).all(dim=-1), 0, older_pick[..., 0])[0]
    use_newest = (picks == n) | chosen_is_zero                                # [s, b]
    return torch.where(use_newest.unsqueeze(-1), newest, chosen)


def roll_history(older: torch.Tensor, cp_group=None, ends: Optional[torch.Tensor] = None,
                 sp_group=None) -> torch.Tensor:
    """``older [n, s, b, h]`` shifted left one place along the sequence, places without a
    continuation 0.

    Without sequence parallelism the shift is the tokens' (:func:`roll_left` over the whole
    context-parallel sequence, inside packed sequences ``ends [b, s_cp]``). With sequence
    parallelism (``sp_group``; ``s`` is this rank's slice of the cp-local sequence) the shift
    stays on the rank, as in Megatron-Core: the slice's last place, the last place of the
    first context-parallel chunk (unless its neighbour is the second chunk, on the last cp
    rank) and the packed sequences' last places get 0, so the mixing uses the newest state
    there.
    """
    by_place = older.permute(0, 3, 2, 1)                                     # [n, h, b, s]
    sp_size = get_group_size(sp_group)
    if sp_size == 1:
        return roll_left(by_place, cp_group, ends).permute(0, 3, 2, 1)
    seq, batch = older.size(1), older.size(2)
    start = get_group_rank(sp_group) * seq
    breaks = torch.zeros(batch, seq, dtype=torch.bool, device=older.device)  # [b, s]
    breaks[:, -1] = True
    cp_size = get_group_size(cp_group)
    chunk_end = seq * sp_size // 2 - 1 - start
    if cp_size > 1 and get_group_rank(cp_group) != cp_size - 1 and 0 <= chunk_end < seq:
        breaks[:, chunk_end] = True
    if ends is not None:
        breaks |= ends[:, start:start + seq]
    rolled = torch.roll(by_place, shifts=-1, dims=-1).masked_fill(breaks, 0)
    return rolled.permute(0, 3, 2, 1)

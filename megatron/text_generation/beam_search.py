"""Beam search for one prompt, as Megatron's generation server runs it (``beam_width``).

Each step extends every open beam by every token: a candidate's score is its beam's summed
log-probability plus the token's (``log_softmax`` over the padded vocabulary, Megatron's
normalisation; padded ids are never chosen). Of the ``2 x beam_width`` best candidates, taken
in order, a stop token among the first ``beam_width`` closes its beam into the finished
hypotheses (length = tokens generated, the stop token counted) and a later one is dropped; the
others become the next beams until there are ``beam_width`` of them. A hypothesis is ranked by
``summed log-probability / length ** length_penalty``; the finished set keeps the best
``beam_width``, and the search stops early once it is full and no open beam can beat its worst
(the best candidate's score over the current length). Beams still open at the end join the set
with their length; the result is the set, best first.

Every rank runs the same bookkeeping: the last pipeline stage's ``2 x beam_width`` best
candidates (scores and flat indices) are broadcast each step, so the beams, and the result,
are the same on every rank. There is no key/value cache to reorder: each step runs the beams'
whole prefixes (a beam request is one prompt, at most ``beam_width`` rows).
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.text_generation.generation import (ForwardStep, GenerationError,
                                                 agree_over_tensor_parallel,
                                                 broadcast_from_last_stage, unwrap_gpt)


@dataclass
class BeamOutput:
    """The hypotheses, best first: each one's ids (prompt + generation) and score."""

    tokens: List[List[int]]
    scores: List[float]


class _Finished:
    """The best ``size`` finished hypotheses seen so far (score, ids)."""

    def __init__(self, size: int, length_penalty: float):
        self.size = size
        self.length_penalty = length_penalty
        self.kept: List[Tuple[float, List[int]]] = []
        self.worst = 1e9

    def _score(self, total: float, length: int) -> float:
        return total / length ** self.length_penalty

    def add(self, ids: List[int], total: float, length: int) -> None:
        score = self._score(total, length)
        if len(self.kept) >= self.size and score <= self.worst:
            return
        self.kept.append((score, ids))
        if len(self.kept) > self.size:
            ranked = sorted((s, i) for i, (s, _) in enumerate(self.kept))
            del self.kept[ranked[0][1]]
            self.worst = ranked[1][0]
        else:
            self.worst = min(score, self.worst)

    def cannot_improve(self, best_total: float, length: int) -> bool:
        return (len(self.kept) >= self.size
                and self.worst >= self._score(best_total, length))


def beam_search(model: torch.nn.Module, pstate, prompt: List[int], *, tokens_to_generate: int,
                beam_width: int, stop_token: int, vocab_size: int, pad_token: int,
                length_penalty: float = 1.0, banned_after: Optional[Tuple[int, int]] = None,
                device=None) -> BeamOutput:
    """Search ``tokens_to_generate`` tokens after ``prompt`` (see the module docstring).

    ``banned_after``: as in :func:`~megatron.text_generation.generation.generate_tokens`.
    """
    gpt = unwrap_gpt(model)
    n, total = len(prompt), len(prompt) + tokens_to_generate
    if tokens_to_generate < 1:
        raise GenerationError("beam search needs tokens_to_generate of at least 1")
    if not 1 <= beam_width < vocab_size:
        raise GenerationError(f"beam_width must be between 1 and the vocabulary size "
                              f"({vocab_size}) - 1, got {beam_width}")
    if n == 0 or total > gpt.config.max_position_embeddings:
        raise GenerationError(f"a prompt of {n} tokens + tokens_to_generate "
                              f"({tokens_to_generate}) does not fit the model's "
                              f"{gpt.config.max_position_embeddings} positions")
    tokens = torch.full((beam_width, total), pad_token, dtype=torch.int64, device=device)
    tokens[:, :n] = torch.tensor(prompt, dtype=torch.int64, device=device)
    positions = torch.arange(total, device=device).expand(beam_width, total)
    scores = torch.zeros(beam_width, dtype=torch.float32, device=device)
    finished = _Finished(beam_width, length_penalty)
    step = ForwardStep(model, pstate)
    top = 2 * beam_width
    best = torch.empty(top, dtype=torch.float32, device=device)
    where = torch.empty(top, dtype=torch.int64, device=device)
    done, context = False, n
    for context in range(n, total):
        logits = step(tokens[:, :context], positions[:, :context])
        if step.is_last:
            last = logits[:, -1, :].float()
            if banned_after is not None:
                last[tokens[:, context - 1] == banned_after[0], banned_after[1]] = -1e10
            candidates = F.log_softmax(last, dim=-1)
            candidates[:, vocab_size:] = float("-inf")
            candidates += scores.unsqueeze(1)
            # At the first step every beam is the prompt: one row, or each token would come
            # back beam_width times.
            flat = candidates[0] if context == n else candidates.reshape(-1)
            width = candidates.size(1)
            found, order = torch.sort(flat, descending=True, stable=True)
            k = min(top, flat.numel())
            best.fill_(float("-inf"))
            where.zero_()
            best[:k], where[:k] = found[:k], order[:k]
            agree_over_tensor_parallel(best, pstate)
            agree_over_tensor_parallel(where, pstate)
            width_t = torch.tensor([width], dtype=torch.int64, device=device)
        else:
            width_t = torch.zeros(1, dtype=torch.int64, device=device)
        broadcast_from_last_stage(best, pstate)
        broadcast_from_last_stage(where, pstate)
        width = int(broadcast_from_last_stage(width_t, pstate).item())
        kept: List[Tuple[int, float, int]] = []
        for rank, (score, index) in enumerate(zip(best.tolist(), where.tolist())):
            if score == float("-inf"):
                break
            beam, token = divmod(index, width)
            if token == stop_token:
                if rank < beam_width:
                    finished.add(tokens[beam, :context].tolist() + [token], score,
                                 context + 1 - n)
            else:
                kept.append((token, score, beam))
            if len(kept) == beam_width:
                break
        if finished.cannot_improve(best.max().item(), context + 1 - n):
            done = True
            break
        if len(kept) < beam_width:
            raise GenerationError(f"beam search found {len(kept)} continuations for "
                                  f"{beam_width} beams")
        rows = torch.tensor([beam for _, _, beam in kept], dtype=torch.int64, device=device)
        tokens = tokens[rows]
        tokens[:, context] = torch.tensor([t for t, _, _ in kept], dtype=torch.int64,
                                          device=device)
        scores = torch.tensor([s for _, s, _ in kept], dtype=torch.float32, device=device)
    if not done:
        for beam in range(beam_width):
            finished.add(tokens[beam, :context + 1].tolist(), float(scores[beam]),
                         context + 1 - n)
    ranked = sorted(finished.kept, key=lambda item: item[0], reverse=True)
    return BeamOutput([ids for _, ids in ranked], [score for score, _ in ranked])

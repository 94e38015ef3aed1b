"""Autoregressive generation with a key/value cache, across tensor and pipeline ranks.

Every rank of the model runs the same loop on the same ``[b, L]`` token buffer (the prompts
left-aligned, ``L`` = longest prompt + tokens to generate). Step by step, as in Megatron:

1. A forward pass over the new positions, stage by stage: the first stage embeds the tokens,
   each stage sends its hidden states ``[s, b, h]`` to the next with the pipeline communicator,
   and the last stage gathers its vocabulary-parallel logits to ``[b, s, V]`` over the
   tensor-parallel group. With the cache (``use_kv_cache``) the first step feeds the shortest
   prompt and each later step one position; without it every step recomputes the whole prefix.
2. The last stage samples the next token of every sequence (all its tensor-parallel ranks draw
   from generators seeded alike, and its first tensor-parallel rank's choice is broadcast to the
   others), then broadcasts the tokens over the pipeline group, so every rank holds the same
   buffer. When the distribution cannot be sampled (not finite: see ``sampling``), that first
   rank's verdict travels in the same broadcasts, as a negative token, and every rank raises
   the same :class:`GenerationError` at the same step: no rank is left waiting in a collective.
3. A sequence whose prompt is longer than the current position keeps its own prompt token there
   instead; a sequence that emits the stop token is finished (its length ends after that token).
   The loop stops early once all are finished.

Log-probabilities of every token after the first (prompt tokens included, as Megatron returns
them) come from the unscaled logits normalised over the whole padded vocabulary, as Megatron's
log_softmax over the gathered logits does: the padded ids, never sampled, still take their share
of the probability mass, so a model whose padded rows are large scores every real token lower.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import device, tensor_parallel
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.text_generation.inference_params import InferenceParams
from megatron.text_generation.sampling import (SamplingError, check_sampling_args, sample,
                                               sampling_error_message)


class GenerationError(ValueError):
    """A request the model cannot serve (too long, empty prompt, bad sampling settings)."""


@dataclass
class GenerationOutput:
    """What every rank holds after :func:`generate_tokens`.

    Attributes:
        tokens: ``[b, l]`` prompts and generated tokens (``l`` = the last position generated + 1).
        lengths: ``[b]`` tokens of each sequence to keep (up to and including its stop token).
        log_probs: ``[b, l - 1]`` log-probability of ``tokens[:, 1:]``, or None.
        finished: ``[b]`` whether each sequence ended at its stop (the stop token or a line
            end), or None when nothing was generated.
        top_log_probs: ``[b, l - 1, k]`` the ``k`` largest log-probabilities at each position
            (of the next token, over the tokenizer's ids), from the same normalisation as
            ``log_probs``; None unless asked for (:func:`score_tokens`).
        top_ids: ``[b, l - 1, k]`` their token ids.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    log_probs: Optional[torch.Tensor]
    finished: Optional[torch.Tensor] = None
    top_log_probs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None


def unwrap_gpt(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT model inside data-parallel / half-precision wrappers."""
    while hasattr(model, "module") and not hasattr(model, "language_model"):
        model = model.module
    return model


class ForwardStep:
    """One forward pass of the whole pipeline for this rank.

    Args:
        model: this rank's single model chunk (in eval mode).
        pstate: the rank's parallel state (``tp_group``, ``tp_ranks``, ``pp_group``,
            ``pp_ranks``, ``pp_rank``, ``pp_size``).
        inference_params: the key/value cache, or None to run without one.
    """

    def __init__(self, model: torch.nn.Module, pstate,
                 inference_params: Optional[InferenceParams] = None):
        gpt = unwrap_gpt(model)
        if getattr(gpt, "sequence_parallel", False):
            raise GenerationError("text generation runs without --sequence-parallel (a step of "
                                  "one token cannot be split over the sequence); build the "
                                  "model with sequence_parallel=False")
        self.model = model
        self.gpt = gpt
        self.pstate = pstate
        self.inference_params = inference_params
        self.is_first = pstate.pp_rank == 0
        self.is_last = pstate.pp_rank == pstate.pp_size - 1
        # An empty stage (a layout's "||") holds no parameter: the config says what it would.
        param = next(model.parameters(), None)
        dtype = (torch.float32 if gpt.config.fp32_residual_connection
                 else gpt.config.params_dtype if param is None else param.dtype)
        where = torch.device(device.current_device()) if param is None else param.device
        self.hidden_size = gpt.config.residual_stream_size
        self.communicator = None
        if pstate.pp_size > 1:
            self.communicator = P2PCommunicator.from_parallel_state(pstate, dtype, where)
        # A standalone MTP stage hands the last stage its K MTP hidden states too
        # ([(1+K)s, b, h]), through any (empty) stages between them; the last stage's logits
        # are the main head's.
        self.into_last = 1 + gpt.mtp_num_layers if getattr(gpt, "mtp_standalone", False) else 1
        holds_mtp = self.into_last > 1 and getattr(gpt, "mtp", None) is not None
        # ... and embeds the shifted tokens, so it reads them as the first stage does.
        self.reads_tokens = self.is_first or holds_mtp
        self.mtp_rank = pstate.pp_size - 2
        if self.into_last > 1:  # which rank holds the MTP stage: every rank learns it
            found = torch.tensor([pstate.pp_rank if holds_mtp else -1], dtype=torch.int64,
                                 device=where)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=pstate.pp_group)
            self.mtp_rank = int(found.item())

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """``[b, s]`` tokens at ``[b, s]`` positions -> logits ``[b, s, V_padded]`` on the last
        stage (None elsewhere); advances the cache offset by ``s``."""
        b, s = tokens.shape
        if not self.is_first:
            wide_in = self.pstate.pp_rank > self.mtp_rank
            received = (s * (self.into_last if wide_in else 1), b, self.hidden_size)
            self.gpt.set_input_tensor(self.communicator.recv_forward(received))
        output = self.model(tokens if self.reads_tokens else None,
                            position_ids if self.reads_tokens else None, None,
                            inference_params=self.inference_params)
        if self.inference_params is not None:
            self.inference_params.sequence_len_offset += s
        if not self.is_last:
            wide_out = self.pstate.pp_rank >= self.mtp_rank
            sent = (s * (self.into_last if wide_out else 1), b, self.hidden_size)
            self.communicator.send_forward(output, sent)
            return None
        if not self.gpt.parallel_output:
            return output
        return tensor_parallel.gather_from_tensor_model_parallel_region(
            output, self.pstate.tp_group)                                    # [b, s, V]


def broadcast_from_last_stage(tensor: torch.Tensor, pstate) -> torch.Tensor:
    """Give every stage the last stage's ``tensor`` (in place); same shape on all ranks."""
    if pstate.pp_size > 1:
        dist.broadcast(tensor, src=pstate.pp_ranks[-1], group=pstate.pp_group)
    return tensor


def agree_over_tensor_parallel(tensor: torch.Tensor, pstate) -> torch.Tensor:
    """The first tensor-parallel rank's ``tensor`` on all of them (in place)."""
    if pstate.tp_size > 1:
        dist.broadcast(tensor, src=pstate.tp_ranks[0], group=pstate.tp_group)
    return tensor


def _sample_or_verdict(new_tokens: torch.Tensor, logits: torch.Tensor, top_k: int, top_p: float,
                       temperature: float, vocab_size: int,
                       generator: Optional[torch.Generator]) -> None:
    """The sampled ``[b]`` tokens into ``new_tokens``, or, when the distribution cannot be
    sampled, ``-code`` of the :class:`SamplingError` in every entry (ids are never negative)."""
    try:
        new_tokens.copy_(sample(logits, top_k, top_p, temperature, vocab_size, generator))
    except SamplingError as err:
        new_tokens.fill_(-err.code)


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets)`` from ``[b, s, V_padded]`` logits and ``[b, s]`` ids -> ``[b, s]``
    float32, normalised over all ``V_padded`` ids (Megatron's)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(log_probs, 2, targets.unsqueeze(2)).squeeze(2)


def _check_inputs(tokens: torch.Tensor, lengths: torch.Tensor, max_sequence_length: int,
                  vocab_size: int) -> None:
    if tokens.dim() != 2 or lengths.shape != tokens.shape[:1]:
        raise GenerationError(f"tokens must be [batch, length] and lengths [batch], got "
                              f"{tuple(tokens.shape)} and {tuple(lengths.shape)}")
    total = tokens.size(1)
    if total > max_sequence_length:
        raise GenerationError(
            f"prompt + tokens_to_generate is {total} tokens, longer than the model's "
            f"--max-position-embeddings ({max_sequence_length})")
    if int(lengths.min()) < 1 or int(lengths.max()) > total:
        raise GenerationError(f"prompt lengths must be between 1 and {total}, got "
                              f"{lengths.tolist()} (an empty prompt needs add_BOS)")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise GenerationError(f"token ids must be in [0, {vocab_size}), got "
                              f"{int(tokens.min())}..{int(tokens.max())}")


def score_tokens(model: torch.nn.Module, pstate, tokens: torch.Tensor, lengths: torch.Tensor,
                 vocab_size: int, max_sequence_length: Optional[int] = None,
                 top_k: int = 0) -> GenerationOutput:
    """Log-probabilities of given sequences, no generation (``tokens_to_generate == 0``); with
    ``top_k`` also the ``top_k`` most likely next tokens at every position (ids below
    ``vocab_size`` only: the padded ids are never real tokens) with their log-probabilities,
    taken from the same log-softmax, so a token that is the most likely one has exactly the
    largest of them."""
    limit = max_sequence_length or unwrap_gpt(model).config.max_position_embeddings
    _check_inputs(tokens, lengths, limit, vocab_size)
    if not 0 <= top_k <= vocab_size:
        raise GenerationError(f"top_k must be in [0, {vocab_size}], got {top_k}")
    step = ForwardStep(model, pstate)
    positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    logits = step(tokens, positions)
    b, s = tokens.size(0), tokens.size(1) - 1
    log_probs = torch.empty(b, s, dtype=torch.float32, device=tokens.device)
    top_values = top_ids = None
    if top_k:
        top_values = torch.empty(b, s, top_k, dtype=torch.float32, device=tokens.device)
        top_ids = torch.empty(b, s, top_k, dtype=torch.int64, device=tokens.device)
    if step.is_last:
        normalised = F.log_softmax(logits[:, :-1].float(), dim=-1)
        log_probs.copy_(torch.gather(normalised, 2, tokens[:, 1:].unsqueeze(2)).squeeze(2))
        if top_k:
            best = torch.topk(normalised[..., :vocab_size], top_k, dim=-1)
            top_values.copy_(best.values)
            top_ids.copy_(best.indices)
    broadcast_from_last_stage(log_probs, pstate)
    if top_k:
        broadcast_from_last_stage(top_values, pstate)
        broadcast_from_last_stage(top_ids, pstate)
    return GenerationOutput(tokens, lengths.clone(), log_probs, None, top_values, top_ids)


@dataclass(frozen=True)
class EolStop:
    """Megatron's ``stop_on_eol`` / ``stop_on_double_eol``: a sequence ends at the token
    ``double_eol`` (a blank line as one token, when the tokenizer has one), or at ``eol`` (a
    newline) when ``double`` is False, or at an ``eol`` right after another when it is True. As
    in Megatron, the stop token then ends nothing, unless ``and_stop_token`` (the completions
    endpoint: it stops at a blank line as Megatron's does, and never writes past the end of a
    document)."""

    eol: int
    double_eol: Optional[int]
    double: bool
    and_stop_token: bool = False


def generate_tokens(model: torch.nn.Module, pstate, tokens: torch.Tensor, lengths: torch.Tensor,
                    *, vocab_size: int, stop_token: int, top_k: int = 0, top_p: float = 0.0,
                    temperature: float = 1.0, return_log_probs: bool = False,
                    use_kv_cache: bool = True, generator: Optional[torch.Generator] = None,
                    max_sequence_length: Optional[int] = None, top_p_decay: float = 0.0,
                    top_p_bound: float = 0.0, eol_stop: Optional[EolStop] = None,
                    banned_after: Optional[Tuple[int, int]] = None) -> GenerationOutput:
    """Generate into ``tokens`` on every rank of the model; see the module docstring.

    Args:
        model: this rank's model chunk (a GPT in eval mode; no virtual pipeline stages).
        pstate: this rank's parallel state.
        tokens: int64 ``[b, L]`` on the model's device, the same on every rank: prompts
            left-aligned, anything after them; ``L - max(lengths)`` tokens are generated.
        lengths: int64 ``[b]`` prompt lengths.
        vocab_size: the tokenizer's vocabulary (ids at or past it are never sampled).
        stop_token: a sequence that emits it is finished.
        top_k, top_p, temperature: see :func:`megatron.text_generation.sampling.sample`.
        return_log_probs: also return the log-probabilities of ``tokens[:, 1:]``.
        use_kv_cache: keep keys and values between steps (False recomputes the prefix).
        generator: the sampling stream of the last stage (seed it alike on all its ranks).
        max_sequence_length: the longest sequence the model takes (default: its
            ``max_position_embeddings``).
        top_p_decay, top_p_bound: after each step ``top_p`` becomes ``top_p x top_p_decay``,
            never below ``top_p_bound`` (Megatron's; 0 turns each off).
        eol_stop: stop at line ends instead of at ``stop_token`` (see :class:`EolStop`).
        banned_after: ``(after, banned)``: where the last token is ``after``, ``banned`` gets a
            logit of -1e10 before sampling and log-probabilities (Megatron's
            ``prevent_newline_after_colon``, with the tokenizer's ':' and newline ids).
    """
    gpt = unwrap_gpt(model)
    limit = max_sequence_length or gpt.config.max_position_embeddings
    _check_inputs(tokens, lengths, limit, vocab_size)
    try:
        check_sampling_args(top_k, top_p, temperature, vocab_size)
    except ValueError as err:
        raise GenerationError(str(err)) from None
    batch, total = tokens.shape
    min_length = int(lengths.min())
    if min_length == total:  # nothing to generate
        if return_log_probs:
            return score_tokens(model, pstate, tokens, lengths, vocab_size, limit)
        return GenerationOutput(tokens.clone(), lengths.clone(), None)
    tokens = tokens.clone()
    step = ForwardStep(model, pstate, InferenceParams(batch, total) if use_kv_cache else None)
    positions = torch.arange(total, device=tokens.device).expand(batch, total)
    log_probs = (torch.empty(batch, total - 1, dtype=torch.float32, device=tokens.device)
                 if return_log_probs else None)
    out_lengths = torch.full_like(lengths, total)
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    new_tokens = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    prev = 0
    context = min_length
    for context in range(min_length, total):
        start = prev if use_kv_cache else 0
        logits = step(tokens[:, start:context], positions[:, start:context])  # [b, s, V] last
        if step.is_last:
            if banned_after is not None:
                after, banned = banned_after
                logits[tokens[:, context - 1] == after, -1, banned] = -1e10
            _sample_or_verdict(new_tokens, logits[:, -1, :], top_k, top_p, temperature,
                               vocab_size, generator)
            agree_over_tensor_parallel(new_tokens, pstate)
        if top_p > 0.0 and top_p_decay > 0.0:
            top_p = top_p * top_p_decay
            if top_p_bound > 0.0:
                top_p = max(top_p, top_p_bound)
        broadcast_from_last_stage(new_tokens, pstate)
        verdict = int(new_tokens.min())
        if verdict < 0:
            raise GenerationError(sampling_error_message(-verdict, temperature))
        started = lengths <= context
        tokens[started, context] = new_tokens[started]
        if log_probs is not None and step.is_last:
            log_probs[:, prev:context] = _token_log_probs(
                logits[:, prev - start:], tokens[:, prev + 1:context + 1])
        prev = context
        if eol_stop is None:
            done = new_tokens == stop_token
        else:
            done = new_tokens == eol_stop.eol
            if eol_stop.double:
                done &= tokens[:, context - 1] == eol_stop.eol
            if eol_stop.double_eol is not None:
                done |= new_tokens == eol_stop.double_eol
            if eol_stop.and_stop_token:
                done |= new_tokens == stop_token
        just_finished = done & started & ~finished
        out_lengths[just_finished] = context + 1
        finished |= just_finished
        if bool(finished.all()):
            break
    tokens = tokens[:, :context + 1]
    if log_probs is not None:
        log_probs = broadcast_from_last_stage(log_probs[:, :context].contiguous(), pstate)
    return GenerationOutput(tokens, out_lengths, log_probs, finished)

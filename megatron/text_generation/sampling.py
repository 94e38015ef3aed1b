"""The next token from the last position's logits: greedy, temperature, top-k or top-p.

The rules are Megatron's: ``top_k == 1`` is greedy (argmax); ``top_k > 1`` keeps the ``k``
largest logits; ``0 < top_p <= 1`` keeps the smallest set of most likely tokens whose probability
reaches ``top_p`` (nucleus sampling); ``top_k == 0`` and ``top_p == 0`` sample from the whole
distribution. Top-k and top-p together are an error. The temperature divides the logits before
any filtering.

Logits come gathered over the tensor-parallel ranks, ``[b, padded vocab]``. The rows past the
tokenizer's vocabulary exist only to make the embedding table divisible; they are set to
``-inf`` first, so they are never chosen, whatever their weights learned.

Before a token is drawn the distribution is checked: NaN or infinite logits (a numerical fault
in the model) or a distribution that is not finite after the temperature (a temperature so small
that the scaled logits overflow float32; ``torch.multinomial`` would raise deep inside) raise
:class:`SamplingError`, whose ``code`` lets a caller tell other ranks which of the two it was.
"""

from typing import Optional

import torch


class SamplingError(ValueError):
    """The logits or the distribution to sample from are not finite; ``code`` says which."""

    NONFINITE_LOGITS = 1
    NONFINITE_DISTRIBUTION = 2

    def __init__(self, code: int, temperature: float):
        super().__init__(sampling_error_message(code, temperature))
        self.code = code


def sampling_error_message(code: int, temperature: float) -> str:
    """The message of :class:`SamplingError` ``code``: every rank can rebuild it from the code
    and the request's temperature alone."""
    if code == SamplingError.NONFINITE_LOGITS:
        return ("the model's logits are not finite (NaN or inf): a numerical fault in the "
                "checkpoint or its precision, not in the request")
    return (f"the sampling distribution is not finite at temperature {temperature!r}: the logits "
            f"divided by it overflow float32; use a larger temperature, or top_k = 1 for greedy "
            f"decoding")


def mask_padded_vocab(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """``logits`` ``[..., V_padded]`` with ids ``>= vocab_size`` set to ``-inf`` (a new tensor
    when anything is masked)."""
    if vocab_size is None or vocab_size >= logits.size(-1):
        return logits
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    logits = logits.clone()
    logits[..., vocab_size:] = float("-inf")
    return logits


def modify_logits_for_top_k_filtering(logits: torch.Tensor, top_k: int) -> None:
    """Set every logit below the ``top_k``-th largest of its row to ``-inf``, in place."""
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]    # [b, 1]
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def modify_logits_for_top_p_filtering(logits: torch.Tensor, top_p: float) -> None:
    """Keep, per row, the most likely tokens up to and including the first one at which their
    cumulative probability exceeds ``top_p``; set the rest to ``-inf``, in place."""
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)        # [b, V]
    # A token is dropped when the tokens ranked before it already hold more than top_p, so the
    # one that crosses the threshold is kept (and the most likely token always is).
    drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
    drop_sorted[..., 1:] = cumulative[..., :-1] > top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_ids, drop_sorted)
    logits.masked_fill_(drop, float("-inf"))


def check_sampling_args(top_k: int, top_p: float, temperature: float,
                        vocab_size: Optional[int] = None) -> None:
    """Raise ``ValueError`` for settings Megatron rejects, naming the value seen."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be between 0 and 1, got {top_p!r}")
    if top_k == 1 and top_p > 0.0:
        raise ValueError("cannot set both greedy (top_k = 1) and top-p samplings")
    if top_k > 1 and top_p > 0.0:
        raise ValueError("cannot set both top-k and top-p samplings")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k ({top_k}) is larger than the vocabulary ({vocab_size} tokens)")


def sample(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0,
           vocab_size: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row of ``logits`` ``[b, V_padded]``; returns int64 ``[b]``.

    Args:
        logits: the last position's logits over the whole (padded) vocabulary.
        top_k: 1 for greedy, > 1 for top-k, 0 for none.
        top_p: nucleus probability, 0 for none.
        temperature: divides the logits before filtering (ignored by greedy).
        vocab_size: the tokenizer's vocabulary; ids at or past it are never returned.
        generator: the random stream to draw from (default: torch's global one). Ranks that
            must agree on the sample use generators seeded alike.

    Raises:
        SamplingError: the logits, or the distribution after the temperature, are not finite.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    check_sampling_args(top_k, top_p, temperature,
                        min(vocab_size or logits.size(-1), logits.size(-1)))
    real = logits[:, :vocab_size] if vocab_size is not None else logits
    if not bool(torch.isfinite(real).all()):
        raise SamplingError(SamplingError.NONFINITE_LOGITS, temperature)
    logits = mask_padded_vocab(logits.float(), vocab_size)
    if top_k == 1:
        return torch.argmax(logits, dim=-1)
    logits = logits.clone()
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k > 1:
        modify_logits_for_top_k_filtering(logits, top_k)
    elif top_p > 0.0:
        modify_logits_for_top_p_filtering(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise SamplingError(SamplingError.NONFINITE_DISTRIBUTION, temperature)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)

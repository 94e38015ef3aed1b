"""Fill-in-the-middle (FIM) GPT samples: Megatron-LM's ``--fim-data``.

A FIM sample teaches a left-to-right model to fill a gap: a text is cut at two random character
positions into prefix, middle and suffix, and re-ordered so that the middle comes last,

- PSM: ``<prefix> prefix <suffix> suffix <middle> middle``
- SPM: ``<prefix> <suffix> suffix <middle> prefix middle`` (chosen with ``--fim-spm-rate``).

Each sample of the ordinary :class:`~megatron.data.gpt_dataset.GPTDataset` (same indices, same
cache, same order) is rewritten by :class:`~megatron.data.gpt_dataset.GPTFIMDataset` as
Megatron-LM does it:

1. the sample is cut at every ``--fim-eod-token``; each document segment is handled on its own
   and the end-of-document tokens stay between them;
2. without ``--fim-split-sample``, a segment is permuted with chance ``--fim-rate``. With it, a
   segment holding that token is, with chance ``--fim-rate``, cut at it into fragments, each
   permuted with chance ``--fim-fragment-rate`` (the split tokens stay between them); a segment
   without it is permuted with chance ``--fim-rate``;
3. to permute, the segment is detokenized; text starting with ``--fim-no-prefix`` is left as
   it is; else two cut points are drawn uniformly in ``[0, len(text)]`` and sorted, and the three
   pieces are tokenized again and joined in SPM (chance ``--fim-spm-rate``) or PSM order;
4. the result is cut back to the sample's length, or filled up with ``--fim-pad-token``.

The random draws of one sample (Bernoulli draws with ``binomial(1, p)``, cut points with
``randint(0, len(text) + 1, size=2)``, in Megatron's order) come from a
``numpy.random.RandomState`` seeded by ``SeedSequence((seed, index))``, so a sample depends only
on ``--seed`` and its index, whichever worker, rank or epoch reads it. Megatron-LM instead draws
from one generator per dataset in reading order. Unlike Megatron-LM, an empty segment (two
end-of-document tokens in a row, or one at either end of the sample) keeps its separator and
makes no draws: Megatron drops the separator there and permutes an empty tail into three
sentinel tokens. So ``--fim-rate 0`` gives the plain dataset's samples exactly.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megatron.data.config import FIMFlags
from megatron.data.dataset_utils import DataError


@dataclass(frozen=True)
class FIMConfig:
    """The FIM rates and token ids, with the tokenizer that turns text to ids and back.

    Attributes:
        rate / spm_rate / fragment_rate: ``--fim-rate``, ``--fim-spm-rate``,
            ``--fim-fragment-rate``.
        prefix_id / middle_id / suffix_id / pad_id / eod_id: ids of the ``--fim-*-token`` flags.
        split_id: id of ``--fim-split-sample``, or None.
        no_prefix: ``--fim-no-prefix``, or None.
        tokenizer: has ``tokenize_text(text) -> ids`` (no begin/end tokens added) and
            ``detokenize(ids) -> text``.
    """

    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    tokenizer: object
    split_id: Optional[int] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None


def _token_id(tokenizer, flag: str, token: str) -> int:
    vocab = tokenizer.vocab
    if token not in vocab:
        raise DataError(f"{flag} {token!r} is not a token of the {tokenizer.name} tokenizer "
                        f"(--fim-data needs its prefix, middle, suffix, pad and eod tokens as "
                        f"single tokens of the vocabulary; name the tokenizer's own with the "
                        f"--fim-*-token flags, or add them to it)")
    return int(vocab[token])


def resolve_fim_config(flags: FIMFlags, tokenizer) -> Optional[FIMConfig]:
    """The FIM config of ``flags`` for ``tokenizer``; None without ``--fim-data``.

    Raises:
        DataError: (one line) a FIM token is not a single token of the tokenizer, or the
            tokenizer cannot turn ids back into text.
    """
    if not flags.fim_data:
        return None
    try:
        tokenizer.detokenize([])
    except NotImplementedError:
        raise DataError(f"--fim-data cuts samples as text, but the {tokenizer.name} tokenizer "
                        f"cannot detokenize; use a tokenizer with a vocabulary") from None
    ids = {part: _token_id(tokenizer, f"--fim-{part}-token", token) for part, token in (
        ("prefix", flags.fim_prefix_token), ("middle", flags.fim_middle_token),
        ("suffix", flags.fim_suffix_token), ("pad", flags.fim_pad_token),
        ("eod", flags.fim_eod_token))}
    split_id = (None if flags.fim_split_sample is None else
                _token_id(tokenizer, "--fim-split-sample", flags.fim_split_sample))
    return FIMConfig(
        rate=flags.fim_rate, spm_rate=flags.fim_spm_rate, prefix_id=ids["prefix"],
        middle_id=ids["middle"], suffix_id=ids["suffix"], pad_id=ids["pad"],
        eod_id=ids["eod"], tokenizer=tokenizer, split_id=split_id,
        fragment_rate=flags.fim_fragment_rate, no_prefix=flags.fim_no_prefix)


def sample_rng(seed: int, index: int) -> np.random.RandomState:
    """The generator of sample ``index``'s draws under ``--seed`` ``seed``."""
    return np.random.RandomState(np.random.SeedSequence((int(seed), int(index))).generate_state(4))


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.tokenize_text(text) if text else [], dtype=np.int64)


def permute(tokens: np.ndarray, rate: float, config: FIMConfig,
            rng: np.random.RandomState) -> np.ndarray:
    """One segment in PSM or SPM order with chance ``rate``, else ``tokens`` unchanged."""
    if not rng.binomial(1, rate):
        return tokens
    text = config.tokenizer.detokenize(tokens.tolist())
    if config.no_prefix is not None and text.startswith(config.no_prefix):
        return tokens
    lo, hi = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
    prefix, middle, suffix = (_ids(config.tokenizer, t)
                              for t in (text[:lo], text[lo:hi], text[hi:]))
    p, m, s = ([config.prefix_id], [config.middle_id], [config.suffix_id])
    if rng.binomial(1, config.spm_rate):
        pieces = [p, s, suffix, m, prefix, middle]
    else:
        pieces = [p, prefix, s, suffix, m, middle]
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in pieces])


def _each_part(tokens: np.ndarray, separator: int,
               transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``transform`` applied to each non-empty run between ``separator`` tokens, which stay."""
    out, start = [], 0
    for cut in np.flatnonzero(tokens == separator).tolist() + [tokens.size]:
        if cut > start:
            out.append(np.asarray(transform(tokens[start:cut]), dtype=np.int64))
        if cut < tokens.size:
            out.append(np.array([separator], dtype=np.int64))
        start = cut + 1
    return np.concatenate(out) if out else tokens[:0]


def _permute_segment(segment: np.ndarray, config: FIMConfig,
                     rng: np.random.RandomState) -> np.ndarray:
    """One document segment: whole, or fragment by fragment at ``--fim-split-sample``."""
    if config.split_id is None or not np.any(segment == config.split_id):
        return permute(segment, config.rate, config, rng)
    if not rng.binomial(1, config.rate):
        return segment
    return _each_part(segment, config.split_id,
                      lambda part: permute(part, config.fragment_rate, config, rng))


def fim_sample(tokens: np.ndarray, config: FIMConfig, rng: np.random.RandomState) -> np.ndarray:
    """``tokens`` (one sample) rewritten for FIM, at its own length (int64)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = _each_part(tokens, config.eod_id, lambda seg: _permute_segment(seg, config, rng))
    if out.size >= tokens.size:
        return out[:tokens.size]
    return np.concatenate([out, np.full(tokens.size - out.size, config.pad_id, dtype=np.int64)])


"""Sampling (greedy, temperature, top-k, top-p) against a naive reference written with Python
floats, and the padded vocabulary never being chosen.

Filters are compared exactly: the set of tokens they keep must equal the reference's (random
logits have no ties, and the top-p thresholds are chosen away from any cumulative sum). Sampled
frequencies are compared with the reference distribution: with N draws a frequency's standard
deviation is sqrt(p (1 - p) / N); 5 of them (plus 1e-4 for float rounding of p) make a false
alarm about 1e-6 per category, while a wrong filter or temperature moves some category by far
more (every case below changes at least one probability by > 0.05 against its neighbours).
"""

import math

import pytest
import torch

from megatron.text_generation.sampling import (
    SamplingError,
    mask_padded_vocab,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
)


def random_logits(rows=6, vocab=12, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale


def naive_distribution(row, top_k=0, top_p=0.0, temperature=1.0, vocab_size=None):
    """Probabilities of one row of logits, token by token in Python floats."""
    values = [float(v) for v in row][:vocab_size]
    scaled = [v / temperature for v in values]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order)
    if top_k > 0:
        keep = set(order[:top_k])
    elif top_p > 0.0:
        total = sum(math.exp(scaled[i]) for i in order)
        keep, mass = set(), 0.0
        for i in order:
            if mass > top_p:          # the tokens before already exceed top_p
                break
            keep.add(i)
            mass += math.exp(scaled[i]) / total
    norm = sum(math.exp(scaled[i]) for i in keep)
    probs = [math.exp(scaled[i]) / norm if i in keep else 0.0 for i in range(len(scaled))]
    return probs + [0.0] * (len(row) - len(values))


def kept(filtered_row):
    return {i for i, v in enumerate(filtered_row.tolist()) if v != float("-inf")}


@pytest.mark.parametrize("top_k", [1, 2, 5, 12])
def test_top_k_filter_keeps_the_k_largest(top_k):
    logits = random_logits()
    filtered = logits.clone()
    modify_logits_for_top_k_filtering(filtered, top_k)
    for row, out in zip(logits, filtered):
        want = {i for i, p in enumerate(naive_distribution(row, top_k=top_k)) if p > 0}
        assert kept(out) == want
        assert len(want) == top_k
        finite = out != float("-inf")
        assert torch.equal(out[finite], row[finite])   # kept logits are untouched


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.61, 0.9, 1.0])
def test_top_p_filter_keeps_the_smallest_nucleus(top_p):
    logits = random_logits(rows=8)
    filtered = logits.clone()
    modify_logits_for_top_p_filtering(filtered, top_p)
    sizes = set()
    for row, out in zip(logits, filtered):
        want = {i for i, p in enumerate(naive_distribution(row, top_p=top_p)) if p > 0}
        assert kept(out) == want, (top_p, row)
        sizes.add(len(want))
    if top_p < 1.0:
        assert max(sizes) < logits.size(1)   # the filter removed something


def test_greedy_is_argmax_over_the_real_vocabulary():
    logits = random_logits(rows=5, vocab=16)
    logits[:, 10:] += 100.0                     # padded rows would win everywhere
    got = sample(logits, top_k=1, vocab_size=10)
    want = torch.tensor([max(range(10), key=lambda i: float(r[i])) for r in logits])
    assert torch.equal(got, want)
    assert torch.equal(sample(logits, top_k=1), logits.argmax(-1))   # no mask without size


def test_mask_padded_vocab():
    logits = random_logits(rows=2, vocab=8)
    masked = mask_padded_vocab(logits, 5)
    assert torch.isinf(masked[:, 5:]).all() and (masked[:, 5:] < 0).all()
    assert torch.equal(masked[:, :5], logits[:, :5])
    assert torch.isfinite(logits).all()          # the input is left alone
    assert mask_padded_vocab(logits, 8) is logits


CASES = {
    "full": dict(),
    "temperature_0.5": dict(temperature=0.5),
    "temperature_3": dict(temperature=3.0),
    "top_k_3": dict(top_k=3),
    "top_k_4_temperature_2": dict(top_k=4, temperature=2.0),
    "top_p_0.7": dict(top_p=0.7),
    "top_p_0.5_temperature_0.7": dict(top_p=0.5, temperature=0.7),
    "padded_full": dict(vocab_size=7),
    "padded_top_p": dict(vocab_size=7, top_p=0.8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_frequencies_match_reference_distribution(name):
    kw = CASES[name]
    n = 40000
    row = random_logits(rows=1, vocab=10, seed=3, scale=1.0)[0]
    if "vocab_size" in kw:
        row[kw["vocab_size"]:] += 50.0            # padded ids would take all the mass
    probs = naive_distribution(row, kw.get("top_k", 0), kw.get("top_p", 0.0),
                               kw.get("temperature", 1.0), kw.get("vocab_size"))
    generator = torch.Generator().manual_seed(1234)
    draws = sample(row.expand(n, -1).clone(), generator=generator, **kw)
    counts = torch.bincount(draws, minlength=row.numel()).double() / n
    for token, (p, f) in enumerate(zip(probs, counts.tolist())):
        if p == 0.0:
            assert f == 0.0, (name, token)
        else:
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-4, (name, token, p, f)


def test_same_seed_same_samples_and_float16_logits():
    logits = random_logits(rows=64, vocab=50).half()
    a = sample(logits, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b = sample(logits, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert a.dtype == torch.int64 and a.shape == (64,)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=3, top_p=0.5), "both top-k and top-p"),
    (dict(top_k=1, top_p=0.5), "greedy"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=11, vocab_size=10), "larger than the vocabulary"),
])
def test_invalid_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        sample(random_logits(rows=2, vocab=16), **kw)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=3), dict(top_p=0.9)])
def test_temperature_that_overflows_is_a_sampling_error(kw):
    """Before: logits / 1e-300 are inf in float32, softmax gives NaN, and torch.multinomial
    raised a RuntimeError deep inside the generation loop (issue 28)."""
    logits = random_logits(rows=2, vocab=16).float()
    with pytest.raises(SamplingError, match="temperature 1e-300") as err:
        sample(logits, temperature=1e-300, **kw)
    assert err.value.code == SamplingError.NONFINITE_DISTRIBUTION
    assert sample(logits, temperature=1e-3, top_k=3).shape == (2,)   # small but finite: fine


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kw", [dict(top_k=1), dict(), dict(top_p=0.5)])
def test_non_finite_logits_are_a_sampling_error(bad, kw):
    """Before: greedy returned the NaN's index as a token, sampling raised in multinomial. The
    padded rows past the vocabulary do not count: they are masked before sampling."""
    logits = random_logits(rows=2, vocab=16).float()
    padded = logits.clone()
    padded[:, 12:] = bad
    assert sample(padded, vocab_size=12, **kw).max() < 12
    logits[1, 4] = bad
    with pytest.raises(SamplingError, match="logits are not finite") as err:
        sample(logits, **kw)
    assert err.value.code == SamplingError.NONFINITE_LOGITS

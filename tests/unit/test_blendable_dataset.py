"""Blending: proportions at every prefix, the documented greedy choice, the 1.005 surplus rule."""

import numpy as np
import pytest

from megatron.data import index_builders
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import blend_num_samples, normalize_weights


class Tagged:
    """Item k of dataset d is (d, k)."""

    def __init__(self, tag, size):
        self.tag, self.size = tag, size

    def __len__(self):
        return self.size

    def __getitem__(self, k):
        assert 0 <= k < self.size
        return (self.tag, k)


def reference_blend(weights, size):
    """FORMATS.md 4 step by step: argmax of w_d * max(i, 1) - count_d, lowest index on ties."""
    counts = [0] * len(weights)
    out = []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        out.append((d, counts[d]))
        counts[d] += 1
    return out


@pytest.mark.parametrize("use_compiled", [
    pytest.param(True, marks=pytest.mark.skipif(not index_builders.compiled_available(),
                                                reason="extension not built")), False])
def test_blending_indices_follow_the_documented_rule(use_compiled):
    rng = np.random.default_rng(0)
    for _ in range(40):
        w = normalize_weights(rng.random(int(rng.integers(1, 6))) + 0.01)
        di, ds = index_builders.build_blending_indices(w, 300, use_compiled=use_compiled)
        assert list(zip(di.tolist(), ds.tolist())) == reference_blend(w, 300)


def test_two_datasets_stay_within_one_sample_of_their_share_at_every_prefix():
    rng = np.random.default_rng(1)
    for _ in range(30):
        w = normalize_weights([rng.random() + 0.01, rng.random() + 0.01])
        di, _ = index_builders.build_blending_indices(w, 2000)
        counts = np.cumsum(np.eye(2)[di], axis=0)  # [i, d]: samples of d among the first i + 1
        share = np.arange(1, 2001)[:, None] * np.array(w)[None, :]
        assert np.abs(counts - share).max() < 1


def test_many_datasets_never_run_ahead_of_their_share():
    # With more than two datasets a lagging dataset may trail by more than one sample, but no
    # dataset is ever more than one sample ahead, and each lags by less than D - 1.
    rng = np.random.default_rng(2)
    for _ in range(30):
        d = int(rng.integers(3, 8))
        w = normalize_weights(rng.random(d) ** 2 + 0.01)
        di, _ = index_builders.build_blending_indices(w, 1500)
        counts = np.cumsum(np.eye(d)[di], axis=0)
        share = np.arange(1, 1501)[:, None] * np.array(w)[None, :]
        assert (counts - share).max() < 1
        assert (share - counts).max() < d - 1


def test_blend_num_samples_rounds_up_twice():
    # 10 * 1/3 = 3.33 -> 4 -> 4.02 -> 5 ; 10 * 2/3 = 6.67 -> 7 -> 7.035 -> 8.
    # (ceil(10 * w * 1.005) would give 4 and 7.)
    assert blend_num_samples(normalize_weights([1, 2]), 10) == [5, 8]
    assert blend_num_samples(normalize_weights([1, 3]), 200) == [51, 151]
    assert blend_num_samples([1.0], 1000) == [1005]
    assert blend_num_samples([0.5, 0.5], 0) == [0, 0]


def test_blendable_dataset_items_come_from_the_chosen_dataset():
    weights = [2.0, 1.0, 1.0]
    size = 50
    datasets = [Tagged(d, n) for d, n in enumerate(blend_num_samples(
        normalize_weights(weights), size))]
    blend = BlendableDataset(datasets, weights, size)
    assert len(blend) == size
    assert [blend[i] for i in range(size)] == reference_blend(normalize_weights(weights), size)


def test_blendable_dataset_errors():
    with pytest.raises(ValueError, match="dataset 1.*only 3"):
        BlendableDataset([Tagged(0, 100), Tagged(1, 3)], [0.5, 0.5], 20)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendableDataset([Tagged(0, 5), Tagged(1, 5)], [1.0], 4)
    with pytest.raises(ValueError, match=">= 0"):
        BlendableDataset([Tagged(0, 5), Tagged(1, 5)], [1.0, -1.0], 4)
    with pytest.raises(IndexError):
        BlendableDataset([Tagged(0, 5)], [1.0], 4)[4]

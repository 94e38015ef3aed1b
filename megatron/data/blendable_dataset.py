"""A weighted mixture of datasets (``--data-path W1 PREFIX1 W2 PREFIX2 ...``; FORMATS.md 4)."""

from typing import Sequence

import numpy as np
import torch

from megatron.data import index_builders
from megatron.data.dataset_utils import DataError


class BlendableDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Sample i is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``; the two arrays
    come from :func:`~megatron.data.index_builders.build_blending_indices`, which keeps every
    prefix of the blend within about one sample of each dataset's share, so a run that stops early
    has still seen the datasets in proportion. Each dataset's samples are taken in its own order
    (0, 1, 2, ...), which is already shuffled for a GPT dataset.

    Args:
        datasets: the datasets (1 to 255); each must hold every sample the blend takes from it.
        weights: one non-negative weight per dataset (normalised here).
        size: number of blended samples.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        self.datasets = list(datasets)
        if len(self.datasets) != len(weights):
            raise DataError(f"{len(self.datasets)} datasets but {len(weights)} weights")
        w = np.array(weights, dtype=np.float64)
        if w.size == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise DataError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
        self.weights = w / w.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = index_builders.build_blending_indices(
            self.weights, self.size)
        self._check_sizes()

    def _check_sizes(self) -> None:
        for d, dataset in enumerate(self.datasets):
            taken = self.dataset_sample_index[self.dataset_index == d]
            needed = int(taken.max()) + 1 if taken.size else 0
            if needed > len(dataset):
                raise DataError(f"blend of {self.size} samples takes {needed} samples from "
                                 f"dataset {d} (weight {self.weights[d]:.6g}), which has only "
                                 f"{len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

"""Synthetic GPT samples for ``--mock-data``: runs without any data files."""

from typing import Dict

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of uniformly random token ids in ``[0, vocab_size)``.

    Sample i depends only on ``(seed, i)``, so every rank, worker and resumed run sees the same
    tokens for the same index, in any order of access. Items have the GPT dataset's format:
    ``{"text": int64 [seq_length + 1]}``.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        if num_samples < 0 or seq_length <= 0 or vocab_size is None or vocab_size <= 0:
            raise ValueError(f"--mock-data needs samples >= 0, --seq-length > 0 and a vocabulary "
                             f"> 0; got {num_samples}, {seq_length}, {vocab_size}")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} mock samples")
        rng = np.random.default_rng([self.seed, int(idx) % self.num_samples])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}

"""Samplers: resuming from consumed samples equals never stopping; DP ranks partition batches."""

import itertools

import numpy as np
import pytest
import torch

from megatron.data.samplers import (MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
                                    build_pretraining_data_loader)


def single_batches(total, consumed, mbs, dp, drop_last=True):
    """Per rank, the list of batches of a single sampler."""
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last))
            for r in range(dp)]


def test_single_sampler_blocks_follow_the_documented_layout():
    # 23 samples, mbs 2, dp 3: blocks [0,6) [6,12) [12,18); [18,23) is incomplete and dropped.
    per_rank = single_batches(23, 0, 2, 3)
    assert per_rank[1] == [[2, 3], [8, 9], [14, 15]]
    for step in range(3):
        union = sorted(itertools.chain(*(b[step] for b in per_rank)))
        assert union == list(range(6 * step, 6 * step + 6))  # the ranks partition the block
    kept = single_batches(23, 0, 2, 3, drop_last=False)
    assert [b[-1] for b in kept] == [[18, 19], [20, 21], [22]]


@pytest.mark.parametrize("consumed", [0, 6, 12, 7])
def test_single_sampler_resume_equals_unstopped(consumed):
    mbs, dp, total = 2, 3, 40
    unstopped = single_batches(total, 0, mbs, dp)
    resumed = single_batches(total, consumed, mbs, dp)
    if consumed % (mbs * dp) == 0:
        steps = consumed // (mbs * dp)
        assert resumed == [b[steps:] for b in unstopped]
    else:
        # Blocks start wherever the run stopped.
        for r in range(dp):
            assert resumed[r] == [[consumed + 6 * k + 2 * r, consumed + 6 * k + 2 * r + 1]
                                  for k in range((total - consumed) // 6)]


def cyclic_stream(total, consumed, mbs, dp, rank, steps, sharding=True):
    """The first ``steps`` batches of one rank's cyclic sampler, iterated epoch after epoch."""
    sampler = MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, sharding)
    out = []
    while len(out) < steps:
        out.extend(itertools.islice(iter(sampler), steps - len(out)))
    return out


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("consumed_steps", [0, 1, 4, 7, 11])
def test_cyclic_sampler_resume_equals_unstopped(sharding, consumed_steps):
    # 29 samples, mbs 2, dp 2: an epoch covers 28 samples = 7 steps; 11 steps crosses an epoch.
    mbs, dp, total, steps = 2, 2, 29, 25
    for rank in range(dp):
        unstopped = cyclic_stream(total, 0, mbs, dp, rank, steps, sharding)
        resumed = cyclic_stream(total, consumed_steps * mbs * dp, mbs, dp, rank,
                                steps - consumed_steps, sharding)
        assert resumed == unstopped[consumed_steps:]


def test_cyclic_sampler_shards_partition_each_epoch_and_reshuffle():
    mbs, dp, total = 2, 3, 40  # epoch of 36 samples = 6 steps
    per_rank = [cyclic_stream(total, 0, mbs, dp, r, 12) for r in range(dp)]
    epochs = []
    for e in range(2):
        seen = [x for r in range(dp) for b in per_rank[r][6 * e:6 * e + 6] for x in b]
        assert sorted(seen) == list(range(36))  # every sample once, no rank overlaps another
        # Rank r reads only its own bucket of 12.
        for r in range(dp):
            mine = {x for b in per_rank[r][6 * e:6 * e + 6] for x in b}
            assert mine == set(range(12 * r, 12 * r + 12))
        epochs.append([tuple(b) for b in per_rank[0][6 * e:6 * e + 6]])
    assert epochs[0] != epochs[1]  # the epoch number seeds a new permutation
    # The permutation is torch.randperm(bucket) seeded with the epoch number.
    want = torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()
    assert [x - 12 for b in per_rank[1][6:12] for x in b] == want


def test_sampler_errors():
    with pytest.raises(ValueError, match="consumed samples"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data-parallel rank"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        MegatronPretrainingRandomSampler(None, 10, 3, 2, 0, 1)
    with pytest.raises(ValueError, match="--dataloader-type.*'bogus'"):
        build_pretraining_data_loader(list(range(4)), 0, 1, 0, 1, dataloader_type="bogus")


class TokenDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return {"text": np.arange(i, i + 5, dtype=np.int64)}


@pytest.mark.parametrize("kind,workers", [("single", 0), ("cyclic", 0), ("single", 1)])
def test_data_loader_batches_follow_the_sampler(kind, workers):
    ds = TokenDataset()
    loader = build_pretraining_data_loader(ds, 8, 2, 1, 2, dataloader_type=kind,
                                           num_workers=workers)
    assert loader.persistent_workers == (workers > 0)
    assert loader.pin_memory == torch.cuda.is_available()
    if kind == "single":
        want = list(MegatronPretrainingSampler(30, 8, 2, 1, 2))
    else:
        want = list(MegatronPretrainingRandomSampler(None, 30, 8, 2, 1, 2))
    got = [batch["text"] for batch in loader]
    assert len(got) == len(want)
    for batch, idx in zip(got, want):
        assert batch.dtype == torch.int64 and batch.shape == (2, 5)
        assert batch[:, 0].tolist() == idx


def test_data_loader_passthrough_cases():
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
    ds = TokenDataset()
    assert build_pretraining_data_loader(ds, 0, 1, 0, 1, dataloader_type="external") is ds

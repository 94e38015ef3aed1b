"""Batch samplers that resume from ``consumed_samples``, and the pretraining DataLoader.

``--dataloader-type single`` (:class:`MegatronPretrainingSampler`) walks the dataset once in order
(the GPT dataset is already shuffled); ``cyclic`` (:class:`MegatronPretrainingRandomSampler`)
reshuffles every epoch and is iterated again and again; ``external`` hands the dataset over as the
loader. Both samplers yield each data-parallel rank its micro batch of every global step, and
start mid-run where a checkpoint's ``consumed_samples`` says, giving exactly the batches an
uninterrupted run would have given.
"""

import functools
import signal
from typing import Callable, Iterable, Iterator, List, Optional

import torch

from megatron.core import device
from megatron.data.dataset_utils import DataError

DATALOADER_TYPES = ("single", "cyclic", "external")


def _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                  data_parallel_size) -> None:
    if total_samples <= 0:
        raise DataError(f"the dataset has no samples (total_samples={total_samples})")
    if micro_batch_size <= 0:
        raise DataError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise DataError(f"data-parallel rank {data_parallel_rank} is not in "
                         f"[0, {data_parallel_size})")
    if consumed_samples < 0:
        raise DataError(f"consumed samples must be >= 0, got {consumed_samples}")


class MegatronPretrainingSampler:
    """Sample indices from ``consumed_samples`` on, in blocks of micro batch x DP; FORMATS.md 5.

    DP rank r takes ``[r * mbs, (r + 1) * mbs)`` of each block. An incomplete last block is
    dropped, or with ``drop_last=False`` split the same way (some ranks may then get fewer samples,
    or none).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                      data_parallel_size)
        if consumed_samples >= total_samples:
            raise DataError(f"consumed samples ({consumed_samples}) must be fewer than the "
                             f"dataset's {total_samples} samples; the run has used all its data")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _my_slice(self, block: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return block[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        block_size = self.micro_batch_times_data_parallel_size
        start = self.consumed_samples
        while start + block_size <= self.total_samples:
            yield self._my_slice(list(range(start, start + block_size)))
            start += block_size
        if start < self.total_samples and not self.drop_last:
            yield self._my_slice(list(range(start, self.total_samples)))


class MegatronPretrainingRandomSampler:
    """Epoch-reshuffled sampler of ``--dataloader-type cyclic``.

    Each epoch covers ``total - total % (mbs * dp)`` samples. With data sharding (the default)
    DP rank r owns the bucket ``[r * B, (r + 1) * B)``, B = ``(total // (mbs * dp)) * mbs``, and
    reads it in the order of ``torch.randperm(B)`` seeded with the epoch number; without it, one
    permutation of the whole dataset is dealt round-robin to the ranks. One pass of ``iter()``
    yields the rest of the current epoch and advances ``consumed_samples``, so iterating again
    continues with the next epoch; a new sampler built with a checkpoint's ``consumed_samples``
    continues exactly where the old one stopped.

    Args:
        dataset: the dataset (kept for reference; its samples are not touched).
        total_samples: ``len(dataset)``.
        consumed_samples: samples all DP ranks together have taken so far.
        micro_batch_size / data_parallel_rank / data_parallel_size: this rank's share.
        data_sharding: ``--no-data-sharding`` turns it off.
    """

    def __init__(self, dataset, total_samples: int, consumed_samples: int,
                 micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                 data_sharding: bool = True):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                      data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise DataError(f"the dataset's {total_samples} samples cannot fill one global "
                             f"micro batch of {micro_batch_size} x {data_parallel_size} ranks")
        if consumed_samples % self.micro_batch_times_data_parallel_size:
            raise DataError(f"consumed samples ({consumed_samples}) must be a multiple of "
                             f"micro batch x data-parallel size "
                             f"({self.micro_batch_times_data_parallel_size})")
        self.epoch = 0

    def __len__(self) -> int:
        return self.total_samples

    def _epoch_order(self, epoch_samples: int) -> List[int]:
        """This rank's remaining sample indices of the current epoch, in reading order."""
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = ((self.total_samples // self.micro_batch_times_data_parallel_size)
                           * self.micro_batch_size)
            bucket_offset = epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=g).tolist()
            return [start + x for x in order[bucket_offset:]]
        full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        order = torch.randperm(full_bucket_size, generator=g).tolist()
        return order[epoch_samples:][self.data_parallel_rank::self.data_parallel_size]

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        epoch_samples = self.consumed_samples % active_total_samples
        batch: List[int] = []
        for idx in self._epoch_order(epoch_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def cyclic_iter(iterable: Iterable) -> Iterator:
    """Iterate ``iterable`` again and again (how a ``cyclic`` loader is consumed)."""
    while True:
        yield from iterable


def _note_exit_signal(signum, frame) -> None:
    """A loader worker's handler of the run's exit signal: noted, not fatal (the training
    process saves and stops, and then ends its workers)."""
    global _EXIT_SIGNAL_RECEIVED
    _EXIT_SIGNAL_RECEIVED = signum


_EXIT_SIGNAL_RECEIVED = 0


def _install_exit_signal_handler(exit_signal: int, worker_id: int) -> None:
    del worker_id
    signal.signal(exit_signal, _note_exit_signal)


def exit_signal_worker_init(exit_signal: int) -> Callable[[int], None]:
    """--exit-signal-handler-for-dataloader: the ``worker_init_fn`` that makes each loader
    worker note ``exit_signal`` instead of dying of it, so a signal sent to the whole process
    group (as schedulers do) leaves the workers alive while the run saves its checkpoint."""
    return functools.partial(_install_exit_signal_handler, int(exit_signal))


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 2,
                                  seed: int = 1234, data_sharding: bool = True,
                                  drop_last: bool = True,
                                  worker_init_fn: Optional[Callable[[int], None]] = None
                                  ) -> Optional[Iterable]:
    """The DataLoader of one data-parallel rank, resuming after ``consumed_samples``.

    Args:
        dataset: the train/valid/test dataset, or None (then None is returned).
        dataloader_type: ``--dataloader-type``: ``single``, ``cyclic`` or ``external`` (the
            dataset is returned as it is: it is its own iterator of batches).
        num_workers: ``--num-workers``; workers stay alive between epochs when > 0.
        seed: seeds the loader's generator (the base seed of its workers).
        worker_init_fn: run first in each worker (:func:`exit_signal_worker_init`).
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
            data_parallel_size, drop_last=drop_last)
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
            data_parallel_size, data_sharding=data_sharding)
    elif dataloader_type == "external":
        return dataset
    else:
        raise DataError(f"--dataloader-type must be one of {DATALOADER_TYPES}, "
                         f"got {dataloader_type!r}")
    if num_workers < 0:
        raise DataError(f"--num-workers must be >= 0, got {num_workers}")
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=num_workers,
        pin_memory=device.is_cuda(), persistent_workers=num_workers > 0, generator=generator,
        worker_init_fn=worker_init_fn if num_workers > 0 else None)

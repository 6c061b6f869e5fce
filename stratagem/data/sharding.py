"""Reading only this worker's rows, and agreeing across workers on when data ends.

A DataLoader over a map-style dataset is re-built with a batch sampler that, for
each global batch of the original sampler, yields only the indices of this
worker's replicas: each worker loads only the rows it trains on. A shuffling
RandomSampler draws its permutation from a seed that the chief picks every epoch,
so every worker cuts the same global batches.

Inputs whose length is unknown are read step by step with an agreement: every
step, the workers sum ``[has_batch, rows]``; when no worker has data, all stop at
that step; a worker whose data ran out early takes part with empty slices, so no
batch is lost and no worker hangs.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler



def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous slices of ``total`` rows, earlier slices taking the extra rows.

    Example::

        from stratagem.data.sharding import split_sizes
        assert split_sizes(7, 3) == [3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class WorkerBatchSampler:
    """Yields this worker's share of every global batch of ``batch_sampler``.

    ``global_sizes`` receives the size of each global batch, in order, so that the
    consumer knows the true global batch size of every local batch it gets.
    """

    def __init__(self, batch_sampler: Any, num_replicas: int, first: int, count: int,
                 agree_seed: Callable[[int], int]):
        self._batch_sampler = batch_sampler
        self._num_replicas = num_replicas
        self._first = first
        self._count = count
        self._agree_seed = agree_seed
        self.global_sizes: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        return len(self._batch_sampler)

    def _epoch_sampler(self) -> Any:
        batch_sampler = self._batch_sampler
        if (type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, RandomSampler)
                and batch_sampler.sampler.generator is None):
            seed = self._agree_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            sampler = copy.copy(batch_sampler.sampler)
            sampler.generator = torch.Generator().manual_seed(seed)
            return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        return batch_sampler

    def __iter__(self) -> Iterator[list[int]]:
        self.global_sizes.clear()
        for indices in self._epoch_sampler():
            indices = list(indices)
            sizes = split_sizes(len(indices), self._num_replicas)
            start = sum(sizes[:self._first])
            stop = start + sum(sizes[self._first:self._first + self._count])
            self.global_sizes.append(len(indices))
            # A DataLoader cannot collate an empty batch: load one row, which the reader drops.
            yield indices[start:stop] if stop > start else indices[:1]


def shard_dataloader(loader: Any, num_replicas: int, first: int, count: int,
                     agree_seed: Callable[[int], int]) -> tuple[DataLoader, WorkerBatchSampler] | None:
    """A copy of ``loader`` that loads only rows ``first..first+count-1`` replicas need; None if impossible."""
    if (not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None):
        return None
    sampler = WorkerBatchSampler(loader.batch_sampler, num_replicas, first, count, agree_seed)
    extra = {}
    if loader.num_workers > 0:
        extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers,
                 "multiprocessing_context": loader.multiprocessing_context}
    sharded = DataLoader(loader.dataset, batch_sampler=sampler, num_workers=loader.num_workers,
                         collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                         worker_init_fn=loader.worker_init_fn, generator=loader.generator, **extra)
    return sharded, sampler


class AgreedEnd:
    """Step-by-step agreement of the workers on whether anyone still has data.

    ``step(has_batch, rows)`` returns ``(workers_with_data, total_rows)``, the sums
    over workers; every worker must call it once per step.
    """

    def __init__(self, cross_worker_sum: Callable[[torch.Tensor], torch.Tensor]):
        self._sum = cross_worker_sum

    def step(self, has_batch: bool, rows: int) -> tuple[int, int]:
        totals = self._sum(torch.tensor([int(has_batch), rows], dtype=torch.int64))
        return int(totals[0].item()), int(totals[1].item())

"""Distributing input across replicas.

``experimental_distribute_dataset`` takes an iterable of *global* batches. Each
batch is cut along its first dimension into one contiguous slice per replica
(counting over all workers): when it does not divide evenly, earlier replicas take
one extra row, and a replica may get an empty slice. This process keeps only its
own replicas' slices and moves each to its replica's device. For CUDA devices the
next batch is copied ahead while the current step runs.

Nothing here knows whether the strategy lives in one process: the strategy's
``topology`` says which slices are this process's, and its ``collective`` lets the
workers agree (on a shuffling seed, on when data ends).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from stratagem.data.position import Position, PositionedDataset, TrackedIterator, primed
from stratagem.data.sharding import AgreedEnd, WorkerBatchSampler, shard_dataloader, split_sizes
from stratagem.errors import InvalidArgumentError
from stratagem.values import PerReplica, flatten, pack_as


class AutoShardPolicy(enum.Enum):
    """How a multi-worker input is divided: TensorFlow's names.

    ``AUTO`` and ``DATA`` give each worker its replicas' slices of every global
    batch; ``OFF`` gives every worker the whole batch (each worker's replicas split it).
    """

    AUTO = "AUTO"
    DATA = "DATA"
    OFF = "OFF"


@dataclass(frozen=True)
class InputOptions:
    """Options of a distributed dataset.

    ``experimental_resizable`` (``distribute_datasets_from_function`` only) says that the
    workers' input pipelines read one order of global batches, each its slice of every
    batch, so that after ``s`` steps they have read the first ``s`` global batches together
    whatever their number: then a position saved in the middle of an epoch resumes on
    another number of workers or replicas (each new pipeline skips ``s`` steps' batches).
    Without it such a resume is refused, since the pipelines could hold other elements.
    ``experimental_distribute_dataset`` reads one pipeline of global batches and resumes on
    any number of workers anyway.

    Example::

        import stratagem as sg
        opts = sg.InputOptions(auto_shard_policy=sg.AutoShardPolicy.OFF)
    """

    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    experimental_fetch_to_device: bool = True
    experimental_prefetch: bool = True
    experimental_resizable: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.auto_shard_policy, AutoShardPolicy):
            raise InvalidArgumentError(
                f"auto_shard_policy must be a sg.AutoShardPolicy, got {self.auto_shard_policy!r}")
        if not isinstance(self.experimental_resizable, bool):
            raise InvalidArgumentError(
                f"experimental_resizable must be True or False, got {self.experimental_resizable!r}")


@dataclass(frozen=True)
class InputContext:
    """What ``dataset_fn`` of ``distribute_datasets_from_function`` is told.

    Example::

        import stratagem as sg
        ctx = sg.InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=4)
        assert ctx.get_per_replica_batch_size(64) == 16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise InvalidArgumentError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync; pick a multiple of "
                f"{self.num_replicas_in_sync} (e.g. {self.num_replicas_in_sync * max(1, global_batch_size // self.num_replicas_in_sync)})")
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class ValueContext:
    """What ``experimental_distribute_values_from_function``'s function is told."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def batch_size_of(leaves: list[Any]) -> int:
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) > 1:
        raise InvalidArgumentError(
            f"the tensors of one batch disagree on the batch size (first dimensions {sorted(sizes)}); "
            f"every tensor in a batch must have the batch dimension first")
    if not sizes:
        raise InvalidArgumentError(
            "a batch must contain at least one tensor or array with a batch dimension first")
    return sizes.pop()


def as_tensor(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf)
    return leaf


def split_batch(batch: Any, num_replicas: int, first: int, count: int) -> tuple[list[Any], int]:
    """Cut a global batch into ``num_replicas`` slices; return slices ``first..first+count-1``.

    Leaves without a batch dimension (numbers, strings, 0-d tensors) go to every
    replica unchanged. Returns the slices and the global batch size.
    """
    leaves = [as_tensor(leaf) for leaf in flatten(batch)]
    total = batch_size_of(leaves)
    sizes = split_sizes(total, num_replicas)
    starts = [sum(sizes[:r]) for r in range(num_replicas)]
    slices = []
    for r in range(first, first + count):
        lo, hi = starts[r], starts[r] + sizes[r]
        slices.append([leaf[lo:hi] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
                       for leaf in leaves])
    return slices, total


def to_device(leaves: list[Any], device: torch.device) -> list[Any]:
    non_blocking = device.type == "cuda"
    return [leaf.to(device, non_blocking=non_blocking) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves]


def _pin(leaves: list[Any]) -> list[Any]:
    return [leaf.pin_memory() if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" else leaf
            for leaf in leaves]


class PrefetchingIterator:
    """Yields distributed batches; with CUDA devices, the next batch is copied ahead."""

    def __init__(self, strategy: Any, source: Iterator, make: Callable[[Any], Any], prefetch: bool):
        self._strategy = strategy
        self._source = source
        self._make = make
        self._prefetch = prefetch
        self._ahead: list[Any] = []

    def __iter__(self) -> "PrefetchingIterator":
        return self

    def __next__(self) -> Any:
        if not self._prefetch:
            return self._make(next(self._source))
        if not self._ahead:
            self._ahead.append(self._make(next(self._source)))
        current = self._ahead.pop()
        try:
            self._ahead.append(self._make(next(self._source)))
        except StopIteration:
            pass
        return current

    def get_next(self) -> Any:
        """TensorFlow's spelling of ``next(iterator)``."""
        return next(self)


class DistributedDataset(PositionedDataset):
    """An iterable of global batches, split across replicas (from ``experimental_distribute_dataset``).

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        data = s.experimental_distribute_dataset([torch.arange(5)])
        print(next(iter(data)))    # PerReplica:{ 0: tensor([0, 1, 2]), 1: tensor([3, 4]) }
    """

    def __init__(self, strategy: Any, dataset: Iterable, options: InputOptions | None = None):
        if options is not None and not isinstance(options, InputOptions):
            raise InvalidArgumentError(f"options must be sg.InputOptions, got {options!r}")
        if not isinstance(dataset, Iterable):
            raise InvalidArgumentError(
                f"experimental_distribute_dataset needs an iterable of global batches (a "
                f"DataLoader, a list, ...), got {type(dataset).__name__}")
        self._strategy = strategy
        self._dataset = dataset
        self._options = options or InputOptions()
        self.position = Position(dataset)

    def __iter__(self) -> TrackedIterator:
        source, settle, token = self.position.begin(self._dataset)
        return TrackedIterator(self, primed(self._iterate(source), settle), token)

    def _iterate(self, source: Iterable) -> PrefetchingIterator:
        strategy = self._strategy
        devices = list(strategy.topology.torch_devices)
        cuda = any(d.type == "cuda" for d in devices) and self._options.experimental_fetch_to_device
        shard_off = self._options.auto_shard_policy is AutoShardPolicy.OFF
        num_replicas = strategy.topology.num_local_replicas if shard_off else strategy.num_replicas_in_sync
        first = 0 if shard_off else strategy.topology.first_replica_id
        count = strategy.topology.num_local_replicas
        one_replica = strategy.num_replicas_in_sync == 1

        def make(item: tuple[Any, list[list[Any]], int]) -> Any:
            batch, slices, total = item
            if shard_off:  # every worker's replicas share the whole batch: the step sees it once per worker
                total *= strategy.topology.num_workers
            if self._options.experimental_fetch_to_device:
                if cuda:
                    slices = [_pin(s) for s in slices]
                slices = [to_device(s, device) for s, device in zip(slices, devices)]
            if one_replica:
                return pack_as(batch, slices[0])
            columns = [PerReplica([s[i] for s in slices], strategy, total) for i in range(len(slices[0]))]
            return pack_as(batch, columns)

        sharded = None
        # every process agrees on the shuffling seed: also those of one worker (tensor parallelism)
        everyone = strategy.checkpoint_collective
        if (strategy.topology.num_workers > 1 or everyone.num_workers > 1) and not shard_off:
            sharded = shard_dataloader(source, num_replicas, first, count, everyone.broadcast_object)
        if sharded is not None:
            items = _sharded_items(*sharded, num_replicas, first, count)
        else:
            items = _split_items(self._worker_batches(source), num_replicas, first, count)
        return PrefetchingIterator(strategy, items, make, cuda and self._options.experimental_prefetch)

    def _worker_batches(self, source: Iterable) -> Iterator[tuple[Any, int | None]]:
        """Global batches, agreed across workers: ``(batch, None)``, or ``(template, total)``
        while this worker has run out and others have not."""
        strategy = self._strategy
        if strategy.topology.num_workers == 1 or _same_length_everywhere(strategy, source):
            return ((batch, None) for batch in source)
        return agreed_batches(strategy, iter(source), global_batches=True)


def empty_like(element: Any) -> Any:
    leaves = [as_tensor(leaf) for leaf in flatten(element)]
    return pack_as(element, [leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
                             for leaf in leaves])


# ------------------------------------------------------------------ workers

class Template:
    """Stands for a batch this worker no longer has, while other workers still do."""

    def __init__(self, batch: Any):
        self.batch = batch


def _split_items(batches: Iterator[tuple[Any, int | None]], num_replicas: int, first: int,
                 count: int) -> Iterator[tuple[Any, list[list[Any]], int]]:
    for batch, agreed_total in batches:
        if isinstance(batch, Template):
            slices, _ = split_batch(empty_like(batch.batch), count, 0, count)
            yield batch.batch, slices, agreed_total
        else:
            slices, total = split_batch(batch, num_replicas, first, count)
            yield batch, slices, total


def _sharded_items(loader: Any, sampler: WorkerBatchSampler, num_replicas: int, first: int,
                   count: int) -> Iterator[tuple[Any, list[list[Any]], int]]:
    """This worker's rows of each global batch, cut into its replicas' slices."""
    for local in loader:
        total = sampler.global_sizes.popleft()
        sizes = split_sizes(total, num_replicas)[first:first + count]  # all 0: the loaded row is dropped
        leaves = [as_tensor(leaf) for leaf in flatten(local)]
        slices, start = [], 0
        for size in sizes:
            slices.append([leaf[start:start + size] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
                           for leaf in leaves])
            start += size
        yield local, slices, total


def _same_length_everywhere(strategy: Any, dataset: Any) -> bool:
    """Whether every worker's dataset has the same known length (then no per-step agreement)."""
    try:
        length = len(dataset)
    except TypeError:
        length = -1
    lengths = torch.tensor([length, length * length], dtype=torch.float64)
    totals = strategy.collective.worker_sum(lengths, "the input (the dataset's length on every worker)")
    n = strategy.topology.num_workers
    return length >= 0 and totals[0].item() == n * length and totals[1].item() == n * length * length


def agreed_batches(strategy: Any, source: Iterator, *, global_batches: bool) -> Iterator[tuple[Any, int | None]]:
    """Read ``source`` step by step while any worker still has data (see :mod:`.sharding`)."""
    agreement = AgreedEnd(lambda t: strategy.collective.worker_sum(t, "the input (which workers have a batch)"))
    template = None
    while True:
        try:
            batch = next(source)
        except StopIteration:
            batch = None
        if batch is None:
            rows = 0
        elif global_batches:
            rows = batch_size_of([as_tensor(leaf) for leaf in flatten(batch)])
        else:
            rows = sum(batch_size_of([as_tensor(leaf) for leaf in flatten(e)]) for e in batch)
        holders, total = agreement.step(batch is not None, rows)
        if not holders:
            return
        if batch is not None:
            template = batch
            yield batch, (None if global_batches else total)
            continue
        if template is None:
            raise InvalidArgumentError(
                f"worker {strategy.topology.worker_index}'s dataset is empty while other workers have data; "
                f"give every worker at least one batch (or read one shared dataset)")
        # Global batches: every worker that still has data read the same batch, so the
        # rows summed over them divided by their number is its size.
        yield Template(template), (total // holders if global_batches else total)

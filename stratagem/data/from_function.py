"""Per-replica input from a function: ``strategy.distribute_datasets_from_function(dataset_fn)``.

``dataset_fn(InputContext)`` runs once per worker and returns that worker's input
pipeline; its elements are per-replica batches, taken by the local replicas in turn.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from stratagem.data.input import (InputContext, InputOptions, PrefetchingIterator, Template, agreed_batches,
                                  as_tensor, batch_size_of, empty_like, to_device)
from stratagem.data.position import Position, PositionedDataset, TrackedIterator, primed
from stratagem.errors import InvalidArgumentError
from stratagem.values import PerReplica, flatten, pack_as


class DistributedDatasetsFromFunction(PositionedDataset):
    """Per-replica batches from ``dataset_fn(InputContext)`` (``distribute_datasets_from_function``).

    Each local replica takes the next element of this worker's dataset in turn.
    When the dataset runs out part-way through a step, the replicas left without an
    element get an empty slice of the same structure, so the step still completes.

    Example::

        import torch, stratagem as sg
        s = sg.MirroredStrategy(["cpu:0", "cpu:1"])

        def dataset_fn(ctx):
            n = ctx.get_per_replica_batch_size(8)
            return [torch.ones(n, 3) for _ in range(4)]

        for batch in s.distribute_datasets_from_function(dataset_fn):
            pass
    """

    def __init__(self, strategy: Any, dataset_fn: Callable, options: InputOptions | None = None):
        if not callable(dataset_fn):
            raise InvalidArgumentError("dataset_fn must be callable: dataset_fn(input_context) -> iterable")
        if options is not None and not isinstance(options, InputOptions):
            raise InvalidArgumentError(f"options must be sg.InputOptions, got {options!r}")
        self._strategy = strategy
        self._options = options or InputOptions()
        context = InputContext(strategy.topology.num_workers, strategy.topology.worker_index, strategy.num_replicas_in_sync)
        self._dataset = dataset_fn(context)
        if not isinstance(self._dataset, Iterable):
            raise InvalidArgumentError(
                f"dataset_fn must return an iterable of per-replica batches, got {type(self._dataset).__name__}")
        count = strategy.topology.num_local_replicas
        self.position = Position(self._dataset, lambda steps: steps * count)

    per_worker_position = True   # each worker reads its own pipeline

    @property
    def resizable(self) -> bool:
        """Whether the pipelines read one order of global batches (``InputOptions(experimental_resizable=True)``)."""
        return self._options.experimental_resizable

    def __iter__(self) -> TrackedIterator:
        source, settle, token = self.position.begin(self._dataset)
        return TrackedIterator(self, primed(self._iterate(source), settle), token)

    def _iterate(self, dataset: Iterable) -> PrefetchingIterator:
        strategy = self._strategy
        devices = list(strategy.topology.torch_devices)
        count = strategy.topology.num_local_replicas
        cuda = any(d.type == "cuda" for d in devices)
        source = iter(dataset)
        exact = strategy.topology.num_workers == 1

        def groups() -> Iterator[list[Any]]:
            while True:
                group = []
                for _ in range(count):
                    try:
                        group.append(next(source))
                    except StopIteration:
                        break
                if not group:
                    return
                while len(group) < count:
                    group.append(empty_like(group[0]))
                yield group

        if not exact:
            agreed = agreed_batches(strategy, groups(), global_batches=False)
        else:
            agreed = ((group, None) for group in groups())

        def make(item: tuple[Any, int | None]) -> Any:
            group, total = item
            if isinstance(group, Template):
                group = [empty_like(group.batch[0])] * count
            flat = [[as_tensor(leaf) for leaf in flatten(element)] for element in group]
            if self._options.experimental_fetch_to_device:
                flat = [to_device(f, device) for f, device in zip(flat, devices)]
            if exact:
                total = sum(batch_size_of(f) for f in flat)
            if strategy.num_replicas_in_sync == 1:
                return pack_as(group[0], flat[0])
            columns = [PerReplica([f[i] for f in flat], strategy, total) for i in range(len(flat[0]))]
            return pack_as(group[0], columns)

        return PrefetchingIterator(strategy, agreed, make, cuda and self._options.experimental_prefetch)

"""``Model.fit`` under a ``ParameterServerStrategy``: steps scheduled through the coordinator.

As in TensorFlow, the input is read on the workers, forever, so ``steps_per_epoch`` is
required. Each worker builds its own input: tensor / numpy inputs are sent to every
worker once and cut into batches of ``batch_size`` there, reshuffled every pass with a
seed of that worker's own; a DataLoader or iterable is sent to every worker (it must
pickle) and read over and over; a function ``dataset_fn(input_context)`` is called on
each worker, as ``coordinator.create_per_worker_dataset`` does (TensorFlow's
``DatasetCreator``).

Per epoch: ``steps_per_epoch`` steps are scheduled, ``steps_per_execution`` per function
(``on_train_batch_begin`` for each as it is queued), then their results are fetched in
order (``on_train_batch_end`` with its last step's loss), then ``join``. The epoch logs are the metrics' global values, read on the
coordinator after the join. ``stop_training`` set during an epoch ends training after
that epoch's scheduled steps (they are already queued). Validation runs on the coordinator.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from stratagem.ps.coordinator import ClusterCoordinator
from stratagem.errors import InvalidArgumentError
from stratagem.keras.callback_list import CallbackList
from stratagem.keras.inputs import DEFAULT_BATCH_SIZE, ArrayDataset, as_batches, keep_batch
from stratagem.keras.progress import ProgressLogger

__all__ = ["ScheduledEpochs"]


class ScheduledEpochs:
    """The steps of ``fit`` under a parameter-server strategy (see the module docstring)."""

    dataset = None   # a backup holds model and optimizer only: the workers' inputs have no position

    def __init__(self, model: Any, x: Any, y: Any, sample_weight: Any, *, batch_size: int | None,
                 steps_per_epoch: int | None, shuffle: bool) -> None:
        if steps_per_epoch is None:
            raise InvalidArgumentError(
                "fit under a ParameterServerStrategy needs steps_per_epoch: the workers read their input over "
                "and over, so an epoch has no end of its own (as in TensorFlow); e.g. "
                "model.fit(x, y, epochs=5, steps_per_epoch=100)")
        strategy = model.strategy
        coordinator = strategy.coordinator
        if coordinator is None:
            coordinator = ClusterCoordinator(strategy)
        self.steps = steps_per_epoch
        self.batch_size = batch_size   # global; None when the input makes its own batches
        self._coordinator = coordinator
        dataset_fn = _dataset_fn(x, y, sample_weight, batch_size, shuffle)
        self._iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        self._step_fn = functools.partial(_scheduled_step, model.make_train_function())
        self._every = model.steps_per_execution

    def prepare(self, callback_list: CallbackList, progress: ProgressLogger) -> None:
        pass

    def end(self, progress: ProgressLogger) -> None:
        pass   # (the straggler table is the collective strategies': the workers here wait for no one)

    def run_epoch(self, callback_list: CallbackList, progress: ProgressLogger) -> None:
        coordinator, every = self._coordinator, self._every
        scheduled = []
        for first in range(0, self.steps, every):
            count = min(every, self.steps - first)
            callback_list.call("on_train_batch_begin", first, None)
            scheduled.append((first + count - 1, count,
                              coordinator.schedule(self._step_fn, args=(self._iterator, count))))
        for step, count, value in scheduled:
            loss, rows = value.fetch()
            logs = {"loss": float(loss)}   # the last step's own: the metrics' global values need the join
            callback_list.call("on_train_batch_end", step, logs)
            progress.step(rows, logs, count)
        coordinator.join()


def _scheduled_step(train_step: Any, iterator: Any, count: int = 1) -> tuple[torch.Tensor, int]:
    """What runs on a worker: ``count`` steps (``steps_per_execution``) on the next batches of
    its own input; the last step's loss and the rows of all of them."""
    rows = 0
    for _ in range(count):
        loss, done = train_step(next(iterator))
        rows += done
    return loss, rows


def _dataset_fn(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool) -> Any:
    """The function each worker calls to build its endless input."""
    if callable(x) and not isinstance(x, (torch.Tensor, DataLoader)) and not hasattr(x, "__iter__"):
        if y is not None or batch_size is not None:
            raise InvalidArgumentError("a dataset_fn x builds its own batches: leave y and batch_size out")
        return functools.partial(_from_function, x)
    data = as_batches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit")
    if isinstance(data, DataLoader) and isinstance(data.dataset, ArrayDataset):
        # send the tensors, not the loader: each worker cuts its own batches
        return functools.partial(_array_batches, data.dataset.tensors, data.dataset.template,
                                 data.batch_size or DEFAULT_BATCH_SIZE, shuffle)
    return functools.partial(_repeat, data)


def _array_batches(tensors: tuple[torch.Tensor, ...], template: Any, batch_size: int, shuffle: bool,
                   context: Any) -> Iterator[Any]:
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + context.input_pipeline_id)
    loader = DataLoader(ArrayDataset(*tensors, template=template), batch_size=batch_size, shuffle=shuffle, collate_fn=keep_batch,
                        generator=generator)
    return _repeat(loader, context)


def _from_function(dataset_fn: Any, context: Any) -> Iterator[Any]:
    """A worker's input from ``dataset_fn``, read over and over as a DataLoader given to fit is
    (TensorFlow's dataset_fn ends in ``.repeat()``; a DataLoader is its rename, and it ends)."""
    return _repeat(dataset_fn(context), context)


def _repeat(data: Any, context: Any = None) -> Iterator[Any]:
    passes = 0
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty and passes:
            raise InvalidArgumentError(
                f"the training input ran out after one pass and cannot be read again (an iterator); under a "
                f"ParameterServerStrategy fit reads it forever: return a DataLoader (read over and over) or an "
                f"endless generator (while True: yield from loader), got {type(data).__name__}")
        if empty:
            raise InvalidArgumentError("the training input has no batches")
        passes += 1

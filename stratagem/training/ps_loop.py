"""``Model.fit`` under a ``ParameterServerStrategy``: steps scheduled through the coordinator.

As in TensorFlow, the input is read on the workers, forever, so ``steps_per_epoch`` is
required. Each worker builds its own input: tensor / numpy inputs are sent to every
worker once and cut into batches of ``batch_size`` there, reshuffled every pass with a
seed of that worker's own; a DataLoader or iterable is sent to every worker (it must
pickle) and read over and over; a function ``dataset_fn(input_context)`` is called on
each worker, as ``coordinator.create_per_worker_dataset`` does (TensorFlow's
``DatasetCreator``).

Per epoch: ``steps_per_epoch`` steps are scheduled (``on_train_batch_begin`` for each as
it is queued), then their results are fetched in order (``on_train_batch_end`` with that
step's loss), then ``join``. The epoch logs are the metrics' global values, read on the
coordinator after the join. ``stop_training`` set during an epoch ends training after
that epoch's scheduled steps (they are already queued). Validation runs on the coordinator.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from stratagem.errors import InvalidArgumentError
from stratagem.training.callback_list import CallbackList, History
from stratagem.training.inputs import DEFAULT_BATCH_SIZE, ArrayDataset, as_batches, keep_batch
from stratagem.training.progress import ProgressLogger
from stratagem.training.steps import make_train_step

__all__ = ["fit_parameter_server"]


def fit_parameter_server(model: Any, x: Any, y: Any, sample_weight: Any, *, batch_size: int | None, epochs: int,
                         steps_per_epoch: int | None, validation_data: Any, shuffle: bool,
                         callbacks: Sequence[Any] | None, progress: ProgressLogger, initial_epoch: int) -> History:
    """The parameter-server form of :meth:`stratagem.Model.fit` (its arguments checked there)."""
    strategy = model.strategy
    if steps_per_epoch is None:
        raise InvalidArgumentError(
            "fit under a ParameterServerStrategy needs steps_per_epoch: the workers read their input over "
            "and over, so an epoch has no end of its own (as in TensorFlow); e.g. "
            "model.fit(x, y, epochs=5, steps_per_epoch=100)")
    coordinator = strategy.coordinator
    if coordinator is None:
        from stratagem.coordinator import ClusterCoordinator

        coordinator = ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(x, y, sample_weight, batch_size, shuffle)))
    train_step = make_train_step(model.module, model.optimizer, model._loss_fn, model._loss_tracker,
                                 model.compiled_metrics)
    step_fn = functools.partial(_scheduled_step, train_step)
    history = History()
    callback_list = CallbackList([*(callbacks or []), history], model=model,
                                 params={"epochs": epochs, "steps": steps_per_epoch, "verbose": progress.verbose})
    initial_epoch = model._restore_backup(callback_list, None, initial_epoch)
    model.history, model.stop_training = history, False
    callback_list.call("on_train_begin", None)
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.call("on_epoch_begin", epoch, None)
        progress.begin(steps_per_epoch, f"Epoch {epoch + 1}/{epochs}")
        scheduled = []
        for step in range(steps_per_epoch):
            callback_list.call("on_train_batch_begin", step, None)
            scheduled.append(coordinator.schedule(step_fn, args=(iterator,)))
        for step, value in enumerate(scheduled):
            loss, rows = value.fetch()
            step_logs = {"loss": float(loss)}
            callback_list.call("on_train_batch_end", step, step_logs)
            progress.step(rows, step_logs)
        coordinator.join()
        logs = model._logs()
        if validation_data is not None:
            logs.update(model._validate(validation_data, batch_size))
        progress.end(logs)
        callback_list.call("on_epoch_end", epoch, logs)
        if model.stop_training:
            break
    callback_list.call("on_train_end", logs)
    return history


def _scheduled_step(train_step: Any, iterator: Any) -> tuple[torch.Tensor, int]:
    """What runs on a worker: the next batch of its own input, one training step."""
    return train_step(next(iterator))


def _dataset_fn(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool) -> Any:
    """The function each worker calls to build its endless input."""
    if callable(x) and not isinstance(x, (torch.Tensor, DataLoader)) and not hasattr(x, "__iter__"):
        if y is not None or batch_size is not None:
            raise InvalidArgumentError("a dataset_fn x builds its own batches: leave y and batch_size out")
        return x
    data = as_batches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit")
    if isinstance(data, DataLoader) and isinstance(data.dataset, ArrayDataset):
        # send the tensors, not the loader: each worker cuts its own batches
        return functools.partial(_array_batches, data.dataset.tensors, data.batch_size or DEFAULT_BATCH_SIZE,
                                 shuffle)
    return functools.partial(_repeat, data)


def _array_batches(tensors: tuple[torch.Tensor, ...], batch_size: int, shuffle: bool,
                   context: Any) -> Iterator[Any]:
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + context.input_pipeline_id)
    loader = DataLoader(ArrayDataset(*tensors), batch_size=batch_size, shuffle=shuffle, collate_fn=keep_batch,
                        generator=generator)
    return _repeat(loader, context)


def _repeat(data: Any, context: Any = None) -> Iterator[Any]:
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise InvalidArgumentError("the training input has no batches")

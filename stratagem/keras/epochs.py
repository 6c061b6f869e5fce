"""The pieces of ``Model``'s loops under synchronous strategies: the epochs of ``fit``
(``strategy.run`` over the distributed dataset), the batches of an epoch, lazy step logs."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import torch

from stratagem.callbacks import Callback
from stratagem.errors import InvalidArgumentError
from stratagem.keras.callback_list import CallbackList
from stratagem.keras.inputs import as_batches
from stratagem.keras.progress import ProgressLogger
from stratagem.observe import record
from stratagem.observe.report import step_report
from stratagem.values import DistributedValues, flatten, pack_as

__all__ = ["EpochBatches", "LazyLogs", "ReplicatedEpochs", "concat", "global_rows", "length", "overrides", "step_logs"]


class ReplicatedEpochs:
    """The steps of ``fit`` under a synchronous strategy: ``strategy.run`` on every batch of
    the distributed dataset (which also holds the input position a backup restores)."""

    def __init__(self, model: Any, x: Any, y: Any, sample_weight: Any, *, batch_size: int | None,
                 steps_per_epoch: int | None, shuffle: bool) -> None:
        train = as_batches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method="fit")
        self.model = model
        self.dataset = model.strategy.experimental_distribute_dataset(train)
        self.steps = steps_per_epoch if steps_per_epoch is not None else length(train)
        self.batch_size: int | None = getattr(train, "batch_size", None)   # global; None when unknown
        self._batches = EpochBatches(self.dataset, steps_per_epoch)
        self._step_fn = model.make_train_function()
        self._batch_logs: Callable[[int], Mapping] = lambda step: {}
        self._first_step = 0

    def prepare(self, callback_list: CallbackList, progress: ProgressLogger) -> None:
        self._batch_logs = step_logs(self.model, callback_list, progress, "on_train_batch_end", self.steps)
        self._first_step = record.steps_done()

    def end(self, progress: ProgressLogger) -> None:
        """After the last epoch, with two or more workers: the straggler table of this fit's steps
        (every worker joins its gathering; the chief prints it)."""
        if self.model.strategy.topology.num_workers > 1:
            text = step_report(self.model.strategy, since=self._first_step)
            if progress.enabled:
                print(text, file=progress.file or sys.stdout, flush=True)

    def resume_in_epoch(self, step: int) -> None:
        """The first epoch is a restored one with ``step`` steps done (the dataset's position
        is restored too): with ``steps_per_epoch`` it takes only the rest."""
        self._batches.done_in_first_epoch = step

    def run_epoch(self, callback_list: CallbackList, progress: ProgressLogger) -> None:
        """Every batch, one ``strategy.run``; the batch callbacks (and ``stop_training``) once
        per ``steps_per_execution`` steps, with the last step's index and logs, as in Keras."""
        model, strategy, step_fn = self.model, self.model.strategy, self._step_fn
        every, rows, pending, step = model.steps_per_execution, 0, 0, -1
        record.new_epoch()   # (on the timeline: the epoch's first step starts here)
        batches = enumerate(self._batches.epoch())
        while True:
            with record.span("next batch", "loop"):   # (the dataset's own wait for input inside)
                step, batch = next(batches, (step, None))
            if batch is None:
                break
            if pending == 0:
                with record.span("callbacks", "loop"):
                    callback_list.call("on_train_batch_begin", step, None)
            strategy.run(step_fn, args=(batch,))
            rows, pending = rows + global_rows(batch), pending + 1
            if pending == every or step + 1 == self.steps:
                self._end_execution(step, rows, pending, callback_list, progress)
                rows = pending = 0
                if model.stop_training:
                    return
        if pending:   # the input ended inside an execution
            self._end_execution(step, rows, pending, callback_list, progress)

    def _end_execution(self, step: int, rows: int, steps: int, callback_list: CallbackList,
                       progress: ProgressLogger) -> None:
        with record.span("callbacks", "loop"):
            logs = self._batch_logs(step)
            callback_list.call("on_train_batch_end", step, logs)
            progress.step(rows, logs, steps)


def step_logs(model: Any, callback_list: CallbackList | None, progress: ProgressLogger, hook: str,
              steps: int | None) -> Callable[[int], Mapping]:
    """How each step's logs are made (``logs_of(step)``): reading a metric's global value
    costs a reduction.

    In one process that reading is local, so the logs are a lazy mapping, read only if a
    callback or the progress bar looks at them. Across workers it is a collective that
    every worker must join at the same step, so the workers agree once, at the start, on
    a schedule: every step when any of them has a callback with ``hook``; else, when any
    shows a bar, about 20 times an epoch but not more often than every 10 steps (the bar
    shows the values of the last reading); else never (the logs are empty).
    """
    if model.strategy.topology.num_workers == 1:
        return lambda step: LazyLogs(model.get_metrics_result)
    callbacks = callback_list.callbacks if callback_list is not None else []
    wanted = [float(any(overrides(callback, hook) for callback in callbacks)), float(progress.verbose == 1)]
    agreed = model.strategy.collective.worker_sum(torch.tensor(wanted), "Model.fit (who reads the logs)")
    if agreed[0].item() > 0:
        every = 1
    elif agreed[1].item() > 0:
        every = max(10, (steps or 200) // 20)   # a reading costs about as much as a small step
    else:
        return lambda step: {}
    last: dict = {}

    def logs_of(step: int) -> dict:
        nonlocal last
        if step % every == 0 or (steps is not None and step == steps - 1):
            last = model.get_metrics_result()
        return last
    return logs_of


class LazyLogs(Mapping):
    """A step's logs, read from the metrics on first use."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self._read = read
        self._logs: dict | None = None

    def _values(self) -> dict:
        if self._logs is None:
            self._logs = self._read()
        return self._logs

    def __getitem__(self, name: str) -> Any:
        return self._values()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __repr__(self) -> str:
        return repr(self._values())


def overrides(callback: Any, hook: str) -> bool:
    """Whether ``callback`` defines ``hook`` itself (not the do-nothing one of ``Callback``)."""
    reads = getattr(callback, "reads_train_batch_logs", None)
    if hook == "on_train_batch_end" and callable(reads):   # the callback says whether it reads them
        return bool(reads())
    own = getattr(type(callback), hook, None)
    return own is not None and own is not getattr(Callback, hook, None)


class EpochBatches:
    """The batches of each epoch: one pass over the input, or ``steps`` batches of an input
    read on across epochs (starting a new pass when one ends)."""

    def __init__(self, dataset: Any, steps: int | None) -> None:
        self._dataset = dataset
        self._steps = steps
        self._iterator: Any = None
        self.done_in_first_epoch = 0   # a resumed epoch's steps done before the restart

    def epoch(self) -> Iterable:
        if self._steps is None:   # one pass: a restored dataset resumes its pass where it stopped
            yield from self._dataset
            return
        done, self.done_in_first_epoch = self.done_in_first_epoch, 0
        while done < self._steps:
            new_pass = self._iterator is None   # else the pass the last epoch stopped in (perhaps at its end)
            if new_pass:
                self._iterator = iter(self._dataset)
            fresh = done
            for batch in self._iterator:
                yield batch
                done += 1
                if done == self._steps:
                    return
            self._iterator = None
            if new_pass and done == fresh:
                raise InvalidArgumentError(f"the input has no batches, but steps={self._steps} were asked for")


def concat(parts: list[Any]) -> Any:
    """Outputs of several slices (tensors, or equal structures of tensors) joined along rows."""
    if len(parts) == 1:
        return parts[0]
    leaves = [flatten(part) for part in parts]
    return pack_as(parts[0], [torch.cat(column) for column in zip(*leaves)])


def global_rows(batch: Any) -> int:
    """The rows of a global batch (over every replica and worker)."""
    for leaf in flatten(batch):
        if isinstance(leaf, DistributedValues) and leaf.global_batch_size is not None:
            return leaf.global_batch_size
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


def length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None

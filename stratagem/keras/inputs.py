"""What ``fit`` / ``evaluate`` / ``predict`` accept as input, turned into global batches.

- tensors or numpy arrays ``x`` (with ``y`` and ``sample_weight`` for training), or a dict
  or tuple of them for a module of several inputs (:func:`is_array_input`): a
  ``DataLoader`` of *global* batches of ``batch_size`` rows (default 32, as Keras),
  reshuffled every epoch when ``shuffle``. Its dataset fetches a whole batch with one
  indexing per tensor (``__getitems__``), not row by row. The strategy's distributed
  dataset cuts each batch over the replicas, agrees on the shuffling seed across workers,
  and keeps the position a checkpoint restores;
- a ``torch.utils.data.DataLoader`` (its own batch size: ``batch_size`` must be None);
- any other iterable of batches ``(x, y)``, ``(x, y, sample_weight)`` or ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from stratagem.errors import InvalidArgumentError
from stratagem.values import flatten, map_structure, pack_as

__all__ = ["Batch", "DEFAULT_BATCH_SIZE", "as_batches", "is_array_input", "split_validation", "unpack"]

DEFAULT_BATCH_SIZE = 32


class ArrayDataset(Dataset):
    """Equal-length tensors; ``__getitems__`` fetches a batch of rows with one indexing per tensor.

    ``template`` is the structure of an item with None for each tensor, in :func:`flatten`
    order (by default a tuple of them): ``((None, None), None)`` for a tuple ``x`` and ``y``.
    """

    def __init__(self, *tensors: torch.Tensor, template: Any = None) -> None:
        self.tensors = tensors
        self.template = tuple(None for _ in tensors) if template is None else template

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> Any:
        return pack_as(self.template, [t[index] for t in self.tensors])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """One batch, gathered with one intra-op thread: between two steps, waking torch's
        thread pool for a copy this small leaves its threads spinning while the replicas of
        the next step compute (measured: +30% CPU and +20-50% time per step for the MLP of
        ``benchmarks/fit.py`` on 2 cores)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            return pack_as(self.template, [t[index] for t in self.tensors])
        finally:
            if threads > 1:
                torch.set_num_threads(threads)


def keep_batch(batch: Any) -> Any:
    """The DataLoader's collate_fn for :class:`ArrayDataset`: its items are whole batches already."""
    return batch


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def is_array_input(x: Any) -> bool:
    """Whether ``x`` is array input: a tensor or numpy array, or a dict or tuple whose values all
    are (a module's named or positional inputs; a list stays an iterable of batches)."""
    if isinstance(x, dict) or type(x) is tuple:
        values = list(x.values()) if isinstance(x, dict) else list(x)
        return bool(values) and all(_is_array(v) for v in values)
    return _is_array(x)


def _check_array_input(x: Any, method: str) -> None:
    """A dict or tuple ``x`` with arrays in it must be arrays throughout, of one length."""
    if not (isinstance(x, dict) or type(x) is tuple) or not any(_is_array(v) for v in (
            x.values() if isinstance(x, dict) else x)):
        return
    names = [f"x[{k!r}]" for k in x] if isinstance(x, dict) else [f"x[{i}]" for i in range(len(x))]
    values = list(x.values()) if isinstance(x, dict) else list(x)
    for name, value in zip(names, values):
        if not _is_array(value):
            raise InvalidArgumentError(f"{method}: {name} is a {type(value).__name__}; every input of a dict or tuple "
                                       f"x must be a tensor or numpy array with one row per example")
    rows = {name: len(value) if value.ndim else 0 for name, value in zip(names, values)}
    if len(set(rows.values())) > 1:
        raise InvalidArgumentError(
            f"{method}: the inputs of x must have the same number of rows (the batch dimension first), got "
            f"{', '.join(f'{k} {v}' for k, v in rows.items())}; fix their shapes (an iterable of batches is "
            f"given as a list or a DataLoader, not a tuple)")

def _tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a tensor or numpy array like x, got {type(value).__name__}")
    if value.dim() == 0:
        raise InvalidArgumentError(f"{name} is a scalar; it needs one row per example (batch dimension first)")
    return value


def as_batches(x: Any, y: Any = None, sample_weight: Any = None, *, batch_size: int | None, shuffle: bool,
               method: str) -> Iterable:
    """The global batches of ``method``'s input (``fit``, ``evaluate`` or ``predict``)."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidArgumentError(f"batch_size must be a positive int (the global batch size) or None, "
                                   f"got {batch_size!r}")
    _check_array_input(x, method)
    if is_array_input(x):
        inputs = map_structure(lambda value: _tensor(value, "x"), x)
        if y is None and sample_weight is not None:
            raise InvalidArgumentError("sample_weight needs y: pass fit(x, y, sample_weight=...)")
        item = (inputs, *(_tensor(value, name) for name, value in [("y", y), ("sample_weight", sample_weight)]
                          if value is not None))
        lengths = {name: len(t) for name, t in zip(["x", "y", "sample_weight"], [flatten(inputs)[0], *item[1:]])}
        if len(set(lengths.values())) > 1:
            raise InvalidArgumentError(
                f"{method}: x and y (and sample_weight) must have the same number of rows, got "
                f"{', '.join(f'{k} {v}' for k, v in lengths.items())}")
        if y is None and method != "predict":
            raise InvalidArgumentError(f"{method}(x) with an array x needs the targets y: {method}(x, y)")
        dataset = ArrayDataset(*flatten(item), template=map_structure(lambda t: None, item))
        return DataLoader(dataset, batch_size=batch_size or DEFAULT_BATCH_SIZE, shuffle=shuffle,
                          collate_fn=keep_batch)
    where = "the DataLoader" if isinstance(x, DataLoader) else "the iterable"
    if batch_size is not None:
        raise InvalidArgumentError(
            f"batch_size={batch_size} was given with {where} x, whose batches are made already; leave "
            f"batch_size out (set the batch size when building the DataLoader)")
    if y is not None or sample_weight is not None:
        raise InvalidArgumentError(
            f"y / sample_weight were given with {where} x; its batches must hold them: (x, y) or "
            f"(x, y, sample_weight)")
    if isinstance(x, (str, bytes, dict)) or not isinstance(x, Iterable):
        raise InvalidArgumentError(
            f"{method} takes tensors or numpy arrays (with y), a dict or tuple of them (the module's inputs), a "
            f"DataLoader, or an iterable of (x, y) batches; got {type(x).__name__}")
    return x


@dataclass
class Batch:
    """One replica's part of a batch: inputs, targets (or None), weights (or None)."""

    x: Any
    y: Any = None
    sample_weight: Any = None


def unpack(batch: Any) -> Batch:
    """``(x, y)``, ``(x, y, sample_weight)``, ``(x,)`` or ``x`` -> :class:`Batch`."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return Batch(batch[0])
        if len(batch) == 2:
            return Batch(batch[0], batch[1])
        if len(batch) == 3:
            return Batch(*batch)
        raise InvalidArgumentError(
            f"a batch must be x, (x, y) or (x, y, sample_weight); got a {type(batch).__name__} of "
            f"{len(batch)} elements")
    return Batch(batch)


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple[tuple, tuple]:
    """Keras's ``validation_split``: the *last* ``fraction`` of the rows (before shuffling) validate."""
    if not 0.0 <= fraction < 1.0:
        raise InvalidArgumentError(f"validation_split must be in [0, 1), got {fraction!r}")
    if not is_array_input(x) or y is None:
        raise InvalidArgumentError(
            "validation_split works with tensor / numpy inputs x (or a dict or tuple of them) and y only; with a "
            "DataLoader or an iterable pass validation_data=... instead")
    _check_array_input(x, "fit")
    rows = len(flatten(x)[0])
    cut = rows - int(rows * fraction)
    if cut <= 0 or cut == rows:
        raise InvalidArgumentError(
            f"validation_split={fraction} of {rows} rows leaves "
            f"{'no training' if cut <= 0 else 'no validation'} rows; pick another fraction")

    def part(value: Any, sl: slice) -> Any:
        return None if value is None else map_structure(lambda array: array[sl], value)
    head, tail = slice(0, cut), slice(cut, rows)
    return ((part(x, head), part(y, head), part(sample_weight, head)),
            (part(x, tail), part(y, tail), part(sample_weight, tail)))

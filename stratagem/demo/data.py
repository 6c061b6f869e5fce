"""The demo's data: scikit-learn's digits, split once, and batches reshuffled per epoch.

Every strategy and the plain-PyTorch reference read the same global batches in the same
order: the order depends only on a seed and the epoch, as with ``DistributedSampler``.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

__all__ = ["Digits", "ShuffledBatches", "load_digits_split"]


@dataclass(frozen=True)
class Digits:
    """The digits data set: standardised float32 features, a fixed stratified split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    """Load scikit-learn's digits, split 80/20 (stratified) and standardise on the train part.

    The digits are read straight from the file scikit-learn ships, without importing
    scikit-learn (and scipy): that import alone took most of a second of the demo's start.

    Example::

        from stratagem.demo import load_digits_split
        data = load_digits_split()
        assert data.x_train.shape == (1437, 64) and data.x_test.shape == (360, 64)
    """
    x, y = _read_digits()
    test_index = _stratified_test_rows(y, test_fraction, split_seed)
    is_test = torch.zeros(len(y), dtype=torch.bool)
    is_test[test_index] = True
    x_train, y_train, x_test, y_test = x[~is_test], y[~is_test], x[is_test], y[is_test]
    mean = x_train.mean(dim=0)
    scale = x_train.std(dim=0, unbiased=False)
    scale[scale == 0] = 1.0                  # constant pixels (always blank) stay 0
    standardise = lambda a: ((a - mean) / scale).to(torch.float32)
    return Digits(standardise(x_train), y_train, standardise(x_test), y_test)


def _read_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as float64 features (8x8 pixels, 0..16) and int64 labels."""
    spec = importlib.util.find_spec("sklearn")      # finds the package without importing it
    path = (Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
            if spec is not None and spec.submodule_search_locations else None)
    if path is not None and path.is_file():
        table = torch.from_numpy(np.loadtxt(path, delimiter=","))
        return table[:, :-1], table[:, -1].to(torch.int64)
    from sklearn.datasets import load_digits       # a scikit-learn that keeps the file elsewhere
    x, y = load_digits(return_X_y=True)
    return torch.from_numpy(x).to(torch.float64), torch.from_numpy(y).to(torch.int64)


def _stratified_test_rows(y: torch.Tensor, test_fraction: float, seed: int) -> torch.Tensor:
    """Rows for the test part: ``ceil(test_fraction * n)`` in all, each class in proportion.

    Each class gets the floor of its share; the rows left over go to the classes with the
    largest remainders, so the total is exact. Which rows of a class: a seeded permutation.
    """
    generator = torch.Generator().manual_seed(seed)
    classes, counts = torch.unique(y, return_counts=True)
    num_test = math.ceil(test_fraction * len(y))
    shares = counts.to(torch.float64) * num_test / len(y)
    per_class = shares.floor().to(torch.int64)
    leftover = num_test - int(per_class.sum())
    per_class[torch.argsort(shares - per_class, descending=True, stable=True)[:leftover]] += 1
    rows = []
    for label, take in zip(classes.tolist(), per_class.tolist()):
        members = torch.nonzero(y == label).flatten()
        rows.append(members[torch.randperm(len(members), generator=generator)[:take]])
    return torch.cat(rows)


class ShuffledBatches:
    """A re-iterable of global ``(x, y)`` batches, reshuffled per epoch like ``DistributedSampler``.

    The order depends only on ``seed`` and the epoch set with :meth:`set_epoch`, so the
    strategy and the plain-PyTorch reference see the same batches in the same order.
    ``shuffle=False`` keeps the stored order (for evaluation).

    Example::

        import torch
        from stratagem.demo import ShuffledBatches
        batches = ShuffledBatches(torch.zeros(10, 2), torch.arange(10), batch_size=4, seed=0)
        assert [len(y) for _, y in batches] == [4, 4, 2]
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        self._x, self._y = x, y
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0

    @property
    def num_examples(self) -> int:
        return len(self._y)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return math.ceil(len(self._y) / self._batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed * 100_003 + self._epoch)
            order = torch.randperm(len(self._y), generator=generator)
        else:
            order = torch.arange(len(self._y))
        for start in range(0, len(order), self._batch_size):
            index = order[start:start + self._batch_size]
            yield self._x[index], self._y[index]

"""The demo's data: scikit-learn's digits, split once, and batches reshuffled per epoch.

Every strategy and the plain-PyTorch reference read the same global batches in the same
order: the order depends only on a seed and the epoch, as with ``DistributedSampler``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

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

    scikit-learn is imported here, on first use: the tasks of the demo's cluster get the
    split data from a file and never import it.

    Example::

        from stratagem.demo import load_digits_split
        data = load_digits_split()
        assert data.x_train.shape == (1437, 64) and data.x_test.shape == (360, 64)
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)
    return Digits(as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test))


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

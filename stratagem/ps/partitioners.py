"""How many shards a variable gets: TensorFlow's partitioners, rule for rule.

A partitioner is called with a variable's shape and dtype and returns the number of shards
per axis, TensorFlow's format: ``[num_shards, 1, 1, ...]`` -- variables are split along
their first dimension only. :func:`shard_sizes` then says how many rows each shard holds.
The rules are those of ``tf.distribute.experimental.partitioners`` (which call TF's
``min_max_variable_partitioner`` and ``variable_axis_size_partitioner``):

- ``FixedShardsPartitioner(num_shards)``: ``min(num_shards, shape[0])`` shards.
- ``MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=1)``:
  ``max(1, min(shape[0], max_shards, ceil(total_bytes / min_shard_bytes)))``. TensorFlow's
  documentation says "each shard has at least min_shard_bytes"; its code rounds up, so a
  variable of 1.5 x min_shard_bytes gets two shards of 0.75 x -- we do what the code does.
- ``MaxSizePartitioner(max_shard_bytes, max_shards=None)``: rows per shard
  ``max(1, floor(max_shard_bytes / bytes_per_row))``, shards
  ``ceil(shape[0] / rows_per_shard)``, capped by ``max_shards``: the fewest shards of at most
  max_shard_bytes each (a single row larger than that still gets a shard of its own).

``bytes_per_string`` is kept for TensorFlow's signature: it is the element size used when
``dtype`` is ``str`` (torch has no string tensors). A 0-d variable cannot be split: every
partitioner returns ``[]`` for it. A variable with 0 rows gets one shard.

Example (TensorFlow's documented cases)::

    >>> import torch
    >>> from stratagem.ps.partitioners import (FixedShardsPartitioner, MaxSizePartitioner,
    ...                                        MinSizePartitioner, shard_sizes)
    >>> FixedShardsPartitioner(num_shards=2)((10, 3), torch.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32)
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
    [2, 1]
    >>> shard_sizes(10, 3)            # the first shards take the extra rows
    [4, 3, 3]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch

from stratagem.errors import InvalidArgumentError

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner",
           "shard_sizes"]

Shape = Union[torch.Size, Sequence[int]]
DType = Union[torch.dtype, type]


def _positive_int(value: object, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{owner}: {name} must be a positive int, got {value!r}.")
    return value


def _check_shape(shape: Shape, owner: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(size) for size in shape)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{owner}: shape must be a sequence of ints like (1000, 64), "
                                   f"got {shape!r}.") from None
    if any(size < 0 for size in dims):
        raise InvalidArgumentError(f"{owner}: shape {dims} has a negative size.")
    return dims


class Partitioner:
    """Base class: ``partitioner(shape, dtype)`` returns the number of shards per axis."""

    def __call__(self, shape: Shape, dtype: DType) -> list[int]:
        dims = _check_shape(shape, type(self).__name__)
        if not dims:
            return []
        result = [1] * len(dims)
        result[0] = self._num_shards(dims, self._element_size(dtype))
        return result

    def _num_shards(self, dims: tuple[int, ...], element_size: int) -> int:
        raise NotImplementedError

    def _element_size(self, dtype: DType) -> int:
        if dtype is str or dtype == "string":
            return getattr(self, "_bytes_per_string", 16)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"{type(self).__name__}: dtype must be a torch.dtype "
                                       f"(or str for strings), got {dtype!r}.")
        return dtype.itemsize


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards, or one per row when the variable has fewer rows."""

    def __init__(self, num_shards: int) -> None:
        self._num_shards_arg = _positive_int(num_shards, "num_shards", "FixedShardsPartitioner")

    def _num_shards(self, dims: tuple[int, ...], element_size: int) -> int:
        return max(1, min(self._num_shards_arg, dims[0]))

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards_arg})"


class MinSizePartitioner(Partitioner):
    """As many shards as ``ceil(bytes / min_shard_bytes)``, at most ``max_shards`` and rows."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16) -> None:
        self._min_shard_bytes = _positive_int(min_shard_bytes, "min_shard_bytes", "MinSizePartitioner")
        self._max_shards = _positive_int(max_shards, "max_shards", "MinSizePartitioner")
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string", "MinSizePartitioner")

    def _num_shards(self, dims: tuple[int, ...], element_size: int) -> int:
        total_bytes = math.prod(dims) * element_size
        return max(1, min(dims[0], self._max_shards, math.ceil(total_bytes / self._min_shard_bytes)))

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
                f"max_shards={self._max_shards})")


class MaxSizePartitioner(Partitioner):
    """The fewest shards of at most ``max_shard_bytes`` each, at most ``max_shards``."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16) -> None:
        self._max_shard_bytes = _positive_int(max_shard_bytes, "max_shard_bytes", "MaxSizePartitioner")
        self._max_shards = (None if max_shards is None
                            else _positive_int(max_shards, "max_shards", "MaxSizePartitioner"))
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string", "MaxSizePartitioner")

    def _num_shards(self, dims: tuple[int, ...], element_size: int) -> int:
        if dims[0] == 0:
            return 1
        bytes_per_row = math.prod(dims[1:]) * element_size
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_row)) if bytes_per_row else dims[0]
        num_shards = math.ceil(dims[0] / rows_per_shard)
        return min(self._max_shards, num_shards) if self._max_shards else num_shards

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
                f"max_shards={self._max_shards})")


def shard_sizes(dim0: int, num_shards: int) -> list[int]:
    """Rows per shard when ``dim0`` rows are split in ``num_shards``: TensorFlow's split,
    ``dim0 // num_shards`` each and one more for the first ``dim0 % num_shards``."""
    if isinstance(dim0, bool) or not isinstance(dim0, int) or dim0 < 0:
        raise InvalidArgumentError(f"shard_sizes: dim0 must be an int >= 0, got {dim0!r}.")
    _positive_int(num_shards, "num_shards", "shard_sizes")
    if num_shards > max(dim0, 1):
        raise InvalidArgumentError(
            f"shard_sizes: {num_shards} shards of {dim0} row(s) would leave shards empty; use at "
            f"most {max(dim0, 1)} (partitioners never ask for more shards than rows).")
    base, extra = divmod(dim0, num_shards)
    return [base + 1] * extra + [base] * (num_shards - extra)

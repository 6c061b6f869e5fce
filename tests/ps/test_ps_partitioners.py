"""Partitioners: TensorFlow's documented examples and rules, shard sizes, bad arguments."""

from __future__ import annotations

import pytest
import torch

from stratagem.errors import InvalidArgumentError
from stratagem.ps import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, shard_sizes

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("partitioner", "shape", "dtype", "expected"), [
    # The examples of tf.distribute.experimental.partitioners' docstrings.
    (FixedShardsPartitioner(num_shards=2), (10, 3), torch.float32, [2, 1]),
    (MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), torch.float32, [2, 1]),
    (MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), torch.float32, [6, 1]),
    (MaxSizePartitioner(max_shard_bytes=4), (6, 1), torch.float32, [6, 1]),
    (MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), torch.float32, [2, 1]),
    (MaxSizePartitioner(max_shard_bytes=1024), (6, 1), torch.float32, [1, 1]),
    # min_max_variable_partitioner's docstring: 1024x1024 float32 = 4 MiB / 256 KiB = 16.
    (MinSizePartitioner(max_shards=100), (1024, 1024), torch.float32, [16, 1]),
    (MinSizePartitioner(max_shards=4), (1024, 1024), torch.float32, [4, 1]),
    (MinSizePartitioner(), (1024, 1024), torch.float32, [1, 1]),        # max_shards=1 default
    # TF's code rounds up: 1.5 x min_shard_bytes gives 2 shards of 0.75 x.
    (MinSizePartitioner(min_shard_bytes=400, max_shards=8), (150, 1), torch.float32, [2, 1]),
    # Never more shards than rows; dtype size counts.
    (FixedShardsPartitioner(8), (3, 5), torch.float32, [3, 1]),
    (MinSizePartitioner(min_shard_bytes=1, max_shards=64), (4, 1000), torch.float32, [4, 1]),
    (MinSizePartitioner(min_shard_bytes=1000, max_shards=64), (100, 10), torch.float16, [2, 1]),
    (MinSizePartitioner(min_shard_bytes=1000, max_shards=64), (100, 10), torch.float64, [8, 1]),
    # MaxSize: rows per shard = floor(max / bytes per row); a row too big gets its own shard.
    (MaxSizePartitioner(max_shard_bytes=100), (10, 10), torch.float32, [5, 1]),   # 2 rows of 40 B each
    (MaxSizePartitioner(max_shard_bytes=10), (5, 10), torch.float32, [5, 1]),
    (MaxSizePartitioner(max_shard_bytes=1 << 20), (1000, 64, 4), torch.float32, [1, 1, 1]),
    (MaxSizePartitioner(max_shard_bytes=1 << 18), (1000, 64, 4), torch.float32, [4, 1, 1]),
    # bytes_per_string for string variables (dtype str).
    (MaxSizePartitioner(max_shard_bytes=32, bytes_per_string=8), (8, 2), str, [4, 1]),
    (MinSizePartitioner(min_shard_bytes=16, max_shards=10, bytes_per_string=8), (8, 2), str, [8, 1]),
    # 1-D, 0-d and empty variables.
    (FixedShardsPartitioner(3), (7,), torch.float32, [3]),
    (FixedShardsPartitioner(3), (), torch.float32, []),
    (MinSizePartitioner(1, 4), (0, 3), torch.float32, [1, 1]),
    (MaxSizePartitioner(1), (0, 3), torch.float32, [1, 1]),
    (FixedShardsPartitioner(3), torch.Size([0, 3]), torch.float32, [1, 1]),
])
def test_partitions(partitioner: object, shape: tuple[int, ...], dtype: object, expected: list[int]) -> None:
    assert partitioner(shape, dtype) == expected  # type: ignore[operator]


def test_shard_sizes_give_the_extra_rows_to_the_first_shards() -> None:
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(9, 3) == [3, 3, 3]
    assert shard_sizes(7, 7) == [1] * 7
    assert shard_sizes(5, 1) == [5]
    assert shard_sizes(0, 1) == [0]
    for dim0 in range(1, 30):
        for num_shards in range(1, dim0 + 1):
            sizes = shard_sizes(dim0, num_shards)
            assert sum(sizes) == dim0 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_bad_arguments_are_named() -> None:
    cases = [
        (lambda: FixedShardsPartitioner(0), "FixedShardsPartitioner: num_shards must be a positive int, got 0"),
        (lambda: FixedShardsPartitioner(2.5), "num_shards must be a positive int"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes must be a positive int"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards must be a positive int"),
        (lambda: MinSizePartitioner(bytes_per_string=0), "bytes_per_string must be a positive int"),
        (lambda: MaxSizePartitioner(0), "max_shard_bytes must be a positive int"),
        (lambda: MaxSizePartitioner(8, max_shards=-1), "max_shards must be a positive int"),
        (lambda: FixedShardsPartitioner(2)("10x3", torch.float32), "shape must be a sequence of ints"),
        (lambda: FixedShardsPartitioner(2)((10, -3), torch.float32), "negative size"),
        (lambda: MinSizePartitioner()((10, 3), "float32"), "dtype must be a torch.dtype"),
        (lambda: shard_sizes(3, 5), "5 shards of 3 row"),
        (lambda: shard_sizes(-1, 1), "dim0 must be an int >= 0"),
        (lambda: shard_sizes(4, 0), "num_shards must be a positive int"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            call()

"""Small all-reduces among the replica threads of one process (a loss's row count, a metric):
every replica sums the exchanged values alone, in replica order, with one meeting instead of two.
The result is the one the op computes for large tensors, bit for bit, and misuse is refused alike
on every replica."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)

OPS = {
    "hierarchical_copy": lambda: sg.HierarchicalCopyAllReduce(),
    "reduction_to_one_device": lambda: sg.ReductionToOneDevice(),
}
DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


@pytest.mark.parametrize("reduce_op", ["sum", "mean"])
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_a_small_all_reduce_sums_in_replica_order_like_a_large_one(op_name: str, reduce_op: str) -> None:
    strategy = sg.MirroredStrategy(DEVICES, cross_device_ops=OPS[op_name]())
    values = [torch.tensor([0.1, 1e16, -3.0]), torch.tensor([0.2, 1.0, 1e-8]), torch.tensor([0.3, -1e16, 7.0])]
    big = 1 << 13   # past the small size: the op's own arithmetic

    def fn() -> torch.Tensor:
        ctx = sg.get_replica_context()
        mine = values[ctx.replica_id_in_sync_group]
        return torch.stack([ctx.all_reduce(reduce_op, mine), ctx.all_reduce(reduce_op, mine.repeat(big))[:3]])

    results = strategy.experimental_local_results(strategy.run(fn))
    expected = (values[0] + values[1]) + values[2]
    if reduce_op == "mean":
        expected = expected / 3
    assert len(results) == 3
    for small, large in results:
        assert torch.equal(small, expected) and torch.equal(large, expected)


def test_mismatched_shapes_in_a_small_all_reduce_are_refused_on_every_replica() -> None:
    strategy = sg.MirroredStrategy(DEVICES)

    def fn() -> torch.Tensor:
        ctx = sg.get_replica_context()
        return ctx.all_reduce("sum", torch.ones(2 + ctx.replica_id_in_sync_group))

    with pytest.raises(InvalidArgumentError, match="every replica must reduce tensors of the same shapes"):
        strategy.run(fn)
    # the strategy is usable afterwards
    assert [float(v) for v in strategy.experimental_local_results(
        strategy.run(lambda: sg.get_replica_context().all_reduce("sum", 1.0)))] == [3.0, 3.0, 3.0]

"""strategy.reduce and strategy.gather from cross-replica context."""

import pytest
import torch

import stratagem as sg
from stratagem.errors import ContextError, InvalidArgumentError, StratagemError

pytestmark = pytest.mark.timeout(60)


def mirrored(n, cross_device_ops=None):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=cross_device_ops)


def uneven(strategy):
    """Replica r holds r + 1 copies of the value r: [0], [1, 1], [2, 2, 2], ..."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((ctx.replica_id_in_sync_group + 1,), float(ctx.replica_id_in_sync_group)))


# ---------------------------------------------------------------- plain values

@pytest.mark.parametrize("num_replicas", [1, 2, 4])
def test_a_plain_value_counts_as_the_same_on_every_replica(num_replicas):
    strategy = mirrored(num_replicas)
    total = strategy.reduce(sg.ReduceOp.SUM, 1.0, axis=None)
    assert isinstance(total, torch.Tensor)
    assert total.item() == float(num_replicas)
    assert strategy.reduce(sg.ReduceOp.MEAN, 1.0, axis=None).item() == 1.0
    assert strategy.reduce("sum", torch.tensor([1.0, 2.0]), axis=0).item() == 3.0 * num_replicas
    assert strategy.reduce("mean", torch.tensor([1.0, 2.0]), axis=0).item() == 1.5


def test_sum_of_one_over_four_replicas_is_four():
    assert mirrored(4).reduce(sg.ReduceOp.SUM, 1.0, axis=None).item() == 4.0


# ---------------------------------------------------------------- axis=None

def test_sum_and_mean_without_axis_are_elementwise_over_replicas():
    strategy = mirrored(3)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 10.0]) * (ctx.replica_id_in_sync_group + 1))
    assert strategy.reduce(sg.ReduceOp.SUM, value, axis=None).tolist() == [6.0, 60.0]
    assert strategy.reduce(sg.ReduceOp.MEAN, value, axis=None).tolist() == [2.0, 20.0]
    # the components are untouched
    assert [t.tolist() for t in strategy.experimental_local_results(value)] == [[1, 10], [2, 20], [3, 30]]


def test_reduce_of_python_numbers_and_integer_tensors():
    strategy = mirrored(2)
    ints = strategy.run(lambda: sg.get_replica_context().replica_id_in_sync_group + 1)  # 1, 2
    assert strategy.reduce("sum", ints).item() == 3
    assert strategy.reduce("mean", ints).item() == 1.5  # a mean is never truncated
    tensors = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group], dtype=torch.int64))  # [0], [1]
    assert strategy.reduce("mean", tensors, axis=0).item() == 0.5


# ---------------------------------------------------------------- with axis

def test_sum_with_axis_adds_every_element():
    strategy = mirrored(4)
    # 0*1 + 1*2 + 2*3 + 3*4 = 20
    assert strategy.reduce(sg.ReduceOp.SUM, uneven(strategy), axis=0).item() == 20.0


def test_mean_with_axis_weighs_every_element_equally_over_uneven_components():
    strategy = mirrored(4)
    # 20 over 10 elements; the mean of the per-replica means would be 1.5
    assert strategy.reduce(sg.ReduceOp.MEAN, uneven(strategy), axis=0).item() == pytest.approx(2.0)


def test_mean_with_axis_counts_empty_components():
    strategy = mirrored(3)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(2 - ctx.replica_id_in_sync_group, 3) * 3)  # 2, 1, 0 rows
    torch.testing.assert_close(strategy.reduce("mean", value, axis=0), torch.full((3,), 3.0))
    torch.testing.assert_close(strategy.reduce("sum", value, axis=0), torch.full((3,), 9.0))


def test_reduce_along_a_later_axis():
    strategy = mirrored(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.arange(6.0).reshape(2, 3) + ctx.replica_id_in_sync_group)
    # replica 0 rows [0,1,2],[3,4,5]; replica 1 rows [1,2,3],[4,5,6]
    assert strategy.reduce("sum", value, axis=1).tolist() == [3.0 + 6.0, 12.0 + 15.0]
    assert strategy.reduce("mean", value, axis=-1).tolist() == [9.0 / 6, 27.0 / 6]


def test_reduce_axis_out_of_range_or_on_scalars_is_an_error():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="axis"):
        strategy.reduce("sum", uneven(strategy), axis=1)
    with pytest.raises(InvalidArgumentError, match="axis=None"):
        strategy.reduce("sum", 1.0, axis=0)
    with pytest.raises(InvalidArgumentError, match="axis must be an int"):
        strategy.reduce("sum", 1.0, axis="0")


# ---------------------------------------------------------------- op spellings

@pytest.mark.parametrize("op, expected", [
    ("sum", 20.0), ("SUM", 20.0), ("Sum", 20.0), (sg.ReduceOp.SUM, 20.0),
    ("mean", 2.0), ("MEAN", 2.0), ("Mean", 2.0), (sg.ReduceOp.MEAN, 2.0),
])
def test_reduce_op_accepts_strings_in_any_case(op, expected):
    strategy = mirrored(4)
    assert strategy.reduce(op, uneven(strategy), axis=0).item() == pytest.approx(expected)


@pytest.mark.parametrize("op", ["max", "min", "prod", "avg", "", None, 0])
def test_unsupported_reduce_op_is_an_error(op):
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="unsupported reduce op") as info:
        strategy.reduce(op, 1.0)
    assert isinstance(info.value, ValueError) and isinstance(info.value, StratagemError)
    assert "sum" in str(info.value) and "mean" in str(info.value)


# ---------------------------------------------------------------- structures

def test_reduce_keeps_nested_structures():
    strategy = mirrored(2)
    value = strategy.run(lambda: {"loss": torch.tensor(float(sg.get_replica_context().replica_id_in_sync_group)),
                                  "count": (torch.tensor([1.0, 1.0]),)})
    reduced = strategy.reduce("sum", value, axis=None)
    assert set(reduced) == {"loss", "count"}
    assert reduced["loss"].item() == 1.0
    assert isinstance(reduced["count"], tuple) and reduced["count"][0].tolist() == [2.0, 2.0]


# ---------------------------------------------------------------- gather

@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_gather_concatenates_in_replica_order(num_replicas):
    strategy = mirrored(num_replicas)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([[10.0 * ctx.replica_id_in_sync_group, 10.0 * ctx.replica_id_in_sync_group + 1]]))
    gathered = strategy.gather(value, axis=0)
    assert gathered.tolist() == [[10.0 * r, 10.0 * r + 1] for r in range(num_replicas)]
    along_1 = strategy.gather(value, axis=1)
    assert along_1.tolist() == [[x for r in range(num_replicas) for x in (10.0 * r, 10.0 * r + 1)]]


def test_gather_uneven_components_and_nested_structures():
    strategy = mirrored(4)
    gathered = strategy.gather((uneven(strategy), [uneven(strategy)]), axis=0)
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert gathered[0].tolist() == expected and gathered[1][0].tolist() == expected


def test_gather_of_a_plain_value_repeats_it_per_replica():
    strategy = mirrored(3)
    assert strategy.gather(torch.tensor([1.0, 2.0]), axis=0).tolist() == [1.0, 2.0] * 3


def test_gather_of_scalars_is_an_error():
    strategy = mirrored(2)
    value = strategy.run(lambda: torch.tensor(float(sg.get_replica_context().replica_id_in_sync_group)))
    with pytest.raises(InvalidArgumentError, match="scalar"):
        strategy.gather(value, axis=0)
    with pytest.raises(InvalidArgumentError, match="integer axis"):
        strategy.gather(value, axis=None)


# ---------------------------------------------------------------- wrong context / strategy

def test_reduce_and_gather_in_replica_context_raise_context_error():
    strategy = mirrored(2)

    def calls_reduce():
        return strategy.reduce("sum", torch.tensor(1.0), axis=None)

    def calls_gather():
        return strategy.gather(torch.ones(1), axis=0)

    with pytest.raises(ContextError, match="cross-replica context"):
        strategy.run(calls_reduce)
    with pytest.raises(ContextError, match="all_reduce"):
        strategy.run(calls_gather)
    assert strategy.reduce("sum", 1.0).item() == 2.0  # the strategy still works afterwards


def test_per_replica_of_another_strategy_raises():
    first, second = mirrored(2), mirrored(2)
    value = first.experimental_distribute_values_from_function(lambda ctx: torch.ones(1))
    with pytest.raises(InvalidArgumentError, match="another strategy"):
        second.reduce("sum", value)
    with pytest.raises(InvalidArgumentError, match="another strategy"):
        second.gather(value, axis=0)
    with pytest.raises(InvalidArgumentError, match="another strategy"):
        second.experimental_local_results(value)
    with pytest.raises(InvalidArgumentError, match="another strategy"):
        second.run(lambda v: v, args=(value,))


def test_per_replica_with_the_wrong_number_of_components_raises():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="3 components"):
        strategy.reduce("sum", sg.PerReplica([torch.ones(1)] * 3))
    # an unowned PerReplica of the right length is accepted
    assert strategy.reduce("sum", sg.PerReplica([torch.ones(1), torch.ones(1) * 2]), axis=0).item() == 3.0


def test_reduce_inside_scope_and_on_the_default_strategy():
    strategy = mirrored(2)
    with strategy.scope():
        assert strategy.reduce("sum", 2.0).item() == 4.0
    default = sg.get_strategy()
    assert default.reduce("sum", torch.tensor([1.0, 2.0]), axis=0).item() == 3.0
    assert default.gather(torch.tensor([1.0]), axis=0).tolist() == [1.0]

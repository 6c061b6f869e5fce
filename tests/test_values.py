"""PerReplica values, nested structures through run, local results, values from a function."""

import collections

import pytest
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)

Pair = collections.namedtuple("Pair", ["first", "second"])


def mirrored(n):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(fn)


def local(strategy, value):
    return strategy.experimental_local_results(value)


# ---------------------------------------------------------------------- PerReplica

def test_per_replica_repr_lists_every_component_in_order():
    strategy = mirrored(2)
    value = per_replica(strategy, lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    text = repr(value)
    assert text.startswith("PerReplica:{")
    assert "0: tensor(0.)" in text and "1: tensor(1.)" in text
    assert text.index("0: tensor(0.)") < text.index("1: tensor(1.)")
    assert str(value) == text


def test_per_replica_repr_shortens_huge_components():
    value = sg.PerReplica(["x" * 1000, "y"])
    text = repr(value)
    assert len(text) < 300
    assert "..." in text and "1: 'y'" in text


def test_per_replica_values_and_len():
    value = sg.PerReplica([1, 2, 3])
    assert value.values == (1, 2, 3)
    assert len(value) == 3
    assert isinstance(value, sg.DistributedValues)


# --------------------------------------------------------- nested structures and run

def test_run_returns_a_per_replica_for_a_plain_result():
    strategy = mirrored(2)
    result = strategy.run(lambda: torch.tensor([float(sg.get_replica_context().replica_id_in_sync_group)]))
    assert isinstance(result, sg.PerReplica)
    assert [t.tolist() for t in local(strategy, result)] == [[0.0], [1.0]]


def test_run_with_one_replica_returns_the_value_itself():
    for strategy in (mirrored(1), sg.OneDeviceStrategy("cpu")):
        result = strategy.run(lambda x: x + 1, args=(torch.tensor(1.0),))
        assert isinstance(result, torch.Tensor) and result.item() == 2.0
        assert strategy.run(lambda: (1, [2], {"a": 3})) == (1, [2], {"a": 3})


def _rid():
    return sg.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_run_regroups_tuples_lists_dicts_and_namedtuples(num_replicas):
    strategy = mirrored(num_replicas)

    def fn():
        r = _rid()
        return (torch.tensor(r), [torch.tensor(10 + r), {"b": torch.tensor(20 + r), "a": Pair(r, -r)}])

    result = strategy.run(fn)
    assert isinstance(result, tuple) and len(result) == 2
    first, (second, mapping) = result
    assert isinstance(result[1], list)
    assert isinstance(mapping, dict) and list(mapping) == ["b", "a"]  # the function's key order
    assert isinstance(mapping["a"], Pair)
    ids = list(range(num_replicas))
    assert [t.item() for t in local(strategy, first)] == ids
    assert [t.item() for t in local(strategy, second)] == [10 + r for r in ids]
    assert [t.item() for t in local(strategy, mapping["b"])] == [20 + r for r in ids]
    assert list(local(strategy, mapping["a"].first)) == ids
    assert list(local(strategy, mapping["a"].second)) == [-r for r in ids]


def test_run_unwraps_distributed_values_at_any_depth():
    strategy = mirrored(3)
    v = per_replica(strategy, lambda ctx: torch.tensor(ctx.replica_id_in_sync_group))
    w = per_replica(strategy, lambda ctx: 100 * ctx.replica_id_in_sync_group)
    constant = torch.tensor(7)

    def fn(a, nested, *, named, const):
        r = _rid()
        assert a.item() == r
        assert nested[0]["w"] == 100 * r
        assert nested[1][0].item() == r
        assert named.first.item() == r and named.second == "same"
        assert const is constant  # a plain tensor passes as is
        return a.item() + nested[0]["w"]

    result = strategy.run(fn, args=(v, [{"w": w}, (v,)]),
                          kwargs={"named": Pair(v, "same"), "const": constant})
    assert local(strategy, result) == (0, 101, 202)


def test_run_passes_the_result_of_a_previous_run_back_in():
    strategy = mirrored(2)
    first = strategy.run(lambda: torch.tensor([float(_rid())]))
    second = strategy.run(lambda x: x * 10, args=(first,))
    assert [t.item() for t in local(strategy, second)] == [0.0, 10.0]


def test_a_leaf_identical_on_every_replica_stays_plain():
    strategy = mirrored(2)
    shared = torch.tensor(5.0)
    none, same, differs = strategy.run(lambda: (None, shared, torch.tensor(float(_rid()))))
    assert none is None
    assert same is shared
    assert isinstance(differs, sg.PerReplica)


def test_replicas_returning_different_structures_is_an_error():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="same structure"):
        strategy.run(lambda: (1,) if _rid() == 0 else (1, 2))


def test_regroup_dicts_with_the_same_keys_in_a_different_order():
    strategy = mirrored(2)
    result = strategy.run(lambda: {"x": _rid(), "y": -_rid()} if _rid() == 0 else {"y": -_rid(), "x": _rid()})
    assert local(strategy, result["x"]) == (0, 1)
    assert local(strategy, result["y"]) == (0, -1)


# ------------------------------------------------------ experimental_local_results

def test_local_results_of_per_replica_plain_value_and_parameter():
    strategy = mirrored(2)
    v = per_replica(strategy, lambda ctx: ctx.replica_id_in_sync_group)
    assert local(strategy, v) == (0, 1)
    assert local(strategy, 3.5) == (3.5,)
    plain = torch.ones(2)
    assert local(strategy, plain)[0] is plain and len(local(strategy, plain)) == 1

    with strategy.scope():
        model = torch.nn.Linear(3, 2)
    copies = local(strategy, model.weight)
    assert len(copies) == 2
    assert copies[0] is model.weight
    assert copies[0] is not copies[1]
    torch.testing.assert_close(copies[0], copies[1])


def test_local_results_of_a_parameter_inside_the_open_scope():
    strategy = mirrored(2)
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        copies = local(strategy, model.weight)
        assert len(copies) == 2 and copies[0] is model.weight
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert local(strategy, model.weight) == copies
    assert isinstance(optimizer, torch.optim.SGD)


def test_local_results_with_one_device_is_a_one_tuple():
    strategy = sg.OneDeviceStrategy("cpu")
    assert local(strategy, 1.0) == (1.0,)
    v = per_replica(strategy, lambda ctx: ctx.replica_id_in_sync_group)
    assert local(strategy, v) == (0,)


# ------------------------------------------- experimental_distribute_values_from_function

@pytest.mark.parametrize("num_replicas", [1, 2, 4])
def test_distribute_values_from_function_calls_once_per_replica(num_replicas):
    strategy = mirrored(num_replicas)
    contexts = []

    def value_fn(ctx):
        contexts.append(ctx)
        return torch.full((2,), float(ctx.replica_id_in_sync_group))

    value = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(value, sg.PerReplica)
    assert all(isinstance(ctx, sg.ValueContext) for ctx in contexts)
    assert [c.replica_id_in_sync_group for c in contexts] == list(range(num_replicas))
    assert {c.num_replicas_in_sync for c in contexts} == {num_replicas}
    assert [t.tolist() for t in local(strategy, value)] == [[float(r)] * 2 for r in range(num_replicas)]
    # such values go through run like any other distributed value
    doubled = strategy.run(lambda t: t * 2, args=(value,))
    assert [t.tolist() for t in local(strategy, doubled)] == [[2.0 * r] * 2 for r in range(num_replicas)]


def test_distribute_values_from_function_accepts_structures():
    strategy = mirrored(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: {"id": ctx.replica_id_in_sync_group})
    assert [c["id"] for c in local(strategy, value)] == [0, 1]
    assert local(strategy, strategy.run(lambda d: d["id"] * 3, args=(value,))) == (0, 3)


def test_distribute_values_from_function_needs_a_callable():
    with pytest.raises(InvalidArgumentError, match="callable"):
        mirrored(2).experimental_distribute_values_from_function(42)


def test_value_context_defaults():
    ctx = sg.ValueContext()
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (0, 1)

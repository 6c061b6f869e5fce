"""Collectives among the replicas of one process, and merge_call.

Expected values are computed by hand from the inputs: replica ``r`` contributes
multiples of ``r + 1`` so that every replica's share is visible in the result.
"""

import threading

import numpy as np
import pytest
import torch

import stratagem as sg
from stratagem.errors import CollectiveMismatchError, InvalidArgumentError, StratagemError

pytestmark = pytest.mark.timeout(60)

OPS = {
    "default": lambda: None,
    "hierarchical": sg.HierarchicalCopyAllReduce,
    "one_device": sg.ReductionToOneDevice,
}


def mirrored(n, cross_device_ops=None):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=cross_device_ops)


def rid():
    return sg.get_replica_context().replica_id_in_sync_group


def ctx():
    return sg.get_replica_context()


def local(strategy, value, n):
    """The per-replica components of a run result as a list of length n."""
    results = strategy.experimental_local_results(value)
    return list(results) if len(results) == n else list(results) * n


def per_replica_lists(strategy, result, n):
    """A run result that is a list (of PerReplica) as each replica's own list."""
    assert isinstance(result, list)
    columns = [local(strategy, leaf, n) for leaf in result]
    return [[column[r] for column in columns] for r in range(n)]


def tri(n):
    return n * (n + 1) // 2  # 1 + 2 + ... + n


# ------------------------------------------------------------ replica context

@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}replicas")
def num_replicas(request):
    return request.param


@pytest.fixture(params=list(OPS), ids=list(OPS))
def ops_name(request):
    return request.param


def test_all_reduce(num_replicas, ops_name):
    n = num_replicas
    strategy = mirrored(n, OPS[ops_name]())

    def fn():
        x = torch.tensor([1.0, 10.0]) * (rid() + 1)
        return ctx().all_reduce("sum", x), ctx().all_reduce(sg.ReduceOp.MEAN, x), x

    total, mean, x = strategy.run(fn)
    for t in local(strategy, total, n):
        assert t.tolist() == [tri(n), 10.0 * tri(n)]
    for t in local(strategy, mean, n):
        torch.testing.assert_close(t, torch.tensor([tri(n) / n, 10.0 * tri(n) / n]))
    # the inputs are not modified
    assert [t.tolist() for t in local(strategy, x, n)] == [[r + 1.0, 10.0 * (r + 1)] for r in range(n)]


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded"])
def test_all_reduce_of_non_contiguous_tensors(ops_name, layout):
    strategy = mirrored(2, OPS[ops_name]())
    make = {"transposed": lambda r: (torch.arange(6.0).reshape(2, 3) * (r + 1)).t(),
            "strided": lambda r: (torch.arange(10.0) * (r + 1))[::2],
            "expanded": lambda r: torch.tensor([r + 1.0]).expand(3)}[layout]
    result = strategy.run(lambda: ctx().all_reduce("sum", make(rid())))
    for t in local(strategy, result, 2):
        torch.testing.assert_close(t, make(0) * 3)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_step_with_channels_last_parameters(n, bias):
    """A channels_last gradient has no flat view: the replica holding its first element sums it
    whole, and a replica left with no piece of any gradient (a convolution without bias) sums
    nothing; the step is plain PyTorch's on the whole batch."""
    def conv():
        torch.manual_seed(0)
        return torch.nn.Conv2d(3, 4, 3, bias=bias).double().to(memory_format=torch.channels_last)
    x = torch.randn(2 * n, 3, 5, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    plain = conv()
    plain(x).sum().backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    strategy = mirrored(n)
    with strategy.scope():
        model = conv()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        copies = strategy.experimental_local_results(mine)
        assert all(torch.equal(c, copies[0]) for c in copies[1:])
        torch.testing.assert_close(copies[0], theirs.detach(), rtol=0, atol=1e-12)


def test_all_reduce_of_numbers_and_structures(num_replicas):
    n = num_replicas
    strategy = mirrored(n)

    def fn():
        r = rid()
        return ctx().all_reduce("sum", {"count": r + 1, "vec": (torch.full((2, 2), float(r)),)})

    result = strategy.run(fn)
    counts = local(strategy, result["count"], n)
    assert counts == [tri(n)] * n and all(isinstance(c, int) for c in counts)
    for t in local(strategy, result["vec"][0], n):
        assert t.tolist() == [[float(tri(n - 1))] * 2] * 2


def test_all_reduce_mean_of_integers_is_not_truncated():
    strategy = mirrored(2)
    mean = strategy.run(lambda: ctx().all_reduce("mean", rid() + 1))  # (1 + 2) / 2
    assert local(strategy, mean, 2) == [1.5, 1.5]
    tensor_mean = strategy.run(lambda: ctx().all_reduce("mean", torch.tensor([rid() + 1])))
    for t in local(strategy, tensor_mean, 2):
        torch.testing.assert_close(t, torch.tensor([1.5]))


def test_all_reduce_of_numpy_values():
    strategy = mirrored(2)
    arrays, scalars = strategy.run(
        lambda: (ctx().all_reduce("sum", np.full(3, rid() + 1.0)), ctx().all_reduce("mean", np.int64(rid()))))
    for t in local(strategy, arrays, 2):
        assert isinstance(t, torch.Tensor) and t.tolist() == [3.0] * 3
    assert local(strategy, scalars, 2) == [0.5, 0.5]


def test_all_gather(num_replicas):
    n = num_replicas
    strategy = mirrored(n)

    def fn():
        r = rid()
        x = torch.tensor([[r, 10 * r]])  # shape (1, 2)
        return ctx().all_gather(x, axis=0), ctx().all_gather(x, axis=1)

    rows, cols = strategy.run(fn)
    for t in local(strategy, rows, n):
        assert t.tolist() == [[r, 10 * r] for r in range(n)]
    for t in local(strategy, cols, n):
        assert t.tolist() == [[v for r in range(n) for v in (r, 10 * r)]]


def test_all_gather_uneven_lengths():
    strategy = mirrored(3)
    result = strategy.run(lambda: ctx().all_gather(torch.full((rid(),), rid()), axis=0))  # 0, 1, 2 rows
    for t in local(strategy, result, 3):
        assert t.tolist() == [1, 2, 2]


def test_broadcast(num_replicas):
    n = num_replicas
    strategy = mirrored(n)
    source = n - 1

    def fn():
        x = torch.tensor([100.0 + rid()])
        got = ctx().broadcast(x, source_replica=source)
        got.add_(1)  # every replica owns its copy
        return got

    result = strategy.run(fn)
    assert [t.tolist() for t in local(strategy, result, n)] == [[101.0 + source]] * n


def test_reduce_to_one_replica(num_replicas):
    n = num_replicas
    strategy = mirrored(n)
    destination = n // 2

    def fn():
        return ctx().reduce("sum", torch.tensor([float(rid() + 1)]), destination_replica=destination)

    result = local(strategy, strategy.run(fn), n)
    for r, value in enumerate(result):
        if r == destination:
            assert value.tolist() == [float(tri(n))]
        else:
            assert value is None


def test_reduce_scatter(num_replicas):
    n = num_replicas
    strategy = mirrored(n)

    def fn():
        return ctx().reduce_scatter("sum", torch.arange(5.0) * (rid() + 1), axis=0)

    summed = [v * tri(n) for v in range(5)]
    expected = {1: [summed], 2: [summed[:3], summed[3:]], 3: [summed[:2], summed[2:4], summed[4:]]}[n]
    assert [t.tolist() for t in local(strategy, strategy.run(fn), n)] == expected


def test_reduce_scatter_mean_along_axis_1():
    strategy = mirrored(2)

    def fn():
        return ctx().reduce_scatter("mean", torch.arange(8.0).reshape(2, 4) * (rid() + 1), axis=1)

    first, second = local(strategy, strategy.run(fn), 2)
    full = torch.arange(8.0).reshape(2, 4) * 1.5
    torch.testing.assert_close(first, full[:, :2])
    torch.testing.assert_close(second, full[:, 2:])


def test_all_to_all(num_replicas):
    n = num_replicas
    strategy = mirrored(n)

    def fn():
        i = rid()
        return ctx().all_to_all([torch.tensor([10 * i + j]) for j in range(n)])

    received = per_replica_lists(strategy, strategy.run(fn), n)
    for j, parts in enumerate(received):
        assert [p.tolist() for p in parts] == [[10 * i + j] for i in range(n)]


def test_scatter(num_replicas):
    n = num_replicas
    strategy = mirrored(n)
    source = n - 1

    def fn():
        values = [torch.tensor([100 + j]) for j in range(n)] if rid() == source else None
        return ctx().scatter(values, source_replica=source)

    assert [t.tolist() for t in local(strategy, strategy.run(fn), n)] == [[100 + j] for j in range(n)]


def test_gather_to_one_replica(num_replicas):
    n = num_replicas
    strategy = mirrored(n)

    def fn():
        return ctx().gather(torch.tensor([rid(), -rid()]), axis=0, destination_replica=0)

    result = local(strategy, strategy.run(fn), n)
    assert result[0].tolist() == [v for r in range(n) for v in (r, -r)]
    assert all(v is None for v in result[1:])


def test_collective_argument_errors():
    strategy = mirrored(2)
    with pytest.raises(InvalidArgumentError, match="source_replica"):
        strategy.run(lambda: ctx().broadcast(torch.ones(1), source_replica=2))
    with pytest.raises(InvalidArgumentError, match="one tensor per replica"):
        strategy.run(lambda: ctx().all_to_all([torch.ones(1)]))
    with pytest.raises(InvalidArgumentError, match="unsupported reduce op"):
        strategy.run(lambda: ctx().all_reduce("max", torch.ones(1)))
    with pytest.raises(InvalidArgumentError, match="same shapes"):
        strategy.run(lambda: ctx().all_reduce("sum", torch.ones(rid() + 1)))
    assert strategy.run(lambda: ctx().all_reduce("sum", 1)) == 2  # still usable


def test_collectives_outside_run_use_the_default_replica_context():
    c = sg.get_replica_context()
    assert c.all_reduce("sum", torch.tensor([2.0])).tolist() == [2.0]
    assert c.all_gather(torch.tensor([2.0]), axis=0).tolist() == [2.0]
    assert c.broadcast(torch.tensor([3.0])).tolist() == [3.0]


# ------------------------------------------------ cross-replica context (strategy.collectives)

def _inputs(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda c: torch.arange(6.0).reshape(3, 2) * (c.replica_id_in_sync_group + 1))


def test_cross_replica_collectives_match_replica_context(num_replicas, ops_name):
    n = num_replicas
    strategy = mirrored(n, OPS[ops_name]())
    value = _inputs(strategy)
    coll = strategy.collectives
    base = torch.arange(6.0).reshape(3, 2)

    for t in local(strategy, coll.all_reduce("sum", value), n):
        torch.testing.assert_close(t, base * tri(n))
    for t in local(strategy, coll.all_reduce("mean", value), n):
        torch.testing.assert_close(t, base * tri(n) / n)
    for t in local(strategy, coll.all_gather(value, axis=0), n):
        torch.testing.assert_close(t, torch.cat([base * (r + 1) for r in range(n)]))
    for t in local(strategy, coll.broadcast(value, source_replica=n - 1), n):
        torch.testing.assert_close(t, base * n)
    reduced = local(strategy, coll.reduce("sum", value, destination_replica=0), n)
    torch.testing.assert_close(reduced[0], base * tri(n))
    assert all(v is None for v in reduced[1:])
    scattered = local(strategy, coll.reduce_scatter("sum", value, axis=0), n)
    sizes = {1: [3], 2: [2, 1], 3: [1, 1, 1]}[n]
    torch.testing.assert_close(torch.cat(scattered), base * tri(n))
    assert [t.shape[0] for t in scattered] == sizes
    gathered = local(strategy, coll.gather(value, axis=1, destination_replica=n - 1), n)
    torch.testing.assert_close(gathered[n - 1], torch.cat([base * (r + 1) for r in range(n)], dim=1))

    sends = strategy.experimental_distribute_values_from_function(
        lambda c: [torch.tensor([10 * c.replica_id_in_sync_group + j]) for j in range(n)])
    received = per_replica_lists(strategy, coll.all_to_all(sends), n)
    for j, parts in enumerate(received):
        assert [p.item() for p in parts] == [10 * i + j for i in range(n)]

    pieces = [torch.tensor([7 + j]) for j in range(n)]
    to_scatter = strategy.experimental_distribute_values_from_function(
        lambda c: pieces if c.replica_id_in_sync_group == 0 else None)
    assert [t.item() for t in local(strategy, coll.scatter(to_scatter, source_replica=0), n)] == \
        [7 + j for j in range(n)]


def test_all_implementations_give_identical_results():
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(37, generator=generator) for _ in range(3)]
    outcomes = {}
    for name, make in OPS.items():
        strategy = mirrored(3, make())

        def fn():
            x = data[rid()]
            c = ctx()
            return (c.all_reduce("sum", x), c.all_reduce("mean", [x, x[:5] * 2]),
                    c.reduce_scatter("sum", x), c.all_gather(x, axis=0), c.broadcast(x, source_replica=1))

        outcomes[name] = [[t for t in local(strategy, leaf, 3)]
                          for leaf in _leaves(strategy.run(fn))]
    reference = outcomes.pop("default")
    torch.testing.assert_close(reference[0][0], data[0] + data[1] + data[2])
    for name, got in outcomes.items():
        for ref_leaf, leaf in zip(reference, got):
            for a, b in zip(ref_leaf, leaf):
                assert torch.equal(a, b), name


def _leaves(structure):
    from stratagem.values import flatten
    return flatten(structure)


def test_nccl_all_reduce_on_cpu_devices_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="NcclAllReduce needs CUDA") as info:
        mirrored(2, sg.NcclAllReduce())
    assert "HierarchicalCopyAllReduce" in str(info.value)


def test_cross_device_ops_must_be_a_cross_device_op():
    with pytest.raises(InvalidArgumentError, match="cross_device_ops"):
        mirrored(2, "nccl")


# ------------------------------------------------------------------ merge_call

def test_merge_call_runs_once_sees_per_replica_args_and_returns_to_all():
    strategy = mirrored(3)
    calls = []

    def merge_fn(s, value, *, scale):
        calls.append(threading.get_ident())
        assert s is strategy
        assert isinstance(value, sg.PerReplica)
        components = strategy.experimental_local_results(value)
        assert [c.item() for c in components] == [1.0, 2.0, 3.0]
        return strategy.reduce("sum", value).item() * scale

    def fn():
        return ctx().merge_call(merge_fn, args=(torch.tensor(float(rid() + 1)),), kwargs={"scale": 10})

    assert strategy.run(fn) == 60.0  # the same object on every replica
    assert len(calls) == 1


def test_merge_call_with_a_distributed_result_gives_each_replica_its_component():
    strategy = mirrored(2)

    def fn():
        r = rid()
        mine = ctx().merge_call(lambda s, v: v, args=(torch.tensor([r]),))
        return mine.item(), ctx().merge_call(lambda s, same: same, args=("shared",))

    ids, shared = strategy.run(fn)
    assert local(strategy, ids, 2) == [0, 1]
    assert shared == "shared"


def test_merge_call_repeatedly_in_one_run():
    strategy = mirrored(2)
    count = [0]

    def merge_fn(s):
        count[0] += 1
        return count[0]

    def fn():
        return [ctx().merge_call(merge_fn) for _ in range(5)]

    assert strategy.run(fn) == [1, 2, 3, 4, 5]


def test_merge_call_with_one_replica():
    strategy = mirrored(1)
    result = strategy.run(lambda: ctx().merge_call(lambda s, x: (s is strategy, x + 1), args=(1,)))
    assert result == (True, 2)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_replica_raising_before_merge_call_does_not_deadlock(failing):
    strategy = mirrored(3)

    def fn():
        if rid() == failing:
            raise KeyError("missing before merge")
        return ctx().merge_call(lambda s: 1)

    with pytest.raises(KeyError, match="missing before merge") as info:
        strategy.run(fn)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"replica {failing}" in notes
    assert strategy.run(lambda: ctx().merge_call(lambda s: 5)) == 5  # reusable afterwards


def test_merge_fn_raising_is_reraised_once_with_its_type():
    strategy = mirrored(2)

    def merge_fn(s):
        raise ZeroDivisionError("in merge")

    with pytest.raises(ZeroDivisionError, match="in merge") as info:
        strategy.run(lambda: ctx().merge_call(merge_fn))
    assert any("replica" in note for note in getattr(info.value, "__notes__", []))
    assert strategy.run(lambda: 3) == 3


# ------------------------------------------------------------- mismatched collectives

@pytest.mark.parametrize("waiting", [0, 1])
def test_a_replica_returning_while_another_waits_is_a_mismatch_not_a_hang(waiting):
    strategy = mirrored(2)

    def fn():
        if rid() == waiting:
            return ctx().all_reduce("sum", torch.ones(1))
        return None

    with pytest.raises(CollectiveMismatchError, match="already returned") as info:
        strategy.run(fn)
    assert isinstance(info.value, StratagemError) and isinstance(info.value, RuntimeError)
    assert strategy.run(lambda: ctx().all_reduce("sum", 1)) == 2


def test_a_replica_skipping_merge_call_is_a_mismatch():
    strategy = mirrored(3)

    def fn():
        if rid() != 2:
            return ctx().merge_call(lambda s: 1)
        return 1

    with pytest.raises(CollectiveMismatchError):
        strategy.run(fn)


def test_replicas_calling_different_collectives_is_an_error():
    strategy = mirrored(2)

    def fn():
        x = torch.ones(2)
        if rid() == 0:
            return ctx().all_reduce("sum", x)
        return ctx().all_gather(x, axis=0)

    with pytest.raises(CollectiveMismatchError, match="different collective calls") as info:
        strategy.run(fn)
    assert "all_gather" in str(info.value)
    assert strategy.run(lambda: ctx().all_reduce("sum", 1)) == 2


def test_replicas_reducing_different_numbers_of_tensors_is_an_error():
    strategy = mirrored(2)

    def fn():
        return ctx().all_reduce("sum", [torch.ones(1)] * (rid() + 1))

    with pytest.raises(CollectiveMismatchError):
        strategy.run(fn)


def test_the_collective_refuses_an_integer_mean() -> None:
    """ReplicaContext turns integers into floats for MEAN; the collective itself refuses them."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn():
        ctx = sg.get_replica_context()
        return strategy.collective.all_reduce(ctx.local_replica_id, [torch.tensor([3])], sg.ReduceOp.MEAN)

    with pytest.raises(sg.errors.InvalidArgumentError, match="floating-point"):
        strategy.run(fn)
    means = strategy.run(lambda: sg.get_replica_context().all_reduce("mean", torch.tensor([3])))
    assert [t.tolist() for t in strategy.experimental_local_results(means)] == [[3.0], [3.0]]

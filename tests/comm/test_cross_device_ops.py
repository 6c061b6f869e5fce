"""The in-process implementations give one result, and a user's CrossDeviceOps is really used.

Property tests (hypothesis) compare every implementation with a plain reference over
random shapes, dtypes and replica counts: bit-identical where the summation order is the
reference's (replica order), within float rounding for the ring with 3+ replicas.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stratagem as sg
from stratagem.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

IMPLEMENTATIONS = {
    "hierarchical": lambda: sg.HierarchicalCopyAllReduce(),
    "hierarchical-3-packs": lambda: sg.HierarchicalCopyAllReduce(num_packs=3),
    "one-device": lambda: sg.ReductionToOneDevice(),
    "ring": lambda: sg.RingAllReduce(),
    "plugin-reference": lambda: sg.CrossDeviceOps(),
}
_STRATEGIES: dict = {}  # one strategy (and its replica threads) per (implementation, replicas)


def strategy_for(name: str, n: int) -> sg.MirroredStrategy:
    key = (name, n)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=IMPLEMENTATIONS[name]())
    return _STRATEGIES[key]


def ctx():
    return sg.get_replica_context()


def exact(name: str, n: int, dtype: torch.dtype) -> bool:
    return name != "ring" or n <= 2 or not dtype.is_floating_point


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 4), name=st.sampled_from(sorted(IMPLEMENTATIONS)),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
       shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 16))
def test_every_implementation_matches_the_reference(n, name, dtype, shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    data = [[(torch.randn(shape, generator=generator, dtype=torch.float64) * 100).to(dtype) for shape in shapes]
            for _ in range(n)]
    ops = ["sum", "mean"] if dtype.is_floating_point else ["sum"]
    strategy = strategy_for(name, n)

    def fn():
        mine = data[ctx().replica_id_in_sync_group]
        out = {op: ctx().all_reduce(op, mine) for op in ops}
        first = mine[0].reshape(-1)
        out["reduce_scatter"] = ctx().reduce_scatter("sum", first, axis=0) if first.numel() else first
        out["all_gather"] = ctx().all_gather([t.reshape(-1) for t in mine], axis=0)
        out["broadcast"] = ctx().broadcast(mine, source_replica=n - 1)
        return out

    results = strategy.run(fn)
    for r in range(n):
        got = {key: [strategy.experimental_local_results(t)[r] if n > 1 else t for t in value]
               if isinstance(value, list) else (strategy.experimental_local_results(value)[r] if n > 1 else value)
               for key, value in results.items()}
        for i in range(len(shapes)):
            total = data[0][i]
            for s in range(1, n):
                total = total + data[s][i]  # replica order: the reference summation
            for op in ops:
                want = total if op == "sum" else total / n
                if exact(name, n, dtype):
                    assert torch.equal(got[op][i], want), (name, op)
                else:
                    torch.testing.assert_close(got[op][i], want)
            torch.testing.assert_close(got["all_gather"][i], torch.cat([data[s][i].reshape(-1) for s in range(n)]))
            assert torch.equal(got["broadcast"][i], data[n - 1][i])
        flat = sum((data[s][0].reshape(-1) for s in range(1, n)), data[0][0].reshape(-1))
        sizes = [flat.numel() // n + (1 if s < flat.numel() % n else 0) for s in range(n)]
        if flat.numel():
            assert torch.equal(got["reduce_scatter"], flat[sum(sizes[:r]):sum(sizes[:r + 1])])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", ["hierarchical", "hierarchical-3-packs", "one-device"])
def test_large_all_reduces_are_the_replica_order_sums(n, name):
    """Past the small all-reduce that every replica sums alone: each replica thread sums its pieces of
    every tensor (several pieces each, float32 and float64 together, one tensor not contiguous) and
    copies the sums back; SUM and MEAN equal the replica-order reference bit for bit."""
    generator = torch.Generator().manual_seed(n)
    shapes = [(300, 1000), (7,), (40, 50), (1 << 19,)]
    data = [[torch.randn(shape, generator=generator, dtype=torch.float64 if i == 1 else torch.float32)
             for i, shape in enumerate(shapes)] for _ in range(n)]
    for replica in data:
        replica[2] = replica[2].t()   # (not contiguous: its replica sums it whole)
    strategy = strategy_for(name, n)
    results = strategy.run(lambda: {op: ctx().all_reduce(op, data[ctx().replica_id_in_sync_group])
                                    for op in ("sum", "mean")})
    for i in range(len(shapes)):
        total = data[0][i]
        for s in range(1, n):
            total = total + data[s][i]
        for op, want in (("sum", total), ("mean", total / n)):
            for r in range(n):
                assert torch.equal(strategy.experimental_local_results(results[op][i])[r], want), (op, i, r)


# ------------------------------------------------------------------ the plug-in point

class Counting(sg.CrossDeviceOps):
    def __init__(self):
        self.calls = {"reduce": 0, "batch_reduce": 0, "broadcast": 0}

    def reduce(self, reduce_op, per_replica_value, destinations):
        self.calls["reduce"] += 1
        return super().reduce(reduce_op, per_replica_value, destinations)

    def batch_reduce(self, reduce_op, value_destination_pairs):
        self.calls["batch_reduce"] += 1
        return super().batch_reduce(reduce_op, value_destination_pairs)

    def broadcast(self, tensor, destinations):
        self.calls["broadcast"] += 1
        return super().broadcast(tensor, destinations)


class Doubling(sg.CrossDeviceOps):
    """A wrong all-reduce on purpose: twice the sum, one tensor per destination."""

    def batch_reduce(self, reduce_op, value_destination_pairs):
        out = []
        for value, destinations in value_destination_pairs:
            total = sum(value.values[1:], value.values[0].clone()) * 2
            out.append([total.to(t.device) for t in value.values])
        return out


def _train_one_step(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = strategy.experimental_distribute_dataset([(torch.ones(4, 3), torch.zeros(4, 1))])

    def step(data):
        x, y = data
        loss = sg.nn.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=4)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for b in batch:
        loss = strategy.reduce("sum", strategy.run(step, args=(b,)))
    return model, loss


def test_a_user_cross_device_ops_is_called_for_gradients_reduce_and_broadcast():
    ops = Counting()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    model, _ = _train_one_step(strategy)
    assert ops.calls["batch_reduce"] == 1 and ops.calls["reduce"] >= 1  # the step's gradients; strategy.reduce
    reference, _ = _train_one_step(sg.OneDeviceStrategy("cpu"))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    before = dict(ops.calls)
    strategy.run(lambda: ctx().broadcast(torch.ones(2) * ctx().replica_id_in_sync_group, source_replica=1))
    assert ops.calls["broadcast"] == before["broadcast"] + 1
    strategy.run(lambda: ctx().all_reduce("mean", torch.ones(2)))
    assert ops.calls["batch_reduce"] == before["batch_reduce"] + 1


def test_a_user_cross_device_ops_that_changes_results_changes_them():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Doubling())
    result = strategy.run(lambda: ctx().all_reduce("sum", torch.tensor([1.0, 2.0])))
    for t in strategy.experimental_local_results(result):
        assert t.tolist() == [4.0, 8.0]
    doubled, _ = _train_one_step(strategy)
    plain, _ = _train_one_step(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 1)
    # SGD with lr 1: the update is the gradient, doubled by the plug-in
    for p, q, p0 in zip(doubled.parameters(), plain.parameters(), start.parameters()):
        torch.testing.assert_close(p.detach() - p0.detach(), 2 * (q.detach() - p0.detach()))


def test_a_plug_in_returning_the_wrong_number_of_results_is_a_clear_error():
    class Broken(sg.CrossDeviceOps):
        def batch_reduce(self, reduce_op, value_destination_pairs):
            return []

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Broken())
    with pytest.raises(ValueError, match="one per pair"):
        strategy.run(lambda: ctx().all_reduce("sum", torch.ones(1)))


def test_built_in_ops_can_be_called_directly_as_in_tensorflow():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    value = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor([1.0, 2.0]) * (c.replica_id_in_sync_group + 1))
    for ops in (sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice(), sg.RingAllReduce()):
        assert ops.reduce("sum", value, destinations="cpu:0").tolist() == [3.0, 6.0]
        both = ops.batch_reduce("mean", [(value, ("cpu:0", "cpu:1"))])[0]
        assert [t.tolist() for t in both.values] == [[1.5, 3.0]] * 2
        assert ops.broadcast(torch.ones(1), "cpu:0").tolist() == [1.0]


def test_a_cross_device_ops_must_be_one():
    with pytest.raises(InvalidArgumentError, match="subclass of sg.CrossDeviceOps"):
        sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=object())


@pytest.mark.parametrize("name", ["default", "one_device"])
def test_one_replica_strategies_have_identity_collectives(name):
    strategy = sg.OneDeviceStrategy("cpu") if name == "one_device" else sg.get_strategy()
    x = torch.arange(6.0).reshape(3, 2)

    def fn():
        c = sg.get_replica_context()
        return [c.all_reduce("sum", x), c.all_reduce("mean", x), c.all_gather(x, axis=1), c.reduce_scatter("sum", x),
                c.broadcast(x), c.reduce("sum", x), c.gather(x), c.scatter([x]), c.all_to_all([x])[0]]

    for got in strategy.run(fn):
        assert torch.equal(got, x)

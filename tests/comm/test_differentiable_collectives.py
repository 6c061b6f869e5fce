"""Differentiable collectives among the replica threads of one process (gradcheck in lockstep)."""

import pytest
import torch

import stratagem as sg
from stratagem.errors import CollectiveMismatchError, InvalidArgumentError

from .collective_cases import OPS, gradcheck_all

pytestmark = pytest.mark.timeout(120)


def mirrored(n, ops=None):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], cross_device_ops=ops)


def ctx():
    return sg.get_replica_context()


@pytest.mark.parametrize("n,ops", [(1, None), (2, None), (3, sg.RingAllReduce()), (4, sg.ReductionToOneDevice())],
                         ids=["1", "2", "3-ring", "4-one-device"])
def test_gradcheck_every_differentiable_collective(n, ops):
    strategy = mirrored(n, ops)
    results = strategy.run(gradcheck_all, args=(n,))
    for outcome in strategy.experimental_local_results(results):
        assert outcome == {op: True for op in OPS}


def test_gradients_by_hand():
    strategy = mirrored(2)

    def step():
        r = ctx().replica_id_in_sync_group
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        total = ctx().all_reduce("sum", x * (r + 1))            # x*1 + x*2
        gathered = ctx().all_gather(x * (r + 1), axis=0)         # [x, 2x]
        mine = ctx().reduce_scatter("sum", torch.stack([x, x]) * (r + 1), axis=0)  # row r of 3 * [x; x]
        got = ctx().broadcast(x * (r + 1), source_replica=1)     # 2x everywhere
        loss = (total.sum() + gathered[2:].sum() * (r + 1) + mine.sum() * (r + 1) + got.sum() * (r + 1))
        loss.backward()
        return x.grad

    g0, g1 = strategy.experimental_local_results(strategy.run(step))
    # d/dx_r: all_reduce: 2 replicas' losses each see (r+1) x_r -> 2(r+1); all_gather slot 1 is 2 x_1,
    # weighted 1+2 -> only x_1: 6; reduce_scatter: every slice of (r+1) x_r, weighted by its owner: (r+1)(1+2);
    # broadcast: only the source (r=1) gets 2 * (1 + 2)
    torch.testing.assert_close(g0, torch.full((2,), 2.0 + 0 + 3.0 + 0))
    torch.testing.assert_close(g1, torch.full((2,), 4.0 + 6.0 + 6.0 + 6.0))


def test_a_replica_whose_input_needs_no_grad_still_takes_part():
    strategy = mirrored(2)

    def step():
        r = ctx().replica_id_in_sync_group
        w = torch.tensor([3.0], requires_grad=True)
        value = w * 1.0 if r == 0 else torch.zeros(1)  # only the source's value is differentiable
        got = ctx().broadcast(value, source_replica=0)
        (got * (r + 1)).sum().backward()
        return w.grad if r == 0 else got.requires_grad

    first, second = strategy.experimental_local_results(strategy.run(step))
    assert first.tolist() == [3.0] and second is True


def test_a_replica_skipping_the_backward_is_an_error_not_a_hang():
    strategy = mirrored(2)

    def step():
        x = torch.ones(2, requires_grad=True)
        y = ctx().all_reduce("sum", x)
        if ctx().replica_id_in_sync_group == 0:
            y.sum().backward()

    with pytest.raises(CollectiveMismatchError):
        strategy.run(step)


@pytest.mark.parametrize("name", ["reduce", "gather", "scatter"])
def test_one_sided_collectives_refuse_inputs_that_require_grad(name):
    strategy = mirrored(2)
    calls = {"reduce": lambda x: ctx().reduce("sum", x), "gather": lambda x: ctx().gather(x),
             "scatter": lambda x: ctx().scatter([x, x] if ctx().replica_id_in_sync_group == 0 else None)}

    def step():
        return calls[name](torch.ones(2, requires_grad=True) * 2)

    with pytest.raises(InvalidArgumentError, match=f"{name} is not differentiable"):
        strategy.run(step)
    with torch.no_grad():
        strategy.run(step)  # fine without grad


def test_collectives_in_no_grad_mode_record_nothing():
    strategy = mirrored(2)

    def step():
        x = torch.ones(2, requires_grad=True)
        with torch.no_grad():
            return ctx().all_reduce("sum", x).requires_grad

    assert set(strategy.experimental_local_results(strategy.run(step))) == {False}


@pytest.mark.parametrize("n,ops", [(1, None), (3, None), (4, sg.RingAllReduce())], ids=["1", "3", "4-ring"])
def test_every_collective_against_the_reference(n, ops):
    from .collective_cases import check_all_collectives
    strategy = mirrored(n, ops)
    for failures in strategy.experimental_local_results(strategy.run(check_all_collectives)):
        assert failures == []


@pytest.mark.parametrize("call", [
    lambda r: ctx().all_gather(torch.ones(2, 2 + r), axis=0),       # differs off the gathered axis
    lambda r: ctx().all_gather(torch.ones(2, dtype=torch.float64 if r else torch.float32), axis=0),
    lambda r: ctx().reduce_scatter("sum", torch.ones(4 + r)),       # replicas disagree on the length
], ids=["all_gather-width", "all_gather-dtype", "reduce_scatter-length"])
def test_mismatched_shapes_are_refused_on_every_replica(call):
    strategy = mirrored(2)

    def fn():
        try:
            call(ctx().replica_id_in_sync_group)
        except InvalidArgumentError as error:
            return str(error)
        return "accepted"

    messages = strategy.experimental_local_results(strategy.run(fn))
    assert all(m != "accepted" for m in messages) and any("replica" in m for m in messages)

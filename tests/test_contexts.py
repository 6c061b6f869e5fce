"""The default strategy and the contexts: which strategy and which replica a thread sees."""

import threading

import pytest
import torch

import stratagem as sg
from stratagem.errors import ContextError, StratagemError

pytestmark = pytest.mark.timeout(60)

_DEFAULT = sg.get_strategy()


def mirrored(n):
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)])


# ------------------------------------------------------------------ outside any scope

def test_outside_every_scope_is_the_default_strategy():
    default = sg.get_strategy()
    assert sg.get_strategy() is default
    assert not sg.has_strategy()
    assert not sg.in_cross_replica_context()
    ctx = sg.get_replica_context()
    assert isinstance(ctx, sg.ReplicaContext)
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ctx.strategy is default
    assert default.num_replicas_in_sync == 1


def test_default_strategy_is_a_singleton_that_cannot_be_constructed():
    default = sg.get_strategy()
    with pytest.raises(ContextError, match="cannot be constructed"):
        type(default)()
    assert sg.get_strategy() is default
    # the singleton is the same from another thread
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sg.get_strategy()))
    thread.start()
    thread.join()
    assert seen == [default]


def test_default_strategy_is_pass_through():
    default = sg.get_strategy()
    model = torch.nn.Linear(2, 1)
    x = torch.ones(3, 2)
    assert default.run(lambda a: a * 2, args=(x,)).equal(x * 2)
    torch.testing.assert_close(default.run(model, args=(x,)), model(x))
    assert default.experimental_local_results(x) == (x,)
    assert default.reduce("sum", torch.tensor(3.0)).item() == 3.0


def test_default_strategy_scope_does_not_count_as_a_strategy():
    default = sg.get_strategy()
    with default.scope() as entered:
        assert entered is default
        assert sg.get_strategy() is default
        assert not sg.has_strategy()
    assert not sg.in_cross_replica_context()


# --------------------------------------------------------------------- scope

@pytest.mark.parametrize("make", [lambda: sg.OneDeviceStrategy("cpu"), lambda: mirrored(2)],
                         ids=["one_device", "mirrored2"])
def test_inside_scope_is_cross_replica_context(make):
    strategy = make()
    with strategy.scope() as entered:
        assert entered is strategy
        assert sg.get_strategy() is strategy
        assert sg.has_strategy()
        assert sg.in_cross_replica_context()
        assert sg.get_replica_context() is None
    assert sg.get_strategy() is not strategy
    assert not sg.has_strategy()
    assert not sg.in_cross_replica_context()


def test_same_scope_can_be_reentered():
    strategy = mirrored(2)
    with strategy.scope():
        with strategy.scope():
            assert sg.get_strategy() is strategy
            assert sg.in_cross_replica_context()
        assert sg.get_strategy() is strategy
        assert sg.in_cross_replica_context()
    assert not sg.has_strategy()


def test_nested_different_scopes_is_an_error_and_leaves_the_stack_intact():
    first, second = mirrored(2), sg.OneDeviceStrategy("cpu")
    with first.scope():
        with pytest.raises(ContextError, match="cannot enter the scope") as info:
            with second.scope():
                pass  # pragma: no cover
        assert isinstance(info.value, StratagemError)
        assert sg.get_strategy() is first
        assert sg.in_cross_replica_context()
    assert not sg.has_strategy()


def test_nested_default_scope_inside_another_is_an_error():
    strategy = mirrored(2)
    with strategy.scope():
        with pytest.raises(ContextError, match="mixing strategies"):
            with _DEFAULT.scope():
                pass  # pragma: no cover
        assert sg.get_strategy() is strategy


def test_exception_inside_scope_unwinds_the_context():
    strategy = mirrored(2)
    with pytest.raises(KeyError):
        with strategy.scope():
            raise KeyError("boom")
    assert not sg.has_strategy()
    assert sg.get_strategy() is _DEFAULT


# ----------------------------------------------------------------------- run

@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_run_gives_each_replica_its_own_context(num_replicas):
    strategy = mirrored(num_replicas)
    seen = {}
    lock = threading.Lock()

    def fn():
        ctx = sg.get_replica_context()
        row = (ctx.num_replicas_in_sync, ctx.strategy is strategy, sg.get_strategy() is strategy,
               sg.has_strategy(), sg.in_cross_replica_context())
        with lock:
            seen[ctx.replica_id_in_sync_group] = row
        return ctx.replica_id_in_sync_group

    for _ in range(2):  # the replica threads are reused between runs
        seen.clear()
        ids = strategy.run(fn)
        assert strategy.experimental_local_results(ids) == tuple(range(num_replicas))
        assert seen == {r: (num_replicas, True, True, True, False) for r in range(num_replicas)}


def test_run_outside_scope_enters_the_scope_for_the_call():
    strategy = mirrored(2)
    assert not sg.has_strategy()
    assert strategy.run(lambda: sg.get_strategy() is strategy) is True
    assert not sg.has_strategy()


def test_run_inside_scope_returns_to_cross_replica_context():
    strategy = mirrored(2)
    with strategy.scope():
        strategy.run(lambda: None)
        assert sg.in_cross_replica_context()
        assert sg.get_replica_context() is None


def test_replica_threads_are_distinct_and_see_only_their_own_context():
    strategy = mirrored(3)
    barrier = threading.Barrier(3, timeout=20)

    def fn():
        ctx = sg.get_replica_context()
        barrier.wait()  # every replica is inside run at once
        again = sg.get_replica_context()
        return ctx is again, again.replica_id_in_sync_group, threading.get_ident()

    same, ids, idents = strategy.run(fn)
    assert same is True  # the same object on every replica stays a plain value
    assert strategy.experimental_local_results(ids) == (0, 1, 2)
    assert len(set(strategy.experimental_local_results(idents))) == 3


def test_run_inside_run_is_a_context_error():
    strategy = mirrored(2)

    def fn():
        return strategy.run(lambda: 1)

    with pytest.raises(ContextError, match="cross-replica context"):
        strategy.run(fn)
    assert strategy.run(lambda: 7) == 7  # still usable


def test_merge_fn_runs_in_cross_replica_context():
    strategy = mirrored(2)

    def merge_fn(s):
        return (s is strategy, sg.in_cross_replica_context(), sg.get_replica_context() is None,
                sg.get_strategy() is strategy)

    def fn():
        result = sg.get_replica_context().merge_call(merge_fn)
        return result, sg.in_cross_replica_context(), sg.get_replica_context().replica_id_in_sync_group

    merged, cross_after, ids = strategy.run(fn)
    assert merged == (True, True, True, True)
    assert cross_after is False
    assert strategy.experimental_local_results(ids) == (0, 1)


# -------------------------------------------------------------- per-thread state

def test_scope_entered_in_one_thread_is_invisible_in_another():
    strategy = mirrored(2)
    inside = threading.Event()
    release = threading.Event()
    seen_in_thread = []

    def holder():
        with strategy.scope():
            seen_in_thread.append((sg.get_strategy() is strategy, sg.has_strategy()))
            inside.set()
            release.wait(20)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(20)
        assert sg.get_strategy() is _DEFAULT
        assert not sg.has_strategy()
        assert not sg.in_cross_replica_context()
        other = []
        probe = threading.Thread(target=lambda: other.append((sg.get_strategy(), sg.has_strategy())))
        probe.start()
        probe.join()
        assert other == [(_DEFAULT, False)]
    finally:
        release.set()
        thread.join()
    assert seen_in_thread == [(True, True)]


def test_two_threads_can_hold_different_scopes_at_once():
    strategies = [mirrored(2), sg.OneDeviceStrategy("cpu")]
    barrier = threading.Barrier(2, timeout=20)
    seen = [None, None]

    def worker(i):
        with strategies[i].scope():
            barrier.wait()
            seen[i] = sg.get_strategy()
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == strategies


def test_get_replica_context_docstring_example():
    ctx = sg.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1

"""sg.experimental_set_strategy: the scope entered for the rest of the program (this thread)."""

from __future__ import annotations

import threading

import pytest
import torch

import stratagem as sg
from stratagem.errors import ContextError, InvalidArgumentError


@pytest.fixture(autouse=True)
def _left() -> None:
    yield
    sg.experimental_set_strategy(None)


def test_what_is_created_after_it_is_created_in_the_scope_and_none_leaves() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    sg.experimental_set_strategy(strategy)
    assert sg.get_strategy() is strategy and sg.in_cross_replica_context()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert type(optimizer).__name__ == "MirroredSGD"

    def step(x):
        optimizer.zero_grad()
        sg.nn.compute_average_loss(model(x).pow(2).sum(1)).backward()
        optimizer.step()

    with strategy.scope():   # re-entering its own scope is fine
        strategy.run(step, args=(torch.ones(4, 4),))
    seen = []
    threading.Thread(target=lambda: seen.append(sg.get_strategy())).start()   # (per thread, as scopes)
    sg.experimental_set_strategy(None)
    assert not sg.has_strategy()
    assert torch.optim.SGD(model.parameters(), lr=0.1).__class__ is torch.optim.SGD


def test_another_strategy_s_scope_is_refused_naming_the_fix() -> None:
    sg.experimental_set_strategy(sg.OneDeviceStrategy("cpu"))
    with pytest.raises(ContextError, match=r"experimental_set_strategy\(None\) first"):
        with sg.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
            pass


def test_setting_it_inside_a_scope_or_run_is_refused_and_replacing_it_works() -> None:
    one, two = sg.OneDeviceStrategy("cpu"), sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with one.scope(), pytest.raises(ContextError, match="leave the `with strategy.scope\\(\\):` block first"):
        sg.experimental_set_strategy(two)
    with pytest.raises(ContextError, match="inside strategy.run"):
        one.run(lambda: sg.experimental_set_strategy(two))
    sg.experimental_set_strategy(one)
    sg.experimental_set_strategy(two)   # the first left, the second entered
    assert sg.get_strategy() is two
    with pytest.raises(InvalidArgumentError, match="takes a strategy"):
        sg.experimental_set_strategy("mirrored")

"""The data axis: every synchronous placement's second collaborator (placement/data_axis/axis.py)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.placement.data_axis.axis import AxisCollective, DataAxis
from stratagem.placement.data_axis.step import synchronous_step

pytestmark = pytest.mark.timeout(60)


def _strategies() -> list:
    return [sg.get_strategy(), sg.OneDeviceStrategy("cpu"), sg.MirroredStrategy(["cpu:0", "cpu:1"]),
            sg.CentralStorageStrategy(["cpu:0", "cpu:1"])]


def test_every_synchronous_placement_hands_its_optimizers_to_its_data_axis() -> None:
    for strategy in _strategies():
        placement = strategy.placement
        axis = placement.data_axis
        assert isinstance(axis, DataAxis), strategy
        assert placement.optimizer_step.__func__ is synchronous_step   # the one step, no frame between
        assert placement.update is axis.update and placement.gradients is axis.gradients
        assert placement.buffers is axis.buffers


def test_a_step_through_the_data_axis_updates_every_copy() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(2, 1, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad():
        model.weight.fill_(1.0)

    def step(x):
        optimizer.zero_grad()
        model(x).sum().backward()   # each replica's gradient is x (ones), summed over the two: 2
        optimizer.step()

    strategy.run(step, args=(torch.ones(1, 2),))
    copies = strategy.placement.all_copies(model.weight)
    assert [c.tolist() for c in copies] == [[[0.0, 0.0]]] * 2


def test_no_sync_and_ddps_attribute_reach_the_data_axis() -> None:
    strategy = sg.OneDeviceStrategy("cpu")   # no gradient sync: the axis counts no_sync itself
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    strategy.placement.finalize()
    axis = strategy.placement.data_axis
    assert axis.gradients is None and axis.requires_sync()
    with strategy.no_sync():
        assert not axis.requires_sync()
    assert axis.requires_sync()
    model.require_backward_grad_sync = False
    assert not axis.requires_sync()


def test_a_pipelined_models_sync_needs_an_axis_of_several_processes() -> None:
    class Alone:
        num_workers = 1

    axis = DataAxis(object(), Alone(), update=None)
    assert AxisCollective.gradient_sync(axis, Alone()) is None
    with pytest.raises(AssertionError, match="one process"):
        axis.model_sync(0)

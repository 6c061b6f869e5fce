"""The replicas of one process meet before any of them updates (``step.py``, step 2).

With split updates each replica's thread updates its range of replica 0's parameters from
replica 0's gradients, so code that one replica runs on its gradients between ``backward()`` and
``step()`` -- here a scaling in place, as ``clip_grad_norm_`` does -- must be done before any
replica updates. The meeting used to come from a step pre-hook that stratagem itself registers
during runs; these tests take every pre-hook away, and a replica that is slow to scale (it
sleeps first) must still train as plain PyTorch: without the meeting SGD was 0.037 off.
"""

from __future__ import annotations

import time

import pytest
import torch

import stratagem as sg
from stratagem.placement.data_axis import step as step_order

pytestmark = pytest.mark.timeout(120)

STRATEGIES = {
    "mirrored": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "reduction_to_one_device": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"],
                                                           cross_device_ops=sg.ReductionToOneDevice()),
    "central_storage": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()


@pytest.mark.parametrize("slow_replica", [0, 1])
@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_no_replica_updates_before_every_replica_has_changed_its_gradients(
        monkeypatch: pytest.MonkeyPatch, strategy_name: str, optimizer_class: type, slow_replica: int) -> None:
    with_hooks = step_order.step_hooks
    monkeypatch.setattr(step_order, "step_hooks", lambda optimizer: ([], with_hooks(optimizer)[1]))
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)

    plain = _model()
    optimizer = optimizer_class(plain.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        for p in plain.parameters():
            p.grad.mul_(0.5)
        optimizer.step()

    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = _model()
        scoped = optimizer_class(model.parameters(), lr=0.1)

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        scoped.zero_grad()
        sg.nn.compute_average_loss(((model(xb) - yb) ** 2).mean(dim=1)).backward()
        if sg.get_replica_context().replica_id_in_sync_group == slow_replica:
            time.sleep(0.05)   # the other replica reaches step() first
        for p in model.parameters():
            p.grad.mul_(0.5)
        scoped.step()

    for _ in range(3):
        strategy.run(train_step, args=(sg.PerReplica([x[:4], x[4:]]), sg.PerReplica([y[:4], y[4:]])))
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)

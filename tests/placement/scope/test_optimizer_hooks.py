"""Optimizers created in scope: no global patch left behind, a visible class, step hooks once.

A scoped optimizer is one logical optimizer: its step pre/post hooks fire once per
training step whatever the replica count and the optimizer (SGD and Adam take the
split update across replica threads, Adafactor the twin update), the pre-hook sees the
summed gradients and the post-hook the updated parameters -- so a hook that clips by
global norm, or one that keeps an average of the weights, does what it does in plain
PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

import stratagem as sg
from stratagem.placement.scope import hooks

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}
STRATEGIES = {
    "default": lambda: sg.get_strategy(),
    "one_device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored1": lambda: sg.MirroredStrategy(["cpu:0"]),
    "mirrored3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "central3": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"]),
}


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(steps)]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(strategy: sg.Strategy, make_optimizer, register, steps: int = 3):
    """Train under ``strategy`` and in plain PyTorch from the same start; return both models."""
    torch.manual_seed(0)
    reference = _net()
    ref_opt = make_optimizer(reference.parameters())
    with strategy.scope():
        model = _net()
        optimizer = make_optimizer(model.parameters())
    model.load_state_dict(reference.state_dict())
    ours, theirs = register(optimizer), register(ref_opt)
    data = _data(steps)

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for (x, y), batch in zip(data, strategy.experimental_distribute_dataset(data)):
        strategy.run(step, args=(batch,))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    return model, reference, ours, theirs, strategy


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_pre_and_post_hooks_fire_once_per_step(strategy_name: str, optimizer_name: str) -> None:
    def register(optimizer):
        calls = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
        return calls

    *_, ours, theirs, _ = _train(STRATEGIES[strategy_name](), OPTIMIZERS[optimizer_name], register)
    assert ours == theirs == ["pre", "post"] * 3


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam", "adafactor"])
def test_a_clipping_pre_hook_gives_plain_pytorch_results(optimizer_name: str) -> None:
    """The pre-hook sees the summed gradients: clipping by global norm is the plain one."""
    def register(optimizer):
        norms = []

        def clip(opt, args, kwargs):
            params = [p for g in opt.param_groups for p in g["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm=0.05)))
        optimizer.register_step_pre_hook(clip)
        return norms

    model, reference, ours, theirs, strategy = _train(
        sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), OPTIMIZERS[optimizer_name], register)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=1e-6)
    assert all(n > 0.05 for n in theirs)  # the clip really cut every step
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)
        copies = strategy.experimental_local_results(p)
        assert all(torch.equal(c, copies[0]) for c in copies[1:])  # replicas stay identical


@pytest.mark.parametrize("optimizer_name", ["sgd", "adafactor"])
def test_a_post_hook_sees_updated_weights_and_may_change_them(optimizer_name: str) -> None:
    """An average of the weights kept by a post-hook, and a projection it applies in place."""
    def register(optimizer):
        averages = {}

        def average_and_project(opt, args, kwargs):
            with torch.no_grad():
                for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
                    p.clamp_(-0.3, 0.3)
                    averages[i] = p.detach().clone() if i not in averages else 0.5 * (averages[i] + p)
        optimizer.register_step_post_hook(average_and_project)
        return averages

    model, reference, ours, theirs, strategy = _train(
        sg.MirroredStrategy(["cpu:0", "cpu:1"]), OPTIMIZERS[optimizer_name], register)
    for i in theirs:
        torch.testing.assert_close(ours[i], theirs[i], rtol=2e-5, atol=2e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)
        copies = strategy.experimental_local_results(p)
        assert all(torch.equal(c, copies[0]) for c in copies[1:])


def test_global_hooks_fire_once_per_step() -> None:
    calls = []
    handle = register_optimizer_step_pre_hook(lambda *a: calls.append("pre"))
    try:
        _train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), OPTIMIZERS["sgd"], lambda opt: None, steps=2)
    finally:
        handle.remove()
    assert calls == ["pre", "pre"] * 2  # ours and the reference's, once each per step


def test_stratagems_own_step_check_is_not_a_hook_of_a_scoped_step() -> None:
    """During a multi-replica run stratagem registers a global step pre-hook of its own (it refuses an
    optimizer created outside the scope); a scoped optimizer's step leaves it out of the hooks it fires
    (it is a no-op there), while a user's global hook registered beside it is still listed and fired."""
    from stratagem.placement.scope.unscoped import _forbid_unscoped_optimizer
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, seen = [], []

    def user_hook(opt, args, kwargs):
        calls.append(sg.get_replica_context() is None)

    def step(x):
        seen.append(hooks.step_hooks(optimizer)[0])
        registered = list(torch_optimizer._global_optimizer_pre_hooks.values())
        assert _forbid_unscoped_optimizer in registered   # (registered for the run)
        model(x).sum().backward()
        optimizer.step()
    handle = register_optimizer_step_pre_hook(user_hook)
    try:
        batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 2)])))
        strategy.run(step, args=(batch,))
    finally:
        handle.remove()
    assert seen == [[user_hook], [user_hook]]
    assert len(calls) == 1


def test_a_hook_that_raises_fails_the_run_cleanly() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def bad(opt, args, kwargs):
        raise ValueError("hook says no")
    optimizer.register_step_pre_hook(bad)

    def step(x):
        model(x).sum().backward()
        optimizer.step()
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 2)])))
    with pytest.raises(ValueError, match="hook says no"):
        strategy.run(step, args=(batch,))


def test_the_class_says_what_changed_and_nothing_stays_patched() -> None:
    original_init = torch.optim.Optimizer.__init__
    assert not hooks.hooks_installed()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        assert hooks.hooks_installed()
        model = nn.Linear(2, 1)
        optimizer = torch.optim.Adam(model.parameters())
    assert not hooks.hooks_installed()
    assert torch.optim.Optimizer.__init__ is original_init
    assert isinstance(optimizer, torch.optim.Adam)
    assert type(optimizer).__name__ == "MirroredAdam"
    assert "MirroredAdam" in repr(optimizer) and "MirroredStrategy" in repr(optimizer)
    outside = torch.optim.Adam(nn.Linear(2, 1).parameters())
    assert type(outside) is torch.optim.Adam  # created outside every scope: untouched
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(optimizer)


def test_a_zero_grad_method_of_another_survives_multi_replica_runs() -> None:
    # while such runs are active Optimizer.zero_grad is wrapped (placement/scope/unscoped.py says why):
    # the wrapper calls the method it found there and gives that one back; a method put there
    # during such a run cannot stay (it would call the wrapper for good): put back, with a warning
    torch_zero_grad = torch.optim.Optimizer.zero_grad
    calls: list[str] = []

    def counted(self, set_to_none=True):
        calls.append("counted")
        torch_zero_grad(self, set_to_none)

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    plain = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)   # over parameters no strategy holds
    torch.optim.Optimizer.zero_grad = counted
    try:
        strategy.run(lambda: plain.zero_grad())
        assert calls == ["counted", "counted"] and torch.optim.Optimizer.zero_grad is counted

        def put_there():
            if sg.get_replica_context().replica_id_in_sync_group == 0:
                torch.optim.Optimizer.zero_grad = torch_zero_grad
        with pytest.warns(RuntimeWarning, match="zero_grad was replaced .* while a multi-replica run was "
                                                "active.*puts back <function .*counted"):
            strategy.run(put_there)
        assert torch.optim.Optimizer.zero_grad is counted
    finally:
        torch.optim.Optimizer.zero_grad = torch_zero_grad


def test_hooks_removed_even_when_the_scope_raises() -> None:
    strategy = sg.OneDeviceStrategy("cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with strategy.scope():
            nn.Linear(2, 2)
            raise RuntimeError("boom")
    assert not hooks.hooks_installed()


def test_hooks_still_fire_once_after_load_state_dict() -> None:
    """torch re-wraps an optimizer class's step in load_state_dict; ours must stay unwrapped."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(optimizer.state_dict())
    calls = []
    optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *a: calls.append("post"))

    def step(x):
        model(x).sum().backward()
        optimizer.step()
    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 3)]))),))
    assert calls == ["pre", "post"]

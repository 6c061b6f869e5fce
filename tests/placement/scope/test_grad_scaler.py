"""Mixed precision in one process: autocast reaches every replica thread, and a GradScaler
created in scope makes one scale/skip decision for every replica, equal to plain PyTorch's
GradScaler on the whole batch."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from .amp_script import scaled_step
from stratagem.errors import ContextError, InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

STRATEGIES = {
    "default": lambda: sg.get_strategy(),
    "one_device": lambda: sg.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "mirrored_ring": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=sg.RingAllReduce()),
}


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_autocast_around_run_reaches_every_replica(kind: str) -> None:
    strategy = STRATEGIES[kind]()
    with strategy.scope():
        model = nn.Linear(4, 3)

    def step(x):
        return model(x), torch.tensor(torch.is_autocast_cache_enabled())

    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs, _ = strategy.run(step, args=(x,))
    assert [o.dtype for o in strategy.experimental_local_results(outputs)] == [torch.bfloat16] * 2

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        _, cache = strategy.run(step, args=(x,))
    assert [bool(c) for c in strategy.experimental_local_results(cache)] == [False, False]

    outputs, cache = strategy.run(step, args=(x,))   # not enabled: float32 on every replica, as before
    assert [o.dtype for o in strategy.experimental_local_results(outputs)] == [torch.float32] * 2
    assert [bool(c) for c in strategy.experimental_local_results(cache)] == [True, True]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):   # switched off inside: off on every replica
            outputs, _ = strategy.run(step, args=(x,))
    assert [o.dtype for o in strategy.experimental_local_results(outputs)] == [torch.float32] * 2


def test_autocast_dtype_is_the_callers() -> None:
    strategy = STRATEGIES["mirrored"]()
    with strategy.scope():
        model = nn.Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        outputs = strategy.run(lambda x: model(x), args=(torch.randn(2, 4),))
    assert [o.dtype for o in strategy.experimental_local_results(outputs)] == [torch.float16] * 2


# ------------------------------------------------------------------ GradScaler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(steps: int, batch: int, poisoned: dict[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float64 batches; at step ``s`` in ``poisoned``, row ``poisoned[s]`` holds an inf."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]
    for step, row in poisoned.items():
        data[step][0][row, 2] = float("inf")
    return data


def _plain_history(model: nn.Module, data: list, *, clip: float | None) -> tuple[list, dict]:
    """Plain single-device PyTorch with its own GradScaler on the whole batch: the scale and
    parameters after every step, and the scaler's final state."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    history = []
    for x, y in data:
        scaled_step(model, optimizer, scaler, F.cross_entropy(model(x), y), clip)
        history.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    return history, scaler.state_dict()


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no_clip", "clip"])
@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_grad_scaler_in_scope_equals_plain_pytorch(kind: str, clip: float | None) -> None:
    strategy = STRATEGIES[kind]()
    n = strategy.num_replicas_in_sync
    batch = 4 * n
    # step 2: an inf in the last replica's slice only; step 5: in the first replica's
    data = _data(8, batch, {2: batch - 1, 5: 0})
    torch.manual_seed(0)
    reference = Net().double()
    with strategy.scope():
        model = Net().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    model.load_state_dict(reference.state_dict())
    expected, final_state = _plain_history(reference, data, clip=clip)

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaled_step(model, optimizer, scaler, loss, clip)
        return torch.tensor(scaler.get_scale())

    for i, batch_ in enumerate(strategy.experimental_distribute_dataset(data)):
        scales = strategy.experimental_local_results(strategy.run(step, args=(batch_,)))
        want_scale, want_params = expected[i]
        assert [s.item() for s in scales] == [want_scale] * len(scales), f"step {i}"
        assert scaler.get_scale() == want_scale
        for r in range(strategy.topology.num_local_replicas):
            for p, q in zip(model.parameters(), want_params):
                got = strategy.experimental_local_results(p)[r] if n > 1 else p
                torch.testing.assert_close(got, q, rtol=1e-12, atol=1e-14, msg=lambda m: f"step {i}, replica {r}: {m}")
    scales = [scale for scale, _ in expected]
    assert scales[2] < scales[1] and scales[5] < scales[4], "the poisoned steps did not back off"
    assert scaler.state_dict() == final_state


def test_grad_scaler_with_two_optimizers() -> None:
    strategy = STRATEGIES["mirrored"]()
    data = _data(4, 8, {1: 6})
    torch.manual_seed(0)
    reference = Net().double()
    with strategy.scope():
        model = Net().double()
        first = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
        second = torch.optim.Adam(model.fc2.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    model.load_state_dict(reference.state_dict())
    ref_first = torch.optim.SGD(reference.fc1.parameters(), lr=0.1)
    ref_second = torch.optim.Adam(reference.fc2.parameters(), lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", growth_interval=1)

    def step(batch):
        x, y = batch
        first.zero_grad()
        second.zero_grad()
        scaler.scale(sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))).backward()
        scaler.unscale_(second)
        scaler.step(first)
        scaler.step(second)
        scaler.update()

    for (x, y), batch in zip(data, strategy.experimental_distribute_dataset(data)):
        strategy.run(step, args=(batch,))
        ref_first.zero_grad()
        ref_second.zero_grad()
        ref_scaler.scale(F.cross_entropy(reference(x), y)).backward()
        ref_scaler.step(ref_first)
        ref_scaler.step(ref_second)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_scoped_grad_scaler_class_and_state() -> None:
    strategy = STRATEGIES["central_storage"]()
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        with pytest.warns(FutureWarning):
            old_style = torch.cpu.amp.GradScaler(init_scale=4.0)
    assert type(scaler).__name__ == "CentralStorageGradScaler" and isinstance(scaler, torch.amp.GradScaler)
    assert isinstance(old_style, torch.cpu.amp.GradScaler) and old_style.get_scale() == 4.0
    assert "CentralStorageStrategy" in repr(scaler)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(scaler)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(scaler)

    def step(x):
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return torch.tensor(scaler.get_scale())

    strategy.run(step, args=(torch.ones(4, 3),))
    state = {**scaler.state_dict(), "scale": 8.0, "_growth_tracker": 3}
    scaler.load_state_dict(state)   # every replica's copy
    scales = strategy.run(lambda: torch.tensor(scaler.get_scale()))
    assert [s.item() for s in strategy.experimental_local_results(scales)] == [8.0, 8.0]
    assert scaler.state_dict() == state
    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(scaler.state_dict())   # one logical scaler: plain torch reads it
    assert plain.state_dict() == state


def test_update_outside_run_moves_every_replica() -> None:
    strategy = STRATEGIES["mirrored"]()
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", growth_interval=1)

    def step(x):
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)

    strategy.run(step, args=(torch.ones(4, 3),))
    scaler.update()
    scales = strategy.run(lambda: torch.tensor(scaler.get_scale()))
    assert [s.item() for s in strategy.experimental_local_results(scales)] == [2.0 ** 17] * 2


def test_grad_scaler_created_outside_the_scope_is_refused_in_a_multi_replica_run() -> None:
    strategy = STRATEGIES["mirrored"]()
    scaler = torch.amp.GradScaler("cpu")
    with strategy.scope():
        model = nn.Linear(3, 1)

    with pytest.raises(ContextError, match=r"created outside its scope.*Create the GradScaler inside `with strategy.scope\(\):`"):
        strategy.run(lambda x: scaler.scale(model(x).sum()), args=(torch.ones(4, 3),))
    # one replica in all: a plain scaler behaves as in plain PyTorch
    one = sg.OneDeviceStrategy("cpu:0")
    with one.scope():
        single = nn.Linear(3, 1)
    assert one.run(lambda x: scaler.scale(single(x).sum()), args=(torch.ones(4, 3),)).dtype == torch.float32
    # and outside every scope torch's GradScaler is untouched
    assert torch.amp.GradScaler.__init__.__module__ == "torch.amp.grad_scaler"
    assert torch.amp.GradScaler.scale.__qualname__ == "GradScaler.scale"


def test_unscale_outside_run_and_in_another_strategy_refused() -> None:
    strategy = STRATEGIES["mirrored"]()
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(2, 3)).sum())
    with pytest.raises(ContextError, match="inside the replica function"):
        scaler.unscale_(optimizer)
    other = STRATEGIES["central_storage"]()
    with pytest.raises(ContextError, match="used in a run of CentralStorageStrategy"):
        other.run(lambda: scaler.scale(torch.ones(())))


def test_grad_scaler_refused_where_gradients_are_not_whole() -> None:
    strategy = sg.MultiWorkerMirroredStrategy(sharding="gradients")
    with pytest.raises(InvalidArgumentError, match=r"sharding='gradients'.*mixed_precision='mixed_bfloat16'"):
        with strategy.scope():
            torch.amp.GradScaler("cpu")


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_an_inf_in_one_replicas_gradient_skips_the_step_on_every_replica(kind: str) -> None:
    """The inf checks are combined: even an inf that only one replica's gradient holds (written
    after backward, where the sum over replicas cannot spread it) skips the step everywhere."""
    strategy = STRATEGIES[kind]()
    with strategy.scope():
        model = nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]

    def step(x, poison):
        optimizer.zero_grad()
        scaler.scale(model(x).sum()).backward()
        if poison and sg.get_replica_context().replica_id_in_sync_group == 1:
            model.bias.grad[0] = float("nan")
        scaler.step(optimizer)
        scaler.update()
        return torch.tensor(scaler.get_scale())

    scales = strategy.run(step, args=(torch.ones(4, 3), True))
    assert [s.item() for s in strategy.experimental_local_results(scales)] == [2.0 ** 15] * 2
    for p, q in zip(model.parameters(), before):
        for copy_ in strategy.experimental_local_results(p):
            torch.testing.assert_close(copy_, q, rtol=0, atol=0)
    strategy.run(step, args=(torch.ones(4, 3), False))
    assert not torch.equal(model.weight.detach(), before[0])

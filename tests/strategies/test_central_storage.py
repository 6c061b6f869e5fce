"""CentralStorageStrategy: parameters and optimizer state once on the parameter device, computation
on every compute replica, results those of plain PyTorch (the equivalence itself is in
tests/strategies/test_equivalence.py).

Two modes: on logical CPU devices the replicas compute with ``Parameter`` objects over the
parameters' own memory (``shared``); the path GPUs take -- a copy per replica, gradients summed
into the parameters' own ``.grad``, copies refreshed after each update -- is run here on the CPU
by declaring that no compute device shares the parameter device's memory (``copies``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.placement.layout.mirrored_dict import MirroredDict

pytestmark = pytest.mark.timeout(120)
TOL = dict(rtol=2e-5, atol=2e-6)
CPUS3 = ["cpu:0", "cpu:1", "cpu:2"]


@pytest.fixture(params=["shared", "copies"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "copies":
        monkeypatch.setattr("stratagem.placement.data_axis.central._same_memory", lambda device, home: False)
    return request.param


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(steps: int, size: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)]


def _build(strategy: sg.Strategy | None, make_optimizer=lambda p: torch.optim.Adam(p, lr=0.01)):
    torch.manual_seed(0)
    if strategy is None:
        model = _net()
        return model, make_optimizer(model.parameters())
    with strategy.scope():
        model = _net()
        optimizer = make_optimizer(model.parameters())
    return model, optimizer


def _train(strategy: sg.Strategy, model: nn.Module, optimizer, data, clip: float | None = None) -> None:
    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:   # between backward and step: this replica's own gradients
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss.detach()
    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(batch,))


def _train_plain(model: nn.Module, optimizer, data) -> None:
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_devices_defaults_and_bad_devices() -> None:
    strategy = sg.CentralStorageStrategy()
    if not torch.cuda.is_available():
        assert strategy.worker_devices == ("cpu:0",) and strategy.parameter_device == "cpu"
    strategy = sg.CentralStorageStrategy(["/cpu:0", "CPU:1"], parameter_device="/job:worker/task:0/device:CPU:0")
    assert strategy.num_replicas_in_sync == 2 and strategy.parameter_device == "cpu"
    assert repr(strategy) == "CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], parameter_device='cpu')"
    for bad in ([], ["cpu:0", "cpu:0"], ["tpu:0"]):
        with pytest.raises(sg.errors.InvalidDeviceError):
            sg.CentralStorageStrategy(bad)
    with pytest.raises(sg.errors.InvalidDeviceError, match="available"):
        sg.CentralStorageStrategy(["cpu:0"], parameter_device=f"cuda:{torch.cuda.device_count()}")


def test_one_compute_device_is_one_device() -> None:
    data = _data(3)
    central = sg.CentralStorageStrategy(["cpu:0"])
    model, optimizer = _build(central)
    assert not isinstance(model[0]._parameters, MirroredDict)   # nothing copied, nothing wrapped
    assert central.experimental_local_results(model[0].weight) == (model[0].weight,)
    _train(central, model, optimizer, data)
    one = sg.OneDeviceStrategy("cpu")
    ref_model, ref_optimizer = _build(one)
    _train(one, ref_model, ref_optimizer, data)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_parameters_state_and_summed_gradients_live_once(mode: str) -> None:
    data = _data(2)
    strategy = sg.CentralStorageStrategy(CPUS3)
    model, optimizer = _build(strategy)
    reference, ref_optimizer = _build(None)
    _train(strategy, model, optimizer, data)
    _train_plain(reference, ref_optimizer, data)
    primaries = list(model.parameters())
    for p, q in zip(primaries, reference.parameters()):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p, q, **TOL)
        # outside run, .grad is the sum over replicas: the gradient of the global batch
        torch.testing.assert_close(p.grad, q.grad, **TOL)
        copies = strategy.experimental_local_results(p)
        assert len({id(c) for c in copies}) == 3 and len({id(c.grad) for c in copies}) == 3
        shared = {c.data_ptr() == p.data_ptr() for c in copies}
        assert shared == ({True} if mode == "shared" else {False})
        assert all(torch.equal(c, p) for c in copies)
    # the optimizer state exists once, for the parameters themselves, in plain PyTorch's layout
    state = optimizer.state_dict()["state"]
    assert sorted(state) == list(range(len(primaries)))
    plain = torch.optim.Adam(_net().parameters(), lr=0.01)
    plain.load_state_dict(optimizer.state_dict())
    for index, p in enumerate(primaries):
        assert state[index]["exp_avg"].shape == p.shape


def test_clipping_matches_mirrored_and_hooks_fire_once(mode: str) -> None:
    """Clipping between backward and step clips each replica's own gradients (as Mirrored
    does); a pre-hook clips the summed ones (as plain PyTorch does); a post-hook's changes
    reach every replica."""
    data = _data(3, size=9)
    central, mirrored = sg.CentralStorageStrategy(CPUS3), sg.MirroredStrategy(CPUS3)
    sgd = lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)  # noqa: E731
    models = {}
    for name, strategy in (("central", central), ("mirrored", mirrored)):
        models[name] = _build(strategy, sgd)
        _train(strategy, *models[name], data, clip=0.05)
    for p, q in zip(models["central"][0].parameters(), models["mirrored"][0].parameters()):
        torch.testing.assert_close(p, q, **TOL)

    strategy = sg.CentralStorageStrategy(CPUS3)
    model, optimizer = _build(strategy, sgd)
    reference, ref_optimizer = _build(None, sgd)
    calls: dict[str, list] = {"ours": [], "plain": []}
    for key, opt in (("ours", optimizer), ("plain", ref_optimizer)):
        def clip(o, args, kwargs, key=key):
            params = [p for g in o.param_groups for p in g["params"]]
            calls[key].append(float(nn.utils.clip_grad_norm_(params, max_norm=0.05)))

        def project(o, args, kwargs, key=key):
            calls[key].append("post")
            with torch.no_grad():
                for p in (p for g in o.param_groups for p in g["params"]):
                    p.clamp_(-0.2, 0.2)
        opt.register_step_pre_hook(clip)
        opt.register_step_post_hook(project)
    _train(strategy, model, optimizer, data)
    _train_plain(reference, ref_optimizer, data)
    assert calls["ours"][1::2] == ["post"] * 3
    torch.testing.assert_close(torch.tensor(calls["ours"][::2]), torch.tensor(calls["plain"][::2]), **TOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL)
        assert all(torch.equal(c, p) for c in strategy.experimental_local_results(p))


def test_step_and_zero_grad_outside_run(mode: str) -> None:
    strategy = sg.CentralStorageStrategy(CPUS3)
    model, optimizer = _build(strategy)
    reference, ref_optimizer = _build(None)
    (x, y), = _data(1)
    F.cross_entropy(model(x), y).backward()   # outside run: computes with the parameters themselves
    optimizer.step()
    _train_plain(reference, ref_optimizer, [(x, y)])
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    _train(strategy, model, optimizer, _data(1))    # then a step inside run, and clear everything
    optimizer.zero_grad()
    for p in model.parameters():
        assert p.grad is None and all(c.grad is None for c in strategy.experimental_local_results(p))
        assert all(torch.equal(c, p) for c in strategy.experimental_local_results(p))


def test_writes_outside_run_reach_every_replica(mode: str) -> None:
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = nn.Linear(2, 2)
    layer.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    out = strategy.run(lambda: layer(torch.ones(1, 2)).detach())
    assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[[2.0, 2.0]]] * 2


def test_unscoped_modules_and_optimizers_are_refused(mode: str) -> None:
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 1)
    outside_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outside_model = nn.Linear(3, 1)
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 3)])))

    def step(x):
        outside_optimizer.zero_grad()
        model(x).sum().backward()
        outside_optimizer.step()
    with pytest.raises(sg.errors.ContextError, match="scope"):
        strategy.run(step, args=(batch,))
    with pytest.raises(sg.errors.ContextError, match="outside strategy.scope"):
        strategy.run(outside_model, args=(batch,))
    with pytest.raises(sg.errors.InvalidArgumentError, match="scope"):
        with strategy.scope():
            torch.optim.SGD(outside_model.parameters(), lr=0.1)


def test_strategy_api_values_and_collectives() -> None:
    strategy = sg.CentralStorageStrategy(CPUS3)
    data = strategy.experimental_distribute_dataset([torch.arange(7.0)])

    def fn(x):
        ctx = sg.get_replica_context()
        return x.sum(), ctx.all_reduce("sum", x.sum()), x

    sums, totals, parts = strategy.run(fn, args=(next(iter(data)),))
    assert [t.item() for t in strategy.experimental_local_results(totals)] == [21.0] * 3
    assert strategy.reduce("sum", sums, axis=None).item() == 21.0
    assert strategy.reduce("mean", parts, axis=0).item() == 3.0
    assert strategy.gather(parts, axis=0).tolist() == list(range(7))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
    assert strategy.experimental_local_results(values) == (0, 1, 2)
    with strategy.scope():
        layer = nn.Linear(2, 1)

    def write_in_place():
        if sg.get_replica_context().replica_id_in_sync_group:
            with torch.no_grad():
                layer.weight.add_(1.0)
    with pytest.raises(sg.errors.ContextError, match="in place"):   # one memory: refused, as Mirrored does
        strategy.run(write_in_place)


def test_checkpoint_round_trip_with_mirrored(tmp_path) -> None:
    """Saved under central storage, restored under Mirrored (and back), training goes on identically."""
    data = _data(4)
    central = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
    model, optimizer = _build(central)
    _train(central, model, optimizer, data[:2])
    path = sg.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "c")
    mirrored = sg.MirroredStrategy(CPUS3)
    other, other_optimizer = _build(mirrored)
    sg.Checkpoint(model=other, optimizer=other_optimizer).restore(path)
    back = sg.Checkpoint(model=other, optimizer=other_optimizer).save(tmp_path / "m")
    again, again_optimizer = _build(central)
    sg.Checkpoint(model=again, optimizer=again_optimizer).restore(back)
    for strategy, m, o in ((central, model, optimizer), (mirrored, other, other_optimizer),
                           (central, again, again_optimizer)):
        _train(strategy, m, o, data[2:])
    for p, q, r in zip(model.parameters(), other.parameters(), again.parameters()):
        torch.testing.assert_close(p, q, **TOL)
        torch.testing.assert_close(p, r, **TOL)


def test_one_replica_computing_with_a_copy_refuses_an_unscoped_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU computing, parameters on the CPU: an optimizer made outside the scope would update
    parameters no replica computes with (their gradients land on the copy): refused, not silent."""
    monkeypatch.setattr("stratagem.placement.data_axis.central._same_memory", lambda device, home: False)
    strategy = sg.CentralStorageStrategy(["cpu:0"], parameter_device="cpu")
    with strategy.scope():
        model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
    with pytest.raises(sg.errors.ContextError, match="scope"):
        strategy.run(step)


def test_optimizer_without_split_update_state_round_trip_and_param_groups(mode: str) -> None:
    """Adafactor is not element-wise: replica 0 applies the whole update; its state dict still
    holds one copy, loads back, and training goes on as plain PyTorch's."""
    data = _data(4)
    make = lambda p: torch.optim.Adafactor(p, lr=0.01)  # noqa: E731
    strategy = sg.CentralStorageStrategy(CPUS3)
    model, optimizer = _build(strategy, make)
    reference, ref_optimizer = _build(None, make)
    _train(strategy, model, optimizer, data[:2])
    _train_plain(reference, ref_optimizer, data[:2])
    fresh_model, fresh_optimizer = _build(strategy, make)
    fresh_model.load_state_dict(model.state_dict())
    fresh_optimizer.load_state_dict(optimizer.state_dict())
    _train(strategy, fresh_model, fresh_optimizer, data[2:])
    _train_plain(reference, ref_optimizer, data[2:])
    for p, q in zip(fresh_model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    with strategy.scope():
        extra = nn.Linear(2, 2)
    fresh_optimizer.add_param_group({"params": extra.parameters()})   # before the first step of a split update
    groups = len(fresh_optimizer.param_groups)
    with pytest.raises(sg.errors.InvalidArgumentError, match="scope"):
        fresh_optimizer.add_param_group({"params": nn.Linear(2, 2).parameters()})
    assert len(fresh_optimizer.param_groups) == groups


def test_parameters_without_gradients_on_some_or_all_replicas(mode: str) -> None:
    """A parameter used only where a replica has data counts as a zero gradient elsewhere; one that
    no replica used keeps no gradient and is left alone, as in plain PyTorch."""
    strategy = sg.CentralStorageStrategy(CPUS3)
    torch.manual_seed(0)
    ref_a, ref_b, ref_unused = nn.Linear(3, 1), nn.Linear(3, 1), nn.Linear(3, 1)
    with strategy.scope():
        a, b, unused = nn.Linear(3, 1), nn.Linear(3, 1), nn.Linear(3, 1)
        optimizer = torch.optim.SGD([*a.parameters(), *b.parameters(), *unused.parameters()], lr=0.5)
    for mine, theirs in ((a, ref_a), (b, ref_b), (unused, ref_unused)):
        mine.load_state_dict(theirs.state_dict())
    x = torch.randn(6, 3)

    def step(xs):
        head = b if sg.get_replica_context().replica_id_in_sync_group == 0 else a  # replica 0 never uses a
        optimizer.zero_grad()
        (head(xs).sum() / 6).backward()
        optimizer.step()

    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
    (ref_b(x[:2]).sum() / 6 + ref_a(x[2:]).sum() / 6).backward()
    with torch.no_grad():
        for p in (*ref_a.parameters(), *ref_b.parameters()):
            p -= 0.5 * p.grad
    for mine, theirs in ((a, ref_a), (b, ref_b), (unused, ref_unused)):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q)
            assert all(torch.equal(c, p) for c in strategy.experimental_local_results(p))
    assert all(p.grad is None for p in unused.parameters())


def test_in_place_writes_to_a_copy_inside_run_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stratagem.placement.data_axis.central._same_memory", lambda device, home: False)
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = nn.Linear(3, 1)

    def manual_sgd():
        layer(torch.ones(2, 3)).sum().backward()
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.1 * p.grad
    with pytest.raises(sg.errors.ContextError, match="lost"):
        strategy.run(manual_sgd)
    with torch.no_grad():   # outside run: written to the parameters, then to every copy
        layer.weight.fill_(2.0)
    seen = strategy.run(lambda: layer.weight.detach().clone())
    assert [t.tolist() for t in strategy.experimental_local_results(seen)] == [[[2.0] * 3]] * 2

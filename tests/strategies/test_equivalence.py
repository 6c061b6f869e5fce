"""The equivalence oracle: every synchronous strategy gives, after every
step, the same parameters as plain single-device PyTorch, within float32 rounding.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem._record import record
from stratagem.placement.data_axis.sharded_update import ShardedUpdate

pytestmark = pytest.mark.timeout(120)

RTOL, ATOL = 2e-5, 2e-6


class BufferedNet(nn.Module):
    """An MLP with a constant buffer in its computation and a buffer updated by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("examples_seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.examples_seen += x.shape[0]
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def _data(batch_sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 4, (b,), generator=g)) for b in batch_sizes]


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def _check_equivalent(strategy: sg.Strategy, optimizer_kind: str, batch_sizes: list[int],
                      scheduler: bool = False) -> None:
    torch.manual_seed(0)
    reference = BufferedNet()
    ref_opt = _optimizer(optimizer_kind, reference.parameters())
    with strategy.scope():
        model = BufferedNet()
        optimizer = _optimizer(optimizer_kind, model.parameters())
    model.load_state_dict(reference.state_dict())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5) if scheduler else None
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if scheduler else None

    data = _data(batch_sizes)

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for (x, y), batch in zip(data, strategy.experimental_distribute_dataset(data)):
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        if scheduler:
            sched.step()
            ref_sched.step()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}: {m}")
            copies = strategy.experimental_local_results(p)
            assert len(copies) == strategy.num_replicas_in_sync
            for copy in copies[1:]:  # every replica holds exactly the same parameters
                assert torch.equal(copy.detach().cpu(), copies[0].detach().cpu()), name
    # optimizer state is one logical copy, equal to the reference's
    for state, ref_state in zip(optimizer.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        for key in ref_state:
            torch.testing.assert_close(torch.as_tensor(state[key]).cpu(), torch.as_tensor(ref_state[key]),
                                       rtol=RTOL, atol=ATOL)
    # the constant buffer is untouched; the updated one reads as the mean over replicas
    torch.testing.assert_close(model.scale.cpu(), reference.scale)
    expected_seen = sum(batch_sizes) / strategy.num_replicas_in_sync
    assert model.examples_seen.item() == pytest.approx(expected_seen)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_mirrored_matches_single_device(replicas: int, optimizer_kind: str) -> None:
    strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    # 12 divides over 1-4 replicas; 7 is uneven; 2 leaves replicas 3 and 4 empty-handed
    _check_equivalent(strategy, optimizer_kind, [12, 12, 7, 12, 2])


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_central_storage_matches_single_device(replicas: int, optimizer_kind: str) -> None:
    strategy = sg.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    _check_equivalent(strategy, optimizer_kind, [12, 12, 7, 12, 2])


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_central_storage_with_copies_matches_single_device(replicas: int, optimizer_kind: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The path GPUs take: every replica computes with a copy of its own (here on the CPU),
    gradients are summed into the parameters' own, copies are refreshed after the update."""
    monkeypatch.setattr("stratagem.placement.data_axis.central._same_memory", lambda device, home: False)
    strategy = sg.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    _check_equivalent(strategy, optimizer_kind, [12, 12, 7, 12, 2])
    _check_equivalent(strategy, optimizer_kind, [9, 3], scheduler=True)


@pytest.mark.parametrize("cross_device_ops", [sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice(),
                                              sg.ReductionToOneDevice(reduce_to_device="cpu:1"),
                                              sg.RingAllReduce(), sg.CrossDeviceOps()],
                         ids=["hierarchical", "one_device", "one_device_cpu1", "ring", "plugin"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_each_cross_device_op(cross_device_ops: sg.CrossDeviceOps, optimizer_kind: str) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=cross_device_ops)
    _check_equivalent(strategy, optimizer_kind, [9, 9, 5, 1])


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_one_device_matches_single_device(optimizer_kind: str) -> None:
    _check_equivalent(sg.OneDeviceStrategy("cpu"), optimizer_kind, [8, 8, 3])


def test_default_strategy_matches_single_device() -> None:
    _check_equivalent(sg.get_strategy(), "adam", [8, 3])


def test_scheduler_on_scoped_optimizer() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    _check_equivalent(strategy, "sgd", [8, 8, 8, 8, 8], scheduler=True)


def test_parameter_without_gradient_on_some_replicas() -> None:
    """A parameter used only where a replica has data counts as a zero gradient elsewhere."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    torch.manual_seed(0)
    ref_a, ref_b = nn.Linear(3, 1), nn.Linear(3, 1)
    with strategy.scope():
        a, b = nn.Linear(3, 1), nn.Linear(3, 1)
        optimizer = torch.optim.SGD(itertools.chain(a.parameters(), b.parameters()), lr=0.5)
    a.load_state_dict(ref_a.state_dict())
    b.load_state_dict(ref_b.state_dict())
    x = torch.randn(6, 3)

    def step(xs):
        ctx = sg.get_replica_context()
        head = b if ctx.replica_id_in_sync_group == 0 else a  # replica 0 never touches `a`
        loss = head(xs).sum() / 6
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    strategy.run(step, args=(batch,))
    ref_loss = ref_b(x[:2]).sum() / 6 + ref_a(x[2:]).sum() / 6
    ref_loss.backward()
    with torch.no_grad():
        for p in itertools.chain(ref_a.parameters(), ref_b.parameters()):
            p -= 0.5 * p.grad
    for p, q in zip(itertools.chain(a.parameters(), b.parameters()),
                    itertools.chain(ref_a.parameters(), ref_b.parameters())):
        torch.testing.assert_close(p.detach(), q.detach())
        c = strategy.experimental_local_results(p)
        assert all(torch.equal(c[0], other) for other in c[1:])


def test_writes_outside_run_reach_every_replica() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(3.0)
    outputs = strategy.run(lambda: model.weight.sum().detach())
    assert [t.item() for t in strategy.experimental_local_results(outputs)] == [12.0, 12.0]
    model.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    outputs = strategy.run(lambda: model(torch.ones(1, 2)).detach())
    for out in strategy.experimental_local_results(outputs):
        assert out.tolist() == [[2.0, 2.0]]


def test_batchnorm_statistics_read_as_mean_over_replicas() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        bn = nn.BatchNorm1d(3, momentum=1.0)  # running stats = last batch's stats
    x = torch.cat([torch.zeros(4, 3), torch.ones(4, 3) * 2])
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    strategy.run(bn, args=(batch,))
    # replica 0 saw zeros (mean 0), replica 1 saw twos (mean 2): the logical value is 1
    torch.testing.assert_close(bn.running_mean, torch.ones(3))
    assert "running_mean" in bn.state_dict()
    copies = strategy.experimental_local_results(bn.running_mean)
    assert all(torch.equal(c, torch.ones(3)) for c in copies)


def test_state_dict_is_one_logical_copy_and_loads_into_plain_model() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = BufferedNet()
    plain = BufferedNet()
    plain.load_state_dict(model.state_dict())
    assert set(model.state_dict()) == set(plain.state_dict())
    assert len(list(model.parameters())) == len(list(plain.parameters()))


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_optimizer_state_dict_round_trip_resumes_identically(optimizer_kind: str) -> None:
    """Saving mid-training and loading into a fresh model and optimizer continues identically."""
    data = _data([8, 8, 8, 8])

    def train(strategy, model, optimizer, batches):
        def step(batch):
            x, y = batch
            loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(batch,))

    torch.manual_seed(0)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = BufferedNet()
        optimizer = _optimizer(optimizer_kind, model.parameters())
    train(strategy, model, optimizer, data[:2])
    assert isinstance(record(optimizer).sharded, ShardedUpdate)  # one update split between the replica threads
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(strategy, model, optimizer, data[2:])

    other = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope():
        resumed = BufferedNet()
        resumed_optimizer = _optimizer(optimizer_kind, resumed.parameters())
    resumed.load_state_dict(saved_model)
    resumed_optimizer.load_state_dict(saved_optimizer)
    train(other, resumed, resumed_optimizer, data[2:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    plain = _optimizer(optimizer_kind, BufferedNet().parameters())
    plain.load_state_dict(saved_optimizer)  # the layout is plain PyTorch's


def test_first_step_builds_one_shared_update_under_thread_races() -> None:
    """Replica threads reach their first optimizer.step together; they must share one update."""
    for _ in range(10):
        _check_equivalent(sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]), "adam", [8, 8, 5])


@pytest.mark.parametrize("num_packs", [2, 5])
def test_hierarchical_copy_with_several_packs(num_packs: int) -> None:
    """num_packs cuts the flattened gradients into packs, each split between the replicas:
    the work is shared differently, the sums are the same."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"],
                                   cross_device_ops=sg.HierarchicalCopyAllReduce(num_packs=num_packs))
    _check_equivalent(strategy, "adam", [9, 9, 5, 1])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_packs_must_be_a_positive_integer(bad) -> None:
    for op in (sg.HierarchicalCopyAllReduce, sg.NcclAllReduce):
        with pytest.raises(sg.errors.InvalidArgumentError, match="num_packs"):
            op(num_packs=bad)


def test_logical_cpu_replicas_share_parameter_memory_and_refuse_in_place_writes() -> None:
    """On logical CPU devices the replicas' parameters are one memory (the update lands once);
    a replica function that writes a parameter in place is refused instead of applying its
    write once per replica."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 1)
    first, second = strategy.experimental_local_results(model.weight)
    assert first is not second and first.data_ptr() == second.data_ptr()
    buffers = strategy.experimental_local_results  # buffers keep one copy per replica
    with strategy.scope():
        norm = nn.BatchNorm1d(3)
    means = buffers(norm.running_mean)
    assert means[0].data_ptr() != means[1].data_ptr()

    def manual_sgd(x):
        model(x).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    batch = next(iter(strategy.experimental_distribute_dataset([torch.ones(4, 3)])))
    with pytest.raises(sg.errors.ContextError, match="in place"):
        strategy.run(manual_sgd, args=(batch,))
    # writes outside run reach every replica (one memory), new memory included
    with torch.no_grad():
        model.weight.fill_(2.0)
    model.weight.data = torch.full((1, 3), 3.0)
    seen = strategy.run(lambda: model.weight.detach().clone())
    assert [t.tolist() for t in strategy.experimental_local_results(seen)] == [[[3.0] * 3]] * 2


def test_writes_to_a_replica_copy_outside_run_are_not_taken_for_writes_inside() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 1)
    with torch.no_grad():
        strategy.experimental_local_results(model.weight)[1].mul_(2.0)  # one memory: every replica sees it
    strategy.run(lambda: model(torch.ones(1, 3)))
    strategy.run(lambda: model(torch.ones(1, 3)))

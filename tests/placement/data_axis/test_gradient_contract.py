"""The gradient contract in one process: when ``backward()`` returns inside ``run``, every
replica's ``.grad`` is plain PyTorch's for the whole global batch.

nanoGPT's loop (``nanogpt_loop.py``: AdamW groups, the learning rate in ``param_groups``, two
micro-batches accumulated, ``clip_grad_norm_`` that clips, tied embeddings) under every
synchronous strategy and every way of accumulating equals plain PyTorch step for step in float64:
the gradients after backward, the norm clip returns, the parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

from . import nanogpt_loop

pytestmark = pytest.mark.timeout(120)

STRATEGIES = {
    "default": lambda: sg.get_strategy(),
    "one_device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored_2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "mirrored_one_device_op": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"],
                                                          cross_device_ops=sg.ReductionToOneDevice()),
    "central_storage_2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "multi_worker_one_process_2": lambda: sg.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]),
}


@pytest.fixture(scope="module")
def plain():
    return {recompute: nanogpt_loop.train(None, recompute=recompute) for recompute in (False, True)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def assert_same_history(history: dict, reference: dict) -> None:
    assert max(n[0] for n in reference["norms"]) > 0.5, "the clip must really clip"
    for step in range(len(reference["params"])):
        for norm in history["norms"][step]:
            assert abs(norm - reference["norms"][step][0]) <= 1e-12 * reference["norms"][step][0], step
        for replica in history["grads"][step]:
            for g, ref in zip(replica, reference["grads"][step][0]):
                assert _relative(g, ref) < 1e-12, step
        for p, ref in zip(history["params"][step], reference["params"][step]):
            assert _relative(p, ref) < 1e-11, step


@pytest.mark.parametrize("skip", ["no_sync", "attribute", "none"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_nanogpt_loop_equals_plain_pytorch(plain, name: str, skip: str) -> None:
    assert_same_history(nanogpt_loop.train(STRATEGIES[name](), skip=skip), plain[False])


@pytest.mark.parametrize("name", ["mirrored_2", "central_storage_2"])
def test_with_activation_checkpointing(plain, name: str) -> None:
    assert_same_history(nanogpt_loop.train(STRATEGIES[name](), recompute=True), plain[True])


def _count_exchanges(strategy: sg.Strategy) -> list[int]:
    calls = [0]
    collective = strategy.collective
    original = collective.sum_gradients

    def counted(local_id, params):
        if local_id == 0:
            calls[0] += 1
        return original(local_id, params)
    collective.sum_gradients = counted
    return calls


@pytest.mark.parametrize("skip", ["no_sync", "attribute"])
def test_accumulation_costs_one_exchange_per_step(skip: str) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    calls = _count_exchanges(strategy)
    nanogpt_loop.train(strategy, steps=2, micro=4, skip=skip)
    assert calls[0] == 2


def test_without_skipping_every_backward_exchanges() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    calls = _count_exchanges(strategy)
    nanogpt_loop.train(strategy, steps=2, micro=3, skip="none")
    assert calls[0] == 6


def _linear(strategy=None, seed: int = 0):
    torch.manual_seed(seed)
    if strategy is None:
        return nn.Linear(3, 2).double()
    with strategy.scope():
        return nn.Linear(3, 2).double()


def _halves(strategy: sg.Strategy, x: torch.Tensor):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: x.chunk(ctx.num_replicas_in_sync)[ctx.replica_id_in_sync_group])


def test_inside_no_sync_grad_is_the_replicas_own_part_then_the_sum() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _linear(strategy)
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    seen = {}

    def step(xs):
        r = sg.get_replica_context().replica_id_in_sync_group
        with strategy.no_sync():
            model(xs).sum().backward()
        seen[r, "local"] = model.weight.grad.clone()
        model(xs).sum().backward()
        seen[r, "synced"] = model.weight.grad.clone()
    strategy.run(step, args=(_halves(strategy, x),))
    for r, part in enumerate(x.chunk(2)):
        torch.testing.assert_close(seen[r, "local"], part.sum(0).expand(2, 3))
        torch.testing.assert_close(seen[r, "synced"], 2 * x.sum(0).expand(2, 3))


def test_zero_grad_between_no_sync_and_the_synced_backward_forgets_the_local_part() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _linear(strategy)
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 3, dtype=torch.float64)

    def step(xs):
        model(xs).sum().backward()              # synced: global part
        with strategy.no_sync():
            model(xs).sum().backward()          # local part
        optimizer.zero_grad(set_to_none=False)  # forgets both
        model(xs).sum().backward()
        return model.weight.grad.clone()
    grads = strategy.run(step, args=(_halves(strategy, x),))
    for g in grads.values:
        torch.testing.assert_close(g, x.sum(0).expand(2, 3))


def test_a_parameter_one_replica_does_not_use_gets_the_others_gradient() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        a, b = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()

    def step(xs):
        r = sg.get_replica_context().replica_id_in_sync_group
        loss = a(xs).sum() + (b(xs).sum() if r == 1 else 0.0)
        loss.backward()
        return b.weight.grad.clone(), a.weight.grad.clone()
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    gb, ga = strategy.run(step, args=(_halves(strategy, x),))
    for g in gb.values:
        torch.testing.assert_close(g, x[2:].sum(0, keepdim=True))
    for g in ga.values:
        torch.testing.assert_close(g, x.sum(0, keepdim=True))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_module_placed_under_no_grad_then_trains_with_the_whole_gradient(mode) -> None:
    # TensorFlow's save-and-load tutorial: a model loaded in a scope, called first through
    # strategy.run for inference (placing it then raised AttributeError in the gradient hooks)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    with strategy.scope():
        model = nn.Linear(3, 1, bias=False).double()
        with mode():
            strategy.run(model, args=(_halves(strategy, x),))

    def step(xs):
        model(xs).sum().backward()
        return model.weight.grad.clone()
    for g in strategy.run(step, args=(_halves(strategy, x),)).values:
        torch.testing.assert_close(g, x.sum(0, keepdim=True))


def test_autograd_grad_inside_run_leaves_grad_alone() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _linear(strategy)
    x = torch.ones(4, 3, dtype=torch.float64)

    def step(xs):
        model(xs).sum().backward()
        before = model.weight.grad.clone()
        (g,) = torch.autograd.grad(model(xs).pow(2).sum(), [model.weight])
        return before, model.weight.grad.clone(), g
    before, after, own = strategy.run(step, args=(_halves(strategy, x),))
    for b, a, g in zip(before.values, after.values, own.values):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(b, x.sum(0).expand(2, 3))
        assert g.shape == (2, 3)


@pytest.mark.parametrize("scoped_optimizer", [True, False])
def test_backward_outside_run_through_the_reduced_loss_trains_on_every_replica(scoped_optimizer: bool) -> None:
    """``loss = strategy.reduce("sum", strategy.run(forward)); loss.backward(); opt.step()`` outside
    ``run``: one backward through every replica's graph; its end sums them (with an optimizer made
    outside the scope too: it steps the primaries, which now hold the sum)."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, reference = _linear(strategy), _linear()
    if scoped_optimizer:
        with strategy.scope():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)
        xs, ys = _halves(strategy, x), _halves(strategy, y)
        per_replica = strategy.run(lambda a, b: F.mse_loss(model(a), b, reduction="sum") / 8, args=(xs, ys))
        optimizer.zero_grad()
        strategy.reduce("sum", per_replica, axis=None).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        (F.mse_loss(reference(x), y, reduction="sum") / 8).backward()
        ref_optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_tied_weights_have_one_copy_per_replica() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nanogpt_loop.build()

    def count(_):
        return torch.tensor([float(len(list(model.parameters()))), float(model.head.weight is model.wte.weight)])
    result = strategy.run(count, args=(None,))
    assert [c.tolist() for c in result.values] == [[len(list(model.parameters())), 1.0]] * 2


def test_a_parameter_unfrozen_after_placement_is_summed_on_every_replica() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _linear(strategy)
    model.bias.requires_grad_(False)
    x = torch.arange(12, dtype=torch.float64).view(4, 3)

    def step(xs):
        model.zero_grad()
        model(xs).sum().backward()
        return model.weight.grad.clone(), (model.bias.grad is None)
    strategy.run(step, args=(_halves(strategy, x),))
    model.bias.requires_grad_(True)   # fine-tuning: unfrozen outside run
    weight, _ = strategy.run(step, args=(_halves(strategy, x),))

    def bias_grad(xs):
        model.zero_grad()
        model(xs).sum().backward()
        return model.bias.grad.clone()
    for g in strategy.run(bias_grad, args=(_halves(strategy, x),)).values:
        torch.testing.assert_close(g, torch.full((2,), 4.0, dtype=torch.float64))
    for g in weight.values:
        torch.testing.assert_close(g, x.sum(0).expand(2, 3))


def test_two_backward_passes_outside_run_accumulate_like_plain_pytorch() -> None:
    """The second pass reaches only one of two modules: the other keeps its gradient, not twice it."""
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        a, b = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    xs = _halves(strategy, x)
    both = strategy.run(lambda v: a(v).sum() + b(v).sum(), args=(xs,))
    strategy.reduce("sum", both, axis=None).backward()
    only_a = strategy.run(lambda v: a(v).sum(), args=(xs,))
    strategy.reduce("sum", only_a, axis=None).backward()
    torch.testing.assert_close(a.weight.grad, 2 * x.sum(0, keepdim=True))
    torch.testing.assert_close(b.weight.grad, x.sum(0, keepdim=True))


def test_a_replica_failing_before_its_backward_stops_the_others_waiting_at_the_end_of_theirs() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _linear(strategy)
    x = torch.ones(4, 3, dtype=torch.float64)

    def step(xs):
        if sg.get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("bad batch on replica 1")
        model(xs).sum().backward()   # waits for replica 1 in the gradient sum: must not hang
    with pytest.raises(ValueError, match="bad batch on replica 1"):
        strategy.run(step, args=(_halves(strategy, x),))
    model.zero_grad()
    grads = strategy.run(lambda xs: (model(xs).sum().backward(), model.weight.grad.clone())[1],
                         args=(_halves(strategy, x),))
    for g in grads.values:   # the next run works and sums as usual
        torch.testing.assert_close(g, x.sum(0).expand(2, 3))

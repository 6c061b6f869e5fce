"""The loss-scaling trap: a per-replica mean loss under gradients summed over replicas.

``F.cross_entropy(model(x), y)`` inside ``strategy.run`` is a mean over the replica's own
examples; the replicas' gradients are summed, so it would train with N times the gradient.
``backward()`` refuses it (or, where a correct loss could look alike, warns once per
strategy); every correctly scaled shape passes silently, and one replica is never checked.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.nn import LossScalingWarning
from stratagem.nn import loss_check

pytestmark = pytest.mark.timeout(120)

ORIGINAL_BACKWARD = torch.autograd.backward


def _setup(strategy: sg.Strategy, rows: int = 8) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 3).double()
        _SCALERS[strategy] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)   # scalers live in scope
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=g))
    return model, batch, next(iter(strategy.experimental_distribute_dataset([batch])))


def _backward(strategy: sg.Strategy, model: nn.Module, batch: Any, loss_fn: Callable) -> list[warnings.WarningMessage]:
    """``loss_fn(model, x, y).backward()`` on every replica; the LossScalingWarnings it gave."""
    def step(b):
        model.zero_grad()
        loss_fn(model, *b).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(step, args=(batch,))
    return [w for w in caught if issubclass(w.category, LossScalingWarning)]


def _mean_ce(model, x, y):
    return F.cross_entropy(model(x), y)


def _average(model, x, y):
    return sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))


TRAPS = {
    "cross_entropy": _mean_ce,
    "mse_loss": lambda m, x, y: F.mse_loss(m(x), F.one_hot(y, 3).double()),
    "tensor_mean": lambda m, x, y: (m(x) - F.one_hot(y, 3)).pow(2).sum(1).mean(),
    "sum_over_local_rows": lambda m, x, y: F.cross_entropy(m(x), y, reduction="none").sum() / x.shape[0],
    "plus_weight_decay": lambda m, x, y: F.cross_entropy(m(x), y) + 1e-4 * m.weight.pow(2).sum(),
    "two_means": lambda m, x, y: F.cross_entropy(m(x), y) + F.mse_loss(m(x), F.one_hot(y, 3).double()),
    "cast_and_viewed": lambda m, x, y: F.cross_entropy(m(x), y).float().view(1),
    "grad_scaler": lambda m, x, y: _scaled(F.cross_entropy(m(x), y)),
}
_SCALERS: dict = {}


def _scaled(loss: torch.Tensor) -> torch.Tensor:
    return _SCALERS[sg.get_strategy()].scale(loss)


GOOD = {
    "compute_average_loss": _average,
    "sum_over_global_batch": lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum") / 8,
    "sum_times_inverse": lambda m, x, y: F.cross_entropy(m(x), y, reduction="none").sum() * (1 / 8),
    "average_plus_regularization": lambda m, x, y: _average(m, x, y) + sg.nn.scale_regularization_loss(
        1e-3 * m.weight.pow(2).mean()),
    "accumulation": lambda m, x, y: _average(m, x, y) / 4,
    "grad_scaler": lambda m, x, y: _scaled(_average(m, x, y)),
    "mean_over_replicas": lambda m, x, y: sg.nn.mean_over_replicas(F.cross_entropy(m(x), y)),
    "mean_over_num_replicas": lambda m, x, y: F.cross_entropy(m(x), y) / sg.get_replica_context().num_replicas_in_sync,
    "mean_times_rows_over_global": lambda m, x, y: F.cross_entropy(m(x), y) * x.shape[0] / 8,
    "skip_check": lambda m, x, y: sg.nn.skip_loss_scaling_check(F.cross_entropy(m(x), y)),
    "plain_sum": lambda m, x, y: m(x).sum(),
    "custom_function": lambda m, x, y: _Double.apply(F.cross_entropy(m(x), y)),
}


class _Double(torch.autograd.Function):
    """A custom autograd function: the check cannot see through it, so it lets it pass."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


@pytest.mark.parametrize("name", list(TRAPS))
def test_a_per_replica_mean_is_refused_with_the_fix(name: str) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    with pytest.raises(InvalidArgumentError) as info:
        _backward(strategy, model, batch, TRAPS[name])
    message = str(info.value)
    assert "per-replica mean loss" in message and "this replica's 4 rows" in message
    assert "gradients of the 2 replicas in sync are summed" in message and "2x the single-device" in message
    assert 'sg.nn.compute_average_loss(F.cross_entropy(logits, labels, reduction="none"))' in message
    assert "divide a sum by the global batch size" in message and "sg.nn.skip_loss_scaling_check" in message
    assert all(p.grad is None for p in model.parameters())   # refused before backward ran
    assert torch.autograd.backward is ORIGINAL_BACKWARD       # the wrapper left with the run


def test_the_message_names_what_the_loss_is() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    for loss_fn, shown in [(TRAPS["cross_entropy"], "F.cross_entropy(...) or F.nll_loss(...) with reduction='mean'"),
                           (TRAPS["mse_loss"], "F.mse_loss(...) with reduction='mean'"),
                           (TRAPS["tensor_mean"], "a .mean() over this replica's 4 rows"),
                           (TRAPS["sum_over_local_rows"], "a sum divided by this replica's 4 rows")]:
        with pytest.raises(InvalidArgumentError, match=shown.replace("(", r"\(").replace(")", r"\)")
                           .replace(".", r"\.")):
            _backward(strategy, model, batch, loss_fn)


@pytest.mark.parametrize("name", list(GOOD))
def test_scaled_losses_pass_silently(name: str) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    assert _backward(strategy, model, batch, GOOD[name]) == []
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("loss_fn, why", [
    (lambda m, x, y: F.cross_entropy(m(x), y) / 4, "times 0.25 (neither 1/num_replicas_in_sync"),
    (lambda m, x, y: _average(m, x, y) + 1e-3 * m.weight.pow(2).mean(), "added to a term that is scaled"),
    (lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1), "times 0.9"),
], ids=["mean_over_accumulation", "unscaled_regularization", "label_smoothing"])
def test_a_loss_that_could_be_right_warns_once_per_strategy(loss_fn, why: str) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    first = _backward(strategy, model, batch, loss_fn)
    assert len(first) == 1, [str(w.message) for w in first]
    message = str(first[0].message)
    assert why in message and "looks like a per-replica mean" in message and "compute_average_loss" in message
    assert first[0].filename == __file__   # shown at the user's line
    assert _backward(strategy, model, batch, loss_fn) == []   # once per strategy
    other = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(other)
    assert len(_backward(other, model, batch, loss_fn)) == 1


@pytest.mark.parametrize("make", [lambda: sg.get_strategy(), lambda: sg.OneDeviceStrategy("cpu"),
                                  lambda: sg.MirroredStrategy(["cpu:0"]),
                                  lambda: sg.CentralStorageStrategy(["cpu:0"])],
                         ids=["default", "one_device", "mirrored1", "central1"])
def test_one_replica_is_never_checked(make) -> None:
    strategy = make()
    model, _, batch = _setup(strategy)
    for loss_fn in (TRAPS["cross_entropy"], lambda m, x, y: F.cross_entropy(m(x), y) / 4):
        assert _backward(strategy, model, batch, loss_fn) == []


def test_central_storage_and_three_replicas_are_checked() -> None:
    for strategy, shown in [(sg.CentralStorageStrategy(["cpu:0", "cpu:1"]), "2 replicas"),
                            (sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), "3 replicas")]:
        model, _, batch = _setup(strategy, rows=9)
        with pytest.raises(InvalidArgumentError, match=f"{shown} in sync are summed"):
            _backward(strategy, model, batch, _mean_ce)
        assert _backward(strategy, model, batch, lambda m, x, y: _average(m, x, y)) == []


def test_the_fixes_give_the_single_device_gradient() -> None:
    # the oracle: .grad after backward() is plain PyTorch's on the whole batch; DDP's averaging
    # matches it for an even split, compute_average_loss and rows/global batch also for 7 rows
    for rows, fixes in [(8, [_average, GOOD["mean_over_replicas"], GOOD["mean_over_num_replicas"]]),
                        (7, [_average, lambda m, x, y: F.cross_entropy(m(x), y) * x.shape[0] / 7])]:
        for loss_fn in fixes:
            strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
            model, (x, y), batch = _setup(strategy, rows)
            reference = nn.Linear(4, 3).double()
            reference.load_state_dict(model.state_dict())
            F.cross_entropy(reference(x), y).backward()
            grads = strategy.run(lambda b: (loss_fn(model, *b).backward(),
                                            [p.grad.clone() for p in model.parameters()])[1], args=(batch,))
            for per_replica, p in zip(grads, reference.parameters()):
                for g in strategy.experimental_local_results(per_replica):
                    torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)


def test_fit_with_keras_losses_passes() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    for loss in (sg.losses.SparseCategoricalCrossentropy(from_logits=True), "mse", F.cross_entropy,
                 lambda y_true, y_pred: F.cross_entropy(y_pred, y_true)):   # a scalar mean, Keras's way
        with strategy.scope():
            model = sg.Model(nn.Linear(4, 3))
            model.compile(optimizer="sgd", loss=loss)
        target = F.one_hot(y, 3).float() if loss == "mse" else y
        with warnings.catch_warnings():
            warnings.simplefilter("error", LossScalingWarning)
            model.fit(x, target, batch_size=8, epochs=1, verbose=0)


def test_what_is_not_a_training_backward_is_not_checked() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)

    def step(b):
        x = b[0].clone().requires_grad_()
        F.cross_entropy(model(x), b[1]).backward(inputs=[x])            # an input's gradient
        torch.autograd.grad(F.cross_entropy(model(x), b[1]), [x])         # never through backward()
        model(x).backward(torch.ones(x.shape[0], 3))                     # an explicit gradient
        return x.grad is not None
    assert all(strategy.experimental_local_results(strategy.run(step, args=(batch,))))
    with strategy.scope():   # outside run: the cross-replica backward is not a replica's
        F.cross_entropy(model(torch.ones(2, 4, dtype=torch.float64)), torch.zeros(2).long()).backward()


def test_the_walk_is_bounded() -> None:
    # a loss of many scaled terms: the check stops after MAX_NODES nodes and lets it pass
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    visited = []
    original = loss_check._terms

    def counting(roots):
        terms = original(roots)
        visited.append(len(terms))
        return terms
    loss_check._terms = counting
    try:
        long = lambda m, x, y: sum(_average(m, x, y) * (k + 1) for k in range(3 * loss_check.MAX_NODES))
        assert _backward(strategy, model, batch, long) == []
    finally:
        loss_check._terms = original
    assert visited and max(visited) <= loss_check.MAX_NODES


def test_the_helpers_refuse_what_is_not_a_loss() -> None:
    with pytest.raises(InvalidArgumentError, match="needs the loss tensor"):
        sg.nn.skip_loss_scaling_check(1.0)
    assert sg.nn.mean_over_replicas(torch.tensor(3.0)).item() == 3.0   # one replica: unchanged



def test_losses_stacked_together_are_terms() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model, _, batch = _setup(strategy)
    scaled = lambda m, x, y: torch.stack([_average(m, x, y), _average(m, x * 2, y)]).mean()
    assert _backward(strategy, model, batch, scaled) == []
    with pytest.raises(InvalidArgumentError, match="per-replica mean loss"):
        _backward(strategy, model, batch, lambda m, x, y: torch.stack([_mean_ce(m, x, y), _mean_ce(m, x, y)]).sum())

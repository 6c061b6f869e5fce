"""``LearningRateScheduler``: set the optimizer's learning rate at the start of every epoch.

The rate is set on ``model.optimizer``, the user's optimizer, under every strategy: a
mirrored strategy copies its hyperparameters to every replica's twin before each step,
and the parameter-server strategy sends changed hyperparameters to the servers.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch

from stratagem.callbacks.base import Callback
from stratagem.callbacks.monitor import is_chief
from stratagem.errors import InvalidArgumentError

__all__ = ["LearningRateScheduler", "learning_rate"]


def learning_rate(model: Any) -> float | None:
    """The learning rate of the model's optimizer (its first parameter group), or None."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or "lr" not in optimizer.param_groups[0]:
        return None
    return float(optimizer.param_groups[0]["lr"])


class LearningRateScheduler(Callback):
    """At the start of every epoch, set each parameter group's ``lr`` to ``schedule(epoch, lr)``.

    ``schedule`` gets the epoch (from 0) and the group's current rate and returns the new
    one (a one-argument ``schedule(epoch)`` works too). The rate is also written to the
    epoch's ``logs`` as ``"lr"``. ``verbose=1`` prints each change (on the chief).

    Example::

        import torch, stratagem as sg
        from types import SimpleNamespace
        module = torch.nn.Linear(2, 1)
        model = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
                                strategy=sg.get_strategy())
        halve = sg.callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else lr / 2)
        halve.set_model(model)
        for epoch in range(3):
            halve.on_epoch_begin(epoch)
        assert model.optimizer.param_groups[0]["lr"] == 0.25
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise InvalidArgumentError(f"LearningRateScheduler: schedule must be a function (epoch, lr) -> lr, "
                                       f"got {type(schedule).__name__}")
        self.schedule = schedule
        self.verbose = verbose
        self._takes_lr = _takes_two_arguments(schedule)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"LearningRateScheduler needs model.optimizer (a torch optimizer), got "
                                       f"{type(optimizer).__name__}; compile the model first")
        for index, group in enumerate(optimizer.param_groups):
            if "lr" not in group:
                raise InvalidArgumentError(f"LearningRateScheduler: parameter group {index} of "
                                           f"{type(optimizer).__name__} has no 'lr'")
            old = float(group["lr"])
            new = self.schedule(epoch, old) if self._takes_lr else self.schedule(epoch)
            if isinstance(new, torch.Tensor) and new.numel() == 1:
                new = new.item()
            if isinstance(new, bool) or not isinstance(new, (int, float)) or not math.isfinite(new) or new < 0:
                raise InvalidArgumentError(f"LearningRateScheduler: schedule({epoch}, {old}) returned {new!r}; it "
                                           f"must return a finite number >= 0")
            group["lr"] = float(new)
            if self.verbose and index == 0 and is_chief(self.model):
                print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {float(new)}.",
                      flush=True)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        rate = learning_rate(self.model)
        if logs is not None and rate is not None:
            logs["lr"] = rate


def _takes_two_arguments(schedule: Callable[..., float]) -> bool:
    try:
        parameters = inspect.signature(schedule).parameters.values()
    except (TypeError, ValueError):   # a builtin without a signature: give it both
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)

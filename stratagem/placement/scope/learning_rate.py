"""Keras's ``optimizer.learning_rate`` on torch optimizers.

Keras code reads and sets the rate on the optimizer (``model.optimizer.learning_rate``,
``optimizer.learning_rate.numpy()``, ``optimizer.learning_rate = 1e-4``); a torch optimizer
keeps it per parameter group (``param_groups[i]["lr"]``). :data:`RATE_ATTRIBUTES` are the
attributes that bridge the two, given to every optimizer class a strategy's scope makes
(``MirroredAdam``, :func:`stratagem.placement.scope.hooks.distributed_class`) and, through
:func:`with_learning_rate`, to the optimizer an ``sg.Model`` is compiled with.

- Reading gives the rate shared by every parameter group, as a :class:`LearningRate` (a
  ``float`` with Keras's ``numpy()`` and ``assign()``). Groups with different rates have no
  single rate: reading then raises and names ``param_groups``.
- Setting writes every parameter group's ``"lr"`` on the user's optimizer. A strategy's
  copies of it (a mirrored replica's twin, a ZeRO range optimizer, a parameter server's
  optimizer) take their hyperparameters from it before every step, as they do for a
  scheduler's changes.
- ``lr`` is the same (Keras 2's older name).

An optimizer whose class or instance has an attribute of that name already keeps its own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from stratagem._record import record_of
from stratagem.errors import InvalidArgumentError

__all__ = ["LearningRate", "RATE_ATTRIBUTES", "rate_attributes", "with_learning_rate"]


class LearningRate(float):
    """An optimizer's learning rate: a ``float``, with Keras's ``numpy()`` and ``assign(value)``.

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            module = torch.nn.Linear(2, 1)
            optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        print(optimizer.learning_rate.numpy())   # 0.001
        optimizer.learning_rate = 1e-4           # every parameter group, every replica
        assert optimizer.param_groups[0]["lr"] == 1e-4
    """

    _optimizer: Any = None

    def numpy(self) -> np.float64:
        """The rate as a numpy scalar (Keras's variable's ``numpy()``)."""
        return np.float64(self)

    def assign(self, value: Any) -> None:
        """Set the optimizer's rate (Keras's ``optimizer.learning_rate.assign(value)``)."""
        if self._optimizer is None:
            raise InvalidArgumentError("this learning rate was not read from an optimizer; set "
                                       "optimizer.learning_rate = value instead")
        _set_rate(self._optimizer, value)

    def __reduce__(self) -> Any:
        return (float, (float(self),))


def _read_rate(optimizer: torch.optim.Optimizer) -> LearningRate:
    rates = []
    for index, group in enumerate(optimizer.param_groups):
        if "lr" not in group:
            raise InvalidArgumentError(f"parameter group {index} of {type(optimizer).__name__} has no 'lr', so "
                                       f"the optimizer has no learning rate to read")
        value = group["lr"]
        rates.append(float(value.item() if isinstance(value, torch.Tensor) else value))
    if not rates:
        raise InvalidArgumentError(f"{type(optimizer).__name__} has no parameter groups, so no learning rate")
    if any(rate != rates[0] for rate in rates):
        raise InvalidArgumentError(
            f"{type(optimizer).__name__} has parameter groups with different learning rates {rates}, so there "
            f"is no one optimizer.learning_rate; read or set optimizer.param_groups[i]['lr'] instead")
    rate = LearningRate(rates[0])
    rate._optimizer = optimizer
    return rate


def _set_rate(optimizer: torch.optim.Optimizer, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or \
            not math.isfinite(float(value)) or float(value) < 0:
        raise InvalidArgumentError(f"optimizer.learning_rate must be a finite number >= 0, got {value!r} "
                                   f"(a learning-rate schedule belongs in a callback such as "
                                   f"sg.callbacks.LearningRateScheduler)")
    for group in optimizer.param_groups:
        current = group.get("lr")
        if isinstance(current, torch.Tensor):   # a tensor rate (capturable / fused) stays a tensor
            current.fill_(float(value))
        else:
            group["lr"] = float(value)


class _Rate:
    """The ``learning_rate`` / ``lr`` descriptor: the rate of every group; an instance's own
    attribute of that name (a third-party optimizer's) wins."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        own = optimizer.__dict__.get(self.name, _MISSING)
        return _read_rate(optimizer) if own is _MISSING else own

    def __set__(self, optimizer: Any, value: Any) -> None:
        if self.name in optimizer.__dict__ or "param_groups" not in optimizer.__dict__:
            optimizer.__dict__[self.name] = value   # the optimizer's own attribute (set in its __init__)
            return
        _set_rate(optimizer, value)


_MISSING = object()
#: the attributes that give an optimizer class Keras's rate
RATE_ATTRIBUTES = ("learning_rate", "lr")


def rate_attributes(base: type) -> dict[str, Any]:
    """The rate descriptors for a subclass of ``base``: those ``base`` does not define itself."""
    return {name: _Rate(name) for name in RATE_ATTRIBUTES if not hasattr(base, name)}


_PLAIN: dict[type, type] = {}        # the user's class -> its subclass with the rate
_USERS_CLASS: dict[type, type] = {}  # the reverse


def with_learning_rate(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give ``optimizer`` Keras's ``learning_rate`` (in place; returned): an optimizer made by a
    strategy's scope has it already; another gets a subclass of its own class of the same name
    that adds only the rate, and that pickles and deep-copies as its own class."""
    cls = type(optimizer)
    if all(hasattr(cls, name) for name in RATE_ATTRIBUTES) or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    keras_cls = _PLAIN.get(cls)
    if keras_cls is None:
        def __reduce_ex__(self: Any, protocol: int) -> Any:
            return (_as_plain, (cls, self.__getstate__()))

        keras_cls = type(cls.__name__, (cls,), {
            **rate_attributes(cls), "__reduce_ex__": __reduce_ex__,
            "__module__": cls.__module__, "__doc__": cls.__doc__})
        keras_cls.__qualname__ = cls.__qualname__
        _PLAIN[cls] = keras_cls
        _USERS_CLASS[keras_cls] = cls
    optimizer.__class__ = keras_cls
    return optimizer


def _as_plain(cls: type, state: dict) -> torch.optim.Optimizer:
    """An optimizer of the user's own class ``cls`` with ``state`` (how the rate's subclass pickles)."""
    optimizer = cls.__new__(cls)
    optimizer.__setstate__(state)
    return optimizer


def plain_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer class the user chose (under a scope's or the rate's subclass)."""
    found = record_of(optimizer)   # a scope's subclass: the record holds the user's class
    if found is not None and found.base is not None:
        return found.base
    cls = type(optimizer)
    return _USERS_CLASS.get(cls, cls)

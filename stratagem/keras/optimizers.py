"""Optimizers by name for ``Model.compile``: Keras's names and learning rates, torch's classes."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from stratagem.errors import InvalidArgumentError

__all__ = ["get"]

# Keras's default learning rates; every other argument is torch's default (RMSprop: Keras's rho=0.9)
_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.001}),
    "adamw": (torch.optim.AdamW, {"lr": 0.001}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.001, "alpha": 0.9}),
}


def get(optimizer: Any, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer`` itself if it is a torch optimizer, else the one its name stands for, over
    ``parameters`` (create it in the strategy's scope)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        entry = _OPTIMIZERS.get(optimizer.lower())
        if entry is None:
            raise InvalidArgumentError(f"unknown optimizer {optimizer!r}; use one of "
                                       f"{', '.join(_OPTIMIZERS)}, or a torch.optim optimizer")
        cls, kwargs = entry
        return cls(parameters, **kwargs)
    raise InvalidArgumentError(f"optimizer must be a name ({', '.join(_OPTIMIZERS)}) or a torch.optim "
                               f"optimizer, got {type(optimizer).__name__}")

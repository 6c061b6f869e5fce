"""What callbacks share: a monitored value and its direction; the chief and its decisions.

A callback that decides something -- stop training, save a checkpoint -- must decide the
same on every worker, or the workers part ways (one stops while the others wait in a
collective for it). So the chief (worker 0) decides from its ``logs`` and the decision
travels to every worker over the strategy's process-level collective
(:func:`chief_decides`); in one process that is the identity and costs nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from stratagem import _context
from stratagem.errors import InvalidArgumentError

__all__ = ["Monitor", "chief_decides", "is_chief", "strategy_of"]

#: Names whose larger values are better, for ``mode="auto"`` (as Keras guesses).
_HIGHER_IS_BETTER = ("acc", "accuracy", "auc", "precision", "recall", "f1", "top_k")


def strategy_of(model: Any) -> Any:
    """The strategy a model trains under: ``model.strategy``, else the current one."""
    strategy = getattr(model, "strategy", None)
    return strategy if strategy is not None else _context.get_strategy()


def is_chief(model: Any) -> bool:
    """Whether this process writes files and summaries: worker 0 (the chief)."""
    return strategy_of(model).checkpoint_collective.worker_index == 0


def chief_decides(model: Any, value: Any) -> Any:
    """The chief's picklable ``value``, on every worker (every worker must call it)."""
    collective = strategy_of(model).checkpoint_collective
    if collective.num_workers > 1:
        return collective.broadcast_object(value)
    return value


class Monitor:
    """A value read from ``logs`` each epoch, and which way is better.

    ``mode`` is ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` for accuracy-like names,
    else ``"min"``); an improvement must beat the best by more than ``min_delta``.

    Example::

        from stratagem.callbacks.monitor import Monitor
        monitor = Monitor("val_accuracy", "auto", owner="EarlyStopping")
        assert monitor.mode == "max" and monitor.improves(0.9, 0.8)
        assert Monitor("val_loss", "auto", min_delta=0.1, owner="x").improves(0.85, 1.0)
    """

    def __init__(self, monitor: str, mode: str, *, min_delta: float = 0.0, owner: str):
        if not isinstance(monitor, str) or not monitor:
            raise InvalidArgumentError(f"{owner}: monitor must name a value of logs, like 'val_loss', "
                                       f"got {monitor!r}")
        if mode not in ("auto", "min", "max"):
            raise InvalidArgumentError(f"{owner}: mode must be 'auto', 'min' or 'max', got {mode!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not math.isfinite(min_delta):
            raise InvalidArgumentError(f"{owner}: min_delta must be a finite number, got {min_delta!r}")
        if mode == "auto":
            base = monitor.removeprefix("val_").lower()
            mode = "max" if any(base == name or base.endswith(f"_{name}") or base.startswith(f"{name}_")
                                for name in _HIGHER_IS_BETTER) else "min"
        self.name = monitor
        self.mode = mode
        self.min_delta = abs(float(min_delta))
        self.owner = owner

    @property
    def worst(self) -> float:
        """The starting best: nothing is worse."""
        return math.inf if self.mode == "min" else -math.inf

    def improves(self, current: float, reference: float) -> bool:
        """Whether ``current`` beats ``reference`` by more than ``min_delta``."""
        if self.mode == "min":
            return current + self.min_delta < reference
        return current - self.min_delta > reference

    def read(self, logs: dict | None) -> float | None:
        """The monitored value in ``logs`` as a float; None (with a warning) when it is missing."""
        value = (logs or {}).get(self.name)
        if value is None:
            warnings.warn(f"{self.owner}: logs have no {self.name!r} to monitor (they have "
                          f"{sorted(logs or {})}); nothing is decided this time. Monitor one of those, or "
                          f"pass validation_data to fit for the val_ values", RuntimeWarning, stacklevel=3)
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{self.owner}: logs[{self.name!r}] must be a number, got "
                                       f"{type(value).__name__}") from None

"""``EarlyStopping``: stop training when a monitored value has stopped improving.

In a multi-worker job every worker must stop at the same epoch (a worker that stops
alone leaves the others waiting in a collective). So the chief decides from its ``logs``
whether the epoch improved and whether to stop, and sends the decision to every worker;
every worker then keeps the same best weights and sets ``model.stop_training`` together.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.callbacks.base import Callback
from stratagem.callbacks.monitor import Monitor, chief_decides, is_chief
from stratagem.errors import InvalidArgumentError

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Set ``model.stop_training`` once ``monitor`` has not improved for ``patience`` epochs.

    An improvement beats the best value so far by more than ``min_delta`` (``mode``:
    ``"min"``, ``"max"``, or ``"auto"`` from the name). With ``baseline``, training also
    stops when the value never beats the baseline within ``patience`` epochs. Epochs before
    ``start_from_epoch`` are not monitored (a warm-up). ``restore_best_weights`` puts the
    best epoch's module weights back at the end of training (``on_train_end``). ``stopped_epoch`` is the epoch it stopped at (0 if it did not),
    ``best_epoch`` the best one.

    Example::

        import torch, stratagem as sg
        from types import SimpleNamespace
        model = SimpleNamespace(module=torch.nn.Linear(2, 1), strategy=sg.get_strategy(), stop_training=False)
        stopper = sg.callbacks.EarlyStopping(monitor="val_loss", patience=1)
        stopper.set_model(model)
        stopper.on_train_begin()
        for epoch, val_loss in enumerate([0.9, 0.5, 0.6, 0.7, 0.1]):
            stopper.on_epoch_end(epoch, {"val_loss": val_loss})
            if model.stop_training:
                break
        assert (stopper.stopped_epoch, stopper.best_epoch) == (2, 1)
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0, patience: int = 0, verbose: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best_weights: bool = False,
                 start_from_epoch: int = 0):
        super().__init__()
        for name, value in (("patience", patience), ("start_from_epoch", start_from_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"EarlyStopping: {name} must be an int >= 0, got {value!r}")
        self.monitor = Monitor(monitor, mode, min_delta=min_delta, owner="EarlyStopping")
        self.patience = patience
        self.verbose = verbose
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.start_from_epoch = start_from_epoch
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best = self.monitor.worst
        self.best_epoch = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch < self.start_from_epoch:
            return
        decision = self._decide(epoch, logs) if is_chief(self.model) else None
        improved, stop, current = chief_decides(self.model, decision)
        if current is None:   # nothing to monitor this epoch
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self._weights()   # something to go back to, even without an improvement
        self.wait += 1
        if improved:
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self._weights()
            if self.baseline is None or self.monitor.improves(current, self.baseline):
                self.wait = 0
        elif stop:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def _decide(self, epoch: int, logs: dict | None) -> tuple[bool, bool, float | None]:
        """The chief's ``(improved, stop, monitored value)`` for this epoch."""
        current = self.monitor.read(logs)
        if current is None:
            return False, False, None
        improved = self.monitor.improves(current, self.best)
        return improved, not improved and self.wait + 1 >= self.patience and epoch > 0, current

    def on_train_end(self, logs: dict | None = None) -> None:
        talk = self.verbose and is_chief(self.model)
        if self.stopped_epoch > 0 and talk:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if talk:
                print(f"Restoring the weights of the end of the best epoch: {self.best_epoch + 1}", flush=True)
            self._module().load_state_dict(self.best_weights)

    def _module(self) -> Any:
        module = getattr(self.model, "module", self.model)
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(f"EarlyStopping(restore_best_weights=True) needs model.module (a "
                                       f"torch.nn.Module), got {type(module).__name__}")
        return module

    def _weights(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self._module().state_dict().items()}

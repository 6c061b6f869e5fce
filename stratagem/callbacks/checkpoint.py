"""``ModelCheckpoint``: save the model (and optimizer) every epoch, every N steps, or when it improves.

Saving goes through :class:`sg.Checkpoint <stratagem.Checkpoint>`: every worker calls
``save``, the chief writes atomically. Whether to save, and under which name, is the
chief's decision, sent to every worker, so that the workers always save together.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from stratagem.callbacks.base import Callback
from stratagem.callbacks.monitor import Monitor, chief_decides, is_chief, strategy_of
from stratagem.errors import InvalidArgumentError
from stratagem.checkpoint.checkpoint import Checkpoint

__all__ = ["ModelCheckpoint", "check_save_freq", "training_state"]


def check_save_freq(save_freq: Any, owner: str) -> None:
    if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1):
        raise InvalidArgumentError(f"{owner}: save_freq must be 'epoch' or a positive number of steps, "
                                   f"got {save_freq!r}")


def training_state(model: Any, *, weights_only: bool = False) -> Checkpoint:
    """An ``sg.Checkpoint`` of a Keras-style model: ``model=`` its module (and ``optimizer=``).

    Made in the model's strategy scope, so that only the chief writes it.
    """
    module = model if isinstance(model, nn.Module) else getattr(model, "module", None)
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(f"cannot checkpoint {type(model).__name__}: expected an sg.Model (with "
                                   f".module) or a torch.nn.Module; pass checkpoint=sg.Checkpoint(...) instead")
    optimizer = None if weights_only else getattr(model, "optimizer", None)
    with strategy_of(model).scope():
        if optimizer is None:
            return Checkpoint(model=module)
        return Checkpoint(model=module, optimizer=optimizer)


class ModelCheckpoint(Callback):
    """Save the training state to ``filepath`` at the end of every epoch (or every ``save_freq`` steps).

    ``filepath`` may hold the epoch (counted from 1), the step in the epoch (``{batch}``) and
    any value of ``logs``: ``"ckpt/epoch{epoch:02d}-{val_loss:.2f}"``. With
    ``save_best_only`` a checkpoint is written only when ``monitor`` improves (``mode``:
    ``"min"``, ``"max"`` or ``"auto"``), beating ``initial_value_threshold`` if given. What is
    saved: ``sg.Checkpoint(model=model.module, optimizer=model.optimizer)``, only the module
    with ``save_weights_only``, or the ``checkpoint`` you give (e.g. with the dataset too).
    Restore it with ``sg.Checkpoint(model=..., optimizer=...).restore(path)``;
    ``last_saved`` is the newest path written.

    Example::

        import os, tempfile, torch, stratagem as sg
        from types import SimpleNamespace
        module = torch.nn.Linear(2, 1)
        model = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                strategy=sg.get_strategy(), stop_training=False)
        folder = tempfile.mkdtemp()
        saver = sg.callbacks.ModelCheckpoint(folder + "/best-{epoch}", save_best_only=True)
        saver.set_model(model)
        saver.on_train_begin()
        for epoch, val_loss in enumerate([0.5, 0.7, 0.3]):
            saver.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})
        saved = sorted(name for name in os.listdir(folder) if not name.startswith("."))
        assert saved == ["best-1", "best-3"]   # (and .best-N.lock, the writer's lock, while it lives)
    """

    def __init__(self, filepath: "str | os.PathLike", monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False, mode: str = "auto",
                 save_freq: "str | int" = "epoch", initial_value_threshold: float | None = None, *,
                 checkpoint: Checkpoint | None = None):
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise InvalidArgumentError(f"ModelCheckpoint: filepath must be a path (it may hold {{epoch}} and "
                                       f"values of logs), got {filepath!r}")
        check_save_freq(save_freq, "ModelCheckpoint")
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(f"ModelCheckpoint(checkpoint=...) takes an sg.Checkpoint, got "
                                       f"{type(checkpoint).__name__}")
        self.filepath = os.fspath(filepath)
        self.monitor = Monitor(monitor, mode, owner="ModelCheckpoint")
        self.verbose = verbose
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        self.save_freq = save_freq
        self.initial_value_threshold = initial_value_threshold
        self.checkpoint = checkpoint
        self.best = self.monitor.worst if initial_value_threshold is None else float(initial_value_threshold)
        self.last_saved: str | None = None
        self._epoch = 0
        self._batches_since_save = 0

    def reads_train_batch_logs(self) -> bool:
        return self.save_freq != "epoch"   # the file name may name them

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.checkpoint is None:
            self.checkpoint = training_state(self.model, weights_only=self.save_weights_only)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches_since_save += 1
        if self._batches_since_save >= self.save_freq:
            self._batches_since_save = 0
            self._save(self._epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self.save_freq == "epoch":
            self._save(epoch, None, logs)

    # ------------------------------------------------------------------ saving

    def _save(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        if self.checkpoint is None:
            self.on_train_begin()
        decision = None
        if is_chief(self.model):
            decision = self._decide(epoch, batch, logs)
        save, path, current, message = chief_decides(self.model, decision)
        if message is not None:
            raise InvalidArgumentError(message)
        if self.save_best_only and save:
            if self.verbose and is_chief(self.model):
                print(f"Epoch {epoch + 1}: {self.monitor.name} improved from {self.best:.5f} to {current:.5f}, "
                      f"saving model to {path}", flush=True)
            self.best = current
        elif self.save_best_only and current is not None and self.verbose and is_chief(self.model):
            print(f"Epoch {epoch + 1}: {self.monitor.name} did not improve from {self.best:.5f}", flush=True)
        if save:
            self.last_saved = self.checkpoint.save(path)

    def _decide(self, epoch: int, batch: int | None, logs: dict | None) -> tuple:
        """The chief's ``(save, path, monitored value, error message)``."""
        current = None
        if self.save_best_only:
            current = self.monitor.read(logs)
            if current is None or not self.monitor.improves(current, self.best):
                return False, None, current, None
        values = {key: _plain(value) for key, value in (logs or {}).items()}
        names = {"epoch": epoch + 1, **({} if batch is None else {"batch": batch + 1})}
        try:
            path = self.filepath.format(**{**values, **names})
        except (KeyError, IndexError, ValueError) as err:
            return False, None, current, (
                f"ModelCheckpoint: cannot fill in filepath {self.filepath!r} ({type(err).__name__}: {err}); "
                f"it may name {sorted({**values, **names})}")
        return True, path, current, None


def _plain(value: Any) -> Any:
    """A logs value as a plain number where it is one (a 1-element tensor, a numpy scalar)."""
    try:
        return float(value) if not isinstance(value, (int, float, str)) else value
    except (TypeError, ValueError):
        return value

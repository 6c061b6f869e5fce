"""``CSVLogger``: one row per epoch (the epoch and every value of ``logs``), written by the chief."""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO

from stratagem.callbacks.base import Callback
from stratagem.callbacks.monitor import is_chief
from stratagem.errors import InvalidArgumentError

__all__ = ["CSVLogger"]


class CSVLogger(Callback):
    """Write ``epoch`` and the epoch's ``logs`` as a CSV row to ``filename`` after every epoch.

    The columns are ``epoch`` then the first epoch's log names, sorted; a value missing
    later is written ``NA``. ``append=True`` adds to an existing file (no second header),
    as a resumed job wants. Only the chief writes; each row is flushed at once.

    Example::

        import tempfile, stratagem as sg
        from types import SimpleNamespace
        path = tempfile.mkdtemp() + "/log.csv"
        logger = sg.callbacks.CSVLogger(path)
        logger.set_model(SimpleNamespace(strategy=sg.get_strategy()))
        logger.on_train_begin()
        logger.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.75})
        logger.on_train_end()
        assert open(path).read().splitlines() == ["epoch,loss,val_loss", "0,0.5,0.75"]
    """

    def __init__(self, filename: "str | os.PathLike", separator: str = ",", append: bool = False):
        super().__init__()
        if not isinstance(separator, str) or len(separator) != 1:
            raise InvalidArgumentError(f"CSVLogger: separator must be one character, got {separator!r}")
        self.filename = os.fspath(filename)
        self.sep = separator
        self.append = bool(append)
        self.keys: list[str] | None = None
        self._file: TextIO | None = None
        self._writer: Any = None
        self._has_header = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not is_chief(self.model):
            return
        self._close()
        has_rows = self.append and os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        if has_rows:
            with open(self.filename, newline="") as existing:
                header = next(csv.reader(existing, delimiter=self.sep), None)
            self.keys = header[1:] if header and header[0] == "epoch" else None
        else:
            self.keys = None
        os.makedirs(os.path.dirname(os.path.abspath(self.filename)), exist_ok=True)
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._writer = None
        self._has_header = has_rows

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not is_chief(self.model):
            return
        if self._file is None:
            self.on_train_begin()
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs)
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=["epoch", *self.keys], delimiter=self.sep,
                                          extrasaction="ignore")
            if not self._has_header:
                self._writer.writeheader()
        row = {"epoch": epoch, **{key: _cell(logs[key]) if key in logs else "NA" for key in self.keys}}
        self._writer.writerow(row)
        self._file.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer = None, None


def _cell(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value

"""What ``fit`` / ``evaluate`` / ``predict`` print: a progress bar per epoch, or one line.

``verbose=1``: on a terminal, a tqdm bar per epoch (step, ETA, loss, metrics, samples/s),
redrawn in place; when the output is not a terminal (a CI log, the launcher's prefixed
output), one plain line per epoch instead of a carriage-return frame per redraw.
``verbose=2``: one line per epoch. ``verbose=0``: nothing. Only the chief prints (the
coordinator under a parameter-server strategy).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from stratagem.observe.epochs import EPOCH_VARIABLE, marker_line

__all__ = ["LineProgress", "ProgressLogger", "format_logs"]


class LineProgress:
    """Progress for output that is not a terminal (CI logs, a launcher's prefixed output): one
    plain line every ``1/parts`` of the work and at the end, where a bar would write a
    carriage-return frame per redraw. The same calls as a tqdm bar: ``set_postfix_str``,
    ``update``, ``close``. ``total=None`` (unknown): one line at the end."""

    def __init__(self, total: int | None, file: Any, parts: int = 10, desc: str = "train") -> None:
        self.total, self.file, self.done, self.postfix, self.desc = total, file, 0, "", desc
        self._every = max(1, total // parts) if total else 0
        self._started = time.perf_counter()
        self._closed = False

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self, count: int = 1) -> None:
        self.done += count
        if self._every and self.done % self._every == 0 and self.done < self.total:
            self._line()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line()

    def _line(self) -> None:
        seconds = time.perf_counter() - self._started
        if self.total:
            count = f"{self.done}/{self.total} steps ({100 * self.done // self.total}%)"
        else:
            count = f"{self.done} steps"
        print(f"{self.desc} {count} {self.postfix} [{seconds:.1f} s]".rstrip(), file=self.file, flush=True)


def format_logs(logs: dict | None) -> str:
    """``loss: 0.1234 - accuracy: 0.9500``: Keras's way of showing logs."""
    return " - ".join(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}"
                      for name, value in (logs or {}).items())


class ProgressLogger:
    """One progress display per epoch (or per evaluate / predict run).

    ``begin(total, desc)``; ``step(samples, logs)`` after every step; ``end(logs)``. Does
    nothing when ``verbose`` is 0 or this process is not the chief.
    """

    def __init__(self, verbose: int, *, chief: bool = True, file: TextIO | None = None) -> None:
        if verbose not in (0, 1, 2) and verbose != "auto":
            raise ValueError(f"verbose must be 0 (silent), 1 (a progress bar) or 2 (one line per epoch), "
                             f"got {verbose!r}")
        self.verbose = 1 if verbose == "auto" else verbose
        self.enabled = self.verbose > 0 and chief
        self.file = file
        self._bar: Any = None
        self._samples = self._steps = 0
        self._started = 0.0
        self._desc = ""
        # under `stratagem launch`, the chief's epochs also end with a line for the launcher
        self._launched = chief and os.environ.get(EPOCH_VARIABLE) == "1"

    def begin(self, total: int | None, desc: str) -> None:
        self._samples, self._steps, self._started, self._desc = 0, 0, time.perf_counter(), desc
        if not self.enabled:
            return
        file = self.file if self.file is not None else sys.stdout
        if self.verbose == 2 or not _is_terminal(file):
            self._bar = LineProgress(total, file, parts=1, desc=desc)
        else:
            from tqdm.auto import tqdm   # only when a bar is shown

            self._bar = tqdm(total=total, desc=desc, unit="step", file=file, dynamic_ncols=True, leave=True)

    def step(self, samples: int, logs: dict | None, steps: int = 1) -> None:
        self._samples += samples
        self._steps += steps
        if self._bar is None:
            return
        self._bar.set_postfix_str(self._postfix(logs), refresh=False)
        self._bar.update(steps)

    def end(self, logs: dict | None) -> None:
        if self._launched and self._desc.startswith("Epoch "):
            line = marker_line(self._desc, samples=self._samples, steps=self._steps,
                               seconds=time.perf_counter() - self._started)
            print(line, file=sys.stdout, flush=True)
        if self._bar is None:
            return
        self._bar.set_postfix_str(self._postfix(logs), refresh=False)
        self._bar.close()
        self._bar = None

    def _postfix(self, logs: dict | None) -> str:
        seconds = time.perf_counter() - self._started
        rate = f"{self._samples / seconds:.0f} samples/s" if seconds > 0 and self._samples else ""
        return " - ".join(part for part in (format_logs(logs), rate) if part)


def _is_terminal(file: Any) -> bool:
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:   # a closed file
        return False

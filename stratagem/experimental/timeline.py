"""``sg.experimental.Timeline(path)``: a Chrome/Perfetto trace of the job, for scripts started
by any launcher (``stratagem launch --timeline PATH`` does the same for every task it starts)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist

from stratagem.callbacks.base import Callback
from stratagem.errors import InvalidArgumentError
from stratagem.observe import chrome, record

__all__ = ["Timeline"]


class Timeline(Callback):
    """Record a timeline of every step while it is open, and write it to ``path`` as one
    Chrome/Perfetto trace (open it in https://ui.perfetto.dev or ``chrome://tracing``).

    Use it as a context manager around the training loop, or pass it to ``fit`` as a callback
    (it opens at ``on_train_begin`` and writes at ``on_train_end``). A track per thread of each
    task: each step (``step``) with its wait for input, ``strategy.run`` and in it the forward,
    the backward, the optimizer step, and the gradient exchange at the end of backward
    (``stratagem.gradients.sync``); an ``exchange`` track with each gradient pack's all-reduce
    (its bytes), from its launch during backward to its sum; checkpoint saves; ps closures.
    Across workers every process must open and close it (closing gathers the events into the
    chief's file, in one collective of ``torch.distributed``); the tasks' clocks are their
    hosts' wall clocks. Under ``stratagem launch --timeline`` the launcher writes the trace and
    this one writes nothing (it says so).

    Example::

        import json, os, tempfile, torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = strategy.experimental_distribute_dataset([torch.randn(8, 4)] * 3)

        def step(x):
            loss = sg.nn.compute_average_loss(model(x).squeeze(1) ** 2)
            optimizer.zero_grad(); loss.backward(); optimizer.step()

        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        with sg.experimental.Timeline(path):
            for x in data:
                strategy.run(step, args=(x,))
        trace = json.load(open(path))
        assert sum(e["name"] == "step" for e in trace["traceEvents"]) == 3
    """

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        super().__init__()
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(f"Timeline needs the path of the trace file to write, got {path!r}")
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise InvalidArgumentError(f"Timeline({self.path!r}): that is a directory; give a file name, like "
                                       f"{os.path.join(self.path, 'trace.json')!r}")
        self._open = False

    def __enter__(self) -> "Timeline":
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def on_train_begin(self, logs: Any = None) -> None:
        self.open()

    def on_train_end(self, logs: Any = None) -> None:
        self.close()

    def open(self) -> None:
        """Start recording (a no-op while open, and under ``stratagem launch --timeline``)."""
        if self._open or record.launched():
            return
        record.take()   # (what an earlier timeline left: not this one's)
        record.start()
        self._open = True

    def close(self) -> "str | None":
        """Stop recording and write the trace (the chief's process writes it); return its path
        where this process wrote it, else None. Every process of the job calls it."""
        if record.launched():
            warnings.warn(f"sg.experimental.Timeline({self.path!r}) writes nothing under `stratagem launch "
                          f"--timeline`: the launcher writes the job's trace to the path given there", stacklevel=2)
            return None
        if not self._open:
            return None
        self._open = False
        record.stop()
        events = record.chrome_events(*record.take())
        parts = _gathered((record.task_name(), events))
        if parts is None:
            return None
        return chrome.write(chrome.merge(parts), self.path)


def _gathered(part: tuple[str, list[dict]]) -> "list | None":
    """Every process's part on the first process (None elsewhere), or this one's alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [part]
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, gathered, dst=0)
    return gathered if dist.get_rank() == 0 else None

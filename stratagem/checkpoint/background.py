"""``Checkpoint.save(blocking=False)``: the state copied in memory now, the files written by a thread.

A :class:`BackgroundWriter` is a :class:`~stratagem.checkpoint.storage.DirectoryWriter` (the
same atomic write, the same lock of the directory) whose files are written after ``commit``
returns; ``wait`` raises what the thread raised, as the CheckpointError a blocking save
would have raised.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

from stratagem.errors import CheckpointError
from stratagem.checkpoint.storage import DirectoryWriter, owned_copy, write_failure

__all__ = ["BackgroundWriter"]


class BackgroundWriter(DirectoryWriter):
    """A :class:`DirectoryWriter` whose files a thread writes after ``commit``.

    ``add`` keeps a copy of the value in CPU memory (what the caller waits for), in the
    tensors of ``staging`` (the copies of the writer before) where they fit; ``commit``
    starts the thread that writes the files and the manifest and renames the directory, and
    returns the path at once; :meth:`wait` joins the thread and raises what it raised (a
    warning says so when it happens, too). Files adopted from other processes were written
    before ``commit``, as with a :class:`DirectoryWriter`.
    """

    def __init__(self, path: "str | os.PathLike", staging: dict[str, Any] | None = None, holder: object = None):
        super().__init__(path, holder)
        self._staging = staging or {}
        self.values: dict[str, Any] = {}   # the copies, by file name: the next writer's staging
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def add(self, name: str, value: Any) -> None:
        self.values[name] = owned_copy(value, into=self._staging.get(name))

    def commit(self, objects: dict[str, dict], info: dict, identity: dict | None = None) -> Path:
        self._thread = threading.Thread(target=self._write_all, args=(objects, info, identity),
                                        name=f"stratagem checkpoint {self.path.name}")
        self._thread.start()   # not a daemon: an exiting program finishes the checkpoint first
        return self.given

    def _write_all(self, objects: dict[str, dict], info: dict, identity: dict | None) -> None:
        try:
            for name, value in self.values.items():
                DirectoryWriter.add(self, name, value)
            DirectoryWriter.commit(self, objects, info, identity)
        except BaseException as err:   # raised by wait(); nothing is left at the path
            self._error = err
            self.abort()
            warnings.warn(f"the background save of the checkpoint {self.given} failed "
                          f"({type(err).__name__}: {err}); the previous checkpoints are untouched",
                          RuntimeWarning, stacklevel=1)

    def wait(self) -> None:
        """Wait until the checkpoint is written; raise CheckpointError if that failed."""
        if self._thread is not None:
            self._thread.join()
        error, self._error = self._error, None
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"the background save failed: {error}") from error
        if isinstance(error, OSError):
            raise CheckpointError(f"the background save failed: {write_failure(self.given, error)}") from error
        if error is not None:
            raise CheckpointError(f"the background save of the checkpoint {self.given} failed: "
                                  f"{type(error).__name__}: {error}") from error

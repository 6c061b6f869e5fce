"""One file that every worker of a strategy writes or reads together (``model.save``, ``load_model``).

Writing (:func:`write_everywhere`), every worker calls it with its own path:

1. the workers gather their paths, and each checks its own (``overwrite=False`` on an
   existing file, a directory in the way): if any worker that would write refuses, every
   worker raises, and nothing is written;
2. every worker builds the payload (building it may be a collective: a sharded optimizer's
   state is gathered from every worker);
3. the chief writes its path; a worker given *another* path writes there too (TensorFlow's
   multi-worker tutorials save each non-chief worker's copy to a temporary directory and
   delete it), a worker given the chief's path writes nothing. Each write is atomic: a
   temporary file in the same directory (created if missing), fsynced, renamed over the
   path, the directory fsynced -- a crash leaves the old file or the new one, never half (and
   the next write to the path removes the temporary file a killed writer left);
4. the workers gather the outcomes: when ``save`` returns on any worker, every file is
   complete -- or every worker raises, naming the worker that failed.

Reading (:func:`read_everywhere`): every worker reads the path it was given and the workers
compare the files' sha256. The chief's file is the truth: a worker that sees none or another
(each host has its own disk) gets the chief's bytes over the process group, with a warning.
"""

from __future__ import annotations

import glob
import hashlib
import os
import secrets
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from stratagem import _context
from stratagem.errors import CheckpointError, InvalidArgumentError

__all__ = ["agree", "in_replica_context", "read_everywhere", "write_everywhere"]


def write_everywhere(strategy: Any, filepath: Any, make_payload: Callable[[], Any], *, overwrite: bool,
                     what: str) -> None:
    """``torch.save(make_payload(), filepath)`` by the workers that write (module docstring)."""
    path = Path(os.path.abspath(os.fspath(filepath)))
    workers = strategy.checkpoint_collective
    refusal = None
    if path.is_dir():
        refusal = f"{path} is a directory; {what} writes one file: give a file path"
    elif not overwrite and path.exists():
        refusal = f"{path} exists and overwrite=False; pass overwrite=True to replace it, or choose another path"
    everyone = [(str(path), refusal)]
    if workers.num_workers > 1:
        everyone = workers.all_gather_object(everyone[0], f"{what} (paths)")
    chief_path = everyone[0][0]
    writers = [index for index, (p, _) in enumerate(everyone) if index == 0 or p != chief_path]
    refused = [(index, everyone[index][1]) for index in writers if everyone[index][1] is not None]
    if refused:
        raise InvalidArgumentError(f"{what}: " + "; ".join(
            problem if len(everyone) == 1 else f"worker {index}: {problem}" for index, problem in refused))
    error: BaseException | None = None
    try:
        payload = make_payload()   # every worker: it may be a collective
        if workers.worker_index in writers:
            _atomic_save(path, payload)
    except Exception as err:   # told to every worker, then raised everywhere
        error = err
    agree(strategy, error, what)


def _atomic_save(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):   # a writer killed mid-write left it
        stale.unlink(missing_ok=True)
    temporary = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    try:
        with open(temporary, "wb", buffering=1 << 20) as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_everywhere(strategy: Any, filepath: Any, what: str) -> bytes:
    """The bytes of the chief's ``filepath`` on every worker (module docstring)."""
    path = Path(os.fspath(filepath))
    workers = strategy.checkpoint_collective
    data: bytes | None = None
    digest = problem = None
    try:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
    except OSError as err:
        problem = (type(err).__name__, str(err))
    if workers.num_workers == 1:
        if problem is not None:
            raise _unreadable(what, path, problem, "")
        return data
    everyone = workers.all_gather_object((digest, problem), f"{what} (file check)")
    chief_digest, chief_problem = everyone[0]
    if chief_problem is not None:
        raise _unreadable(what, path, chief_problem, " on worker 0 (the chief)")
    if all(d == chief_digest for d, _ in everyone):
        return data
    data = workers.broadcast_object(data if workers.worker_index == 0 else None)
    if digest != chief_digest:
        seen = "no file" if digest is None else "another file"
        warnings.warn(f"{what}: this worker sees {seen} at {path}; it loads the chief's copy, sent over the "
                      f"process group", RuntimeWarning, stacklevel=3)
    return data


def _unreadable(what: str, path: Path, problem: tuple[str, str], where: str) -> Exception:
    kind, message = problem
    if kind == "FileNotFoundError":
        return FileNotFoundError(f"{what}: no file at {path}{where}")
    return CheckpointError(f"{what}: cannot read {path}{where}: {kind}: {message}")


def agree(strategy: Any, error: BaseException | None, what: str) -> None:
    """Every worker raises when any worker failed (``error``: this worker's failure, or None):
    its own error, or one that names the workers that failed. Nothing changes before it."""
    workers = strategy.checkpoint_collective
    problems = [None if error is None else f"{type(error).__name__}: {error}"]
    if workers.num_workers > 1:
        problems = workers.all_gather_object(problems[0], f"{what} (agreement)")
    if error is not None:
        raise error
    failed = [(index, problem) for index, problem in enumerate(problems) if problem is not None]
    if failed:
        raise CheckpointError(f"{what} failed on " + "; ".join(f"worker {index}: {problem}" for index, problem in failed))


def in_replica_context() -> bool:
    """Whether this thread runs inside ``strategy.run`` (files are written and read outside it)."""
    frame = _context.current_frame()
    return frame is not None and frame.replica_context is not None

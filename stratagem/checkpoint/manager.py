"""``sg.CheckpointManager``: numbered checkpoints in one directory, the newest few kept.

The directory holds ``ckpt-1``, ``ckpt-2``, ... (each a complete checkpoint, see
:mod:`stratagem.checkpoint.storage`); the directory listing is the index, so nothing can
disagree with it after a crash. ``save()`` writes ``ckpt-<latest + 1>``, then the chief
deletes the oldest beyond ``max_to_keep`` (each is first renamed to a temporary name, so a
half-deleted checkpoint never looks like one) and any unfinished writes a crash left.

When training is over, ``mark_training_finished()`` writes ``ckpt-finished`` naming the
last checkpoint, which tells a :class:`~stratagem.keras.sidecar.SidecarEvaluator` to
stop after it; the next ``save()`` removes the mark (a resumed job is not finished).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path

from stratagem.errors import CheckpointError, InvalidArgumentError
from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.checkpoint.storage import MANIFEST, remove_stale_temporaries, write_failure
from stratagem.checkpoint.writer_lock import hold_writer_lock, release_writer_lock, series_of

__all__ = ["CheckpointManager", "latest_checkpoint"]


class CheckpointManager:
    """Saves ``checkpoint`` as ``directory/ckpt-<n>``, keeps the newest ``max_to_keep``.

    ``restore_or_initialize()`` restores the newest checkpoint that verifies, warning about
    each newer one that does not, and returns its path; with no checkpoint it returns None
    (the objects keep their fresh values).

    Example::

        import os, tempfile, torch, stratagem as sg
        model = torch.nn.Linear(4, 2)
        ckpt = sg.Checkpoint(model=model, step=0)
        manager = sg.CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2)
        assert manager.restore_or_initialize() is None      # nothing saved yet
        for step in range(1, 4):
            ckpt.step = step
            manager.save()
        assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
        assert manager.restore_or_initialize().endswith("ckpt-3") and ckpt.step == 3
    """

    def __init__(self, checkpoint: Checkpoint, directory: "str | os.PathLike", max_to_keep: int | None = 5,
                 *, checkpoint_name: str = "ckpt"):
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(f"CheckpointManager manages an sg.Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise InvalidArgumentError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")
        if not re.match(r"^[A-Za-z0-9_.]+$", checkpoint_name) or "-" in checkpoint_name:
            raise InvalidArgumentError(f"checkpoint_name must use letters, digits, '_' or '.', got {checkpoint_name!r}")
        self.checkpoint = checkpoint
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self._pattern = re.compile(rf"^{re.escape(checkpoint_name)}-(\d+)$")
        self._name = checkpoint_name
        self._series = series_of(f"{checkpoint_name}-1")   # whose lock the writer holds (writer_lock.py)

    def _numbered(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = self._pattern.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the checkpoints in the directory, oldest first."""
        return [str(path) for _, path in self._numbered()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest checkpoint, or None."""
        numbered = self._numbered()
        return str(numbered[-1][1]) if numbered else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save as ``ckpt-<checkpoint_number>`` (default: one more than the newest); return its path.

        Every worker must call it; the chief writes, then deletes the oldest beyond ``max_to_keep``.
        """
        numbered = self._numbered()
        if checkpoint_number is None:
            checkpoint_number = numbered[-1][0] + 1 if numbered else 1
        if not isinstance(checkpoint_number, int) or checkpoint_number < 0:
            raise InvalidArgumentError(f"checkpoint_number must be a non-negative int, got {checkpoint_number!r}")
        savers = self.checkpoint.strategy.checkpoint_collective
        target = self.directory / f"{self._name}-{checkpoint_number}"
        problem = None
        if self.checkpoint.is_writer:   # this directory's writer (refused while another lives), not finished
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                hold_writer_lock(self.directory, self._series, self.checkpoint, str(target))
                self.finished_mark.unlink(missing_ok=True)
            except OSError as err:
                problem = write_failure(target, err)
            except CheckpointError as err:
                problem = err
        else:   # the chief writes; the directory exists on every worker (a tutorial's temporary one too)
            self.directory.mkdir(parents=True, exist_ok=True)
        if savers.num_workers > 1:   # the chief's listing decides the name; its failure stops every worker
            checkpoint_number, said = savers.broadcast_object((checkpoint_number, problem and str(problem)))
            if said is not None and problem is None:
                raise CheckpointError(f"the chief could not write the checkpoint: {said}")
        if problem is not None:
            raise problem
        path = self.checkpoint.save(self.directory / f"{self._name}-{checkpoint_number}")
        if self.checkpoint.is_writer:
            remove_stale_temporaries(self.directory, f"{self._name}-")
            if self.max_to_keep is not None:
                for _, old in self._numbered()[:-self.max_to_keep]:
                    _remove(old)
        return path

    @property
    def finished_mark(self) -> Path:
        """The file that says training is over: ``<directory>/<checkpoint_name>-finished``."""
        return self.directory / f"{self._name}-finished"

    def mark_training_finished(self) -> None:
        """Say that no checkpoint will follow the newest one (every worker calls it; the chief writes).

        The mark names the newest checkpoint; it is written atomically (a temporary file
        renamed into place), so a reader sees all of it or nothing.
        """
        if not self.checkpoint.is_writer:
            return
        numbered = self._numbered()
        mark = {"last_checkpoint": numbered[-1][1].name if numbered else None,
                "last_number": numbered[-1][0] if numbered else None}
        temporary = self.finished_mark.with_name(f"{self.finished_mark.name}.tmp-{secrets.token_hex(4)}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            hold_writer_lock(self.directory, self._series, self.checkpoint, str(self.finished_mark))
            temporary.write_text(json.dumps(mark))
            os.replace(temporary, self.finished_mark)
        except OSError as err:
            temporary.unlink(missing_ok=True)
            raise write_failure(self.finished_mark, err) from err

    def restore_or_initialize(self) -> str | None:
        """Restore the newest good checkpoint and return its path; None when there is none.

        A checkpoint that fails verification is skipped with a warning that names it and
        the problem; when every checkpoint fails, raises the newest one's CheckpointError
        (rather than silently starting over).
        """
        failures = []
        paths = self.checkpoints
        savers = self.checkpoint.strategy.checkpoint_collective
        if savers.num_workers > 1:   # every worker tries the chief's list, in the same order
            paths = savers.broadcast_object(paths)
        for path in reversed(paths):
            try:
                return self.checkpoint.restore(path)
            except CheckpointError as err:
                failures.append(err)
                warnings.warn(f"checkpoint {path} cannot be restored ({err}); falling back to the previous "
                              f"checkpoint", RuntimeWarning, stacklevel=2)
        if failures:
            raise CheckpointError(f"none of the {len(failures)} checkpoints in {self.directory} can be restored; "
                                  f"the newest: {failures[0]}")
        return None

    def delete_all(self) -> None:
        """Remove every checkpoint of this manager (every worker calls it; the chief deletes).

        The workers meet first: a worker still training when the chief deleted the
        checkpoints would, if it then failed, restart the whole job from the beginning.
        """
        savers = self.checkpoint.strategy.checkpoint_collective
        if savers.num_workers > 1:
            savers.broadcast_object(None)
        if self.checkpoint.is_writer:
            if self._numbered():   # never another live job's checkpoints
                hold_writer_lock(self.directory, self._series, self.checkpoint, str(self.directory))
            for _, path in self._numbered():
                _remove(path)
            remove_stale_temporaries(self.directory, f"{self._name}-")
            release_writer_lock(self.directory, self._series)   # nothing left to guard


def _remove(path: Path) -> None:
    doomed = path.with_name(f"{path.name}.tmp-deleting-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def latest_checkpoint(checkpoint_dir: "str | os.PathLike") -> str | None:
    """The path of the most recently saved checkpoint in ``checkpoint_dir``, or None.

    TensorFlow's ``tf.train.latest_checkpoint``: pass what it returns to
    ``Checkpoint.restore``. Any complete checkpoint directly inside ``checkpoint_dir``
    counts (``CheckpointManager``'s ``ckpt-<n>``, or ``Checkpoint.save(dir + "/ckpt")``);
    the newest is the one whose manifest was written last (the higher number on a tie).
    Half-written or half-deleted checkpoints are never returned.

    Example::

        import os, tempfile, torch, stratagem as sg
        directory = tempfile.mkdtemp()
        assert sg.latest_checkpoint(directory) is None
        ckpt = sg.Checkpoint(model=torch.nn.Linear(2, 2))
        ckpt.save(os.path.join(directory, "ckpt"))
        ckpt.restore(sg.latest_checkpoint(directory))
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        return None
    found = []
    for entry in directory.iterdir():
        if ".tmp-" in entry.name or ".old-" in entry.name:
            continue
        try:
            written = (entry / MANIFEST).stat().st_mtime_ns
        except OSError:   # not a checkpoint, or one being deleted
            continue
        number = re.search(r"-(\d+)$", entry.name)
        found.append((written, int(number.group(1)) if number else -1, entry.name))
    return str(directory / max(found)[2]) if found else None

"""``sg.SidecarEvaluator``: a process beside training that evaluates every checkpoint it writes.

TensorFlow's SidecarEvaluator: training saves with :class:`sg.CheckpointManager
<stratagem.CheckpointManager>` (``ckpt-1``, ``ckpt-2``, ... in one directory); the
evaluator, in its own process (``stratagem launch --evaluator 1`` starts one), watches
that directory, restores each new checkpoint into its model and evaluates it once.

The protocol, and why it is safe without any locking:

- a checkpoint appears by an atomic rename, complete (the manager's listing ignores
  unfinished writes), so the evaluator never reads half of one;
- the manager deletes old checkpoints (``max_to_keep``) by renaming them away first; a
  checkpoint gone between listing and reading fails verification *before* anything is
  changed (``Checkpoint.restore`` reads everything, then applies), and is skipped with
  a note; so is one deleted by hand while it is read (its manifest or a file it lists
  already gone: :func:`missing_parts`), with a ``RuntimeWarning``; one deleted before the evaluator even listed it is never seen (when training
  saves faster than it evaluates, the shown numbers jump; keep more checkpoints, or
  accept it: TensorFlow's evaluator only ever evaluates the newest);
- training ends with ``manager.mark_training_finished()``, which writes
  ``ckpt-finished`` naming the last checkpoint; the evaluator reads the mark *before*
  each listing, so once it sees the mark the listing holds the last checkpoint, and
  it stops after evaluating it. ``max_evaluations`` stops it earlier.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from torch import nn

from stratagem.errors import CheckpointError, InvalidArgumentError
from stratagem.checkpoint.checkpoint import Checkpoint
from stratagem.checkpoint.manager import CheckpointManager
from stratagem.checkpoint.storage import MANIFEST
from stratagem.keras.summaries import summary_writer, write_scalars

__all__ = ["SidecarEvaluator"]


class SidecarEvaluator:
    """Evaluate every new checkpoint in ``checkpoint_dir`` once, until training says it is done.

    ``model`` is a compiled ``sg.Model`` (evaluated with ``model.evaluate(data, steps=steps,
    verbose=0, return_dict=True)``) or a ``torch.nn.Module`` with ``evaluate_fn(model, data,
    steps) -> dict`` of results. Each checkpoint is restored into ``checkpoint`` (default:
    ``sg.Checkpoint(model=<the module>)``, the name training should save the module under;
    other saved objects are ignored). :meth:`start` returns ``{checkpoint number: results}``
    after the last checkpoint (see ``CheckpointManager.mark_training_finished``), or after
    ``max_evaluations``; with ``timeout`` it raises ``TimeoutError`` when no new checkpoint
    nor the finished mark appears for that many seconds. Each evaluation prints a line
    (``verbose=1``) and, with ``summary_dir``, writes ``eval_<name>`` scalars for TensorBoard
    at the checkpoint's number.

    Example::

        import tempfile, torch, stratagem as sg
        folder = tempfile.mkdtemp()
        module = torch.nn.Linear(2, 1)
        manager = sg.CheckpointManager(sg.Checkpoint(model=module), folder)
        for _ in range(2):
            torch.nn.init.normal_(module.weight)
            manager.save()
        manager.mark_training_finished()

        def weight_sum(model, data, steps):
            return {"weight_sum": model.weight.sum().item()}

        evaluator = sg.SidecarEvaluator(torch.nn.Linear(2, 1), None, folder, evaluate_fn=weight_sum, verbose=0)
        results = evaluator.start()
        assert sorted(results) == [1, 2]
        assert results[2]["weight_sum"] == module.weight.sum().item()
    """

    def __init__(self, model: Any, data: Any, checkpoint_dir: "str | os.PathLike", steps: int | None = None,
                 max_evaluations: int | None = None, *, evaluate_fn: Callable[[Any, Any, Any], dict] | None = None,
                 checkpoint: Checkpoint | None = None, checkpoint_name: str = "ckpt",
                 summary_dir: "str | os.PathLike | None" = None, poll_interval: float = 0.5,
                 timeout: float | None = None, verbose: int = 1):
        if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
                                            or max_evaluations < 1):
            raise InvalidArgumentError(f"SidecarEvaluator: max_evaluations must be a positive int or None, got "
                                       f"{max_evaluations!r}")
        if evaluate_fn is None and not callable(getattr(model, "evaluate", None)):
            raise InvalidArgumentError(f"SidecarEvaluator: {type(model).__name__} has no evaluate(); pass a compiled "
                                       f"sg.Model, or evaluate_fn=lambda model, data, steps: {{'name': value}}")
        if checkpoint is None:
            module = model if isinstance(model, nn.Module) else getattr(model, "module", None)
            if not isinstance(module, nn.Module):
                raise InvalidArgumentError(f"SidecarEvaluator: cannot find the module of {type(model).__name__}; "
                                           f"pass checkpoint=sg.Checkpoint(model=...) naming what to restore")
            checkpoint = Checkpoint(model=module)
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(f"SidecarEvaluator(checkpoint=...) takes an sg.Checkpoint, got "
                                       f"{type(checkpoint).__name__}")
        self.model, self.data, self.steps = model, data, steps
        self.max_evaluations = max_evaluations
        self.evaluate_fn = evaluate_fn
        self.checkpoint = checkpoint
        self.manager = CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=None, checkpoint_name=checkpoint_name)
        self.summary_dir = summary_dir
        self.poll_interval = float(poll_interval)
        self.timeout = timeout
        self.verbose = verbose
        self.results: dict[int, dict] = {}
        self.skipped: list[int] = []
        self._writer: Any = None

    def start(self) -> dict[int, dict]:
        """Evaluate checkpoints as they come; return ``{checkpoint number: results}`` when done."""
        handled = 0              # the newest checkpoint number evaluated or skipped
        waiting_since = time.monotonic()
        try:
            while True:
                finished = self._finished_mark()   # before the listing: see the docstring
                for path in map(Path, self.manager.checkpoints):
                    number = int(path.name.rsplit("-", 1)[1])
                    if number <= handled:
                        continue
                    handled = number
                    waiting_since = time.monotonic()
                    self._evaluate(number, path)
                    if self.max_evaluations is not None and len(self.results) >= self.max_evaluations:
                        self._say(f"SidecarEvaluator: done after max_evaluations={self.max_evaluations}")
                        return self.results
                if finished is not None and (finished["last_number"] is None or handled >= finished["last_number"]):
                    self._say(f"SidecarEvaluator: training finished (last checkpoint "
                              f"{finished['last_checkpoint']}); {len(self.results)} evaluated")
                    return self.results
                if self.timeout is not None and time.monotonic() - waiting_since > self.timeout:
                    raise TimeoutError(f"SidecarEvaluator: no new checkpoint in {self.manager.directory} for "
                                       f"{self.timeout:g} s, and training did not mark itself finished "
                                       f"(manager.mark_training_finished()); stopped waiting")
                time.sleep(self.poll_interval)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def _finished_mark(self) -> dict | None:
        try:
            return json.loads(self.manager.finished_mark.read_text())
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise CheckpointError(f"{self.manager.finished_mark} is not valid JSON ({err}); it is written by "
                                  f"CheckpointManager.mark_training_finished() alone") from None

    def _evaluate(self, number: int, path: Path) -> None:
        try:
            self.checkpoint.restore(path)
        except CheckpointError as err:
            gone = missing_parts(path)
            if gone is None:   # whole, and still wrong: that is an error
                raise
            self.skipped.append(number)
            if not path.exists():
                self._say(f"SidecarEvaluator: {path.name} was deleted (max_to_keep) before it could be read; "
                          f"skipped")
            else:   # deleted by hand (or by a cleanup job) while it was read
                warnings.warn(f"SidecarEvaluator: skipped {path}: it is being deleted ({gone}), so it could not be "
                              f"read ({err})", RuntimeWarning, stacklevel=2)
            return
        if self.evaluate_fn is not None:
            results = self.evaluate_fn(self.model, self.data, self.steps)
        else:
            results = self.model.evaluate(self.data, steps=self.steps, verbose=0, return_dict=True)
        if not isinstance(results, dict):
            raise InvalidArgumentError(f"SidecarEvaluator: the evaluation returned {type(results).__name__}; "
                                       f"it must return a dict of results by name")
        results = {name: _number(value) for name, value in results.items()}
        self.results[number] = results
        shown = " ".join(f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
                         for name, value in results.items())
        self._say(f"SidecarEvaluator: evaluated {path.name}: {shown}")
        if self.summary_dir is not None:
            if self._writer is None:
                self._writer = summary_writer(self.summary_dir)
            write_scalars(self._writer, "eval_", results, number)

    def _say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)


def missing_parts(path: "str | os.PathLike") -> str | None:
    """What the checkpoint directory ``path`` lacks of what every complete one holds (the
    directory itself, its manifest, a file its manifest lists), in words; None when nothing is
    missing. A checkpoint appears whole, by a rename, so a missing part means it is being deleted."""
    path = Path(path)
    if not path.is_dir():
        return "the directory is gone"
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        return f"its {MANIFEST} is gone"
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    gone = [name for name in (files if isinstance(files, dict) else {}) if not (path / name).exists()]
    return f"{', '.join(gone)} listed in its manifest {'is' if len(gone) == 1 else 'are'} gone" if gone else None


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value

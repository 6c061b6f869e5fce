"""``sg.Checkpoint``: one logical copy of the training state, saved atomically, restored anywhere.

What each strategy contributes is what it already promises outside ``run``: a module's
``state_dict()`` and a scoped optimizer's ``state_dict()`` are one logical copy under
every strategy (Mirrored: replica 0's; parameter server: pulled from the shards), and
``load_state_dict`` reaches every copy (every replica, every ps). So a checkpoint holds
plain tensors, whatever wrote it, and restores under any other strategy or replica count.

Across workers (the strategy's topology says how many, and which one this is): every
worker calls ``save`` and ``restore``. In ``save`` the workers first gather their dataset
positions (each reads its own input), then the chief (worker 0) writes while the others
wait for its answer, so that when ``save`` returns on any worker the checkpoint is
complete -- or every worker raises. In ``restore`` every worker reads and verifies the
files itself when it sees the chief's checkpoint (a shared file system), else receives the
chief's copy over the process group (:mod:`stratagem.checkpoint.chief_copy`); the workers
agree that all of them succeeded, and only then does anything change.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem import _context
from stratagem.data.position import PositionedDataset, TrackedIterator
from stratagem.errors import CheckpointError, ContextError, InvalidArgumentError
from stratagem.observe import record as observed
from stratagem.placement.scope.hooks import module_placement, placement_of
from stratagem.checkpoint.background import BackgroundWriter
from stratagem.checkpoint.chief_copy import ChiefCopy, open_checkpoint
from stratagem.checkpoint.identity import new_job, record
from stratagem.checkpoint.pieces import PlacedRestore, assemble
from stratagem.checkpoint.storage import CheckpointReader, DirectoryWriter, check_loadable, owned_copy, write_failure
from stratagem.checkpoint.validate import problems_with

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_MODEL_PARTS = ("optimizer", "loss_scaler")   # what an sg.Model adds beside its module
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def kind_of(name: str, obj: Any) -> str:
    """What a trackable is: module, optimizer, scheduler, tensor, int, dataset or stateful."""
    if isinstance(obj, bool):
        raise InvalidArgumentError(f"Checkpoint({name}=...) got a bool; track an int (0 or 1) instead")
    if callable(getattr(obj, "checkpoint_parts", None)):   # an sg.Model: its module, optimizer, scaler
        return "model"
    refusal = getattr(type(obj), "checkpoint_refusal", None)   # a type that says why it has no state
    if refusal:
        raise InvalidArgumentError(f"Checkpoint cannot track {name}, {refusal}")
    for kind, types in (("int", int), ("module", nn.Module), ("optimizer", torch.optim.Optimizer),
                        ("scheduler", _SCHEDULERS), ("tensor", torch.Tensor),
                        ("dataset", (PositionedDataset, TrackedIterator))):
        if isinstance(obj, types):
            return kind
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful"
    raise InvalidArgumentError(
        f"Checkpoint cannot track {name}={type(obj).__name__}: it tracks modules, optimizers, LR schedulers, "
        f"tensors, ints, distributed datasets or their iterators, and objects with state_dict() and "
        f"load_state_dict(); wrap other values in a tensor")


class Checkpoint:
    """Training state to save and restore: ``sg.Checkpoint(model=..., optimizer=..., step=0)``.

    Tracks modules, optimizers, LR schedulers, tensors (restored in place), ints (read
    and set as attributes: ``ckpt.step``), distributed datasets or their iterators (the
    input position: epoch, step in it, shuffle state; see ``docs/checkpoints.md``), and
    any object with ``state_dict()`` / ``load_state_dict()``. ``save(path)`` writes one
    logical copy atomically and returns the path; ``restore(path)`` verifies everything
    (checksums, names, shapes) before it changes anything, and raises
    :class:`~stratagem.errors.CheckpointError` naming the file and the problem -- also when
    the directory holds another checkpoint than its name says (swapped or renamed on disk:
    every checkpoint records the name it was saved as, this job and its save counter).

    Example::

        import tempfile, torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.Adam(model.parameters())
        ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
        ckpt.step = 10
        path = ckpt.save(tempfile.mkdtemp() + "/ckpt-1")
        ckpt.step = 0
        ckpt.restore(path)
        assert ckpt.step == 10
    """

    def __init__(self, **trackables: Any):
        if not trackables:
            raise InvalidArgumentError("Checkpoint needs something to track: sg.Checkpoint(model=model, ...)")
        kinds = {}
        for name, obj in trackables.items():
            if not _NAME.match(name) or name == "manifest":
                raise InvalidArgumentError(
                    f"Checkpoint cannot track a name {name!r}: names start with a letter and use letters, "
                    f"digits and underscores (and 'manifest' is taken)")
            kinds[name] = kind_of(name, obj)
        for name, obj in trackables.items():
            clash = [f"{name}_{part}" for part in _MODEL_PARTS if kinds[name] == "model" and f"{name}_{part}" in kinds]
            if clash:
                raise InvalidArgumentError(f"Checkpoint tracks the sg.Model {name!r} as {name}, {name}_optimizer and "
                                           f"{name}_loss_scaler; rename the other trackable {clash[0]!r}")
        object.__setattr__(self, "_objects", dict(trackables))
        object.__setattr__(self, "_kinds", kinds)
        object.__setattr__(self, "_scope_strategy", _context.get_strategy() if _context.has_strategy() else None)
        object.__setattr__(self, "_pending", None)   # a BackgroundWriter of save(blocking=False)
        object.__setattr__(self, "_staging", {})     # its copies, reused by the next one
        object.__setattr__(self, "_job", [new_job(), 0])   # this job's id and saves: identity.py

    # ------------------------------------------------------------- attributes

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint tracks no {name!r} (it tracks {', '.join(objects)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._objects:
            raise AttributeError(f"Checkpoint tracks no {name!r}; name it when creating the checkpoint: "
                                 f"sg.Checkpoint({name}=...)")
        if kind_of(name, value) != self._kinds[name]:
            raise InvalidArgumentError(f"{name} is tracked as a {self._kinds[name]}; cannot replace it with a "
                                       f"{type(value).__name__}")
        self._objects[name] = value

    def _tracked(self) -> tuple[dict[str, Any], dict[str, str]]:
        """What is saved, by name: the trackables, each ``sg.Model`` as its parts as they are now
        (``model``: its module; ``model_optimizer``, ``model_loss_scaler`` once compiled)."""
        objects, kinds = {}, {}
        for name, obj in self._objects.items():
            if self._kinds[name] != "model":
                objects[name], kinds[name] = obj, self._kinds[name]
                continue
            for part, value in obj.checkpoint_parts().items():
                key = name if part == "module" else f"{name}_{part}"
                objects[key], kinds[key] = value, kind_of(key, value)
        return objects, kinds

    @property
    def trackables(self) -> dict[str, Any]:
        """The tracked objects by name (a copy: change ints through attributes)."""
        return dict(self._objects)

    # -------------------------------------------------------------- strategy

    @property
    def strategy(self) -> Any:
        """Whose workers save together: that of a tracked scoped optimizer or distributed dataset,
        else the strategy whose scope was open when the checkpoint was made, else the current one."""
        for obj in self._tracked()[0].values():
            placement = placement_of(obj) if isinstance(obj, torch.optim.Optimizer) else None
            if isinstance(obj, nn.Module):   # a module made in a scope (no optimizer tracked beside it)
                placement = module_placement(obj)
            if placement is not None:
                return placement.strategy
            if isinstance(obj, (PositionedDataset, TrackedIterator)):
                return obj.strategy
        strategy = self._scope_strategy or _context.get_strategy()
        if strategy.is_default and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ContextError(
                f"this Checkpoint tracks nothing that names its strategy, and this process is one of "
                f"{dist.get_world_size()}: create the Checkpoint inside `with strategy.scope():` (or track an "
                f"optimizer or distributed dataset made under it) so that only the chief writes")
        return strategy

    @property
    def is_writer(self) -> bool:
        """Whether this process writes checkpoints: the chief (worker 0); every other worker only waits."""
        return self.strategy.checkpoint_collective.worker_index == 0

    def _check_context(self, method: str) -> None:
        if _context.has_strategy() and _context.get_replica_context() is not None:
            raise ContextError(f"Checkpoint.{method} was called inside strategy.run; call it between steps, "
                               f"outside run (in cross-replica context)")

    # ------------------------------------------------------------------ save

    def save(self, path: "str | os.PathLike", *, blocking: bool = True) -> str:
        """Write the tracked state to the directory ``path`` atomically; return the path written.

        Every worker of a multi-worker strategy must call it; only the chief writes.
        ``blocking=False`` (one worker): returns once the state is copied in memory; a thread
        writes the files, and :meth:`wait` -- or the next ``save`` or ``restore`` -- waits for
        it and raises what it raised. Raises CheckpointError, with the previous checkpoints
        untouched, when the file system refuses the write (full, read-only) and when another
        live process writes the same series of checkpoints in that directory (the writer
        takes a lock there, held while this Checkpoint lives: :mod:`~stratagem.checkpoint.writer_lock`).
        """
        self._check_context("save")
        self.wait()
        strategy = self.strategy
        collective, topology = strategy.collective, strategy.topology
        savers = strategy.checkpoint_collective   # every process that saves; its worker 0 writes
        if not blocking and savers.num_workers > 1:
            raise InvalidArgumentError(
                f"Checkpoint.save(blocking=False) needs one worker, and this strategy has {savers.num_workers}: "
                f"the workers must agree that a checkpoint is complete, which a thread cannot do beside the "
                f"training steps' collectives; save with blocking=True")
        objects, kinds = self._tracked()
        positions = {name: obj.state_dict() for name, obj in objects.items() if kinds[name] == "dataset"}
        if topology.num_workers > 1:
            everyone = collective.all_gather_object(positions, "Checkpoint.save (dataset positions)")
            positions = {name: [worker[name] for worker in everyone] for name in positions}
        else:
            positions = {name: [state] for name, state in positions.items()}
        outcome: tuple[str, str] | None = None
        failure = None
        with strategy.placement.prepare_checkpoint(objects), observed.span("checkpoint save", "checkpoint"):
            if savers.worker_index == 0:
                try:
                    outcome = ("ok", str(self._write(Path(path), objects, kinds, positions, strategy, blocking)))
                except Exception as err:   # told to every worker, then raised everywhere
                    outcome, failure = ("error", f"{type(err).__name__}: {err}"), err
        if savers.worker_index != 0:   # nothing written here, but the directory a worker names exists
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        if savers.num_workers > 1:
            outcome = savers.broadcast_object(outcome)
        if failure is not None:
            raise failure
        status, detail = outcome
        if status != "ok":
            raise CheckpointError(f"the chief could not write the checkpoint {path}: {detail}")
        self._job[1] += 1   # (on every worker: the same count)
        return detail

    def wait(self) -> None:
        """Wait for a ``save(blocking=False)`` still writing; raise CheckpointError if it failed."""
        pending = self._pending
        object.__setattr__(self, "_pending", None)
        if pending is not None:
            object.__setattr__(self, "_staging", pending.values)
            pending.wait()

    def _write(self, path: Path, objects: dict[str, Any], kinds: dict[str, str], positions: dict[str, list],
               strategy: Any, blocking: bool = True) -> Path:
        try:   # (takes the directory's writer lock, held while this Checkpoint lives)
            writer = DirectoryWriter(path, self) if blocking else BackgroundWriter(path, self._staging, self)
        except OSError as err:   # a read-only or full file system: said as such
            raise write_failure(path, err) from err
        if not blocking:
            object.__setattr__(self, "_pending", writer)
        try:
            entries = {name: self._write_object(writer, name, obj, kinds[name], positions, strategy)
                       for name, obj in objects.items()}
            info = {"strategy": type(strategy).__name__, "num_replicas_in_sync": strategy.num_replicas_in_sync,
                    "num_workers": strategy.topology.num_workers, "torch": torch.__version__,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            return writer.commit(entries, info, record(writer.path.name, self._job[0], self._job[1] + 1))
        except BaseException as err:
            writer.abort()
            cause = err if isinstance(err, OSError) else getattr(err, "remote_exception", None)  # (a ps's)
            if isinstance(cause, OSError):
                raise write_failure(path, cause) from err
            raise

    def _write_object(self, writer: DirectoryWriter, name: str, obj: Any, kind: str, positions: dict[str, list],
                      strategy: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": kind, "type": type(obj).__name__}
        if kind == "int":
            entry["value"] = int(obj)
            return entry
        written = None
        if kind in ("module", "optimizer"):   # where the state lives may write it there (ps shards)
            written = strategy.placement.write_checkpoint_state(obj, writer.temporary, name)
        if written is not None:
            state, others = written
            for file, file_entry in others.items():
                writer.adopt(file, file_entry)
            entry["pieces"] = sorted(others)
        elif kind == "tensor":
            state = obj.detach().cpu()
        elif kind == "dataset":
            state = {"workers": positions[name], "num_replicas_in_sync": obj.strategy.num_replicas_in_sync}
        else:
            state = obj.state_dict()
        check_loadable(state, f"{name}.state_dict()" if kind != "tensor" else name)
        writer.add(f"{name}.pt", state)
        entry["file"] = f"{name}.pt"
        return entry

    # --------------------------------------------------------------- restore

    def restore(self, path: "str | os.PathLike", *, saved_as: str | None = None) -> str:
        """Restore every tracked object from ``path``; return the path.

        Verifies first (manifest, sizes, checksums, names, kinds, shapes) and changes
        nothing unless everything matches -- on every worker. Every worker must call it.
        The checkpoint must be the one saved under the directory's name (one swapped or
        renamed on disk is refused, naming both), or, for a copy renamed on purpose, the one
        saved as ``saved_as``. This Checkpoint then continues the restored one's job.
        """
        self._check_context("restore")
        if saved_as is not None and not isinstance(saved_as, str):
            raise InvalidArgumentError(f"saved_as names the checkpoint (such as 'ckpt-3'), got {saved_as!r}")
        self.wait()
        strategy = self.strategy
        loaded: dict[str, Any] = {}
        problem = None
        try:
            reader = open_checkpoint(path, strategy, saved_as)
            loaded = self._read(reader)
            identity = reader.manifest.get("identity") or {}
        except CheckpointError as err:
            problem = str(err)
        savers = strategy.checkpoint_collective
        if savers.num_workers > 1:
            problems = savers.all_gather_object(problem, "Checkpoint.restore (verification)")
            failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
            if failed:
                raise CheckpointError("; ".join(f"worker {rank}: {p}" for rank, p in failed))
        elif problem is not None:
            raise CheckpointError(problem)
        self._apply(loaded)
        if identity.get("job") is not None:   # saves go on counting in the restored job
            self._job[:] = [identity["job"], int(identity.get("save_counter") or 0)]
        return str(path)

    def _read(self, reader: "CheckpointReader | ChiefCopy") -> dict[str, Any]:
        saved = reader.manifest["objects"]
        objects, kinds = self._tracked()
        missing = [name for name in objects if name not in saved]
        if missing:
            raise CheckpointError(
                f"checkpoint {reader.path} holds no {', '.join(map(repr, missing))} (it holds "
                f"{', '.join(map(repr, saved))}); track the same names as the job that saved it")
        names = _parameter_names(objects, kinds)
        loaded = {}
        for name, obj in objects.items():
            entry, kind = saved[name], kinds[name]
            if entry.get("kind") != kind:
                raise CheckpointError(f"checkpoint {reader.path}: {name!r} was saved as a {entry.get('kind')}, "
                                      f"but here it is a {kind} ({type(obj).__name__})")
            if kind == "int":
                loaded[name] = int(entry["value"])
                continue
            value = reader.load(entry["file"])   # tensors: views of the file's memory map
            if entry.get("pieces"):   # written where the state lives; restored there if it can
                placed = self.strategy.placement.read_checkpoint_state(obj, value, reader.path, name,
                                                                       manifest=reader.manifest)
                if placed is not None:
                    if placed.problem is not None:
                        raise CheckpointError(placed.problem)
                    loaded[name] = placed
                    continue
            value = assemble(value, reader.load)
            if kind not in ("module", "tensor"):   # what the object keeps: copied out of the map
                value = owned_copy(value)
            problem = None
            if kind == "dataset":   # this worker's position, also on another number of workers
                value, problem = obj.saved_position(value)
            problem = problem or problems_with(kind, obj, value, names)
            if problem:
                raise CheckpointError(f"checkpoint {reader.path}: {entry['file']}: {problem}")
            loaded[name] = value
        return loaded

    def _apply(self, loaded: dict[str, Any]) -> None:
        order = ("module", "tensor", "optimizer", "scheduler", "stateful", "int", "dataset")
        objects, kinds = self._tracked()
        for name in sorted(loaded, key=lambda n: order.index(kinds[n])):
            kind, obj, value = kinds[name], objects[name], loaded[name]
            if isinstance(value, PlacedRestore):
                value.apply()
            elif kind == "int":
                self._objects[name] = value
            elif kind == "tensor":
                with torch.no_grad():
                    obj.copy_(value)
            else:
                obj.load_state_dict(value)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(f'{n}=<{k}>' for n, k in self._kinds.items())})"


def _parameter_names(objects: dict[str, Any], kinds: dict[str, str]) -> dict[int, str]:
    """``id(parameter) -> "model.fc1.weight"`` over the tracked modules: errors name parameters."""
    names: dict[int, str] = {}
    for name, obj in objects.items():
        if kinds[name] == "module":
            for prefix, module in obj.named_modules():
                # dict.items: the parameters themselves, never a read of their values (a ps may be fresh)
                for pname, param in dict.items(module._parameters):
                    if param is not None:
                        names.setdefault(id(param), f"{name}.{prefix + '.' if prefix else ''}{pname}")
    return names

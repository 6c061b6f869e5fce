"""What travels with a scheduled function from the coordinator to a worker, and back.

A closure (the function, its arguments, the datasets' functions) is pickled on the
coordinator by :class:`ClosurePickler` and read on the worker by :class:`ClosureUnpickler`,
made with that worker's :class:`~stratagem.ps.runtime.WorkerRuntime`. These kinds of
object travel by reference, as persistent ids, never by value:

- a scoped module's ``_parameters`` / ``_buffers`` (a placement's ``_VariableDict``):
  ``("variables", ((name, RemoteVariable or None, is_parameter), ...))``; on the worker, a
  dict of the runtime's local copies;
- an optimizer created in the strategy's scope: ``("optimizer", [var_id, ...])``; on the
  worker, a :class:`~stratagem.ps.runtime.WorkerOptimizer` of the runtime;
- a per-worker iterator: ``("iterator", dataset_id, iterator_id)``; on the worker, the
  runtime's live iterator;
- the :class:`~stratagem.ps.strategy.ParameterServerStrategy` itself (a dataset function
  that calls ``strategy.distribute_datasets_from_function``, a step that calls
  ``strategy.run``): ``("strategy",)``; on the worker, a ``_WorkerStrategy`` bound to the
  runtime;
- the strategy's :class:`~stratagem.ps.placement.ParameterServerPlacement`, which a scoped module's
  ``load_state_dict`` hooks mention: ``("placement",)``; on the worker, None (its modules'
  values are the runtime's, not the coordinator's);
- a metric (:mod:`stratagem.metrics`): ``("metric", id, copy)``, the copy holding the
  configuration and no state; on the worker, the runtime's one copy for that id (every
  closure mentioning the metric shares it). What a run adds to it travels back with the
  run's result (:attr:`ClosureUnpickler.metrics` lists the copies met).

The unpickler records the variable ids it met (:attr:`ClosureUnpickler.var_ids`): the
dense ones among them are pulled before the function runs. Pickled any other way (a
copy, a checkpoint), these objects keep their ordinary meaning.

When a worker is asked to run a closure it does not hold (it restarted since the function
was sent), it raises :class:`ClosureNotCachedError`, and the coordinator sends the closure
again to another worker.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from stratagem.errors import InvalidArgumentError, StratagemError
from stratagem.metrics.base import Metric, closure_reference
from stratagem.placement.scope.hooks import placement_of
from stratagem.ps.placement import ParameterServerPlacement, _VariableDict
from stratagem.ps.runtime import WorkerOptimizer, WorkerRuntime
from stratagem.ps.strategy import ParameterServerStrategy, _WorkerStrategy
from stratagem.ps.variables import remote_of
from stratagem.rpc.codec import Pickler, Unpickler
from stratagem.rpc.errors import CodecError

__all__ = ["ClosureNotCachedError", "ClosurePickler", "ClosureUnpickler", "PerWorkerDataset",
           "PerWorkerIterator"]


class ClosureNotCachedError(StratagemError, LookupError):
    """A worker was asked to run a closure by key, but does not hold it (it restarted)."""


_NO_POSITION = (
    "a per-worker dataset (create_per_worker_dataset) or its iterator: each scheduled function reads from "
    "whichever worker runs it, and one that fails runs again elsewhere, so no position says which elements "
    "were trained on; after a restore a per-worker dataset starts from its beginning. Track an int instead "
    "(sg.Checkpoint(epoch=0, ...)) and let dataset_fn use it (seed the shuffle of each epoch with it); see "
    "docs/checkpoints.md")


class PerWorkerDataset:
    """A dataset created on every worker; ``iter()`` gives a per-worker iterator."""

    _counter = itertools.count()
    checkpoint_refusal = _NO_POSITION   # sg.Checkpoint says why it cannot track one

    def __init__(self, dataset_id: str):
        self._dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self._dataset_id, f"it{next(self._counter)}")


class PerWorkerIterator:
    """Stands for each worker's own iterator: pass it to scheduled functions, call ``next`` there."""

    checkpoint_refusal = _NO_POSITION

    def __init__(self, dataset_id: str, iterator_id: str):
        self._ids = (dataset_id, iterator_id)
        self._dataset: PerWorkerDataset | None = None   # kept alive by its iterators (the coordinator's)

    def __next__(self) -> Any:
        raise InvalidArgumentError("a per-worker iterator is read inside a scheduled function, on a worker")


_PLAIN = frozenset({str, bytes, int, float, bool, type(None), tuple, list, dict})   # exactly these, not subclasses


class ClosurePickler(Pickler):
    """The coordinator's pickler of closures: variables, optimizers and per-worker
    iterators become references (see the module docstring)."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:   # most of a request: nothing to look up
            return None
        pid = super().persistent_id(obj)   # tensors
        if pid is not None:
            return pid
        if isinstance(obj, _VariableDict):
            return ("variables", obj.entries())
        if isinstance(obj, torch.optim.Optimizer) and isinstance(placement_of(obj), ParameterServerPlacement):
            return ("optimizer", [remote_of(p).var_id for g in obj.param_groups for p in g["params"]])
        if isinstance(obj, PerWorkerIterator):
            return ("iterator", *obj._ids)
        if isinstance(obj, ParameterServerPlacement):
            return ("placement",)
        if isinstance(obj, ParameterServerStrategy):
            return ("strategy",)
        reference = closure_reference(obj)
        if reference is not None and not isinstance(obj.strategy, ParameterServerStrategy):
            raise CodecError(
                f"metric {obj.name!r} was created under {obj.strategy!r}, but a function scheduled with "
                f"a ClusterCoordinator updates it: its workers' updates would reach no one. Create the "
                f"metric inside `with strategy.scope():` of the ParameterServerStrategy")
        return reference


class ClosureUnpickler(Unpickler):
    """A worker's reader of one request: references resolve against ``runtime``; the
    variable ids met are in :attr:`var_ids` after :meth:`load`."""

    def __init__(self, data: bytes, runtime: WorkerRuntime):
        super().__init__(data)
        self.runtime = runtime
        self.var_ids: list[str] = []
        self.metrics: list[Metric] = []

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, int):
            return super().persistent_load(pid)
        kind = pid[0] if isinstance(pid, tuple) and pid else None
        if kind == "variables":
            entries = pid[1]
            self.var_ids.extend(remote.var_id for _, remote, _ in entries if remote is not None)
            return {name: (None if remote is None else self.runtime.local_parameter(remote, is_parameter))
                    for name, remote, is_parameter in entries}
        if kind == "optimizer":
            return WorkerOptimizer(self.runtime, pid[1])
        if kind == "iterator":
            return self.runtime.iterator(pid[1], pid[2])
        if kind == "placement":
            return None
        if kind == "strategy":
            return _WorkerStrategy(self.runtime)
        if kind == "metric":
            metric = self.runtime.metric(pid[1], pid[2])
            self.metrics.append(metric)
            return metric
        raise CodecError(f"a closure refers to {pid!r}, which is no variable dict, optimizer, "
                         f"iterator, placement, strategy or metric")

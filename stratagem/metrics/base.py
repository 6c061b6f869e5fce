"""The :class:`Metric` base class: torchmetrics states, one per replica, combined on read.

A metric is bound to the strategy in whose scope it was created. Where it is updated
decides which *state* (a torchmetrics metric object holding only that part's sums,
counts or concatenated predictions) receives the update:

- inside ``strategy.run``: the state of the calling replica (``local_replica_id``), on
  that replica's device. Each replica thread touches only its own state, so concurrent
  replicas need no lock on the update path;
- outside ``run`` (cross-replica context, or the default strategy): the ``"outside"``
  state;
- inside a function scheduled by a ``ClusterCoordinator``: a copy of the metric made on
  the worker when the function arrived (see :mod:`stratagem.metrics.remote`). Its state
  starts empty for each execution and travels back with the function's result; the
  coordinator merges it only when it accepts that result, so a step executed twice
  (its worker was lost) counts once.

``result()`` in cross-replica context merges every non-empty state with the reductions
torchmetrics declares for them (``dist_reduce_fx``: sum, cat, max, min, mean, or a
callable applied to the stacked values, exactly as torchmetrics combines processes),
then gathers the merged states of all workers (MultiWorkerMirroredStrategy: one
``all_gather_object`` over the strategy's process group, so every worker must call
``result()`` together, like ``strategy.reduce``), and computes once on the whole. For
sum and cat states that is the value computed on all predictions at once.

``result()`` in the replica context of a strategy with more than one replica in sync
raises :class:`~stratagem.errors.ContextError`: a replica sees only its own part.
Calling the metric (Keras's ``metric(y_true, y_pred)``) there updates, then meets the
other replicas once (``merge_call``) to return the global value. torchmetrics is imported
where a metric is built, not here (parameter-server closures import this module).
"""

from __future__ import annotations

import copy
import threading
import uuid
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterable

import torch

from stratagem import _context
from stratagem.errors import ContextError, InvalidArgumentError
from stratagem.metrics.states import Snapshot, merge_states, on_cpu, snapshot

if TYPE_CHECKING:  # pragma: no cover
    import torchmetrics

    from stratagem.strategies.base import Strategy

__all__ = ["Metric", "accept_worker_deltas", "closure_reference", "results", "worker_deltas"]

_OUTSIDE = "outside"     # the state updated outside strategy.run
_ACCEPTED = "accepted"   # the states parameter-server workers sent back, merged
_LOCAL = ("_lock", "_scratch_lock", "_states", "_scratches")   # never copied nor sent
_REGISTRIES: "weakref.WeakKeyDictionary[Strategy, weakref.WeakValueDictionary]" = weakref.WeakKeyDictionary()


class Metric:
    """Base class of stratagem's metrics: Keras's ``update_state`` / ``result`` / ``reset_state``
    on top of a torchmetrics metric, aggregated over replicas and workers.

    ``name`` is what logs call it; ``dtype`` the floating dtype of ``result()`` (None: the
    metric's own). A subclass implements :meth:`_build` (the torchmetrics metric that holds
    the state, created empty) and :meth:`_update` (how Keras's arguments update it); it may
    override :meth:`_compute`.

    Example::

        import torch, stratagem as sg
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
        with strategy.scope():
            accuracy = sg.metrics.SparseCategoricalAccuracy()
        labels, logits = torch.tensor([0, 1, 2, 1, 0]), torch.randn(5, 3)
        data = strategy.experimental_distribute_dataset([(labels, logits)])
        for batch in data:
            strategy.run(lambda b: accuracy.update_state(*b), args=(batch,))
        expected = (logits.argmax(-1) == labels).float().mean()
        torch.testing.assert_close(accuracy.result(), expected)
    """

    def __init__(self, name: str, *, dtype: torch.dtype | None = None):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a metric's name must be a non-empty string, got {name!r}")
        frame = _context.current_frame()
        if frame is not None and frame.replica_context is not None and not frame.strategy.is_default:
            raise ContextError(
                f"metric {name!r} was created inside strategy.run (replica context); create metrics "
                f"once, in the strategy's scope outside run, and update them inside run")
        self.name = name
        self.dtype = dtype
        self._strategy: Strategy | None = _context.get_strategy()
        self._id = uuid.uuid4().hex
        self._template = self._checked(self._build())
        self._lock: threading.Lock              # guards the dict of states
        self._scratch_lock: threading.Lock      # guards the merge targets
        self._states: dict[Any, torchmetrics.Metric]
        self._scratches: dict[torch.device, torchmetrics.Metric]
        self._fresh_locals()
        self._worker_copy = False
        self._register()

    # ------------------------------------------------------------ subclass hooks

    def _build(self) -> "torchmetrics.Metric":
        """The torchmetrics metric that holds this metric's state (called once, empty)."""
        raise NotImplementedError

    def _update(self, state: "torchmetrics.Metric", *args: Any, **kwargs: Any) -> None:
        """Update ``state`` (one replica's) with the arguments of :meth:`update_state`."""
        raise NotImplementedError

    def _compute(self, state: "torchmetrics.Metric") -> torch.Tensor:
        """The value of the merged ``state``."""
        return state.compute()

    # ---------------------------------------------------------------- public API

    @property
    def strategy(self) -> "Strategy | None":
        """The strategy this metric was created under (None for a copy on a parameter-server worker)."""
        return self._strategy

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate a batch: ``update_state(y_true, y_pred, sample_weight=None)`` (``Mean``:
        ``update_state(values, sample_weight=None)``), in replica context, cross-replica
        context, or inside a function scheduled onto parameter-server workers. An empty
        batch (every tensor argument without elements: a replica given no row of an uneven
        last batch) adds nothing."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(t.numel() == 0 for t in tensors):
            return
        state = self._state_for_update()
        if tensors and tensors[-1].device != state.device:   # (the default strategy places nothing)
            state.to(tensors[-1].device)
        with torch.no_grad():
            self._update(state, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Keras's ``metric(y_true, y_pred, sample_weight=None)``: :meth:`update_state`, then the
        value so far over every replica and worker (inside ``run`` every replica must call it)."""
        self.update_state(*args, **kwargs)
        frame = _context.current_frame()
        if (not self._worker_copy and frame is not None and frame.replica_context is not None
                and frame.strategy is self._strategy and self._strategy.num_replicas_in_sync > 1):
            return frame.replica_context.merge_call(lambda _: self.result())
        return self.result()

    def result(self) -> torch.Tensor:
        """The value over every replica and worker (see the module docstring for where it may be read)."""
        self._check_readable()
        with self._lock:
            live = self._nonempty_states()
            if len(live) == 1 and not self._spans_workers():
                return self._compute(live[0])   # one state: nothing to merge
            snapshots = [snapshot(s) for s in live]
        if self._spans_workers():
            snapshots = _exchange([self], [snapshots], self._strategy.collective)[0]
        return self._compute_on(snapshots)

    def _check_readable(self) -> None:
        frame = _context.current_frame()
        strategy = self._strategy
        if (not self._worker_copy and frame is not None and frame.replica_context is not None
                and frame.strategy is strategy and strategy.num_replicas_in_sync > 1):
            raise ContextError(
                f"metric {self.name!r}: result() was called inside strategy.run, where a replica "
                f"holds only its own part of the metric. Read result() outside run (cross-replica "
                f"context), where it combines all {strategy.num_replicas_in_sync} replicas")

    def _spans_workers(self) -> bool:
        return not self._worker_copy and self._strategy.collective.num_workers > 1

    def _local_snapshots(self) -> list[Snapshot]:
        with self._lock:
            return [snapshot(s) for s in self._nonempty_states()]

    def reset_state(self) -> None:
        """Forget every replica's and worker's accumulated state (call it on every worker)."""
        with self._lock:
            self._states.clear()

    reset_states = reset_state   # Keras 2's name, which TensorFlow's tutorials call

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ------------------------------------------------------------------ states

    def _checked(self, metric: "torchmetrics.Metric") -> "torchmetrics.Metric":
        if getattr(metric, "dist_sync_on_step", False):
            raise InvalidArgumentError(
                f"metric {self.name!r}: a torchmetrics metric with dist_sync_on_step=True synchronises "
                f"processes in every update; stratagem combines replicas and workers itself. Create it "
                f"with dist_sync_on_step=False")
        metric = copy.deepcopy(metric)
        metric.reset()
        # torchmetrics would all-gather over torch.distributed's default group in compute():
        # stratagem merges the states itself, over its own replicas and workers.
        metric.sync_on_compute = False
        metric._to_sync = False
        return metric

    def _state_for_update(self) -> "torchmetrics.Metric":
        if self._worker_copy:
            key = _OUTSIDE
        else:
            frame = _context.current_frame()
            strategy = self._strategy
            if frame is None or frame.strategy is strategy:
                context = frame.replica_context if frame is not None else None
                key = _OUTSIDE if context is None or strategy.is_default else context.local_replica_id
            elif frame.strategy.is_default:
                key = _OUTSIDE
            else:
                raise ContextError(
                    f"metric {self.name!r} was created under {strategy!r} but is updated under "
                    f"{frame.strategy!r}: a metric keeps one state per replica of the strategy it was "
                    f"created with. Create the metric inside `with strategy.scope():` of the strategy "
                    f"that runs the step")
        state = self._states.get(key)
        if state is None:
            with self._lock:
                state = self._states.get(key)
                if state is None:
                    state = self._states[key] = self._new_state(key)
        return state

    def _new_state(self, key: Any) -> "torchmetrics.Metric":
        state = copy.deepcopy(self._template)
        if isinstance(key, int):
            state = state.to(self._strategy.topology.devices[key].torch_device)
        return state

    def _nonempty_states(self) -> list["torchmetrics.Metric"]:
        return [s for s in self._states.values() if s._update_count > 0]

    def _merged(self, snapshots: list[Snapshot]) -> Snapshot:
        if len(snapshots) == 1:
            return snapshots[0]
        with self._scratch_lock:
            target = self._scratch(self._result_device())
            merge_states(target, snapshots)
            return snapshot(target)

    def _scratch(self, device: torch.device) -> "torchmetrics.Metric":
        """A metric object to merge into and compute on, one per device, reused (states replaced, not written)."""
        scratch = self._scratches.get(device)
        if scratch is None:
            scratch = self._scratches[device] = copy.deepcopy(self._template).to(device)
        return scratch

    def _compute_on(self, snapshots: list[Snapshot]) -> torch.Tensor:
        with self._scratch_lock:
            target = self._scratch(self._result_device())
            if snapshots:
                merge_states(target, snapshots)
                return self._compute(target)
            target.reset()
            with warnings.catch_warnings():   # "compute called before update": the value of nothing
                warnings.simplefilter("ignore")
                return self._compute(target)

    def _result_device(self) -> torch.device:
        if self._strategy is None or self._strategy.is_default:
            return torch.device("cpu")
        return self._strategy.topology.devices[0].torch_device

    # ------------------------------------------- parameter-server workers' deltas

    def _delta(self) -> Snapshot | None:
        """On a worker's copy: what the last execution accumulated, on the CPU (None when nothing)."""
        live = self._nonempty_states()
        return on_cpu(self._merged([snapshot(s) for s in live])) if live else None

    def _accept(self, delta: Snapshot) -> None:
        """On the coordinator: merge a worker's accepted delta (see :meth:`_delta`)."""
        with self._lock:
            accepted = self._states.get(_ACCEPTED)
            if accepted is None:
                accepted = self._states[_ACCEPTED] = copy.deepcopy(self._template).to(self._result_device())
            merge_states(accepted, [snapshot(accepted), delta] if accepted._update_count else [delta])

    def _for_worker(self) -> "Metric":
        """The copy that travels to a parameter-server worker: the configuration and this
        metric's id, no state, no strategy (its updates stay in its one local state)."""
        clone = object.__new__(type(self))
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if k not in _LOCAL})
        clone._strategy, clone._worker_copy = None, True
        return clone

    def __getstate__(self) -> dict[str, Any]:
        if not self._worker_copy:
            raise TypeError(
                f"metric {self.name!r} cannot be pickled: it is bound to its strategy and holds one "
                f"state per replica. Functions scheduled with a ClusterCoordinator may use it (it "
                f"travels by reference); elsewhere send its result() instead")
        return {k: v for k, v in self.__dict__.items() if k not in _LOCAL}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh_locals()

    def _fresh_locals(self) -> None:
        self._lock, self._scratch_lock = threading.Lock(), threading.Lock()
        self._states, self._scratches = {}, {}

    def __deepcopy__(self, memo: dict) -> "Metric":
        """A new metric bound to the same strategy, with a copy of the states so far."""
        clone = object.__new__(type(self))
        for key, value in self.__dict__.items():
            if key not in _LOCAL and key != "_strategy":
                clone.__dict__[key] = copy.deepcopy(value, memo)
        clone._fresh_locals()
        clone._strategy, clone._id = self._strategy, uuid.uuid4().hex
        with self._lock:
            clone._states = copy.deepcopy(self._states, memo)
        clone._register()
        return clone

    def _register(self) -> None:
        if not self._worker_copy:
            _registry(self._strategy)[self._id] = self

    def _clear_worker_state(self) -> None:
        with self._lock:
            self._states.clear()


def _registry(strategy: Any) -> "weakref.WeakValueDictionary[str, Metric]":
    """The live metrics bound to ``strategy``, by id (a parameter-server worker's deltas name their metric by id)."""
    return _REGISTRIES.setdefault(strategy, weakref.WeakValueDictionary())


def results(metrics: Iterable[Metric]) -> list[torch.Tensor]:
    """``[m.result() for m in metrics]`` with one exchange between workers for all of them (a
    collective: every worker calls it with the same metrics in the same order).

    Example::

        import torch, stratagem as sg
        loss, mae = sg.metrics.Mean(name="loss"), sg.metrics.get("mae")
        loss.update_state(torch.tensor([1.0, 3.0]))
        mae.update_state(torch.tensor([1.0]), torch.tensor([1.5]))
        print(sg.metrics.results([loss, mae]))   # [tensor(2.), tensor(0.5000)]
    """
    metrics = list(metrics)
    for metric in metrics:
        if not isinstance(metric, Metric):
            raise InvalidArgumentError(f"sg.metrics.results takes sg.metrics.Metric objects, got {metric!r}")
        metric._check_readable()
    spanning = [m for m in metrics if m._spans_workers()]
    gathered: dict[int, list[Snapshot]] = {}
    if spanning:
        strategy = spanning[0].strategy
        if any(m.strategy is not strategy for m in spanning):
            raise InvalidArgumentError("sg.metrics.results reads metrics of one strategy at a time")
        exchanged = _exchange(spanning, [m._local_snapshots() for m in spanning], strategy.collective)
        gathered = {id(m): snapshots for m, snapshots in zip(spanning, exchanged)}
    return [m._compute_on(gathered[id(m)]) if id(m) in gathered else m.result() for m in metrics]


def _exchange(metrics: list[Metric], snapshots: list[list[Snapshot]], collective: Any) -> list[list[Snapshot]]:
    """Per metric, every worker's merged snapshot in worker order (a worker with nothing sends
    None and is left out): one ``all_gather_object`` for all the metrics."""
    mine = [on_cpu(m._merged(s)) if s else None for m, s in zip(metrics, snapshots)]
    names = ", ".join(repr(m.name) for m in metrics)
    everyone = collective.all_gather_object(mine, f"result() of metrics {names}")
    return [[theirs[i] for theirs in everyone if theirs[i] is not None] for i in range(len(metrics))]


def closure_reference(obj: Any) -> tuple | None:
    """How a scheduled function's pickler sends ``obj`` when it is a metric bound to a
    strategy: ``("metric", id, copy for the worker)``; None for anything else."""
    if isinstance(obj, Metric) and not obj._worker_copy:
        return ("metric", obj._id, obj._for_worker())
    return None


def worker_deltas(metrics: Iterable[Metric]) -> dict[str, tuple[int, dict[str, Any]]]:
    """On a worker, after a scheduled function ran: what it added to each metric, by id (each then emptied)."""
    deltas = {}
    for metric in metrics:
        delta = metric._delta()
        metric._clear_worker_state()
        if delta is not None:
            deltas[metric._id] = delta
    return deltas


def accept_worker_deltas(strategy: Any, deltas: dict[str, tuple[int, dict[str, Any]]]) -> None:
    """Merge the states a parameter-server worker accumulated during a scheduled function
    whose result the coordinator accepted (``{metric id: delta}``, see ``Metric._delta``)."""
    registry = _registry(strategy)
    for metric_id, delta in deltas.items():
        metric = registry.get(metric_id)
        if metric is not None:   # (a metric dropped since the function was scheduled: nobody reads it)
            metric._accept(delta)

"""ClusterCoordinator: schedules steps onto worker tasks and survives losing workers.

Closure queue protocol: ``schedule`` appends a closure (function, arguments and a
:class:`RemoteValue`) and returns at once. One dispatcher thread per worker takes
closures in order and runs them there with an RPC. While a closure runs, the
dispatcher pings its worker every second (keepalive does not notice a stopped
process); three missed pings, or a broken connection, mark the worker lost: the
closure goes back to the *front* of the queue for another worker, and the
dispatcher keeps probing the lost address until a (restarted) worker answers, then
re-creates its datasets and gives it work again.

A closure may *execute* more than once (its worker was lost while it ran), but each
parameter server applies its updates at most once, and exactly once for every closure
that completes: pushes carry a fence (:mod:`stratagem.ps.fencing`), and the gRPC call of
an abandoned execution is cancelled.

An exception in the user's function fails that closure only: ``join()`` and
``fetch()`` re-raise it with the remote traceback; the other closures still run.
A parameter server that stops answering for ``ps_timeout`` seconds, or comes back as a
new process, is declared lost (:mod:`stratagem.ps.health`; a stall of a few
seconds is not a loss): from then on nothing more is applied, and ``schedule``, ``join``
and ``fetch`` raise :class:`~stratagem.errors.UnavailableError` naming it until the user
restores the variables (``model.load_state_dict`` / ``optimizer.load_state_dict``). A step
scheduled before the loss fails with it, even one that ends after the restore (and nothing
it pushes after the restore is applied).

One coordinator drives the parameter servers at a time (the strategy's tenure,
:mod:`stratagem.ps.tenure`; its id names this coordinator's requests and fences). When another
program takes them over -- this one was stopped past its lease, say -- every closure fails and
``schedule``, ``join`` and ``fetch`` raise :class:`~stratagem.ps.ownership.FencedError` naming
the newcomer: nothing this coordinator sends is applied any more.

Back-pressure: at most ``max_queued`` closures are scheduled and unfinished at once;
``schedule`` blocks while that many are, and goes on as they finish. A blocked
``schedule`` raises as soon as the coordinator fails (a fatal dispatcher error, a lost
ps) or is shut down. Per-worker datasets and iterators the program no longer references
are released on the workers (with the next step each worker is sent).

Nothing waits silently forever:

- ``join(timeout=)`` and ``fetch(timeout=)`` raise Python's ``TimeoutError`` when the
  time passes (the closures stay scheduled: waiting again is allowed).
- When every worker is lost and none has answered for ``worker_timeout`` seconds,
  ``join`` and ``fetch`` raise :class:`~stratagem.errors.UnavailableError` naming the
  workers. The closures stay queued: a worker that comes back is given them.
- A worker that refuses the coordinator's cluster token
  (:class:`~stratagem.rpc.errors.AuthenticationError`), an address that is not a worker
  task (:class:`~stratagem.errors.ClusterConfigError`), and any unexpected error in a
  dispatcher thread are fatal: the closure it held and every waiting one fail with the
  error, and ``schedule``, ``join``, ``done`` and ``fetch`` raise it from then on.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import uuid
import weakref
from typing import Any, Callable

from stratagem._profiling import label
from stratagem.errors import InvalidArgumentError, UnavailableError
from stratagem.ps.closure_queue import _Closure, _Queue
from stratagem.ps.closures import PerWorkerDataset, PerWorkerIterator
from stratagem.ps.coordinator_link import CoordinatorLink
from stratagem.ps.dispatcher import _Worker
from stratagem.ps.health import PsWatchdog
from stratagem.ps.remote_value import RemoteValue, check_timeout, remaining
from stratagem.ps.strategy import ParameterServerStrategy
from stratagem.ps.traffic import WorkerTraffic
from stratagem.values import map_structure

DEFAULT_WORKER_TIMEOUT_SECONDS = 60.0
DEFAULT_PS_TIMEOUT_SECONDS = 10.0
DEFAULT_MAX_QUEUED_PER_WORKER = 64
MIN_DEFAULT_MAX_QUEUED = 256


class _TrackedDataset(PerWorkerDataset):
    """A per-worker dataset whose iterators keep it alive; when the program drops the
    dataset and all its iterators, the workers are told to release them."""

    def __init__(self, dataset_id: str, coordinator: ClusterCoordinator):
        super().__init__(dataset_id)
        release = weakref.WeakMethod(coordinator._release)
        self._release = release
        weakref.finalize(self, _call_weak, release, dataset_id, None)

    def __iter__(self) -> PerWorkerIterator:
        iterator = super().__iter__()
        iterator._dataset = self          # the dataset lives as long as any iterator of it
        weakref.finalize(iterator, _call_weak, self._release, *iterator._ids)
        return iterator


def _call_weak(method: weakref.WeakMethod, *args: Any) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


class ClusterCoordinator:
    """Schedules functions onto the worker tasks of a ParameterServerStrategy.

    One per strategy: creating it again returns the strategy's live coordinator (TensorFlow
    does the same), so code after a parameter-server ``Model.fit`` may ask for it.

    Example (inside a script run by ``stratagem launch --workers 2 --ps 1 train.py``)::

        # strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
        # coordinator = sg.ClusterCoordinator(strategy)
        # value = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        # coordinator.join(); print(value.fetch())

    ``worker_timeout``: seconds without an answer from any worker after which ``join`` and
    ``fetch`` raise ``UnavailableError`` instead of waiting for one to come back.

    ``max_queued``: how many scheduled functions may be unfinished (queued or running) at
    once before ``schedule`` blocks; default ``max(256, 64 * num_workers)``. It bounds the
    coordinator's memory: each queued function holds its arguments.

    ``ps_timeout``: seconds a parameter server may go without answering the coordinator's
    heartbeats (one a second) before it is declared lost, provided a fresh connection to
    it fails too; shorter stalls only delay the steps.
    """

    def __new__(cls, strategy: ParameterServerStrategy, **options: Any) -> "ClusterCoordinator":
        # TensorFlow's behaviour: a strategy has one coordinator; asking again (after a
        # parameter-server ``Model.fit`` made one, say) hands back the live one
        existing = getattr(strategy, "coordinator", None) if isinstance(strategy, ParameterServerStrategy) else None
        if existing is not None and not existing._stopping.is_set():
            if options:
                raise InvalidArgumentError(
                    f"{strategy!r} already has a ClusterCoordinator, so {', '.join(sorted(options))} cannot be "
                    f"set again; use strategy.coordinator, or pass the options to the first ClusterCoordinator")
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy, *,
                 worker_timeout: float = DEFAULT_WORKER_TIMEOUT_SECONDS, max_queued: int | None = None,
                 ps_timeout: float = DEFAULT_PS_TIMEOUT_SECONDS):
        if getattr(self, "strategy", None) is strategy:
            return   # the strategy's live coordinator, handed back by __new__
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                f"ClusterCoordinator needs a sg.ParameterServerStrategy, got {type(strategy).__name__}")
        num_workers = len(strategy.cluster.worker_addresses)
        if max_queued is None:
            max_queued = max(MIN_DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_PER_WORKER * num_workers)
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise InvalidArgumentError(
                f"max_queued must be a positive int (how many scheduled functions may wait or run "
                f"at once), got {max_queued!r}")
        self._worker_timeout = check_timeout(worker_timeout, "worker_timeout")
        ps_timeout = check_timeout(ps_timeout, "ps_timeout")
        if ps_timeout < 4:
            raise InvalidArgumentError(
                f"ps_timeout must be at least 4 seconds (several heartbeats, one a second), got {ps_timeout:g}")
        self.id = strategy.cluster.tenure.id   # names this program's requests and closures on the ps
        self._seq = itertools.count()
        self._fatal: BaseException | None = None
        self._stopping = threading.Event()
        strategy.attach_coordinator(self, live=lambda: not self._stopping.is_set())
        self.strategy = strategy
        strategy.placement.on_restored = self._variables_restored
        self._queue = _Queue(max_queued)
        strategy.cluster.tenure.on_failure(self._fail)   # another coordinator took the ps over
        self._datasets: dict[str, Callable] = {}
        self._keys: "weakref.WeakKeyDictionary[Callable, str]" = weakref.WeakKeyDictionary()
        # what the dispatchers and the watchdog may use of this coordinator, and nothing more
        #: what each worker's calls to the parameter servers moved (stratagem.ps.traffic; TensorBoard writes it)
        self.worker_traffic = WorkerTraffic()
        link = CoordinatorLink(id=self.id, strategy=strategy, queue=self._queue, stopping=self._stopping,
                               datasets=self._datasets, closure_key=self._closure_key,
                               check=self._raise_if_failed, fail=self._fail, traffic=self.worker_traffic)
        self._ps_watch = PsWatchdog(link, ps_timeout)
        self._workers = [_Worker(link, self._ps_watch, i, address)
                         for i, address in enumerate(strategy.cluster.worker_addresses)]
        atexit.register(self.shutdown)  # threads inside gRPC calls at interpreter exit abort it

    # ------------------------------------------------------------------ API

    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns a RemoteValue.

        Blocks while ``max_queued`` functions are unfinished; raises instead when the
        coordinator has failed or is shut down.
        """
        if not callable(fn):
            raise InvalidArgumentError(f"schedule needs a callable, got {type(fn).__name__}")
        with label("stratagem.ps.schedule"):
            losses = self._ps_watch.losses    # (read first: a loss declared from now on fails it)
            self._raise_if_failed()
            placement = self.strategy.placement
            placement.finalize()
            placement.sync_hyperparameters()
            value = RemoteValue(check=self._check)
            closure = _Closure(fn, tuple(args), dict(kwargs or {}), value, seq=next(self._seq),
                               losses=losses)
            self._queue.put(closure, check=self._raise_if_failed)
            return value

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled function has run; raise the first error, if any.

        ``TimeoutError`` when ``timeout`` seconds pass first; ``UnavailableError`` when no
        worker has answered for ``worker_timeout`` seconds.
        """
        timeout = None if timeout is None else check_timeout(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._queue.wait_idle(self._check, deadline):
            self._check()
            raise TimeoutError(f"join(timeout={timeout:g}): {self._queue.unfinished} scheduled "
                               "functions had not finished; they stay scheduled")
        self._raise_if_failed()
        if self._queue.errors:
            error, self._queue.errors = self._queue.errors[0], []
            raise error

    def done(self) -> bool:
        """Whether every scheduled function has run (errors are raised, as by join)."""
        self._raise_if_failed()
        if self._queue.errors:
            error, self._queue.errors = self._queue.errors[0], []
            raise error
        return self._queue.unfinished == 0

    def fetch(self, value: Any, timeout: float | None = None) -> Any:
        """``RemoteValue``s anywhere in a structure replaced by their fetched results.

        ``timeout`` bounds the whole fetch (``TimeoutError``), as in ``RemoteValue.fetch``.
        """
        timeout = None if timeout is None else check_timeout(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        return map_structure(
            lambda v: v.fetch(remaining(deadline)) if isinstance(v, RemoteValue) else v, value)

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """Run ``dataset_fn`` on every worker (with an ``InputContext`` if it takes one)."""
        if not callable(dataset_fn):
            raise InvalidArgumentError("dataset_fn must be callable: dataset_fn(input_context) -> iterable")
        dataset_id = uuid.uuid4().hex[:12]
        self._datasets[dataset_id] = dataset_fn
        return _TrackedDataset(dataset_id, self)

    def shutdown(self) -> None:
        """Stop dispatching (closures still queued are not run) and wait for the threads to end.

        Calls in flight have deadlines, so this takes seconds even with dead peers. A
        ``schedule`` blocked on a full queue raises; so does any later ``schedule``.
        """
        if self._stopping.is_set():
            return
        self._stopping.set()
        for thread in [w.thread for w in self._workers] + [self._ps_watch.thread]:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        for worker in self._workers:
            worker.client.close()
        self._ps_watch.release()   # closures still running on workers apply nothing more

    # ------------------------------------------------------------- internals

    def _closure_key(self, fn: Callable) -> str:
        try:
            key = self._keys.get(fn)
            if key is None:
                key = self._keys.setdefault(fn, uuid.uuid4().hex)
            return key
        except TypeError:  # not weak-referenceable: ship it every time
            return uuid.uuid4().hex

    def _check(self) -> None:
        """Raise what makes waiting pointless: a fatal error, a lost ps, no worker answering."""
        self._raise_if_failed()
        workers = self._workers
        if any(w.incarnation is not None for w in workers):
            return
        silent = time.monotonic() - max(w.last_answer for w in workers)
        if silent >= self._worker_timeout:
            raise UnavailableError(
                f"no worker has answered for {silent:.0f} s (worker_timeout={self._worker_timeout:g} s): "
                f"{', '.join(w.who for w in workers)}. They died or cannot be reached; restart them "
                "(stratagem launch --max-restarts restarts them): the scheduled functions stay queued "
                "and run when a worker answers again.", task=", ".join(w.name for w in workers))

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._ps_failure is not None:
            raise self._ps_failure
        if self._stopping.is_set():
            raise InvalidArgumentError("this ClusterCoordinator was shut down: it runs nothing more; "
                                       "make a new one to schedule functions")

    def _release(self, dataset_id: str, iterator_id: str | None) -> None:
        """A per-worker dataset (iterator_id None) or iterator the program dropped."""
        if iterator_id is None:
            self._datasets.pop(dataset_id, None)
        for worker in self._workers:
            worker.release(dataset_id, iterator_id)

    def _fail(self, error: BaseException) -> None:
        """A fatal error (from a dispatcher): fail every waiting closure and keep raising it."""
        if self._fatal is None:
            self._fatal = error
        self._queue.close(self._fatal)

    @property
    def _ps_failure(self) -> UnavailableError | None:
        return self._ps_watch.failure

    def _variables_restored(self) -> None:
        """The user restored the variables after a ps failure: scheduling may go on."""
        self._ps_watch.restored()
        # the loss was raised to the user, who restored: the errors of steps that failed
        # before (on the lost ps, or on its empty restart) are not raised again by join(),
        # nor those of steps scheduled before that end later (they are failed, not recorded)
        self._queue.clear_errors()


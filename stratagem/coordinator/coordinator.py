"""ClusterCoordinator: schedules steps onto worker tasks and survives losing workers.

Closure queue protocol: ``schedule`` appends a closure (function, arguments and a
:class:`RemoteValue`) and returns at once. One dispatcher thread per worker takes
closures in order and runs them there with an RPC. While a closure runs, the
dispatcher pings its worker every second (keepalive does not notice a stopped
process); three missed pings, or a broken connection, mark the worker lost: the
closure goes back to the *front* of the queue for another worker, and the
dispatcher keeps probing the lost address until a (restarted) worker answers, then
re-creates its datasets and gives it work again.

An exception in the user's function fails that closure only: ``join()`` and
``fetch()`` re-raise it with the remote traceback; the other closures still run.
A parameter server that stops answering (a watchdog pings each every second, and
workers report failed pulls and pushes) makes ``schedule``, ``join`` and ``fetch``
raise :class:`~stratagem.errors.UnavailableError` naming it until the user restores
the variables (``model.load_state_dict`` / ``optimizer.load_state_dict``).
"""

from __future__ import annotations

import atexit
import collections
import threading
import uuid
import weakref
from typing import Any, Callable

from stratagem._profiling import label
from stratagem.coordinator.values import RemoteValue
from stratagem.errors import InvalidArgumentError, UnavailableError
from stratagem.ps.closures import ClosureNotCachedError, ClosurePickler, PerWorkerDataset
from stratagem.ps.strategy import ParameterServerStrategy
from stratagem.rpc import RemoteError, RpcClient
from stratagem.values import map_structure

PING_SECONDS = 1.0
MISSED_PINGS = 3
RUN_TIMEOUT_SECONDS = 24 * 3600.0


class _Closure:
    __slots__ = ("fn", "args", "kwargs", "value")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, value: RemoteValue):
        self.fn, self.args, self.kwargs, self.value = fn, args, kwargs, value


class _Queue:
    """Closures waiting to run, and a count of those scheduled but not finished."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Closure] = collections.deque()
        self._unfinished = 0
        self.errors: list[BaseException] = []

    def put(self, closure: _Closure, *, front: bool = False, new: bool = True) -> None:
        with self._cond:
            if new:
                self._unfinished += 1
            (self._waiting.appendleft if front else self._waiting.append)(closure)
            self._cond.notify_all()

    def get(self, timeout: float) -> _Closure | None:
        with self._cond:
            if not self._waiting:
                self._cond.wait(timeout)
            return self._waiting.popleft() if self._waiting else None

    def finished(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._unfinished -= 1
            if error is not None:
                self.errors.append(error)
            self._cond.notify_all()

    def wait_idle(self, check: Callable[[], None]) -> None:
        with self._cond:
            while self._unfinished:
                self._cond.wait(0.2)
                check()

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._unfinished == 0


class _Worker:
    """One worker task and the dispatcher thread that feeds it."""

    def __init__(self, coordinator: "ClusterCoordinator", index: int, address: str, token: str):
        self.coordinator = coordinator
        self.index = index
        self.name = f"worker {index}"
        self.client = RpcClient(address, token, task=self.name, default_timeout=10.0, pickler=ClosurePickler)
        self.incarnation: str | None = None
        self.cached: set[str] = set()
        self.datasets: set[str] = set()
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"stratagem-dispatch-{index}")
        self.thread.start()

    def _ping(self, timeout: float) -> bool:
        try:
            answer = self.client.call("ping", None, timeout=timeout)
        except Exception:  # noqa: BLE001 - any failure means: not available now
            return False
        if answer["incarnation"] != self.incarnation:  # a new process: it knows nothing yet
            self.incarnation = answer["incarnation"]
            self.cached.clear()
            self.datasets.clear()
        return True

    def _loop(self) -> None:
        coordinator = self.coordinator
        while not coordinator._stopping.is_set():
            if self.incarnation is None and not self._ping(2.0):  # lost or not yet seen: probe
                coordinator._stopping.wait(0.2)
                continue
            closure = coordinator._queue.get(timeout=0.5)
            if closure is None:
                continue
            try:
                self._prepare()
                result = self._run(closure)
            except _WorkerLost:
                self.incarnation = None
                coordinator._queue.put(closure, front=True, new=False)
                continue
            except BaseException as error:  # noqa: BLE001 - belongs to this closure only
                error = coordinator._classify(error)
                closure.value._set_error(error)
                coordinator._queue.finished(error)
                continue
            coordinator.strategy.placement.stale()  # the ps values moved: re-read on next access
            closure.value._set_value(result)
            coordinator._queue.finished()

    def _prepare(self) -> None:
        for dataset_id, dataset_fn in list(self.coordinator._datasets.items()):
            if dataset_id not in self.datasets:
                self._call("create_dataset", {"dataset_id": dataset_id, "dataset_fn": dataset_fn})
                self.datasets.add(dataset_id)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return self.client.call(method, request, timeout=60.0)
        except UnavailableError as error:
            raise _WorkerLost() from error

    def _run(self, closure: _Closure) -> Any:
        key = self.coordinator._closure_key(closure.fn)
        request = {"key": key, "fn": None if key in self.cached else closure.fn,
                   "args": closure.args, "kwargs": closure.kwargs}
        future = self.client.call_async("run", request, timeout=RUN_TIMEOUT_SECONDS)
        self.cached.add(key)
        missed = 0
        while True:
            try:
                return future.result(timeout=PING_SECONDS)
            except TimeoutError:
                pass
            except UnavailableError as error:
                self.cached.discard(key)
                raise _WorkerLost() from error
            except RemoteError as error:
                if isinstance(error.remote_exception, ClosureNotCachedError):   # it restarted
                    self.cached.discard(key)
                    raise _WorkerLost() from error
                raise
            if self.coordinator._stopping.is_set():
                future.cancel()
                raise _WorkerLost()
            missed = 0 if self._ping(PING_SECONDS) else missed + 1
            if missed >= MISSED_PINGS:
                future.cancel()
                self.cached.discard(key)
                raise _WorkerLost()


class _WorkerLost(Exception):
    pass


class ClusterCoordinator:
    """Schedules functions onto the worker tasks of a ParameterServerStrategy.

    Example (inside a script run by ``stratagem launch --workers 2 --ps 1 train.py``)::

        # strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
        # coordinator = sg.ClusterCoordinator(strategy)
        # value = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        # coordinator.join(); print(value.fetch())
    """

    def __init__(self, strategy: ParameterServerStrategy):
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                f"ClusterCoordinator needs a sg.ParameterServerStrategy, got {type(strategy).__name__}")
        strategy.attach_coordinator(self)
        self.strategy = strategy
        strategy.placement.on_restored = self._variables_restored
        self._queue = _Queue()
        self._stopping = threading.Event()
        self._datasets: dict[str, Callable] = {}
        self._keys: "weakref.WeakKeyDictionary[Callable, str]" = weakref.WeakKeyDictionary()
        self._ps_failure: UnavailableError | None = None
        self._workers = [_Worker(self, i, address, strategy.cluster.token)
                         for i, address in enumerate(strategy.cluster.worker_addresses)]
        self._watchdog = threading.Thread(target=self._watch_ps, daemon=True, name="stratagem-ps-watchdog")
        self._watchdog.start()
        atexit.register(self.shutdown)  # threads inside gRPC calls at interpreter exit abort it

    # ------------------------------------------------------------------ API

    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns a RemoteValue at once."""
        if not callable(fn):
            raise InvalidArgumentError(f"schedule needs a callable, got {type(fn).__name__}")
        with label("stratagem.ps.schedule"):
            self._raise_if_ps_failed()
            placement = self.strategy.placement
            placement.finalize()
            placement.sync_hyperparameters()
            value = RemoteValue(self)
            self._queue.put(_Closure(fn, tuple(args), dict(kwargs or {}), value))
            return value

    def join(self) -> None:
        """Wait until every scheduled function has run; raise the first error, if any."""
        self._queue.wait_idle(self._raise_if_ps_failed)
        self._raise_if_ps_failed()
        if self._queue.errors:
            error, self._queue.errors = self._queue.errors[0], []
            raise error

    def done(self) -> bool:
        """Whether every scheduled function has run (errors are raised, as by join)."""
        self._raise_if_ps_failed()
        if self._queue.errors:
            error, self._queue.errors = self._queue.errors[0], []
            raise error
        return self._queue.idle

    def fetch(self, value: Any) -> Any:
        """``RemoteValue``s anywhere in a structure replaced by their fetched results."""
        return map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, value)

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """Run ``dataset_fn`` on every worker (with an ``InputContext`` if it takes one)."""
        if not callable(dataset_fn):
            raise InvalidArgumentError("dataset_fn must be callable: dataset_fn(input_context) -> iterable")
        dataset_id = uuid.uuid4().hex[:12]
        self._datasets[dataset_id] = dataset_fn
        return PerWorkerDataset(dataset_id)

    def shutdown(self) -> None:
        """Stop dispatching (closures still queued are not run) and wait for the threads to end.

        Calls in flight have deadlines, so this takes seconds even with dead peers.
        """
        self._stopping.set()
        for thread in [w.thread for w in self._workers] + [self._watchdog]:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)

    # ------------------------------------------------------------- internals

    def _closure_key(self, fn: Callable) -> str:
        try:
            key = self._keys.get(fn)
            if key is None:
                key = self._keys.setdefault(fn, uuid.uuid4().hex)
            return key
        except TypeError:  # not weak-referenceable: ship it every time
            return uuid.uuid4().hex

    def _raise_if_ps_failed(self) -> None:
        if self._ps_failure is not None:
            raise self._ps_failure

    def _classify(self, error: BaseException) -> BaseException:
        """A closure's error; one that says a parameter server is unavailable (a worker's
        pull or push failed) also fails everything after it."""
        remote = error.remote_exception if isinstance(error, RemoteError) else None
        ps_tasks = {client.task for client in self.strategy.cluster.ps_clients}
        if isinstance(remote, UnavailableError) and remote.task in ps_tasks:
            failure = UnavailableError(
                f"parameter server {remote.task} is unavailable: {error.remote_message}. Restart it "
                f"(stratagem launch --max-restarts restarts it) and restore the variables from the last "
                f"checkpoint with model.load_state_dict / optimizer.load_state_dict", task=remote.task)
            self._ps_failure = failure
            return failure
        return error

    def _watch_ps(self) -> None:
        clients = self.strategy.cluster.ps_clients
        while not self._stopping.wait(PING_SECONDS):
            if self._ps_failure is not None:
                continue
            for i, client in enumerate(clients):
                try:
                    client.call("ping", timeout=2 * PING_SECONDS)
                except Exception as error:  # noqa: BLE001 - unreachable means unavailable
                    self._ps_failure = UnavailableError(
                        f"parameter server ps {i} stopped answering ({error}). Restart it (stratagem "
                        f"launch --max-restarts restarts it) and restore the variables from the last "
                        f"checkpoint with model.load_state_dict / optimizer.load_state_dict", task=f"ps {i}")
                    break

    def _variables_restored(self) -> None:
        """The user restored the variables after a ps failure: scheduling may go on."""
        self._ps_failure = None
        self._queue.errors = [e for e in self._queue.errors if not isinstance(e, UnavailableError)]

"""The closure queue and the dispatcher thread that feeds one worker task.

Queue: ``put`` appends a closure; ``get`` hands the next one to a dispatcher; ``finished``
counts it done (with its error, if any). ``close(error)`` is the end of the queue after a
fatal error: every waiting closure fails with it, and so does any closure put back later.
The queue is bounded (back-pressure, as TensorFlow bounds its in-flight closures): a new
closure waits while ``max_queued`` closures are scheduled and unfinished (waiting or
running); a closure put back after a lost worker never waits. A waiting ``put`` polls its
``check`` and wakes at once when the queue is closed, so it never outlives a failure.

A dispatcher's states::

    probing --(ping answered by a worker)--------------> serving
    serving --(broken connection, 3 missed pings)-------> probing   (closure re-queued at the front,
                                                                      its gRPC call cancelled)
    probing/serving --(refused token, not a worker,
                       any unexpected error)------------> dead      (the coordinator fails with it)

The dead state is never silent: the closure the dispatcher held fails with the error,
``coordinator._fail`` closes the queue with it, and ``join()``/``fetch()`` raise it.

Each dispatch of a closure is a new *attempt*; its run request carries the fence that the
worker attaches to its pushes (:mod:`stratagem.ps.fencing`), so a closure re-queued while
its first execution still runs (a stopped worker resumes) applies each update at most once.
A closure that failed because a ps did not answer, or refused its pushes for a lapsed
lease, runs again (a few times at most) unless the coordinator has declared that ps lost;
once it has, no closure is run and the ones in flight fail.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from stratagem.ps.remote_value import RemoteValue
from stratagem.errors import ClusterConfigError, UnavailableError
from stratagem.metrics.base import accept_worker_deltas
from stratagem.ps.closures import ClosureNotCachedError, ClosurePickler
from stratagem.rpc import RemoteError, RpcClient
from stratagem.rpc.errors import AuthenticationError, ClockSkewError, RpcError

if TYPE_CHECKING:
    from stratagem.ps.coordinator import ClusterCoordinator

PING_SECONDS = 1.0
MISSED_PINGS = 3
RUN_TIMEOUT_SECONDS = 24 * 3600.0
MAX_CACHED_HINTS = 4096   # keys a dispatcher remembers having sent; only saves re-sending


class _Closure:
    """A scheduled function: ``seq`` numbers it at its coordinator, ``attempt`` counts its
    executions (each one's pushes are fenced, see :mod:`stratagem.ps.fencing`)."""

    __slots__ = ("fn", "args", "kwargs", "value", "seq", "attempt", "ps_retries")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, value: RemoteValue, seq: int = 0):
        self.fn, self.args, self.kwargs, self.value = fn, args, kwargs, value
        self.seq, self.attempt, self.ps_retries = seq, 0, 0


class _Queue:
    """Closures waiting to run, and a count of those scheduled but not finished."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Closure] = collections.deque()
        self._unfinished = 0
        self._seqs: list[int] = []         # heap of the unfinished closures' seqs (lazily pruned)
        self._done: set[int] = set()
        self._closed: BaseException | None = None
        self._next = 0                     # one more than the newest seq put
        self.errors: list[BaseException] = []

    def put(self, closure: _Closure, *, front: bool = False, new: bool = True,
            check: Callable[[], None] | None = None) -> None:
        """Append ``closure``; a new one first waits for room, calling ``check`` (which raises
        to give up) every 0.1 s."""
        with self._cond:
            while new and self._closed is None and self._unfinished >= self.max_queued:
                self._cond.wait(0.1)
                if check is not None:
                    check()
            if self._closed is not None and check is not None:
                check()
            if new:
                self._unfinished += 1
                heapq.heappush(self._seqs, closure.seq)
                self._next = max(self._next, closure.seq + 1)
            if self._closed is not None:
                self._fail(closure, self._closed)
                return
            (self._waiting.appendleft if front else self._waiting.append)(closure)
            self._cond.notify_all()

    def get(self, timeout: float) -> _Closure | None:
        with self._cond:
            if not self._waiting:
                self._cond.wait(timeout)
            return self._waiting.popleft() if self._waiting else None

    def finished(self, closure: _Closure, error: BaseException | None = None) -> None:
        with self._cond:
            self._unfinished -= 1
            self._done.add(closure.seq)
            if error is not None:
                self.errors.append(error)
            self._cond.notify_all()

    def close(self, error: BaseException) -> None:
        """Fail every waiting closure, and every one put later, with ``error``."""
        with self._cond:
            if self._closed is None:
                self._closed = error
                self.errors.append(error)
            while self._waiting:
                self._fail(self._waiting.popleft(), error)
            self._cond.notify_all()

    def _fail(self, closure: _Closure, error: BaseException) -> None:   # holding the lock
        closure.value._set_error(error)
        self._unfinished -= 1
        self._done.add(closure.seq)
        self._cond.notify_all()

    def drain(self, error: BaseException) -> None:
        """Fail every waiting closure with ``error`` (the queue stays open)."""
        with self._cond:
            while self._waiting:
                self._fail(self._waiting.popleft(), error)

    @property
    def floor(self) -> int:
        """The smallest seq of an unfinished closure, or of the next one (every older one has finished)."""
        with self._cond:
            while self._seqs and self._seqs[0] in self._done:
                self._done.discard(heapq.heappop(self._seqs))
            return self._seqs[0] if self._seqs else self._next

    def wait_idle(self, check: Callable[[], None], deadline: float | None = None) -> bool:
        """Wait until nothing is unfinished (True) or ``deadline`` (monotonic) passes (False)."""
        with self._cond:
            while self._unfinished:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cond.wait(0.2 if deadline is None else min(0.2, max(deadline - time.monotonic(), 0)))
                check()
            return True

    @property
    def unfinished(self) -> int:
        with self._cond:
            return self._unfinished


class _WorkerLost(Exception):
    pass


class _NotCached(Exception):
    pass


class _Worker:
    """One worker task and the dispatcher thread that feeds it.

    ``last_answer`` (monotonic) is when the task last answered; ``incarnation`` is None
    while it is lost or not yet seen.
    """

    def __init__(self, coordinator: ClusterCoordinator, index: int, address: str, token: str):
        self.coordinator = coordinator
        self.index = index
        self.name = f"worker {index}"
        self.client = RpcClient(address, token, task=self.name, default_timeout=10.0, pickler=ClosurePickler)
        self.incarnation: str | None = None
        self.last_answer = time.monotonic()
        self.cached: set[str] = set()
        self.datasets: set[str] = set()
        self.releases: collections.deque[tuple[str, str | None]] = collections.deque()
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"stratagem-dispatch-{index}")
        self.thread.start()

    @property
    def who(self) -> str:
        return f"{self.name} ({self.client.address})"

    def _ping(self, timeout: float) -> bool:
        try:
            answer = self.client.call("ping", {"coordinator": self.coordinator.id}, timeout=timeout)
        except AuthenticationError as error:
            raise self._token_error(error) from error
        except ClusterConfigError as error:   # the address serves a task of another name
            raise ClusterConfigError(f"{self.who} is not a worker task, or not the one listed "
                                     f"there: {error}") from None
        except Exception:  # noqa: BLE001 - any other failure means: not available now
            return False
        if not isinstance(answer, dict) or answer.get("kind") != "worker":
            said = f", and calls itself {answer['name']!r}" if isinstance(answer, dict) and "name" in answer else ""
            raise ClusterConfigError(
                f"{self.who} is not a worker task: it answered the coordinator's ping with "
                f"{sorted(answer) if isinstance(answer, dict) else type(answer).__name__}{said}, where "
                "a worker answers with its incarnation. The cluster's 'worker' list names another "
                "task's address (a parameter server's, spelled differently?); fix the cluster "
                "description (TF_CONFIG).")
        self.last_answer = time.monotonic()
        if answer["incarnation"] != self.incarnation:  # a new process: it knows nothing yet
            self.incarnation = answer["incarnation"]
            self.cached.clear()
            self.datasets.clear()
        return True

    def _token_error(self, error: AuthenticationError) -> AuthenticationError:
        if isinstance(error, ClockSkewError):   # says the cause first (the clocks) and names the worker
            return error
        return AuthenticationError(
            f"{self.who} refused the coordinator's requests or its replies failed the check: its "
            "cluster token (STRATAGEM_CLUSTER_TOKEN) differs from the coordinator's. Every task of a "
            "cluster must be started with the same token (`stratagem launch` gives all its tasks "
            f"one); their clocks must also agree within 5 minutes. ({error})")

    def _loop(self) -> None:
        coordinator = self.coordinator
        closure: _Closure | None = None
        try:
            while not coordinator._stopping.is_set():
                closure = None
                if self.incarnation is None and not self._ping(2.0):  # lost or not yet seen: probe
                    coordinator._stopping.wait(0.2)
                    continue
                closure = coordinator._queue.get(timeout=0.5)
                if closure is not None:
                    self._serve(closure)
        except BaseException as error:  # noqa: BLE001 - a dispatcher never dies silently
            error = self._explain(error)
            if closure is not None:
                closure.value._set_error(error)
                coordinator._queue.finished(closure, error)
            coordinator._fail(error)

    def _serve(self, closure: _Closure) -> None:
        """Run one closure; a fatal error (refused token, not a worker) propagates."""
        coordinator = self.coordinator
        queue = coordinator._queue
        lost = coordinator._ps_failure
        if lost is not None:   # a ps declared lost applies nothing more: run nothing
            closure.value._set_error(lost)
            queue.finished(closure, lost)
            return
        generation, restores = coordinator._ps_watch.generation, coordinator._restores
        try:
            coordinator._wait_leased()
            self._prepare()
            closure.attempt += 1
            result = self._run(closure)
            if coordinator._ps_watch.generation != generation:   # a ps was lost meanwhile
                raise coordinator._ps_watch.last_failure  # type: ignore[misc]
        except _WorkerLost:
            self.incarnation = None
            queue.put(closure, front=True, new=False)
            return
        except (AuthenticationError, ClusterConfigError):
            raise
        except BaseException as error:  # noqa: BLE001 - belongs to this closure only
            if self._misconfigured(error):
                raise
            if coordinator._ps_watch.generation != generation:   # it ran into a lost ps
                error = coordinator._ps_watch.last_failure  # type: ignore[assignment]
                if coordinator._restores != restores:   # raised and restored since: join() is past it
                    closure.value._set_error(error)
                    queue.finished(closure)
                    return
            else:
                error = coordinator._classify(error)
                if coordinator._retry_for_ps(closure, error):   # a ps stalled: run it again
                    queue.put(closure, front=True, new=False)
                    return
            closure.value._set_error(error)
            queue.finished(closure, error)
            return
        placement = coordinator.strategy.placement
        placement.stale()  # the ps values moved: re-read on next access
        if result["buffers_written"]:   # they stay on the worker: reading them here warns
            placement.buffers_written_on_workers(result["buffers_written"])
        if result.get("metrics"):   # this run's metric updates count, and only this run's
            accept_worker_deltas(coordinator.strategy, result["metrics"])
        closure.value._set_value(result["result"])
        queue.finished(closure)

    def _misconfigured(self, error: BaseException) -> bool:
        """The task has no handler for a worker's methods (told by status code, not text)."""
        remote = error.remote_exception if isinstance(error, RemoteError) else error
        return isinstance(remote, RpcError) and remote.code == "UNIMPLEMENTED"

    def _explain(self, error: BaseException) -> BaseException:
        if isinstance(error, AuthenticationError) and self.name not in str(error):
            return self._token_error(error)
        if self._misconfigured(error):
            return ClusterConfigError(
                f"{self.who} is not a worker task: it has no handler for the coordinator's "
                f"requests ({error}). Fix the cluster's 'worker' list (TF_CONFIG).")
        if isinstance(error, Exception) and not isinstance(error, (ClusterConfigError, AuthenticationError)):
            error.add_note(f"(raised in the ClusterCoordinator's dispatcher thread of {self.who})")
        return error

    def _prepare(self) -> None:
        for dataset_id, dataset_fn in list(self.coordinator._datasets.items()):
            if dataset_id not in self.datasets:
                self._call("create_dataset", {"dataset_id": dataset_id, "dataset_fn": dataset_fn})
                self.datasets.add(dataset_id)

    def _call(self, method: str, request: Any) -> Any:
        try:
            result = self.client.call(method, request, timeout=60.0)
        except UnavailableError as error:
            raise _WorkerLost() from error
        self.last_answer = time.monotonic()
        return result

    def release(self, dataset_id: str, iterator_id: str | None) -> None:
        """The coordinator no longer references this dataset (iterator_id None) or iterator:
        the worker drops it with the next ``run`` it is sent."""
        if iterator_id is None:
            self.datasets.discard(dataset_id)
        self.releases.append((dataset_id, iterator_id))

    def _run(self, closure: _Closure) -> Any:
        key = self.coordinator._closure_key(closure.fn)
        try:
            return self._run_once(closure, key, send=key not in self.cached)
        except _NotCached:   # evicted from the worker's bounded cache, or the worker restarted
            if not self._ping(2.0):
                raise _WorkerLost() from None
            self._prepare()  # (re-creates the datasets if it is a new process)
            return self._run_once(closure, key, send=True)

    def _run_once(self, closure: _Closure, key: str, send: bool) -> Any:
        releases = []
        while self.releases:
            releases.append(self.releases.popleft())
        coordinator = self.coordinator
        fence = {"coordinator": coordinator.id, "closure": closure.seq, "attempt": closure.attempt,
                 "floor": coordinator._queue.floor}
        request = {"key": key, "fn": closure.fn if send else None, "fence": fence,
                   "args": closure.args, "kwargs": closure.kwargs, "release": releases}
        future = self.client.call_async("run", request, timeout=RUN_TIMEOUT_SECONDS)
        if len(self.cached) >= MAX_CACHED_HINTS:
            self.cached.clear()
        self.cached.add(key)
        missed = 0
        while True:
            try:
                result = future.result(timeout=PING_SECONDS)
                self.last_answer = time.monotonic()
                return result
            except TimeoutError:
                pass
            except UnavailableError as error:
                self.cached.discard(key)
                raise _WorkerLost() from error
            except RemoteError as error:
                if isinstance(error.remote_exception, ClosureNotCachedError):   # evicted, or restarted
                    self.cached.discard(key)
                    if send:     # it had the function and still lacks it: something else is wrong
                        raise
                    raise _NotCached() from error
                raise
            if coordinator._stopping.is_set():
                future.cancel()
                raise _WorkerLost()
            if coordinator._ps_failure is not None:   # its pushes would be refused anyway
                future.cancel()
                raise coordinator._ps_failure
            missed = 0 if self._ping(PING_SECONDS) else missed + 1
            if missed >= MISSED_PINGS:
                future.cancel()
                self.cached.discard(key)
                raise _WorkerLost()

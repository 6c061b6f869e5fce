"""The dispatcher thread that feeds one worker task closures from its coordinator's queue.

A dispatcher reaches its coordinator only through the
:class:`~stratagem.ps.coordinator_link.CoordinatorLink` it is given (the queue of
:mod:`stratagem.ps.closure_queue`, the fatal-error callback, the datasets, the fence's id)
and the coordinator's :class:`~stratagem.ps.health.PsWatchdog` (the ps-health verdict).

A dispatcher's states::

    probing --(ping answered by a worker)--------------> serving
    serving --(broken connection, 3 missed pings)-------> probing   (closure re-queued at the front,
                                                                      its gRPC call cancelled)
    probing/serving --(refused token, not a worker,
                       any unexpected error)------------> dead      (the coordinator fails with it)

The dead state is never silent: the closure the dispatcher held fails with the error,
the link's ``fail`` closes the queue with it, and ``join()``/``fetch()`` raise it.

Each dispatch of a closure is a new *attempt*; its run request carries the fence that the
worker attaches to its pushes (:mod:`stratagem.ps.fencing`), so a closure re-queued while
its first execution still runs (a stopped worker resumes) applies each update at most once.
A closure that failed because a ps did not answer, or refused its pushes for a lapsed
lease, runs again (a few times at most) unless the coordinator has declared that ps lost;
once it has, no closure is run and the ones in flight fail. A closure scheduled before a
loss fails with it however it ends -- also when it ends, or is only about to start, after
the user restored the variables (:meth:`~stratagem.ps.health.PsWatchdog.lost_since`).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from stratagem.errors import ClusterConfigError, UnavailableError
from stratagem.metrics.base import accept_worker_deltas
from stratagem.observe import record
from stratagem.ps.closure_queue import _Closure
from stratagem.ps.closures import ClosureNotCachedError, ClosurePickler
from stratagem.ps.coordinator_link import CoordinatorLink
from stratagem.ps.health import PsWatchdog
from stratagem.rpc import RemoteError, RpcClient
from stratagem.rpc.errors import AuthenticationError, ClockSkewError, RpcError

PING_SECONDS = 1.0
MISSED_PINGS = 3
RUN_TIMEOUT_SECONDS = 24 * 3600.0
MAX_CACHED_HINTS = 4096   # keys a dispatcher remembers having sent; only saves re-sending


class _WorkerLost(Exception):
    pass


class _NotCached(Exception):
    pass


class _Worker:
    """One worker task and the dispatcher thread that feeds it.

    ``last_answer`` (monotonic) is when the task last answered; ``incarnation`` is None
    while it is lost or not yet seen. ``link`` is all it uses of its coordinator, ``ps`` the
    coordinator's ps watchdog.
    """

    def __init__(self, link: CoordinatorLink, ps: PsWatchdog, index: int, address: str):
        self.link = link
        self.ps = ps
        self.index = index
        self.name = f"worker {index}"
        self.client = RpcClient(address, link.strategy.cluster.token, task=self.name, default_timeout=10.0,
                                pickler=ClosurePickler)
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
            answer = self.client.call("ping", {"coordinator": self.link.id}, timeout=timeout)
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
        link = self.link
        closure: _Closure | None = None
        try:
            while not link.stopping.is_set():
                closure = None
                if self.incarnation is None and not self._ping(2.0):  # lost or not yet seen: probe
                    link.stopping.wait(0.2)
                    continue
                closure = link.queue.get(timeout=0.5)
                if closure is not None:
                    self._serve(closure)
        except BaseException as error:  # noqa: BLE001 - a dispatcher never dies silently
            error = self._explain(error)
            if closure is not None:
                closure.value._set_error(error)
                link.queue.finished(closure, error)
            link.fail(error)

    def _serve(self, closure: _Closure) -> None:
        """Run one closure; a fatal error (refused token, not a worker) propagates."""
        queue, ps = self.link.queue, self.ps
        lost = ps.failure or ps.lost_since(closure)
        if lost is not None:   # a ps declared lost applies nothing more: run nothing
            self._fail_with_loss(closure, lost)
            return
        try:
            ps.wait_leased()
            self._prepare()
            self._raise_if_lost_since(closure)    # (the datasets may take long to create)
            closure.attempt += 1
            with record.span("closure", "closure", {"worker": self.index, "attempt": closure.attempt}):
                result = self._run(closure)   # (on the timeline: sent, run on the worker, answered)
            self._raise_if_lost_since(closure)    # it ended after a loss: it fails with it
        except _WorkerLost:
            self.incarnation = None
            queue.put(closure, front=True, new=False)
            return
        except (AuthenticationError, ClusterConfigError):
            raise
        except BaseException as error:  # noqa: BLE001 - belongs to this closure only
            if self._misconfigured(error):
                raise
            lost = ps.lost_since(closure)
            if lost is not None:   # it ran into a lost ps: it fails with the loss
                self._fail_with_loss(closure, lost)
                return
            error = ps.classify(error)
            if ps.retry(closure, error):   # a ps stalled: run it again
                queue.put(closure, front=True, new=False)
                return
            error = ps.located(error)   # a ps call that timed out: where each task stands
            closure.value._set_error(error)
            queue.finished(closure, error)
            return
        strategy = self.link.strategy
        strategy.placement.stale()  # the ps values moved: re-read on next access
        if result["buffers_written"]:   # they stay on the worker: reading them here warns
            strategy.placement.buffers_written_on_workers(result["buffers_written"])
        if result.get("metrics"):   # this run's metric updates count, and only this run's
            accept_worker_deltas(strategy, result["metrics"])
        self.link.traffic.add(self.index, result.get("traffic"))   # (the TensorBoard callback's ps scalars)
        closure.value._set_value(result["result"])
        queue.finished(closure)

    def _raise_if_lost_since(self, closure: _Closure) -> None:
        lost = self.ps.lost_since(closure)
        if lost is not None:
            raise lost

    def _fail_with_loss(self, closure: _Closure, lost: UnavailableError) -> None:
        """``closure`` fails with a ps loss; join() raises it too, unless the variables were
        restored since (the user has seen the loss: join() is past it)."""
        closure.value._set_error(lost)
        ps = self.ps
        self.link.queue.finished(closure, lost, keep=lambda: ps.failure is not None)

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
        for dataset_id, dataset_fn in list(self.link.datasets.items()):
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
        key = self.link.closure_key(closure.fn)
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
        link = self.link
        fence = {"coordinator": link.id, "closure": closure.seq, "attempt": closure.attempt,
                 "floor": link.queue.floor}
        request = {"key": key, "fn": closure.fn if send else None, "fence": fence,
                   "args": closure.args, "kwargs": closure.kwargs, "release": releases,
                   "writes": link.strategy.placement.writes}   # (values prefetched before a write are old)
        try:   # (on the worker's lane: sent, and its reply awaited, from this thread)
            future = self.client.start("run", request, timeout=RUN_TIMEOUT_SECONDS)
        except UnavailableError as error:   # its lane's session or the request did not go through
            raise _WorkerLost() from error
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
            if link.stopping.is_set():
                future.cancel()
                raise _WorkerLost()
            lost = self.ps.failure
            if lost is not None:   # its pushes would be refused anyway
                future.cancel()
                raise lost
            missed = 0 if self._ping(PING_SECONDS) else missed + 1
            if missed >= MISSED_PINGS:
                future.cancel()
                self.cached.discard(key)
                raise _WorkerLost()

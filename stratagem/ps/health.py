"""When a parameter server counts as lost, and the leases that make a lost ps apply nothing.

The coordinator's watchdog thread renews a lease on every ps once a second
(``renew_lease``, see :mod:`stratagem.ps.fencing`): the ps applies the pushes of this
coordinator's closures only while the lease runs, ``ps_timeout / 2`` seconds from the
last renewal. A ps is declared **lost** when

- it has not renewed a lease for ``ps_timeout`` seconds (several missed heartbeats) and a
  call over a fresh connection fails too -- a ps stopped for a few seconds, or briefly
  overloaded, is not lost, and the steps waiting on it go on when it answers; or
- it answers as a new process (another incarnation): it was restarted, and the variables
  it held are gone.

By the time the first happens the lease has run out on the ps for at least
``ps_timeout / 2`` seconds, so a ps that was only stopped and resumes applies nothing
more: its queued pushes are refused. Once a ps is declared lost the coordinator runs no
closure, fails the waiting ones and the running ones with :class:`UnavailableError`
naming the ps, and ``schedule``/``join``/``fetch`` raise it until the user restores the
variables (``model.load_state_dict`` / ``optimizer.load_state_dict``), which renews the
leases. The error says where every task stands (:func:`stratagem.observe.hang_report.report`,
a few seconds at most, under ``stratagem launch``): a ps that does not answer, with its state
(stopped, say) and the last call it completed (method, bytes); each worker's call in flight
and its line of the script; the full stacks in a file it names. So does the error of a
closure whose ps call timed out and that is not run again (:meth:`PsWatchdog.located`).

A closure scheduled before a loss fails with it even when it ends after the restore --
it was held by a dispatcher (creating a worker's datasets, say) or still running on its
worker: it never starts after the restore, and nothing it pushes after the restore is
applied, because the first renewal after a restore carries a floor above every closure
scheduled before it (a ps refuses the pushes of closures below the floor,
:mod:`stratagem.ps.fencing`). The user restores from a checkpoint and schedules those
steps again: each update is applied once.

The watchdog also judges the errors of closures for the dispatchers: which come from a ps
(one that stalled or lapsed its lease: the closure runs again, a few times at most; one
declared lost: it fails with the loss), and which say another coordinator took the ps over.
It reaches its coordinator only through the :class:`~stratagem.ps.coordinator_link.CoordinatorLink`
it is given.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from stratagem.errors import UnavailableError
from stratagem.observe import hang_report
from stratagem.ps.client import ParameterServerClient
from stratagem.ps.closure_queue import _Closure
from stratagem.ps.coordinator_link import CoordinatorLink
from stratagem.ps.fencing import LeaseExpiredError
from stratagem.ps.ownership import FencedError
from stratagem.rpc import RemoteError

__all__ = ["PsWatchdog"]

HEARTBEAT_SECONDS = 1.0
RECONNECT_TIMEOUT_SECONDS = 2.0
MAX_PS_RETRIES = 5     # runs of one closure that failed because a ps stalled
COORDINATOR_TASK = "chief"   # this process in a hang report made outside `stratagem launch`
_RESTORE = ("Restart it (stratagem launch --max-restarts restarts it) and restore the variables from "
            "the last checkpoint with model.load_state_dict / optimizer.load_state_dict")


class PsWatchdog:
    """Renews this coordinator's leases on the parameter servers and judges them lost.

    ``failure`` is the :class:`UnavailableError` of the first ps declared lost (None while
    all count as alive, and again once the variables were restored); ``leased`` is set once
    every ps has granted a first lease. ``losses`` counts the losses declared and
    ``last_failure`` is the latest one's error: a closure scheduled when ``losses`` was
    lower fails with it, even if it ends after the restore (:meth:`lost_since`).
    """

    def __init__(self, link: CoordinatorLink, ps_timeout: float) -> None:
        self.link = link
        self.ps_timeout = ps_timeout
        self.lease_s = ps_timeout / 2
        self.cluster = link.strategy.cluster
        self.clients = self.cluster.ps_clients
        self.failure: UnavailableError | None = None
        self.losses = 0
        self.last_failure: UnavailableError | None = None
        self._floor = 0     # closures older than this were scheduled before the last restore
        self.leased = threading.Event()
        now = time.monotonic()
        self._last_renewed = [now] * len(self.clients)
        self._incarnations: list[str | None] = [None] * len(self.clients)
        self._granted = [False] * len(self.clients)
        self._expired: set[int] = set()
        self._lock = threading.Lock()   # the watchdog thread and restored() both run rounds
        if not self.clients:
            self.leased.set()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="stratagem-ps-watchdog")
        self.thread.start()

    def _loop(self) -> None:
        stopping = self.link.stopping
        while not stopping.is_set():
            try:
                self.heartbeat()
            except Exception as error:  # noqa: BLE001 - the watchdog never dies silently
                self.link.fail(error)
                return
            stopping.wait(HEARTBEAT_SECONDS)

    def heartbeat(self) -> bool:
        """One round: renew every lease at once; declare lost what has been silent too long.
        True when every ps answered as the process it was (nothing left to judge)."""
        with self._lock:
            return self._round()

    def _round(self) -> bool:
        if self.failure is not None:
            self._expire_lost()
            return False
        sent = time.monotonic()
        request = {"coordinator": self.link.id, "lease_s": self.lease_s, "sent_at": time.time(),
                   # older closures have finished, or belong to before a restore
                   "floor": max(self.link.queue.floor, self._floor)}
        calls = [client.rpc.call_async("renew_lease", request, timeout=2 * HEARTBEAT_SECONDS)
                 for client in self.clients]   # (a restarted ps: a hello and the call again)
        answered = 0
        for i, call in enumerate(calls):
            try:
                answer = call.result()
            except Exception as error:  # noqa: BLE001 - not answering in time is what is judged below
                fenced = getattr(error, "remote_exception", None)
                if isinstance(fenced, FencedError):   # another coordinator took this ps over
                    self.cluster.tenure.replaced(fenced)
                    return
                answer = None
            if answer is not None and self._check_incarnation(i, answer):
                answered += 1
                if answer.get("renewed"):
                    self._last_renewed[i] = sent
                    self._granted[i] = True
            elif answer is None and time.monotonic() - self._last_renewed[i] > self.ps_timeout:
                if not self._reconnects(i):
                    self._declare_lost(i, f"it has not answered for {time.monotonic() - self._last_renewed[i]:.0f} s "
                                          f"(ps_timeout={self.ps_timeout:g} s), nor over a fresh connection")
            if self.failure is not None:
                return False
        if all(self._granted):
            self.leased.set()
        return answered == len(calls)

    def _check_incarnation(self, i: int, answer: Any) -> bool:
        incarnation = answer.get("incarnation") if isinstance(answer, dict) else None
        known = self._incarnations[i]
        if known is not None and incarnation != known:
            self._declare_lost(i, "it was restarted (it answers as a new process), so the variables "
                                  "it held are gone")
            return False
        self._incarnations[i] = incarnation
        return True

    def _reconnects(self, i: int) -> bool:
        """Whether ps ``i`` answers a ping over a new connection (the old one may be wedged)."""
        old = self.clients[i]
        with ParameterServerClient(old.rpc.address, self.cluster.token,
                                   task=old.task) as fresh:
            try:
                answer = fresh.call("ping", timeout=RECONNECT_TIMEOUT_SECONDS)
            except Exception:  # noqa: BLE001
                return False
        if self._check_incarnation(i, answer):   # (a new process is lost all the same)
            self._last_renewed[i] = time.monotonic() - self.lease_s   # alive: wait some more
        return True

    def _declare_lost(self, i: int, why: str) -> None:   # holding the lock
        task = self.clients[i].task
        self.failure = UnavailableError(
            f"parameter server {task} is lost: {why}. Nothing more is applied to it: the steps "
            f"waiting or running fail with this error. {_RESTORE}. Where the tasks stand:\n"
            f"{hang_report.report(COORDINATOR_TASK)}", task=task)   # (bounded: a few seconds)
        self.last_failure = self.failure
        self.losses += 1    # (after last_failure: whoever sees the count sees the error)
        self._expired.clear()
        self.link.queue.drain(self.failure)   # the waiting closures fail; the running ones' dispatchers see it

    def _expire_lost(self) -> None:
        """While a ps counts as lost, end this coordinator's lease on every ps that answers
        (belt and braces: a stopped ps's lease has run out already)."""
        for i, client in enumerate(self.clients):
            if i in self._expired:
                continue
            try:
                client.call("expire_lease", coordinator=self.link.id, timeout=HEARTBEAT_SECONDS)
                self._expired.add(i)
            except Exception:  # noqa: BLE001 - still unreachable: try again next round
                pass

    def restored(self) -> None:
        """The user restored the variables: count every ps as alive and renew the leases now.
        After a loss, the renewal's floor is raised above every closure scheduled so far: the
        pushes of those still running are refused from now on."""
        with self._lock:
            if self.failure is not None:
                self._floor = max(self._floor, self.link.queue.next_seq)
            self.failure = None
            now = time.monotonic()
            self._last_renewed = [now] * len(self.clients)
            self._incarnations = [None] * len(self.clients)
            self._round()

    def lost_since(self, closure: _Closure) -> UnavailableError | None:
        """The error of a ps loss declared after ``closure`` was scheduled, if any (the
        latest one's): such a closure fails with it, however it ended."""
        return self.last_failure if self.losses != closure.losses else None

    def release(self) -> None:
        """The coordinator shuts down: end its leases (best effort, bounded)."""
        calls = []
        for client in self.clients:
            try:
                calls.append(client.rpc.call_async("expire_lease", {"coordinator": self.link.id},
                                                   timeout=HEARTBEAT_SECONDS))
            except Exception:  # noqa: BLE001
                pass
        for call in calls:
            try:
                call.result()
            except Exception:  # noqa: BLE001 - a dead ps holds no lease worth ending
                pass

    def wait_leased(self) -> None:
        """Wait until every ps has granted the coordinator a lease (before the first step)."""
        while not self.leased.wait(0.2):
            self.link.check()

    def retry(self, closure: _Closure, error: BaseException) -> bool:
        """Whether a closure that failed because a ps did not answer in time, or refused its
        pushes for a lapsed lease, should run again: yes, a few times, unless the ps has been
        declared lost (each update still applies at most once: the pushes are fenced).
        ``error`` is what :meth:`classify` made of the closure's error."""
        if self.failure is not None or closure.ps_retries >= MAX_PS_RETRIES:
            return False
        if any(isinstance(cause, LeaseExpiredError) or (isinstance(cause, UnavailableError) and self._is_ps(cause))
               for cause in _causes(error)):
            closure.ps_retries += 1
            self.link.stopping.wait(1.0)   # the next heartbeat renews the lease
            return True
        return False

    def located(self, error: BaseException) -> BaseException:
        """``error``, about to fail a closure, with where every task stands added (as a note) when
        a ps did not answer one of its calls in time and is not declared lost (a lost ps's error
        says it already)."""
        timed_out = any(isinstance(cause, UnavailableError) and self._is_ps(cause) for cause in _causes(error))
        if timed_out and error is not self.failure and error is not self.last_failure:
            error.add_note(f"Where the tasks stand:\n{hang_report.report(COORDINATOR_TASK)}")
        return error

    def _is_ps(self, error: BaseException) -> bool:
        return getattr(error, "task", None) in {c.task for c in self.clients}

    def _ps_in_chain(self, error: BaseException) -> bool:
        """Whether a ps raised or failed somewhere in ``error``'s chain of remote calls."""
        ps_tasks = {c.task for c in self.clients}
        return any(self._is_ps(cause) or any(task in ps_tasks for _, task in getattr(cause, "chain", ()))
                   for cause in _causes(error))

    def classify(self, error: BaseException) -> BaseException:
        """A closure's error; the lost ps's error once one is declared lost (a step that
        failed on a ps -- one restarted empty, say -- first makes the watchdog look, once).
        A remote error loses the dispatcher thread's frames (the RPC's): its message has
        the frames that matter."""
        if isinstance(error, RemoteError):
            error.with_traceback(None)
        fenced = next((cause for cause in _causes(error) if isinstance(cause, FencedError)), None)
        if fenced is not None:   # this program was taken over: fatal (the tenure tells the coordinator)
            return self.cluster.tenure.replaced(fenced)
        # Until every ps has answered a round as the process it was (the error is the closure's
        # own), or one is declared lost. Not a fixed number of rounds: a channel that saw its ps
        # die fails its calls at once for up to a second of reconnection backoff, and a restarted
        # ps's first answer needs a new handshake, so back-to-back rounds can all come back
        # empty while the ps the closure reached has been running, empty, for a while. Bounded:
        # a ps silent for ps_timeout is judged by the round itself.
        deadline = time.monotonic() + self.ps_timeout + 2 * RECONNECT_TIMEOUT_SECONDS
        while self.failure is None and self._ps_in_chain(error):
            if self.heartbeat() or time.monotonic() >= deadline or self.link.stopping.wait(0.1):
                break
        return self.failure or error


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the remote exceptions it carries, outermost first."""
    cause: BaseException | None = error
    while cause is not None:
        yield cause
        cause = getattr(cause, "remote_exception", None)

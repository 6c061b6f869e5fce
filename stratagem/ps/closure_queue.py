"""The closure queue of a :class:`~stratagem.ClusterCoordinator`: what its dispatchers run.

``put`` appends a closure; ``get`` hands the next one to a dispatcher; ``finished``
counts it done (with its error, if any). ``close(error)`` is the end of the queue after a
fatal error: every waiting closure fails with it, and so does any closure put back later.
The queue is bounded (back-pressure, as TensorFlow bounds its in-flight closures): a new
closure waits while ``max_queued`` closures are scheduled and unfinished (waiting or
running); a closure put back after a lost worker never waits. A waiting ``put`` polls its
``check`` and wakes at once when the queue is closed, so it never outlives a failure.
``floor`` is the oldest unfinished closure's number: the fences of
:mod:`stratagem.ps.fencing` carry it, so a ps forgets what older closures pushed.
``errors`` are what ``join()`` raises next; ``clear_errors`` forgets them (the variables were
restored after a ps loss), and ``finished`` records an error only if its ``keep`` says so at
that moment, under the queue's lock: an error decided before a restore is never recorded
after it.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from typing import Callable

from stratagem.ps.remote_value import RemoteValue


class _Closure:
    """A scheduled function: ``seq`` numbers it at its coordinator, ``attempt`` counts its
    executions (each one's pushes are fenced, see :mod:`stratagem.ps.fencing`); ``losses`` is
    how many ps losses its coordinator had declared when it was scheduled (one declared
    since fails it: :class:`~stratagem.ps.health.PsWatchdog`)."""

    __slots__ = ("fn", "args", "kwargs", "value", "seq", "attempt", "ps_retries", "losses")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, value: RemoteValue, seq: int = 0,
                 losses: int = 0):
        self.fn, self.args, self.kwargs, self.value = fn, args, kwargs, value
        self.seq, self.attempt, self.ps_retries, self.losses = seq, 0, 0, losses


class _Queue:
    """Closures waiting to run, and a count of those scheduled but not finished."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        # one lock, three kinds of waiters, each woken only for its own event: dispatchers for a
        # closure to run, ``put`` for room, ``wait_idle`` for the last closure's end (waking every
        # thread at every event cost each closure a few needless context switches)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
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
        with self._lock:
            while new and self._closed is None and self._unfinished >= self.max_queued:
                self._room.wait(0.1)
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
            self._ready.notify()

    def get(self, timeout: float) -> _Closure | None:
        with self._lock:
            if not self._waiting:
                self._ready.wait(timeout)
            return self._waiting.popleft() if self._waiting else None

    def finished(self, closure: _Closure, error: BaseException | None = None, *,
                 keep: Callable[[], bool] | None = None) -> None:
        """``closure`` is done; ``join()`` raises ``error`` next, unless ``keep`` (asked under
        the queue's lock) says no."""
        with self._lock:
            self._unfinished -= 1
            self._done.add(closure.seq)
            if error is not None and (keep is None or keep()):
                self.errors.append(error)
            self._ended()

    def clear_errors(self) -> None:
        """Forget the errors ``join()`` would raise (the variables were restored after a loss)."""
        with self._lock:
            self.errors = []

    def close(self, error: BaseException) -> None:
        """Fail every waiting closure, and every one put later, with ``error``."""
        with self._lock:
            if self._closed is None:
                self._closed = error
                self.errors.append(error)
            while self._waiting:
                self._fail(self._waiting.popleft(), error)
            for waiters in (self._ready, self._room, self._idle):
                waiters.notify_all()

    def _fail(self, closure: _Closure, error: BaseException) -> None:   # holding the lock
        closure.value._set_error(error)
        self._unfinished -= 1
        self._done.add(closure.seq)
        self._ended()

    def _ended(self) -> None:   # holding the lock: one closure fewer is unfinished
        self._room.notify()
        if not self._unfinished or self.errors:
            self._idle.notify_all()

    def drain(self, error: BaseException) -> None:
        """Fail every waiting closure with ``error`` (the queue stays open)."""
        with self._lock:
            while self._waiting:
                self._fail(self._waiting.popleft(), error)

    @property
    def floor(self) -> int:
        """The smallest seq of an unfinished closure, or of the next one (every older one has finished)."""
        with self._lock:
            while self._seqs and self._seqs[0] in self._done:
                self._done.discard(heapq.heappop(self._seqs))
            return self._seqs[0] if self._seqs else self._next

    def wait_idle(self, check: Callable[[], None], deadline: float | None = None) -> bool:
        """Wait until nothing is unfinished (True) or ``deadline`` (monotonic) passes (False)."""
        with self._lock:
            while self._unfinished:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._idle.wait(0.2 if deadline is None else min(0.2, max(deadline - time.monotonic(), 0)))
                check()
            return True

    @property
    def next_seq(self) -> int:
        """One more than the newest closure's seq put so far."""
        with self._lock:
            return self._next

    @property
    def unfinished(self) -> int:
        with self._lock:
            return self._unfinished

"""RemoteValue: the future result of a scheduled function.

States and transitions::

    PENDING --(a worker ran it)--> READY        fetch() returns the value
    PENDING --(it raised)--------> FAILED       fetch() raises the error
    PENDING --(worker lost)------> PENDING      re-queued, runs again on another worker

A closure whose worker dies stays PENDING and is scheduled again, so a RemoteValue
is only ever set once. ``fetch(timeout=)`` raising ``TimeoutError`` or
``UnavailableError`` (no worker answering) changes nothing: the value stays PENDING.

A RemoteValue does not hold its coordinator: the coordinator gives it ``check``, a
callback that raises what makes waiting pointless (a fatal error, a lost ps, no worker
answering, shutdown), which ``fetch`` calls while it waits.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Any, Callable

from stratagem.errors import InvalidArgumentError


def check_timeout(timeout: Any, name: str) -> float:
    """``timeout`` as seconds > 0; ``InvalidArgumentError`` otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"{name} must be a number of seconds > 0 (or None: no limit), got {timeout!r}")
    return float(timeout)


def remaining(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (monotonic); a tiny positive number once it passed."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-6)


class RemoteValueStatus(enum.Enum):
    PENDING = "PENDING"
    READY = "READY"
    FAILED = "FAILED"


class RemoteValue:
    """The result of ``coordinator.schedule``: ``fetch()`` waits for it and returns it.

    Example::

        # value = coordinator.schedule(step_fn, args=(iterator,))
        # loss = value.fetch()          # blocks until a worker has run the step
    """

    def __init__(self, check: Callable[[], None] | None = None):
        self._check = check   # raises what makes waiting pointless (given by the coordinator)
        self._event = threading.Event()
        self._status = RemoteValueStatus.PENDING
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def _set_value(self, value: Any) -> None:
        self._value, self._status = value, RemoteValueStatus.READY
        self._event.set()

    def _set_error(self, error: BaseException) -> None:
        self._error, self._status = error, RemoteValueStatus.FAILED
        self._event.set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait until the function has run; return its result or raise its error.

        Python's ``TimeoutError`` after ``timeout`` seconds (the value stays PENDING);
        the coordinator's errors (a lost ps, no worker answering, a fatal error) at once.
        """
        timeout = None if timeout is None else check_timeout(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(0.2 if deadline is None else min(0.2, max(deadline - time.monotonic(), 0))):
            if self._check is not None:
                self._check()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the scheduled function did not finish within {timeout:g} s; "
                                   "it stays scheduled (fetch again to wait longer)")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """The same as :meth:`fetch`."""
        return self.fetch(timeout)

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.value})"

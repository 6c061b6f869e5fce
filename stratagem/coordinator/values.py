"""RemoteValue: the future result of a scheduled function.

States and transitions::

    PENDING --(a worker ran it)--> READY        fetch() returns the value
    PENDING --(it raised)--------> FAILED       fetch() raises the error
    PENDING --(worker lost)------> PENDING      re-queued, runs again on another worker

A closure whose worker dies stays PENDING and is scheduled again, so a RemoteValue
is only ever set once.
"""

from __future__ import annotations

import enum
import threading
from typing import Any


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

    def __init__(self, coordinator: Any = None):
        self._coordinator = coordinator
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
        """Wait until the function has run; return its result or raise its error."""
        while not self._event.wait(0.2 if timeout is None else timeout):
            if self._coordinator is not None:
                self._coordinator._raise_if_ps_failed()
            if timeout is not None:
                raise TimeoutError(f"the scheduled function did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """The same as :meth:`fetch`."""
        return self.fetch(timeout)

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.value})"

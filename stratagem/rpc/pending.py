"""The handles of calls in flight: :meth:`RpcClient.call_async`'s Future, and the lane's.

Both answer ``result(timeout)`` (TimeoutError while the reply has not come; the call goes on)
and ``cancel()``, so that a caller waiting in steps (the parameter-server coordinator's
dispatcher, which pings a worker between steps) treats them alike.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from stratagem.observe import flight
from stratagem.rpc.lane import LaneCall

__all__ = ["LanePending"]


class _CallFuture(futures.Future):
    """The Future that :meth:`RpcClient.call_async` returns: its ``cancel()`` also cancels
    the gRPC call in flight, which the server's handler sees
    (:func:`~stratagem.rpc.server.caller_gone`). It stays pending, never running, until
    the reply comes, so that it can be cancelled until then."""

    def __init__(self) -> None:
        super().__init__()
        self._grpc_call: grpc.Future | None = None
        self._call_lock = threading.Lock()

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        with self._call_lock:
            call = self._grpc_call
        if call is not None:
            call.cancel()
        return True

    def _attach(self, call: grpc.Future) -> None:
        with self._call_lock:
            self._grpc_call = call
        if self.cancelled():   # cancelled before the call existed
            call.cancel()

    def _settle(self, value: Any = None, error: BaseException | None = None) -> None:
        try:
            if error is None:
                self.set_result(value)
            else:
                self.set_exception(error)
        except futures.InvalidStateError:   # cancelled meanwhile: nobody waits for it
            pass


class LanePending:
    """A call in flight on a lane (from :meth:`RpcClient.start`), awaited by one thread:
    ``result(timeout)`` is its decoded reply (or raises its error, as :meth:`RpcClient.call`
    would); ``futures.TimeoutError`` while it has not come within ``timeout`` seconds."""

    def __init__(self, call: LaneCall, decode: Callable[[Any], Any], seq: int) -> None:
        self._call, self._decode, self._seq = call, decode, seq
        self._outcome: tuple[Any, BaseException | None] | None = None

    def result(self, timeout: float | None = None) -> Any:
        if self._outcome is None:
            try:
                value, error = self._decode(self._call.reply(timeout)), None
            except (futures.TimeoutError, futures.CancelledError):   # not an outcome: the call goes on
                raise
            except BaseException as raised:  # noqa: BLE001 - kept, and raised to every caller
                value, error = None, raised
            self._outcome = (value, error)
            flight.end(self._seq)
        value, error = self._outcome
        if error is not None:
            raise error
        return value

    def cancel(self) -> bool:
        """Stops waiting for the reply; False when it has already come."""
        if self._outcome is not None:
            return False
        self._call.cancel()
        self._outcome = (None, futures.CancelledError())
        flight.end(self._seq)
        return True

    def done(self) -> bool:
        return self._outcome is not None

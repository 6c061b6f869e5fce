"""RpcClient: calls the named handlers of one RpcServer, with deadlines and reconnection.

::

    client = RpcClient("127.0.0.1:2222", token, task="ps 0")
    client.call("add", (torch.ones(3), 2))            # tensor([3., 3., 3.])
    future = client.call_async("add", (1, 2))         # concurrent.futures.Future

Failures on the caller: a dead, unreachable or silent peer raises
:class:`stratagem.errors.UnavailableError` naming the task (gRPC ``UNAVAILABLE`` -- a killed
peer is noticed in milliseconds -- or ``DEADLINE_EXCEEDED``: every call has a deadline,
``default_timeout`` unless given, since keepalive does not notice a stopped peer); a refused
token :class:`~stratagem.rpc.errors.AuthenticationError`; an oversize message
:class:`~stratagem.rpc.errors.MessageTooLargeError`; an exception in the handler
:class:`~stratagem.rpc.errors.RemoteError`, with the remote traceback.

Connections: one gRPC channel per client, reconnecting with 100 ms initial / 1 s maximum
backoff, so a restarted server is reachable again within about a second.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc

from stratagem._profiling import label
from stratagem.cluster.spec import validate_address
from stratagem.errors import InvalidArgumentError, UnavailableError
from stratagem.rpc.auth import DEFAULT_MAX_SKEW_S, Authenticator
from stratagem.rpc.codec import Pickler, decode, encode
from stratagem.rpc.errors import AuthenticationError, MessageTooLargeError, RemoteError, RpcError
from stratagem.rpc.transport import (DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S, REPLY_OK,
                                     SERVICE, check_max_bytes, size_options)

__all__ = ["RpcClient"]


def _check_timeout(timeout: float, name: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {timeout!r}.")
    return float(timeout)


class RpcClient:
    """Calls the handlers of the :class:`~stratagem.rpc.server.RpcServer` at ``address``.

    ``task`` names the peer in errors ("ps 0"; the address when not given). Every call has
    a deadline: its ``timeout`` or ``default_timeout`` seconds. Thread-safe: threads may
    share one client (calls are multiplexed over one HTTP/2 connection). Requests are
    pickled by ``pickler`` (a :class:`~stratagem.rpc.codec.Pickler` subclass may send some
    objects by reference).
    """

    def __init__(self, address: str, token: str, *, task: str | None = None,
                 default_timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S, pickler: type[Pickler] = Pickler) -> None:
        self.address = validate_address(address, where="RpcClient address")
        self._pickler = pickler
        self.task = task or address
        self.default_timeout = _check_timeout(default_timeout, "default_timeout")
        self._max_bytes = check_max_bytes(max_message_bytes)
        self._auth = Authenticator(token, max_skew_s=max_skew_s)
        self._channel = grpc.insecure_channel(address, options=size_options(self._max_bytes) + [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.keepalive_time_ms", 20000),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.enable_http_proxy", 0),   # cluster traffic never goes through a proxy
        ])
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def __repr__(self) -> str:
        return f"RpcClient({self.address!r}, task={self.task!r})"

    def call(self, method: str, request: Any = None, *, timeout: float | None = None,
             writable_reply: bool = True) -> Any:
        """Runs handler ``method`` on the server with ``request``; returns its reply.

        ``writable_reply=False`` promises that the caller only reads the reply's tensors
        (copies them elsewhere): they are then views of the received bytes, not copies.
        """
        with label("stratagem.rpc.call"):
            body, metadata, nonce, seconds = self._prepare(method, request, timeout)
            try:
                reply, call = self._callable(method).with_call(body, timeout=seconds, metadata=metadata)
            except grpc.RpcError as err:
                raise self._translate(err, method, seconds) from None
            return self._finish(method, nonce, reply, call.trailing_metadata(), writable_reply)

    def call_async(self, method: str, request: Any = None, *, timeout: float | None = None,
                   writable_reply: bool = True) -> futures.Future[Any]:
        """Like :meth:`call`, but returns at once a Future of the reply (or of the error)."""
        body, metadata, nonce, seconds = self._prepare(method, request, timeout)
        result: futures.Future[Any] = futures.Future()
        result.set_running_or_notify_cancel()

        def done(call: Any) -> None:   # on a gRPC thread: decode, never block
            try:
                reply = call.result()
                result.set_result(self._finish(method, nonce, reply, call.trailing_metadata(),
                                               writable_reply))
            except grpc.RpcError as err:
                result.set_exception(self._translate(err, method, seconds))
            except BaseException as err:
                result.set_exception(err)

        self._callable(method).future(body, timeout=seconds, metadata=metadata).add_done_callback(done)
        return result

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the server accepts connections; UnavailableError after ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(
                f"{self.task} ({self.address}) did not accept a connection within {timeout:g} s; "
                "is the task running, and is its address right?", task=self.task) from None

    def close(self) -> None:
        """Closes the connection; calls in flight fail."""
        self._channel.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------- internals

    def _callable(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        callable_ = self._callables.get(method)
        if callable_ is None:
            callable_ = self._callables[method] = self._channel.unary_unary(f"/{SERVICE}/{method}")
        return callable_

    def _prepare(self, method: str, request: Any,
                 timeout: float | None) -> tuple[bytes, Any, str, float]:
        if not isinstance(method, str) or not method or "/" in method:
            raise InvalidArgumentError(f"method must be a handler name (non-empty, no '/'), got {method!r}.")
        seconds = self.default_timeout if timeout is None else _check_timeout(timeout, "timeout")
        body = encode(request, pickler=self._pickler)
        if len(body) > self._max_bytes:
            raise MessageTooLargeError(
                f"the request to {method!r} on {self.task} is {len(body)} bytes, more than "
                f"max_message_bytes={self._max_bytes}; send it in parts or raise the limit "
                "on both sides.")
        metadata = self._auth.sign_request(method, body)
        return body, metadata, metadata[1][1], seconds

    def _finish(self, method: str, nonce: str, reply: bytes, trailing: Any,
                writable: bool = True) -> Any:
        metadata: dict[str, str] = {}
        for key, value in trailing or ():
            metadata.setdefault(key, value)
        self._auth.verify_reply(method, nonce, metadata, reply)   # before decoding
        status, value = decode(reply, writable=writable)
        if status == REPLY_OK:
            return value
        remote_exception = None
        if value.get("exception") is not None:
            try:
                remote_exception = decode(value["exception"])
            except Exception:   # its class is not importable here, or it cannot be rebuilt
                remote_exception = None
        error = RemoteError.from_reply(
            value, method=method, task=self.task,
            remote_exception=remote_exception if isinstance(remote_exception, BaseException) else None)
        raise error from error.remote_exception

    def _translate(self, err: grpc.RpcError, method: str, timeout: float) -> Exception:
        code = err.code() if hasattr(err, "code") else None
        details = (err.details() if hasattr(err, "details") else None) or str(err)
        who = f"{self.task} ({self.address})" if self.task != self.address else self.address
        if code == grpc.StatusCode.UNAVAILABLE:
            return UnavailableError(
                f"{who} is unavailable: {method!r} failed ({details}); the task has died, "
                "has not started yet, or cannot be reached.", task=self.task)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return UnavailableError(
                f"{who} did not answer {method!r} within {timeout:g} s: the task is hung, "
                "overloaded or dead (pass a larger timeout if the call is legitimately slow).",
                task=self.task)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return AuthenticationError(f"{who} refused {method!r}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            return MessageTooLargeError(
                f"{method!r} on {who}: {details}; the two sides' max_message_bytes differ, or "
                "the message is too large for them.")
        name = code.name if code is not None else "UNKNOWN"
        return RpcError(f"{method!r} on {who} failed: {name}: {details}", code=name)

"""RpcClient: calls the named handlers of one RpcServer, with deadlines and reconnection.

::

    client = RpcClient("127.0.0.1:2222", token, task="ps 0")
    client.call("add", (torch.ones(3), 2))            # tensor([3., 3., 3.])
    future = client.call_async("add", (1, 2))         # concurrent.futures.Future
    future.cancel()                                   # cancels the gRPC call too
    started = client.start("add", (1, 2))             # on the lane where the server serves "add" there
    started.result(timeout=1.0)                       # 3 (TimeoutError while it has not come: ask again)

Failures on the caller: a dead, unreachable or silent peer raises
:class:`stratagem.errors.UnavailableError` naming the task (gRPC ``UNAVAILABLE`` -- a killed
peer is noticed in milliseconds -- or ``DEADLINE_EXCEEDED``: every call has a deadline,
``default_timeout`` unless given, since keepalive does not notice a stopped peer); a refused
token :class:`~stratagem.rpc.errors.AuthenticationError` (:class:`~stratagem.rpc.errors.ClockSkewError`,
naming both clocks, when the server refused the request for the time it was signed at); an
oversize message :class:`~stratagem.rpc.errors.MessageTooLargeError`; an exception in the
handler :class:`~stratagem.rpc.errors.RemoteError`, with the remote traceback.

Binding: before its first call the client asks the server for its name and incarnation
(the built-in ``_rpc_hello``, once per server run) and signs every request for them, so that
no other server, nor this one after a restart, accepts it (see
:mod:`~stratagem.rpc.transport`). A client given ``task`` refuses a server that calls
itself otherwise (:class:`stratagem.errors.ClusterConfigError`); a server given no name
goes by its address and any client accepts it. When the server has restarted, its refusal
of the old incarnation makes the client learn the new one and send the call again, once.

Connections: one gRPC channel per client, reconnecting with 100 ms initial / 1 s maximum
backoff, so a restarted server is reachable again within about a second; and, for the
methods a server serves there, its lane (:mod:`~stratagem.rpc.lane`: far less CPU per call).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc

from stratagem._profiling import label
from stratagem.cluster.spec import validate_address
from stratagem.errors import ClusterConfigError, InvalidArgumentError, UnavailableError
from stratagem.observe import flight
from stratagem.rpc.auth import DEFAULT_MAX_SKEW_S, Authenticator, clock_refusal
from stratagem.rpc.codec import Pickler, decode, encode
from stratagem.rpc.errors import (AuthenticationError, ClockSkewError, MessageTooLargeError, RemoteError,
                                   RpcError)
from stratagem.rpc.lane import LaneClient
from stratagem.rpc.pending import LanePending, _CallFuture
from stratagem.rpc.tokens import check_token_strength
from stratagem.rpc.transport import (DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S, HELLO_METHOD, LANE_METHOD,
                                     REPLY_OK, SERVICE, check_max_bytes, size_options)

__all__ = ["RpcClient"]


def _check_timeout(timeout: float, name: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {timeout!r}.")
    return float(timeout)


def _left(deadline: float) -> float:
    """Seconds from now to ``deadline`` (monotonic); a millisecond at least, for gRPC."""
    return max(deadline - time.monotonic(), 1e-3)


def _is_stale(err: grpc.RpcError) -> bool:
    """Whether the server refused the call as signed for another server or an earlier run."""
    return hasattr(err, "code") and err.code() == grpc.StatusCode.FAILED_PRECONDITION


class RpcClient:
    """Calls the handlers of the :class:`~stratagem.rpc.server.RpcServer` at ``address``.

    ``task`` names the peer in errors ("ps 0"; the address when not given); when given, the
    server there must go by that name, if it has one (see "Binding" above). Every call has
    a deadline: its ``timeout`` or ``default_timeout`` seconds. Thread-safe: threads may
    share one client (calls are multiplexed over one HTTP/2 connection). Requests are
    pickled by ``pickler`` (a :class:`~stratagem.rpc.codec.Pickler` subclass may send some
    objects by reference). ``token`` must be random (the rule of
    :func:`~stratagem.rpc.tokens.check_token_strength`, as for ``STRATAGEM_CLUSTER_TOKEN``):
    a weak one raises ClusterConfigError.
    """

    def __init__(self, address: str, token: str, *, task: str | None = None,
                 default_timeout: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S, pickler: type[Pickler] = Pickler,
                 lane: bool = True) -> None:
        self.address = validate_address(address, where="RpcClient address")
        self._pickler = pickler
        self.task = task or address
        self._expected_name = task
        self._bound: tuple[str, str] | None = None   # the server's (name, incarnation)
        self._hello: futures.Future[tuple[str, str]] | None = None   # asking for them
        self._bind_lock = threading.Lock()
        self.default_timeout = _check_timeout(default_timeout, "default_timeout")
        self._max_bytes = check_max_bytes(max_message_bytes)
        if isinstance(token, str):   # (a token of another type: Authenticator says so)
            check_token_strength(token, source=f"the token given to RpcClient({address!r})")
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
            ("grpc.use_local_subchannel_pool", 1),   # not the backoff of a gone server's port (shared pool)
        ])
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._lane = LaneClient(address.rpartition(":")[0], self.task, self._auth.lane_key, self._open_lane,
                                pickler=pickler, max_bytes=self._max_bytes) if lane else None

    def __repr__(self) -> str:
        return f"RpcClient({self.address!r}, task={self.task!r})"

    def call(self, method: str, request: Any = None, *, timeout: float | None = None,
             writable_reply: bool = True) -> Any:
        """Runs handler ``method`` on the server with ``request``; returns its reply.
        ``writable_reply=False`` promises that the caller only reads the reply's tensors
        (copies them elsewhere): they are then views of the received bytes, not copies."""
        with label("stratagem.rpc.call"), flight.record(f"rpc {method}", 0, self.task):
            seconds = self.default_timeout if timeout is None else _check_timeout(timeout, "timeout")
            deadline = time.monotonic() + seconds   # (asking whether the lane serves it counts too)
            if self._lane is not None and method != LANE_METHOD and self._lane.serves(method, seconds):
                reply = self._lane.call(method, request, _left(deadline), seconds)   # None: its port is closed to us
                if reply is not None:
                    return self._decode_reply(method, reply, writable_reply)
            body, seconds = self._prepare(method, request, timeout)
            return self._send(method, body, deadline, seconds, writable_reply, True)

    def call_async(self, method: str, request: Any = None, *, timeout: float | None = None,
                   writable_reply: bool = True) -> futures.Future[Any]:
        """Like :meth:`call`, but returns at once a Future of the reply (or of the error).

        Its ``cancel()`` cancels the call on the server too (the handler's
        :func:`~stratagem.rpc.server.caller_gone` turns True) and marks the Future cancelled.
        """
        body, seconds = self._prepare(method, request, timeout)
        result = _CallFuture()
        seq = flight.begin(f"rpc {method}", len(body), self.task)   # (its end: when the reply or error comes)
        result.add_done_callback(lambda _: flight.end(seq))
        self._send_async(result, method, body, time.monotonic() + seconds, seconds, writable_reply, True)
        return result

    def start(self, method: str, request: Any = None, *, timeout: float | None = None,
              writable_reply: bool = True) -> LanePending | futures.Future[Any]:
        """Like :meth:`call_async`, for a caller that waits for the reply in its own thread: when the
        server serves ``method`` on its lane, the call goes there (no thread of the gRPC stack
        involved: far less CPU per call) and the handle's ``result(timeout)`` waits on the lane's
        socket; otherwise the handle is :meth:`call_async`'s Future. Either way ``result(t)`` raises
        TimeoutError when the reply has not come within ``t`` seconds (the call goes on), and
        ``cancel()`` stops the call (on the lane the handler runs on, its reply is dropped: as with
        gRPC, a handler that does not poll :func:`~stratagem.rpc.server.caller_gone` is not stopped).
        Asking for the lane and sending the request take at most ``default_timeout``."""
        seconds = self.default_timeout if timeout is None else _check_timeout(timeout, "timeout")
        if self._lane is not None and method != LANE_METHOD and self._lane.serves(method, self.default_timeout):
            with label("stratagem.rpc.call"):
                started = self._lane.start(method, request, seconds, self.default_timeout)
            if started is not None:   # (None: the port is closed to us, or a large request: gRPC)
                return LanePending(started, lambda reply: self._decode_reply(method, reply, writable_reply),
                                   flight.begin(f"rpc {method}", 0, self.task))
        return self.call_async(method, request, timeout=seconds, writable_reply=writable_reply)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the server accepts connections; UnavailableError after ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(
                f"{self.task} ({self.address}) did not accept a connection within {timeout:g} s; "
                "is the task running, and is its address right?", task=self.task) from None

    def close(self) -> None:
        """Closes the connections; calls in flight fail."""
        for connections in (self._lane, self._channel):
            connections is None or connections.close()

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

    def _prepare(self, method: str, request: Any, timeout: float | None) -> tuple[bytes, float]:
        if not isinstance(method, str) or not method or "/" in method:
            raise InvalidArgumentError(f"method must be a handler name (non-empty, no '/'), got {method!r}.")
        seconds = self.default_timeout if timeout is None else _check_timeout(timeout, "timeout")
        body = encode(request, pickler=self._pickler)
        if len(body) > self._max_bytes:
            raise MessageTooLargeError(
                f"the request to {method!r} on {self.task} is {len(body)} bytes, more than "
                f"max_message_bytes={self._max_bytes}; send it in parts or raise the limit "
                "on both sides.")
        return body, seconds

    def _open_lane(self, seconds: float) -> dict | None:
        """A session for a new lane connection (None: the server has no lane)."""
        try:
            return self.call(LANE_METHOD, timeout=seconds)
        except RemoteError as error:   # an older server, or one started without a lane: None
            if not (isinstance(error.remote_exception, RpcError) and error.remote_exception.code == "UNIMPLEMENTED"):
                raise
        return None

    def _send(self, method: str, body: bytes, deadline: float, seconds: float, writable: bool,
              retry: bool) -> Any:
        """Sends a call addressed to the server's name and incarnation; once more, addressed
        anew, if the server refused it as meant for another (it restarted, or another server
        now listens at the address)."""
        try:
            binding = self._bound or self._binding().result(timeout=_left(deadline))
        except futures.TimeoutError:
            raise UnavailableError(
                f"{self._who()} did not answer {method!r} within {seconds:g} s (waiting for its "
                "name and incarnation): the task is hung, overloaded or dead.", task=self.task) from None
        except grpc.RpcError as err:
            raise self._translate(err, method, seconds) from None
        metadata = self._auth.sign_request(method, body, to=binding[0], incarnation=binding[1])
        try:
            reply, call = self._callable(method).with_call(body, timeout=_left(deadline), metadata=metadata)
        except grpc.RpcError as err:
            if retry and _is_stale(err):   # refused unread: safe to send again
                self._forget(binding)
                return self._send(method, body, deadline, seconds, writable, False)
            raise self._translate(err, method, seconds) from None
        return self._finish(method, metadata[1][1], reply, call.trailing_metadata(), writable)

    def _send_async(self, result: _CallFuture, method: str, body: bytes, deadline: float,
                    seconds: float, writable: bool, retry: bool) -> None:
        """:meth:`_send` without blocking: each step runs when the previous one is done."""
        def bound(hello: futures.Future[tuple[str, str]]) -> None:
            if result.cancelled():
                return
            try:
                binding = hello.result()
                metadata = self._auth.sign_request(method, body, to=binding[0], incarnation=binding[1])
                call = self._callable(method).future(body, timeout=_left(deadline), metadata=metadata)
            except BaseException as err:
                result._settle(error=self._translate(err, method, seconds) if isinstance(err, grpc.RpcError) else err)
                return
            result._attach(call)
            call.add_done_callback(lambda call: done(call, binding, metadata[1][1]))

        def done(call: Any, binding: tuple[str, str], nonce: str) -> None:   # on a gRPC thread: never block
            try:
                reply = call.result()
                result._settle(self._finish(method, nonce, reply, call.trailing_metadata(), writable))
            except grpc.FutureCancelledError:
                result.cancel()
            except grpc.RpcError as err:
                if retry and _is_stale(err):   # refused unread: safe to send again
                    self._forget(binding)
                    self._send_async(result, method, body, deadline, seconds, writable, False)
                else:
                    result._settle(error=self._translate(err, method, seconds))
            except BaseException as err:
                result._settle(error=err)

        self._binding().add_done_callback(bound)   # at once when the binding is known

    def _binding(self) -> futures.Future[tuple[str, str]]:
        """The server's (name, incarnation): asked with one hello shared by all callers."""
        with self._bind_lock:
            hello: futures.Future[tuple[str, str]] = futures.Future()
            if self._bound is not None:
                hello.set_result(self._bound)
                return hello
            if self._hello is not None:
                return self._hello
            self._hello = hello
        body = encode(None)
        metadata = self._auth.sign_request(HELLO_METHOD, body, to="", incarnation="")
        try:
            call = self._callable(HELLO_METHOD).future(body, timeout=self.default_timeout, metadata=metadata)
        except BaseException as err:   # a closed channel: the callers get the error
            self._hello_done(hello, error=err)
            return hello
        call.add_done_callback(lambda call: self._answered(hello, call, metadata[1][1]))
        return hello

    def _answered(self, hello: futures.Future[tuple[str, str]], call: Any, nonce: str) -> None:
        """Checks the hello's signed answer (on a gRPC thread) and settles ``hello``."""
        try:
            answer = self._finish(HELLO_METHOD, nonce, call.result(), call.trailing_metadata())
            self._hello_done(hello, binding=self._check_hello(answer))
        except BaseException as err:   # a grpc.RpcError is translated by each caller
            self._hello_done(hello, error=err)

    def _check_hello(self, answer: Any) -> tuple[str, str]:
        if not (isinstance(answer, dict) and isinstance(answer.get("name"), str)
                and isinstance(answer.get("incarnation"), str)):
            raise RpcError(f"{self._who()} answered {HELLO_METHOD!r} with {answer!r}; it is not a "
                           "stratagem RPC server of this version.", code="UNIMPLEMENTED")
        name = answer["name"]
        if answer.get("named") and self._expected_name is not None and name != self._expected_name:
            raise ClusterConfigError(
                f"{self.address} serves {name!r}, not {self._expected_name!r}: the cluster "
                f"description (TF_CONFIG) gives {self._expected_name}'s address to another "
                "task. Fix it so that each task is listed at the address it listens on.")
        return name, answer["incarnation"]

    def _hello_done(self, hello: futures.Future[tuple[str, str]],
                    binding: tuple[str, str] | None = None, error: BaseException | None = None) -> None:
        with self._bind_lock:
            self._hello = None   # a failed hello is asked again by the next call
            if binding is not None:
                self._bound = binding
        hello.set_result(binding) if error is None else hello.set_exception(error)

    def _forget(self, binding: tuple[str, str]) -> None:
        """Drops ``binding``, refused as stale, unless another thread already replaced it."""
        with self._bind_lock:
            if self._bound == binding:
                self._bound = None

    def _who(self) -> str:
        return f"{self.task} ({self.address})" if self.task != self.address else self.address

    def _finish(self, method: str, nonce: str, reply: bytes, trailing: Any,
                writable: bool = True) -> Any:
        metadata: dict[str, str] = {}
        for key, value in trailing or ():
            metadata.setdefault(key, value)
        self._auth.verify_reply(method, nonce, metadata, reply)   # before decoding
        return self._decode_reply(method, reply, writable)

    def _decode_reply(self, method: str, reply: Any, writable: bool) -> Any:
        """The value of an authenticated reply, or the RemoteError it carries, raised."""
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
        who = self._who()
        if code == grpc.StatusCode.UNAVAILABLE:
            return UnavailableError(
                f"{who} is unavailable: {method!r} failed ({details}); the task has died, "
                "has not started yet, or cannot be reached.", task=self.task)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return UnavailableError(
                f"{who} did not answer {method!r} within {timeout:g} s: the task is hung, "
                "overloaded or dead (pass a larger timeout if the call is legitimately slow).",
                task=self.task)
        if code == grpc.StatusCode.FAILED_PRECONDITION:   # misaddressed, after one retry
            return UnavailableError(
                f"{who} refused {method!r} twice as addressed to another server or to an "
                f"earlier run of it ({details}): it is restarting repeatedly.", task=self.task)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            skewed = clock_refusal(err, who, method)
            return skewed or AuthenticationError(f"{who} refused {method!r}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "takes requests of at most" in details:
            return MessageTooLargeError(f"{method!r} on {who}: {details}.")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            return MessageTooLargeError(
                f"{method!r} on {who}: {details}; the two sides' max_message_bytes differ, or "
                "the message is too large for them.")
        name = code.name if code is not None else "UNKNOWN"
        return RpcError(f"{method!r} on {who} failed: {name}: {details}", code=name)

"""RpcServer and RpcClient: authenticated calls of named handlers over gRPC.

A server is a table of handlers ``name -> fn(request) -> reply`` behind one address; a
client calls them by name with any picklable request and gets the reply back::

    server = RpcServer("127.0.0.1:2222", {"add": lambda pair: pair[0] + pair[1]}, token).start()
    client = RpcClient("127.0.0.1:2222", token, task="ps 0")
    client.call("add", (torch.ones(3), 2))            # tensor([3., 3., 3.])
    future = client.call_async("add", (1, 2))         # concurrent.futures.Future
    server.stop()

The protocol, one gRPC unary call per request (service ``stratagem.Rpc``, method = handler
name, raw bytes in and out, no protobuf):

1. the client frames the request with :func:`~stratagem.rpc.codec.encode` and signs it
   (:class:`~stratagem.rpc.auth.Authenticator`: a MAC in the metadata);
2. the server checks the signature on the raw bytes -- a request that fails is answered
   ``UNAUTHENTICATED``, logged (without the token) and never decoded;
3. the server decodes the request, runs the handler in its thread pool and frames
   ``("ok", reply)`` or ``("error", description)`` when the handler raised;
4. the server signs the reply (trailing metadata); the client checks it, decodes it and
   returns the reply or raises :class:`RemoteError` with the remote traceback.

Failures on the caller: a dead, unreachable or silent peer raises
:class:`stratagem.errors.UnavailableError` naming the task (gRPC ``UNAVAILABLE`` -- a killed
peer is noticed in milliseconds -- or ``DEADLINE_EXCEEDED``: every call has a deadline,
``default_timeout`` unless given, since keepalive does not notice a stopped peer); a refused
token :class:`AuthenticationError`; an oversize message :class:`MessageTooLargeError`.

Connections: one gRPC channel per client, reconnecting with 100 ms initial / 1 s maximum
backoff, so a restarted server is reachable again within about a second. The message size
limit is set on both sides, for sending and receiving (gRPC's default is 4 MiB).

Never ``fork()`` a process once it holds a gRPC object (server, channel): gRPC's threads
do not survive it. Start servers in processes of their own (``stratagem server``, the
launcher, ``multiprocessing`` with the "spawn" start method).
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any, NoReturn

import grpc

from stratagem._profiling import label
from stratagem.cluster.spec import validate_address
from stratagem.errors import ClusterConfigError, InvalidArgumentError, UnavailableError
from stratagem.rpc.auth import DEFAULT_MAX_SKEW_S, Authenticator
from stratagem.rpc.codec import Pickler, decode, encode
from stratagem.rpc.errors import (AuthenticationError, MessageTooLargeError, RemoteError,
                                  RpcError)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "EncodedReply", "Handler", "RpcClient", "RpcServer",
           "decodes_request", "reads_only"]

logger = logging.getLogger("stratagem.rpc")

Handler = Callable[[Any], Any]

SERVICE = "stratagem.Rpc"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 60.0
_GRPC_MAX_MESSAGE = 2**31 - 1
_OK, _ERROR = "ok", "error"
_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", "*", ""}
STATS_METHOD = "_rpc_stats"   # built into every server: its wire counters


def _check_max_bytes(max_message_bytes: int) -> int:
    if (not isinstance(max_message_bytes, int) or isinstance(max_message_bytes, bool)
            or not 0 < max_message_bytes <= _GRPC_MAX_MESSAGE):
        raise InvalidArgumentError(
            f"max_message_bytes must be an int from 1 to {_GRPC_MAX_MESSAGE} (gRPC's limit), "
            f"got {max_message_bytes!r}.")
    return max_message_bytes


def _check_timeout(timeout: float, name: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {timeout!r}.")
    return float(timeout)


def _size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def reads_only(handler: Handler) -> Handler:
    """Marks ``handler`` as one that only reads the tensors of its request (it copies them
    elsewhere or uses them as gradients, and never writes them or keeps them): the server
    then decodes its requests without copying their tensors out of gRPC's read-only buffer
    (see :func:`~stratagem.rpc.codec.decode`). Returns ``handler``."""
    handler._sg_reads_only = True   # type: ignore[attr-defined]
    return handler


def decodes_request(handler: Handler) -> Handler:
    """Marks ``handler`` as one that decodes its request itself: it receives the request's
    bytes (authenticated, not yet unpickled) and reads them with its own
    :class:`~stratagem.rpc.codec.Unpickler` subclass. Returns a marked wrapper of ``handler``
    (a bound method cannot be marked itself)."""
    @functools.wraps(handler)
    def takes_bytes(message: bytes) -> Any:
        return handler(message)

    takes_bytes._sg_decodes_request = True   # type: ignore[attr-defined]
    return takes_bytes


class EncodedReply:
    """A handler's reply framed at once: return ``EncodedReply(value)`` from a handler to
    encode ``value`` while the handler still holds its locks, so that live tensors can be
    sent without first copying them (the framing is the copy)."""

    __slots__ = ("message",)

    def __init__(self, value: Any) -> None:
        self.message = encode((_OK, value))


def _describe(exc: BaseException) -> dict[str, Any]:
    """What the caller learns of an exception raised by a handler."""
    try:
        pickled: bytes | None = encode(exc)
    except Exception:   # an exception holding an unpicklable object: send its text only
        pickled = None
    kind = type(exc)
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)), "exception": pickled}


# ---------------------------------------------------------------------------- server


class _Service(grpc.GenericRpcHandler):
    """Routes every method of the service to the server, which authenticates first."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server
        self._prefix = f"/{SERVICE}/"
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        path = handler_call_details.method
        if not path.startswith(self._prefix):
            return None
        handler = self._cache.get(path)
        if handler is None:
            method = path[len(self._prefix):]
            handler = grpc.unary_unary_rpc_method_handler(
                lambda request, context: self._server._handle(method, request, context))
            if method in self._server._handlers:   # unknown names are not cached
                self._cache[path] = handler
        return handler


class RpcServer:
    """Serves ``handlers`` at ``address`` ("host:port") to clients holding ``token``.

    ``address`` is bound exactly: the host of the cluster spec, loopback in local launches.
    A wildcard host ("0.0.0.0", "[::]") is refused unless ``allow_wildcard=True``; port 0
    picks a free port (see :attr:`address` after :meth:`start`). Each handler receives the
    decoded request and returns the reply; its exceptions travel to the caller. Handlers
    run on ``max_workers`` threads, so they must be thread-safe. ``name`` (e.g. "ps 0")
    appears in logs and in errors the callers see.
    """

    def __init__(self, address: str, handlers: Mapping[str, Handler], token: str, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_workers: int = 16,
                 allow_wildcard: bool = False, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 name: str | None = None) -> None:
        validate_address(address, where="RpcServer address")
        host = address.rpartition(":")[0]
        if host in _WILDCARD_HOSTS and not allow_wildcard:
            raise ClusterConfigError(
                f"RpcServer address {address!r} listens on every interface; give the address "
                "of this task in the cluster spec (loopback '127.0.0.1:PORT' for a local "
                "cluster), or pass allow_wildcard=True to mean it.")
        for method, handler in handlers.items():
            if not isinstance(method, str) or not method or "/" in method or not callable(handler):
                raise InvalidArgumentError(
                    f"handlers must map method names (non-empty, no '/') to callables; got "
                    f"{method!r} -> {handler!r}.")
        if STATS_METHOD in handlers:
            raise InvalidArgumentError(f"{STATS_METHOD!r} is reserved for the server's own counters.")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be an int >= 1, got {max_workers!r}.")
        self._requested = address
        self._handlers: dict[str, Handler] = {**handlers, STATS_METHOD: lambda _: self.stats()}
        self._auth = Authenticator(token, max_skew_s=max_skew_s)
        self._max_bytes = _check_max_bytes(max_message_bytes)
        self._max_workers = max_workers
        self._name = name
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, int]] = {}
        self._refused = 0

    @property
    def name(self) -> str:
        """How logs and errors name this server: ``name`` if given, else its address."""
        return self._name or self.address

    @property
    def address(self) -> str:
        """The address served: the one given, with the port chosen when it was 0."""
        if self._port is None:
            return self._requested
        return f"{self._requested.rpartition(':')[0]}:{self._port}"

    @property
    def port(self) -> int | None:
        """The bound port, None before :meth:`start`."""
        return self._port

    def start(self) -> RpcServer:
        """Binds the address and starts serving; returns ``self``."""
        if self._server is not None:
            raise InvalidArgumentError(f"RpcServer {self.name} is already started.")
        server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="stratagem-rpc"),
            handlers=[_Service(self)],
            options=_size_options(self._max_bytes) + [
                ("grpc.so_reuseport", 0),   # a second server on a taken port must fail
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                ("grpc.http2.max_ping_strikes", 0),
            ])
        try:
            port = server.add_insecure_port(self._requested)
        except RuntimeError:
            port = 0
        if not port:
            server.stop(None)
            raise ClusterConfigError(
                f"cannot listen on {self._requested}: the port is taken or the host is not an "
                "address of this machine; free the port or fix this task's address in the "
                "cluster spec.")
        server.start()
        self._server, self._port = server, port
        logger.info("%s listening on %s", self.name, self.address)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds to finish. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()

    def __enter__(self) -> RpcServer:
        return self if self._server is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """Wire counters: per method, calls / errors / bytes_in / bytes_out; refused requests."""
        with self._lock:
            return {"methods": {name: dict(counts) for name, counts in self._stats.items()},
                    "refused": self._refused}

    def _count(self, method: str, bytes_in: int, bytes_out: int, error: bool) -> None:
        with self._lock:
            counts = self._stats.setdefault(
                method, {"calls": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0})
            counts["calls"] += 1
            counts["errors"] += error
            counts["bytes_in"] += bytes_in
            counts["bytes_out"] += bytes_out

    def _refuse(self, method: str, context: grpc.ServicerContext, err: AuthenticationError) -> NoReturn:
        with self._lock:
            self._refused += 1
        logger.warning("%s refused a %r request from %s: %s", self.name, method[:100],
                       context.peer(), err)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refused the request: {err}")
        raise AssertionError("context.abort returns only by raising")

    def _handle(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        with label("stratagem.rpc.handle"):
            return self._handle_authenticated(method, request, context)

    def _handle_authenticated(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata():
            metadata.setdefault(key, value)
        try:   # on the raw bytes: nothing is decoded before this passes
            nonce = self._auth.verify_request(method, metadata, request)
        except AuthenticationError as err:
            self._refuse(method, context, err)
        error = False
        try:
            handler = self._handlers.get(method)
            if handler is None:
                raise RpcError(f"{self.name} has no method {method!r}; it serves "
                               f"{sorted(self._handlers)}.", code="UNIMPLEMENTED")
            if getattr(handler, "_sg_decodes_request", False):
                result = handler(request)
            else:
                result = handler(decode(request, writable=not getattr(handler, "_sg_reads_only", False)))
            reply = result.message if isinstance(result, EncodedReply) else encode((_OK, result))
            if len(reply) > self._max_bytes:
                raise MessageTooLargeError(
                    f"the reply to {method!r} is {len(reply)} bytes, more than this server's "
                    f"max_message_bytes={self._max_bytes}; ask for less per call or raise the "
                    "limit on both sides.")
        except Exception as exc:
            error = True
            reply = encode((_ERROR, _describe(exc)))
        context.set_trailing_metadata(self._auth.sign_reply(method, nonce, reply))
        self._count(method, len(request), len(reply), error)
        return reply


# ---------------------------------------------------------------------------- client


class RpcClient:
    """Calls the handlers of the :class:`RpcServer` at ``address``.

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
        self._max_bytes = _check_max_bytes(max_message_bytes)
        self._auth = Authenticator(token, max_skew_s=max_skew_s)
        self._channel = grpc.insecure_channel(address, options=_size_options(self._max_bytes) + [
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
        if status == _OK:
            return value
        remote_exception = None
        if value.get("exception") is not None:
            try:
                remote_exception = decode(value["exception"])
            except Exception:   # its class is not importable here, or it cannot be rebuilt
                remote_exception = None
        error = RemoteError(
            f"{method!r} on {self.task} raised {value['type']}: {value['message']}\n\n"
            f"Remote traceback ({self.task}):\n{value['traceback'].rstrip()}",
            remote_type=value["type"], remote_message=value["message"],
            remote_traceback=value["traceback"], method=method, task=self.task,
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

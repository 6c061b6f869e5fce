"""RpcServer: a table of named handlers served at one address, behind the cluster token.

A server is a table of handlers ``name -> fn(request) -> reply`` behind one address;
:class:`~stratagem.rpc.client.RpcClient` calls them by name with any picklable request and
gets the reply back::

    server = RpcServer("127.0.0.1:2222", {"add": lambda pair: pair[0] + pair[1]}, token).start()
    ...
    server.stop()

Each request is authenticated on its raw bytes before anything is decoded (the protocol is
in :mod:`~stratagem.rpc.transport`); a handler's exception travels to the caller with its
traceback. Handlers may be marked to save copies: :func:`reads_only` (decode the request's
tensors as views of the received bytes), :func:`decodes_request` (take the bytes and decode
them itself), and a reply framed at once, under the handler's locks, with
:class:`EncodedReply`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any, NoReturn

import grpc

from stratagem._profiling import label
from stratagem.cluster.spec import validate_address
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc.auth import DEFAULT_MAX_SKEW_S, Authenticator
from stratagem.rpc.codec import decode, encode
from stratagem.rpc.errors import AuthenticationError, MessageTooLargeError, RpcError, describe_exception
from stratagem.rpc.transport import (DEFAULT_MAX_MESSAGE_BYTES, REPLY_ERROR, REPLY_OK, SERVICE,
                                     STATS_METHOD, check_max_bytes, size_options)

__all__ = ["EncodedReply", "Handler", "RpcServer", "decodes_request", "reads_only"]

logger = logging.getLogger("stratagem.rpc")

Handler = Callable[[Any], Any]

_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", "*", ""}


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
        self.message = encode((REPLY_OK, value))


def _describe(exc: BaseException) -> dict[str, Any]:
    """What the caller learns of an exception raised by a handler (see describe_exception)."""
    described, original = describe_exception(exc)
    try:
        pickled: bytes | None = None if original is None else encode(original)
    except Exception:   # an exception holding an unpicklable object: send its text only
        pickled = None
    return {**described, "exception": pickled}


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
        self._max_bytes = check_max_bytes(max_message_bytes)
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

    def start(self) -> RpcServer:
        """Binds the address and starts serving; returns ``self``."""
        if self._server is not None:
            raise InvalidArgumentError(f"RpcServer {self.name} is already started.")
        server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="stratagem-rpc"),
            handlers=[_Service(self)],
            options=size_options(self._max_bytes) + [
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
            reply = result.message if isinstance(result, EncodedReply) else encode((REPLY_OK, result))
            if len(reply) > self._max_bytes:
                raise MessageTooLargeError(
                    f"the reply to {method!r} is {len(reply)} bytes, more than this server's "
                    f"max_message_bytes={self._max_bytes}; ask for less per call or raise the "
                    "limit on both sides.")
        except Exception as exc:
            error = True
            reply = encode((REPLY_ERROR, _describe(exc)))
        context.set_trailing_metadata(self._auth.sign_reply(method, nonce, reply))
        self._count(method, len(request), len(reply), error)
        return reply

"""RpcServer: a table of named handlers served at one address, behind the cluster token.

A server is a table of handlers ``name -> fn(request) -> reply`` behind one address;
:class:`~stratagem.rpc.client.RpcClient` calls them by name with any picklable request and
gets the reply back::

    server = RpcServer("127.0.0.1:2222", {"add": lambda pair: pair[0] + pair[1]}, token).start()
    ...
    server.stop()

Each request's signed header is checked from its metadata before its body is read, and its
body before anything is decoded (the protocol is in :mod:`~stratagem.rpc.transport`); a
handler's exception travels to the caller with its traceback. Requests are limited to
:data:`~stratagem.rpc.transport.SMALL_REQUEST_BYTES` unless the handler is marked with
:func:`large_requests`. Handlers may be marked to save copies: :func:`reads_only` (decode
the request's tensors as views of the received bytes), :func:`decodes_request` (take the
bytes and decode them itself), and a reply framed at once, under the handler's locks, with
:class:`EncodedReply`. A long-running handler may poll :func:`caller_gone` to stop early
when its caller cancelled or gave up.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any, NoReturn

import grpc

from stratagem._profiling import label
from stratagem.cluster.spec import is_wildcard_host, validate_address
from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc.auth import DEFAULT_MAX_SKEW_S, Authenticator
from stratagem.rpc.codec import decode, encode
from stratagem.rpc.errors import (AuthenticationError, ClockSkewError, MessageTooLargeError, RpcError,
                                   WrongServerError, describe_exception)
from stratagem.rpc.lane import LaneServer
from stratagem.rpc.tokens import check_token_strength
from stratagem.rpc.transport import (DEFAULT_MAX_MESSAGE_BYTES, HELLO_METHOD, LANE_METHOD, REPLY_ERROR, REPLY_OK,
                                     SERVICE, SMALL_REQUEST_BYTES, STATS_METHOD, check_max_bytes,
                                     server_options)

__all__ = ["EncodedReply", "Handler", "RpcServer", "caller_gone", "decodes_request", "fast_lane",
           "large_requests", "reads_only"]

logger = logging.getLogger("stratagem.rpc")

Handler = Callable[[Any], Any]

_current = threading.local()   # .context: the gRPC context of the call this thread serves


def caller_gone() -> bool:
    """Whether the caller of the request this thread is handling has cancelled it or passed
    its deadline; False outside a handler.

    A handler that runs for long (a loop of steps, a wait) may poll it and stop early: its
    reply would be thrown away.
    """
    context = getattr(_current, "context", None)
    if context is None:
        return False
    remaining = context.time_remaining()
    return not context.is_active() or (remaining is not None and remaining <= 0)


def reads_only(handler: Handler) -> Handler:
    """Marks ``handler`` as one that only reads the tensors of its request (it copies them
    elsewhere or uses them as gradients, and never writes them or keeps them): the server
    then decodes its requests without copying their tensors out of gRPC's read-only buffer
    (see :func:`~stratagem.rpc.codec.decode`). Returns ``handler``."""
    handler._rpc_reads_only = True   # type: ignore[attr-defined]
    return handler


def large_requests(handler: Handler) -> Handler:
    """Marks ``handler`` as one whose requests may be large (tensors to store, closures with
    their arguments): it accepts requests up to the server's ``max_message_bytes``, where
    other handlers accept :data:`~stratagem.rpc.transport.SMALL_REQUEST_BYTES`. Keeping the
    large limit to the methods that need it bounds what one request can make a server hold.
    Returns ``handler``."""
    handler._rpc_large_requests = True   # type: ignore[attr-defined]
    return handler


def fast_lane(handler: Handler) -> Handler:
    """Marks ``handler`` as served on the server's lane too (:mod:`~stratagem.rpc.lane`: a TCP
    connection beside gRPC, same token, far less CPU per call), where clients call it; for
    handlers that never poll :func:`caller_gone` (a cancelled lane call closes its connection; the
    handler runs on, its reply dropped). Returns ``handler``."""
    handler._rpc_fast_lane = True   # type: ignore[attr-defined]
    return handler


def decodes_request(handler: Handler) -> Handler:
    """Marks ``handler`` as one that decodes its request itself: it receives the request's
    bytes (authenticated, not yet unpickled) and reads them with its own
    :class:`~stratagem.rpc.codec.Unpickler` subclass. Returns a marked wrapper of ``handler``
    (a bound method cannot be marked itself)."""
    @functools.wraps(handler)
    def takes_bytes(message: bytes) -> Any:
        return handler(message)

    takes_bytes._rpc_decodes_request = True   # type: ignore[attr-defined]
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
    """Routes every method of the service to the server, which authenticates first.

    Methods are served as stream-unary, though clients call them as unary (the wire format
    is the same): gRPC receives a unary handler's request before calling it, where a
    stream handler is given an iterator read only when asked, so the server checks the
    metadata before it receives the body.
    """

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
            handler = grpc.stream_unary_rpc_method_handler(
                lambda requests, context: self._server._handle(method, requests, context))
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
    appears in logs and in errors the callers see; requests must be addressed to it (the
    address when not given), and to the server's :attr:`incarnation`. ``token`` must be
    random (the rule of :func:`~stratagem.rpc.tokens.check_token_strength`, as for
    ``STRATAGEM_CLUSTER_TOKEN``): a weak one raises ClusterConfigError.
    """

    def __init__(self, address: str, handlers: Mapping[str, Handler], token: str, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_workers: int = 16,
                 allow_wildcard: bool = False, max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 name: str | None = None, lane: bool = True) -> None:
        validate_address(address, where="RpcServer address")
        host = address.rpartition(":")[0]
        if is_wildcard_host(host) and not allow_wildcard:
            raise ClusterConfigError(
                f"RpcServer address {address!r} listens on every interface; give the address "
                "of this task in the cluster spec (loopback '127.0.0.1:PORT' for a local "
                "cluster), or pass allow_wildcard=True to mean it.")
        for method, handler in handlers.items():
            if not isinstance(method, str) or not method or "/" in method or not callable(handler):
                raise InvalidArgumentError(
                    f"handlers must map method names (non-empty, no '/') to callables; got "
                    f"{method!r} -> {handler!r}.")
        for reserved in (STATS_METHOD, HELLO_METHOD, LANE_METHOD):
            if reserved in handlers:
                raise InvalidArgumentError(f"{reserved!r} is reserved for the server's own use.")
        if name is not None and not (isinstance(name, str) and name and name.isascii()
                                     and name.isprintable()):
            raise InvalidArgumentError(f"name must be a non-empty printable ASCII str, got {name!r}.")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be an int >= 1, got {max_workers!r}.")
        self._requested = address
        self._handlers: dict[str, Handler] = {**handlers, STATS_METHOD: lambda _: self.stats(),
                                              HELLO_METHOD: lambda _: self._hello(),
                                              LANE_METHOD: lambda _: self._lane_session()}
        if isinstance(token, str):   # (a token of another type: Authenticator says so)
            check_token_strength(token, source=f"the token given to RpcServer({address!r})")
        self._auth = Authenticator(token, max_skew_s=max_skew_s)
        self._max_bytes = check_max_bytes(max_message_bytes)
        self._max_workers = max_workers
        self._name = name
        self._incarnation: str | None = None
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, int]] = {}
        self._refused = 0
        self._wants_lane, self._lane = lane, None

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
    def incarnation(self) -> str | None:
        """A random id drawn each time the server starts (None before): requests signed for
        an earlier run are refused, so one captured before a restart cannot be replayed."""
        return self._incarnation

    def _hello(self) -> dict[str, Any]:
        """What a client learns before its first call: where to address its requests."""
        return {"name": self.name, "named": self._name is not None, "incarnation": self._incarnation}

    def start(self) -> RpcServer:
        """Binds the address and starts serving; returns ``self``."""
        if self._server is not None:
            raise InvalidArgumentError(f"RpcServer {self.name} is already started.")
        server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="stratagem-rpc"),
            handlers=[_Service(self)],
            options=server_options(self._max_bytes))
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
        self._incarnation, self._port = uuid.uuid4().hex, port   # before the first request
        if self._wants_lane:
            self._lane = LaneServer(self._requested.rpartition(":")[0], self._auth.lane_key, self._serve_lane,
                                    self._limit, self._refuse_count, self.name)
        server.start()
        self._server = server
        logger.info("%s listening on %s", self.name, self.address)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds to finish. Idempotent."""
        server, self._server = self._server, None
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.stop()
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

    def _lane_session(self) -> dict[str, Any]:
        """A one-use session for one lane connection, and the methods served there with their limits."""
        if self._lane is None:
            raise RpcError(f"{self.name} serves no lane.", code="UNIMPLEMENTED")
        return {"port": self._lane.port, "session": self._lane.session(),
                "methods": {m: self._limit(m) for m, h in self._handlers.items() if getattr(h, "_rpc_fast_lane", False)}}

    def _limit(self, method: str) -> int:
        """The largest request ``method`` takes (see :func:`large_requests`)."""
        handler = self._handlers.get(method)
        return self._max_bytes if getattr(handler, "_rpc_large_requests", False) else min(
            self._max_bytes, SMALL_REQUEST_BYTES)

    def _refuse_count(self, _: str) -> None:
        with self._lock:
            self._refused += 1

    def _serve_lane(self, method: str, request: memoryview) -> list:
        """A lane request, its frame already checked: run the handler, frame the reply."""
        handler = self._handlers.get(method)
        with label("stratagem.rpc.handle"):   # (a method not marked fast_lane is not there)
            reply, error = self._run(method, handler if getattr(handler, "_rpc_fast_lane", False) else None, request)
        self._count(method, len(request), len(reply), error)
        return [reply]

    def _refuse(self, method: str, context: grpc.ServicerContext, err: Exception,
                code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> NoReturn:
        self._refuse_count(method)
        log = logger.info if isinstance(err, WrongServerError) else logger.warning
        log("%s refused a %r request from %s: %s", self.name, method[:100], context.peer(), err)
        if isinstance(err, ClockSkewError):   # the caller's error names both clocks
            context.set_trailing_metadata(self._auth.clock_metadata())
        context.abort(code, f"{self.name} refused the request: {err}")
        raise AssertionError("context.abort returns only by raising")

    def _handle(self, method: str, requests: Any, context: grpc.ServicerContext) -> bytes:
        _current.context = context
        try:
            with label("stratagem.rpc.handle"):
                return self._handle_authenticated(method, requests, context)
        finally:
            _current.context = None

    def _receive(self, method: str, handler: Handler | None, requests: Any,
                 context: grpc.ServicerContext) -> tuple[str, bytes]:
        """The request's nonce and body: the header checked from the metadata alone, then
        the body read and checked. Refuses (aborts) the call when either fails."""
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata():
            metadata.setdefault(key, value)
        try:
            header = self._auth.verify_header(method, metadata, to=self.name,
                                              incarnation=self._incarnation or "",
                                              unbound_ok=method == HELLO_METHOD)
        except WrongServerError as err:   # the client learns who this is and signs again
            self._refuse(method, context, err, grpc.StatusCode.FAILED_PRECONDITION)
        except AuthenticationError as err:
            self._refuse(method, context, err)
        limit = self._limit(method)
        if header.length > limit:   # refused before its body is received
            advice = ("raise max_message_bytes on both sides" if limit == self._max_bytes else
                      "mark its handler with stratagem.rpc.server.large_requests if it needs more")
            self._refuse(method, context, MessageTooLargeError(
                f"{method!r} takes requests of at most {limit} bytes and this one is "
                f"{header.length} bytes (larger than max); send less per call, or {advice}"),
                grpc.StatusCode.RESOURCE_EXHAUSTED)
        body = next(requests, None)
        try:
            if body is None:
                raise AuthenticationError("the request has no body")
            self._auth.verify_body(header, body)
        except AuthenticationError as err:
            self._refuse(method, context, err)
        return header.nonce, body

    def _handle_authenticated(self, method: str, requests: Any, context: grpc.ServicerContext) -> bytes:
        handler = self._handlers.get(method)
        nonce, request = self._receive(method, handler, requests, context)
        reply, error = self._run(method, handler, request)
        context.set_trailing_metadata(self._auth.sign_reply(method, nonce, reply))
        self._count(method, len(request), len(reply), error)
        return reply

    def _run(self, method: str, handler: Handler | None, request: Any) -> tuple[bytes, bool]:
        """The framed reply to an authenticated request, and whether the handler failed."""
        error = False
        try:
            if handler is None:
                raise RpcError(f"{self.name} has no method {method!r}; it serves "
                               f"{sorted(self._handlers)}.", code="UNIMPLEMENTED")
            if getattr(handler, "_rpc_decodes_request", False):
                result = handler(request)
            else:
                result = handler(decode(request, writable=not getattr(handler, "_rpc_reads_only", False)))
            reply = result.message if isinstance(result, EncodedReply) else encode((REPLY_OK, result))
            if len(reply) > self._max_bytes:
                raise MessageTooLargeError(
                    f"the reply to {method!r} is {len(reply)} bytes, more than this server's "
                    f"max_message_bytes={self._max_bytes}; ask for less per call or raise the "
                    "limit on both sides.")
        except Exception as exc:
            error = True
            reply = encode((REPLY_ERROR, _describe(exc)))
        return reply, error

"""The lane: a plain TCP connection beside gRPC for the calls that move tensors or come often.

Why it exists: a parameter-server step is CPU-bound on 2 cores, and gRPC's Python stack spent
most of it (measured, MLP 784-1024-1024-10, 7.1 MiB each way per step: ~27 of ~39 ms of CPU per
step in transport, against ~11 ms of compute; an embedding step's three small calls ~2.5 ms of
CPU each, both sides together). A lane frames the same bodies (:mod:`~stratagem.rpc.codec`)
over a socket that the receiver reads straight into one buffer, and authenticates them with
the same token; handlers marked :func:`~stratagem.rpc.server.fast_lane` are served on it.

How a connection is opened and used:

1. the client asks the server over gRPC -- a signed request like any other, so a wrong token
   is refused there -- for a session (the built-in
   :data:`~stratagem.rpc.transport.LANE_METHOD`): the signed reply names the lane's port, a
   fresh 128-bit session id and the methods served on it. A session opens one connection,
   within :data:`SESSION_TTL_S`;
2. the client connects to the server's host at that port and sends the 16 session bytes; the
   server forgets the session (one use) and closes, unread, a connection that brings no
   pending session. Both ends derive the connection's key from the token and the session
   (:meth:`~stratagem.rpc.auth.Authenticator.lane_key`); the token never travels;
3. each request and each reply is one frame::

       head = b"SGL1" | counter u64 | body length u64 | word length u16 | word (the method)
       head tag (16) | body | body tag (16)

   The tags are GMACs under the connection's key with IVs (direction, part, counter), never
   reused: a connection's requests count 0, 1, 2... and each reply carries its request's
   counter, so a frame replayed, reordered or moved to another connection fails. The head's
   tag and the size limit are checked before the body is read, the body's tag before it is
   decoded; a failed check closes the connection (the server counts it as refused).

Failures, as the gRPC path reports them: a dead or restarted peer, a broken connection or a
passed deadline raise :class:`~stratagem.errors.UnavailableError` naming the task (a request
whose connection broke may or may not have run, as with gRPC; callers that must not apply
something twice fence it, see :mod:`stratagem.ps.fencing`); a connection that fails a check
raises :class:`~stratagem.rpc.errors.AuthenticationError`. Idle connections are checked before
reuse, so a restarted server costs a new session, not an error.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import threading
import time
from concurrent import futures
from typing import Any, Callable, NoReturn

from stratagem.errors import UnavailableError
from stratagem.rpc.codec import Pickler, encode_parts
from stratagem.rpc.errors import AuthenticationError, MessageTooLargeError
from stratagem.rpc.lane_frames import _Connection, _limit_time, _recv

__all__ = ["LaneCall", "LaneClient", "LaneServer", "SESSION_TTL_S"]

logger = logging.getLogger("stratagem.rpc")

_SESSION = 16
SESSION_TTL_S = 30.0
MAX_CONNECTIONS = 256        # per server; more are closed unread
MAX_PENDING_SESSIONS = 1024
REPLY_S = 60.0               # a reply that has begun to arrive is whole within this (the server's send bound)
MAX_STARTED_BYTES = 4 << 20  # larger requests of LaneClient.start go over gRPC (their send is not bounded by start)


class LaneServer:
    """Serves ``serve(method, body) -> reply parts`` on connections opened with sessions.

    ``host`` is the server's own host (as its gRPC address gives it); the port is free.
    ``limit(method)`` bounds a request's body. ``refused()`` is called for each connection
    closed on a failed check. Each connection is served by a thread of its own.
    """

    def __init__(self, host: str, keys: Callable[[bytes], bytes], serve: Callable[[str, memoryview], list],
                 limit: Callable[[str], int], refused: Callable[[str], None], name: str) -> None:
        self._keys, self._serve, self._limit, self._refused, self.name = keys, serve, limit, refused, name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), 0), family=family)
        self.port = self._listener.getsockname()[1]
        self._pending: dict[bytes, float] = {}
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name=f"stratagem-lane-{self.port}").start()

    def session(self) -> bytes:
        """A fresh one-use session id for one connection (handed out over gRPC)."""
        session, now = secrets.token_bytes(_SESSION), time.monotonic()
        with self._lock:
            for old in [s for s, expiry in self._pending.items() if expiry < now]:
                del self._pending[old]
            if len(self._pending) >= MAX_PENDING_SESSIONS:
                self._pending.pop(next(iter(self._pending)))
            self._pending[session] = now + SESSION_TTL_S
        return session

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            connections = list(self._open)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread; the port closes
        except OSError:
            pass
        self._listener.close()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:   # closed: the server stopped
                return
            with self._lock:
                if self._stopped or len(self._open) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                self._open.add(sock)
            threading.Thread(target=self._connection, args=(sock,), daemon=True,
                             name="stratagem-lane-conn").start()

    def _connection(self, sock: socket.socket) -> None:
        connection = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _limit_time(sock, time.monotonic() + 10.0)
            session = _recv(sock, _SESSION, time.monotonic() + 10.0)
            with self._lock:
                expiry = self._pending.pop(session, None)
            if expiry is None or expiry < time.monotonic():
                raise AuthenticationError("a lane connection brought no session this server handed out")
            connection = _Connection(sock, self._keys(session), server=True)
            while True:   # idle between requests as long as the client likes
                method, body = connection.receive(self._limit, None)
                connection.send(method, self._serve(method, body), time.monotonic() + REPLY_S)
                connection.counter += 1
        except (AuthenticationError, MessageTooLargeError) as error:
            self._refused("lane")
            logger.warning("%s closed a lane connection from %s: %s", self.name, _peer(sock), error)
        except (OSError, EOFError, UnicodeDecodeError):   # the client went away, or sent garbage
            pass
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "a closed socket"


class LaneClient:
    """The client's lane to one server: a pool of connections, each opened with a session that
    ``open_session(seconds)`` asks for over gRPC (``{"port", "session", "methods"}``, or None when the
    server has no lane). Thread-safe: each call takes a connection of its own."""

    def __init__(self, host: str, task: str, keys: Callable[[bytes], bytes],
                 open_session: Callable[[float], dict | None], *, pickler: type[Pickler], max_bytes: int) -> None:
        self._host, self.task, self._keys, self._open_session = host.strip("[]"), task, keys, open_session
        self._pickler, self._max_bytes = pickler, max_bytes
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self.methods: dict[str, int] | None = None   # method -> request limit; unknown until a session

    def serves(self, method: str, seconds: float) -> bool:
        """Whether ``method`` is served on the lane (asked once, within ``seconds``). When the
        server cannot be asked, False: the caller goes over gRPC, whose error names its method."""
        if self.methods is None:
            try:
                self._give_back(self._connect(time.monotonic() + seconds))
            except Exception:  # noqa: BLE001 - the gRPC call that follows reports it
                return False
        return method in self.methods   # type: ignore[operator]

    def call(self, method: str, request: Any, seconds: float, timeout: float | None = None) -> memoryview | None:
        """The reply body (its tags checked) of ``method`` with ``request``, within ``seconds`` (what
        is left of the call's ``timeout``, the one an error names);
        the request's tensors are written from their own memory, unjoined. None, with nothing
        sent, when the lane's port cannot be reached (firewalled): the caller uses gRPC."""
        deadline = time.monotonic() + seconds
        started = self._begin(method, self._encode(method, request), deadline, deadline, timeout or seconds)
        return None if started is None else started.reply(None)

    def start(self, method: str, request: Any, seconds: float, start_seconds: float) -> LaneCall | None:
        """``method`` sent with ``request``, its reply not waited for: the :class:`LaneCall` in flight
        (the reply due within ``seconds``). Asking for a session and sending the request take at most
        ``start_seconds`` (a stopped server is not waited for longer: UnavailableError). None, with
        nothing sent, when the port cannot be reached or the request is over ``MAX_STARTED_BYTES``."""
        body = self._encode(method, request)
        if sum(memoryview(part).nbytes for part in body) > MAX_STARTED_BYTES:
            return None
        now = time.monotonic()
        return self._begin(method, body, now + seconds, now + min(seconds, start_seconds), seconds)

    def _encode(self, method: str, request: Any) -> list:
        body = encode_parts(request, pickler=self._pickler)
        size = sum(memoryview(part).nbytes for part in body)
        if size > min(self._max_bytes, self.methods[method]):   # (the server checks it too)
            raise MessageTooLargeError(f"{method!r} on {self.task} takes requests of at most "
                                       f"{min(self._max_bytes, self.methods[method])} bytes and this one is {size} "
                                       "bytes; send less per call, or raise the limits on both sides.")
        return body

    def _begin(self, method: str, body: list, deadline: float, sent_by: float, timeout: float) -> LaneCall | None:
        connection = self._take(sent_by)
        if connection is None:
            return None
        call = LaneCall(self, connection, method, deadline, timeout)
        try:
            connection.send(method, body, sent_by)
        except (OSError, TimeoutError) as error:
            call._fail(error)
        return call

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _connect(self, deadline: float) -> _Connection | None:
        answer = self._open_session(max(deadline - time.monotonic(), 1e-3))
        if answer is None:   # a server without a lane
            self.methods = {}
            return None
        self.methods = dict(answer["methods"])
        try:
            sock = socket.create_connection((self._host, answer["port"]),
                                            timeout=max(deadline - time.monotonic(), 1e-3))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)   # blocking; each call bounds its time in the kernel (_limit_time)
            _limit_time(sock, deadline)
            sock.sendall(answer["session"])
        except OSError as error:   # it answered over gRPC just now: the port is not open to us
            logger.warning("%s's lane (port %s) cannot be reached (%s); its calls go over gRPC from now on "
                           "(open the port between the hosts for the faster path)", self.task, answer["port"], error)
            self.methods = {}
            return None
        return _Connection(sock, self._keys(answer["session"]), server=False)

    def _take(self, deadline: float) -> _Connection | None:
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                return self._connect(deadline)
            if _idle_and_open(connection.sock):
                return connection
            connection.close()   # the server closed it (stopped or restarted): open another

    def _give_back(self, connection: _Connection | None) -> None:
        if connection is not None:
            with self._lock:
                self._idle.append(connection)



class LaneCall:
    """One call on a lane connection, sent, its reply awaited in steps by one thread
    (:meth:`LaneClient.start`). The connection is the call's until the reply has come; then
    it goes back to the pool."""

    def __init__(self, lane: LaneClient, connection: _Connection, method: str, deadline: float,
                 timeout: float) -> None:
        self._lane, self._connection, self.method = lane, connection, method
        self._deadline, self._timeout = deadline, timeout

    def reply(self, wait: float | None) -> memoryview:
        """The reply body, its tags checked, once it has come. ``futures.TimeoutError`` when it has
        not come within ``wait`` seconds (None: the call's whole time); the call goes on. A dead
        peer (its connection closed), a passed deadline: UnavailableError naming the task."""
        connection = self._connection
        if connection is None:
            raise futures.CancelledError()
        deadline = self._deadline
        if wait is not None:
            if not _readable(connection.sock, max(0.0, min(wait, deadline - time.monotonic()))):
                if time.monotonic() < deadline:
                    raise futures.TimeoutError()
                self._fail(TimeoutError("timed out"))
            deadline = min(deadline, time.monotonic() + REPLY_S)   # it has begun to come: the rest follows
        try:
            _, reply = connection.receive(lambda _: self._lane._max_bytes, deadline)
        except (OSError, TimeoutError) as error:
            self._fail(error)
        except AuthenticationError as error:
            self.cancel()
            raise AuthenticationError(f"{self._lane.task}'s reply to {self.method!r} failed the lane's check: "
                                      f"{error}") from None
        connection.counter += 1
        self._connection = None
        self._lane._give_back(connection)
        return reply

    def cancel(self) -> None:
        """Stops waiting: the connection closes (the server's handler runs on, its reply is dropped)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _fail(self, error: BaseException) -> NoReturn:
        self.cancel()   # its state is unknown: never reused
        task, method = self._lane.task, self.method
        if isinstance(error, TimeoutError):
            raise UnavailableError(f"{task} did not answer {method!r} within {self._timeout:g} s: the task is "
                                   "hung, overloaded or dead.", task=task) from None
        raise UnavailableError(f"{task} is unavailable: {method!r} failed on its lane ({error}); the "
                               "task has died or cannot be reached.", task=task) from None


def _readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has bytes (or EOF) to read within ``seconds``."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(int(seconds * 1000) + (seconds > 0)))


def _idle_and_open(sock: socket.socket) -> bool:
    """Whether an idle connection is still open with nothing to read (a closed one reads EOF)."""
    try:
        sock.setblocking(False)
        sock.recv(1, socket.MSG_PEEK)   # EOF, or bytes nobody asked for: unusable either way
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        try:
            sock.setblocking(True)
        except OSError:
            pass


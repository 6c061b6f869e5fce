"""What both ends of a stratagem RPC agree on: the wire protocol, its limits and defaults.

The server side is :mod:`~stratagem.rpc.server` (:class:`~stratagem.rpc.server.RpcServer`,
a table of named handlers behind one address); the client side is
:mod:`~stratagem.rpc.client` (:class:`~stratagem.rpc.client.RpcClient`, which calls them).

The protocol, one gRPC call per request (service ``stratagem.Rpc``, method = handler name,
raw bytes in and out, no protobuf; clients call unary, servers serve stream-unary so that
they read the body only when they choose to):

1. before its first call, and after the server restarted, a client calls the built-in
   :data:`HELLO_METHOD`, signed but addressed to no one, and learns the server's name and
   incarnation from its signed reply; a client told which task to expect there (``task=``)
   refuses a server of another name (``ClusterConfigError``: the cluster description is
   wrong);
2. the client frames the request with :func:`~stratagem.rpc.codec.encode` and signs it
   (:class:`~stratagem.rpc.auth.Authenticator`): timestamp, nonce, destination name,
   incarnation, body length and body tag go in the metadata, with the MAC over them all;
3. the server checks the metadata alone -- format, clock skew, MAC, destination, incarnation,
   replay, in that order -- before it receives the body: a request that fails is answered
   ``UNAUTHENTICATED`` and logged (without the token); one signed with the token but for
   another server name or an earlier incarnation (the server restarted) is answered
   ``FAILED_PRECONDITION``, and the client learns name and incarnation again and sends the
   call again, once, with a fresh signature (the refused request was never read);
4. the server compares the declared length with the method's limit (``max_message_bytes``
   for handlers marked :func:`~stratagem.rpc.server.large_requests`,
   :data:`SMALL_REQUEST_BYTES` for the others) and refuses a larger one with
   ``RESOURCE_EXHAUSTED``, unread;
5. the server reads the body, checks its length and tag, decodes it, runs the handler in
   its thread pool and frames ``("ok", reply)`` or ``("error", description)`` when the
   handler raised;
6. the server signs the reply (trailing metadata); the client checks it, decodes it and
   returns the reply or raises :class:`~stratagem.rpc.errors.RemoteError` with the remote
   traceback.

The message size limit is set on both sides, for sending and receiving (gRPC's default is
4 MiB): :data:`DEFAULT_MAX_MESSAGE_BYTES` unless given. What a caller without the token can
make a server hold is bounded by HTTP/2 flow control instead (:func:`server_options`): the
server's receive windows are kept small, so an unread body waits on the caller's side.

Never ``fork()`` a process once it holds a gRPC object (server, channel): gRPC's threads
do not survive it. Start servers in processes of their own (``stratagem server``, the
launcher, ``multiprocessing`` with the "spawn" start method).
"""

from __future__ import annotations

from typing import Any

from stratagem.errors import InvalidArgumentError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT_S", "HELLO_METHOD", "LANE_METHOD", "REPLY_ERROR",
           "REPLY_OK", "SERVICE", "SMALL_REQUEST_BYTES", "STATS_METHOD", "check_max_bytes", "server_options",
           "size_options"]

SERVICE = "stratagem.Rpc"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 60.0
GRPC_MAX_MESSAGE = 2**31 - 1
REPLY_OK, REPLY_ERROR = "ok", "error"   # the status that heads every reply
STATS_METHOD = "_rpc_stats"   # built into every server: its wire counters
HELLO_METHOD = "_rpc_hello"   # built into every server: its name and incarnation
LANE_METHOD = "_rpc_lane"   # built into every server: a session for one lane connection (rpc/lane.py)
SMALL_REQUEST_BYTES = 4 << 20   # the request limit of handlers not marked large_requests


def check_max_bytes(max_message_bytes: int) -> int:
    """``max_message_bytes`` if it is a size gRPC accepts; InvalidArgumentError otherwise."""
    if (not isinstance(max_message_bytes, int) or isinstance(max_message_bytes, bool)
            or not 0 < max_message_bytes <= GRPC_MAX_MESSAGE):
        raise InvalidArgumentError(
            f"max_message_bytes must be an int from 1 to {GRPC_MAX_MESSAGE} (gRPC's limit), "
            f"got {max_message_bytes!r}.")
    return max_message_bytes


def size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """The gRPC options that limit messages to ``max_message_bytes``, sent and received."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """A server's gRPC options: the size limits, keepalive, no port sharing, small windows.

    BDP probing is off on the server: it grows a connection's HTTP/2 receive windows with
    the data that arrives, read or not, so that a caller without the token, opening many
    streams whose bodies are never read, could make the server buffer tens of megabytes per
    round (measured: ~60-110 MB for 100 streams of 4 MiB, growing with every round; 2-6 MB
    without probing, even with 1,000 streams). A body the server does read opens its
    stream's window to the message's size anyway, so large authenticated requests are not
    slowed (64 MiB pushes over loopback took the same time with and without probing).
    """
    return size_options(max_message_bytes) + [
        ("grpc.so_reuseport", 0),   # a second server on a taken port must fail
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.bdp_probe", 0),
    ]

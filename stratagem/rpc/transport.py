"""What both ends of a stratagem RPC agree on: the wire protocol, its limits and defaults.

The server side is :mod:`~stratagem.rpc.server` (:class:`~stratagem.rpc.server.RpcServer`,
a table of named handlers behind one address); the client side is
:mod:`~stratagem.rpc.client` (:class:`~stratagem.rpc.client.RpcClient`, which calls them).

The protocol, one gRPC unary call per request (service ``stratagem.Rpc``, method = handler
name, raw bytes in and out, no protobuf):

1. the client frames the request with :func:`~stratagem.rpc.codec.encode` and signs it
   (:class:`~stratagem.rpc.auth.Authenticator`: a MAC in the metadata);
2. the server checks the signature on the raw bytes -- a request that fails is answered
   ``UNAUTHENTICATED``, logged (without the token) and never decoded;
3. the server decodes the request, runs the handler in its thread pool and frames
   ``("ok", reply)`` or ``("error", description)`` when the handler raised;
4. the server signs the reply (trailing metadata); the client checks it, decodes it and
   returns the reply or raises :class:`~stratagem.rpc.errors.RemoteError` with the remote
   traceback.

The message size limit is set on both sides, for sending and receiving (gRPC's default is
4 MiB): :data:`DEFAULT_MAX_MESSAGE_BYTES` unless given.

Never ``fork()`` a process once it holds a gRPC object (server, channel): gRPC's threads
do not survive it. Start servers in processes of their own (``stratagem server``, the
launcher, ``multiprocessing`` with the "spawn" start method).
"""

from __future__ import annotations

from typing import Any

from stratagem.errors import InvalidArgumentError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT_S", "REPLY_ERROR", "REPLY_OK", "SERVICE",
           "STATS_METHOD", "check_max_bytes", "size_options"]

SERVICE = "stratagem.Rpc"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 60.0
GRPC_MAX_MESSAGE = 2**31 - 1
REPLY_OK, REPLY_ERROR = "ok", "error"   # the status that heads every reply
STATS_METHOD = "_rpc_stats"   # built into every server: its wire counters


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

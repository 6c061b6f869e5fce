"""Errors of the RPC layer.

Each subclasses :class:`~stratagem.errors.StratagemError` and ``RuntimeError`` or
``ValueError``, like every stratagem error. A dead or silent peer is not among them: that is
:class:`stratagem.errors.UnavailableError`, raised with the peer's task name.
"""

from __future__ import annotations

from stratagem.errors import StratagemError

__all__ = ["AuthenticationError", "CodecError", "MessageTooLargeError", "RemoteError", "RpcError",
           "WrongServerError"]


class RpcError(StratagemError, RuntimeError):
    """A call failed in a way that no more specific error describes (gRPC status in the text)."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class AuthenticationError(StratagemError, RuntimeError):
    """A message did not prove knowledge of the cluster token (or was stale or replayed).

    Raised on the caller when a server refused its request, and when a reply fails the
    client's check; servers raise it internally and answer ``UNAUTHENTICATED``.
    """


class WrongServerError(AuthenticationError):
    """A request, signed with the right token, was addressed to another server: one of
    another name, or an earlier incarnation of this one (it has restarted since).

    Servers raise it internally and answer ``FAILED_PRECONDITION``; the client then learns
    the server's name and incarnation again and signs the call anew, once (the refused
    request was never read). A replayed request stays refused.
    """


class MessageTooLargeError(StratagemError, ValueError):
    """A request or reply is larger than ``max_message_bytes`` on one side."""


class CodecError(StratagemError, ValueError):
    """Bytes are not a stratagem message, or an object cannot be framed (sparse tensor...)."""


class RemoteError(StratagemError, RuntimeError):
    """A handler raised on the remote side; the caller gets this, with the remote traceback.

    ``str(err)`` ends with the remote traceback. The original exception, when it could be
    pickled and unpickled, is ``err.remote_exception`` and also ``err.__cause__``.
    """

    def __init__(self, message: str, *, remote_type: str, remote_message: str,
                 remote_traceback: str, method: str | None = None, task: str | None = None,
                 remote_exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.method = method
        self.task = task
        self.remote_exception = remote_exception

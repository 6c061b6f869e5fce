"""Errors of the RPC layer.

Each subclasses :class:`~stratagem.errors.StratagemError` and ``RuntimeError`` or
``ValueError``, like every stratagem error. A dead or silent peer is not among them: that is
:class:`stratagem.errors.UnavailableError`, raised with the peer's task name.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from stratagem._frames import is_users
from stratagem.errors import StratagemError

__all__ = ["AuthenticationError", "ClockSkewError", "CodecError", "MessageTooLargeError", "RemoteError",
           "RpcError", "WrongServerError", "describe_exception"]


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


class ClockSkewError(AuthenticationError):
    """A request was refused because the clocks of its sender and its server differ by more
    than the cluster allows (``max_skew_s``, 5 minutes by default), not for its token.

    ``offset_s`` is the server's clock minus the sender's, in seconds, where known (None
    otherwise). The fix is on the hosts: synchronise their clocks (NTP: chrony or
    systemd-timesyncd).
    """

    def __init__(self, message: str, *, offset_s: float | None = None) -> None:
        super().__init__(message)
        self.offset_s = offset_s

    def __reduce__(self) -> tuple:   # travels pickled inside RemoteError, with its offset
        return (_clock_skew_error, (str(self), self.offset_s))


def _clock_skew_error(message: str, offset_s: float | None) -> ClockSkewError:
    return ClockSkewError(message, offset_s=offset_s)


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

    ``str(err)`` is short: the error, where it was raised, and one traceback of the user's
    frames (those outside stratagem, the standard library and installed packages, see
    :mod:`stratagem._frames`) plus the frame that raised. A handler that failed because a
    call it made failed in turn -- a worker's step whose push a ps refused -- is told as
    that innermost error, its way summed up in one line (``'run' on worker 0 -> 'push' on
    ps 0``). The whole remote traceback, every frame of every task, is
    ``err.remote_traceback``.

    ``remote_type``, ``remote_message`` and ``remote_exception`` describe the innermost
    error; the latter, when it could be pickled and unpickled, is also ``err.__cause__``.
    ``method`` and ``task`` name the call that failed here, ``chain`` every call on the
    way, as ``(method, task)`` pairs, and ``frames`` the remote frames, as
    ``(filename, lineno, function, line, is_users, task)``.
    """

    def __init__(self, message: str, *, remote_type: str, remote_message: str,
                 remote_traceback: str, method: str | None = None, task: str | None = None,
                 remote_exception: BaseException | None = None,
                 chain: Sequence[tuple[str | None, str | None]] = (),
                 frames: Sequence[tuple[Any, ...]] = ()) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.method = method
        self.task = task
        self.remote_exception = remote_exception
        self.chain = tuple(chain) or ((method, task),)
        self.frames = [tuple(frame) for frame in frames]

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any], *, method: str, task: str,
                   remote_exception: BaseException | None) -> RemoteError:
        """The error a client raises for ``reply`` (what :func:`describe_exception` made on the
        server of ``task``) to its call of ``method``."""
        chain = ((method, task), *(tuple(link) for link in reply.get("chain", ())))
        frames = [(*frame[:5], frame[5] or task) for frame in reply.get("frames", ())]
        shown: list[tuple[Any, ...] | None] = [frame for frame in frames if frame[4]]
        if frames and not frames[-1][4]:
            shown.append(frames[-1])   # where it was raised, even inside a library
        if len(shown) > MAX_FRAMES_SHOWN:   # deep recursion: the first frames and the last
            shown = [*shown[:3], None, *shown[-(MAX_FRAMES_SHOWN - 3):]]
        said = f": {reply['message']}" if reply["message"] else ""
        lines = [f"{' -> '.join(f'{m!r} on {t}' for m, t in chain)} raised {reply['type']}{said}"]
        if shown:
            lines.append(f"\nRemote traceback ({' -> '.join(str(t) for _, t in chain)}): your code, then the line "
                         "that raised (every frame: error.remote_traceback)")
            for frame in shown:
                lines += (["  ..."] if frame is None else
                          [f'  File "{frame[0]}", line {frame[1]}, in {frame[2]}'
                           + (f"  [{frame[5]}]" if len(chain) > 1 else "")]
                          + ([f"    {frame[3]}"] if frame[3] else []))
        elif reply.get("traceback"):   # no frames sent: show the text
            lines.append(f"\nRemote traceback ({task}):\n{reply['traceback'].rstrip()}")
        return cls("\n".join(lines), remote_type=reply["type"], remote_message=reply["message"],
                   remote_traceback=reply.get("traceback", ""), method=method, task=task,
                   remote_exception=remote_exception, chain=chain, frames=frames)


#: The most frames a RemoteError's message shows.
MAX_FRAMES_SHOWN = 12


def describe_exception(exc: BaseException) -> tuple[dict[str, Any], BaseException | None]:
    """What the caller of a handler that raised ``exc`` learns of it -- ``type``, ``message``,
    ``traceback`` (the whole text), ``frames`` and ``chain``, see :class:`RemoteError` --
    and the exception to send along pickled: ``exc``, or for a :class:`RemoteError` (a call
    the handler made failed) the innermost one."""
    kind = type(exc)
    frames = [(f.filename, f.lineno, f.name, f.line, is_users(f.filename), None)
              for f in traceback.extract_tb(exc.__traceback__)]
    described: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc),
                                 "traceback": _whole_traceback(exc), "frames": frames, "chain": []}
    if isinstance(exc, RemoteError):
        described.update(type=exc.remote_type, message=exc.remote_message, frames=frames + exc.frames,
                         chain=list(exc.chain))
        return described, exc.remote_exception
    return described, exc


def _whole_traceback(exc: BaseException) -> str:
    """``exc``'s traceback, then those of the remote errors among its causes and contexts."""
    text = "".join(traceback.format_exception(exc))
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, RemoteError):
            text += f"\nRemote traceback of {inner.method!r} on {inner.task}:\n{inner.remote_traceback}"
        inner = inner.__cause__ or inner.__context__
    return text

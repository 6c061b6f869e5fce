"""The lane's frames: how one request or reply travels on an authenticated connection.

A frame is a head (magic, counter, body length, method word) and its GMAC tag, then the body
and its tag, under the connection's key (see :mod:`~stratagem.rpc.lane` for the protocol).
Reads and writes are blocking system calls bounded in the kernel, one per body.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stratagem.rpc.errors import AuthenticationError, MessageTooLargeError

MAGIC = b"SGL1"
_HEAD = struct.Struct("<4sQQH")
_IV = struct.Struct("<IQ")
_TAG = 16
_REQUEST, _REPLY = 0, 2      # IV direction codes (+0 head, +1 body)
_JOIN_BYTES = 64 << 10       # a body of parts up to this size is tagged joined (cheaper than a GCM context)


def _limit_time(sock: socket.socket, deadline: float | None) -> None:
    """Bounds the socket's blocking reads and writes by ``deadline`` (None: unbounded) in the
    kernel (SO_RCVTIMEO / SO_SNDTIMEO). The socket itself stays blocking: one ``recv`` with
    MSG_WAITALL then takes a whole body in one system call, the GIL released once -- where a
    Python-level timeout polls and reads in 64 KiB pieces, each taking the GIL back (measured:
    a ps step 3x slower once other threads of the process wanted the GIL)."""
    left = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-3)
    limit = struct.pack("ll", int(left), int(left % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    while view.nbytes:
        try:
            got = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
        except BlockingIOError:   # SO_RCVTIMEO ran out
            raise TimeoutError("timed out") from None
        if not got:
            raise ConnectionResetError("the connection was closed")
        view = view[got:]
        if view.nbytes and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("timed out")


def _recv(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buffer = bytearray(n)
    _recv_into(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def _send(sock: socket.socket, buffers: list, deadline: float | None) -> None:
    """Writes every buffer, in order, without joining them (``sendmsg`` with their views)."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    first = 0
    while first < len(views):
        try:
            sent = sock.sendmsg(views[first:first + 512])
        except BlockingIOError:   # SO_SNDTIMEO ran out
            raise TimeoutError("timed out") from None
        if deadline is not None and time.monotonic() >= deadline and sent < sum(v.nbytes for v in views[first:]):
            raise TimeoutError("timed out")
        while sent:
            if sent >= views[first].nbytes:
                sent -= views[first].nbytes
                first += 1
            else:
                views[first], sent = views[first][sent:], 0


class _Connection:
    """One authenticated connection's framing: its key and the counter of its next request."""

    def __init__(self, sock: socket.socket, key: bytes, *, server: bool) -> None:
        self.sock = sock
        self._key = key
        self._aead = AESGCM(key)
        self._sends, self._receives = (_REPLY, _REQUEST) if server else (_REQUEST, _REPLY)
        self.counter = 0

    def _tag(self, kind: int, buffers: list) -> bytes:
        iv = _IV.pack(kind, self.counter)
        if len(buffers) > 1 and sum(memoryview(b).nbytes for b in buffers) <= _JOIN_BYTES:
            buffers = [b"".join(buffers)]   # (the same tag: the parts are one stream of associated data)
        if len(buffers) == 1:
            return self._aead.encrypt(iv, b"", buffers[0])   # nothing encrypted: the GMAC tag
        tagger = Cipher(algorithms.AES(self._key), modes.GCM(iv)).encryptor()
        for buffer in buffers:
            tagger.authenticate_additional_data(buffer)
        tagger.finalize()
        return tagger.tag

    def send(self, word: str, body: list, deadline: float | None) -> None:
        encoded = word.encode()
        size = sum(memoryview(b).nbytes for b in body)
        head = _HEAD.pack(MAGIC, self.counter, size, len(encoded)) + encoded
        _limit_time(self.sock, deadline)
        _send(self.sock, [head, self._tag(self._sends, [head]), *body,
                          self._tag(self._sends + 1, body or [b""])], deadline)

    def receive(self, limit: Callable[[str], int], deadline: float | None) -> tuple[str, memoryview]:
        """The next frame's word and body, both checked; the head before the body is read."""
        _limit_time(self.sock, deadline)
        head = _recv(self.sock, _HEAD.size, deadline)
        magic, counter, size, word_size = _HEAD.unpack(head)
        if magic != MAGIC:
            raise AuthenticationError(f"not a stratagem lane frame (starts with {magic!r})")
        head += _recv(self.sock, word_size, deadline)
        if not hmac.compare_digest(_recv(self.sock, _TAG, deadline), self._tag(self._receives, [head])):
            raise AuthenticationError("the frame's head does not carry this connection's tag (wrong "
                                      "cluster token, or a frame replayed or altered)")
        if counter != self.counter:
            raise AuthenticationError(f"frame {counter} where {self.counter} was due (replayed or reordered)")
        word = head[_HEAD.size:].decode()
        if size > limit(word):
            raise MessageTooLargeError(f"{word!r} takes at most {limit(word)} bytes on the lane; this "
                                       f"frame announces {size}")
        body = memoryview(np.empty(size, dtype=np.uint8)).cast("B")   # not zeroed: filled below
        _recv_into(self.sock, body, deadline)
        if not hmac.compare_digest(_recv(self.sock, _TAG, deadline), self._tag(self._receives + 1, [body])):
            raise AuthenticationError("the frame's body does not carry this connection's tag (altered "
                                      "on its way, or a wrong cluster token)")
        return word, body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

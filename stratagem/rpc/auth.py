"""Proof of the cluster token on every message, checked before anything is unpickled.

SPEC §14: cluster processes accept work only from members of their own cluster, which
share a secret, ``STRATAGEM_CLUSTER_TOKEN`` (the launcher makes one per job). The token
itself never travels. Every request carries, in gRPC metadata:

- ``sg-ts``: the sender's wall-clock time in milliseconds;
- ``sg-nonce``: 96 random bits, hex;
- ``sg-mac``: HMAC-SHA256, keyed by the token, over ("request", method, ts, nonce, body).

The server recomputes the MAC over the raw bytes it received and compares in constant
time; only then does the transport decode (unpickle) the body. It refuses a timestamp more
than ``max_skew_s`` (default 5 minutes) from its own clock -- cluster hosts need roughly
synchronised clocks -- and a nonce it has already accepted with the same timestamp (a
replayed request); nonces are forgotten once their timestamp leaves the window, when a
replay would be refused as stale anyway.

Replies are authenticated the same way: the server's MAC covers ("reply", method, the
request's nonce, body), so a reply cannot be forged, altered, or replayed for another
request; the client checks it before it decodes the reply.

This is authentication and integrity, not secrecy: the bytes travel in clear (plain
HTTP/2). Run clusters on a private network.

Example::

    >>> from stratagem.rpc.auth import Authenticator
    >>> sender, receiver = Authenticator("s3cret"), Authenticator("s3cret")
    >>> metadata = sender.sign_request("pull", b"body")
    >>> nonce = receiver.verify_request("pull", dict(metadata), b"body")
    >>> receiver.verify_request("pull", dict(metadata), b"body")
    Traceback (most recent call last):
    ...
    stratagem.rpc.errors.AuthenticationError: replayed request (nonce already used)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from collections.abc import Mapping

from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc.errors import AuthenticationError

__all__ = ["Authenticator", "TOKEN_VARIABLE", "cluster_token"]

TOKEN_VARIABLE = "STRATAGEM_CLUSTER_TOKEN"
TIMESTAMP_KEY, NONCE_KEY, MAC_KEY = "sg-ts", "sg-nonce", "sg-mac"
DEFAULT_MAX_SKEW_S = 300.0
_NONCE_HEX = 24


def cluster_token(environ: Mapping[str, str] | None = None) -> str:
    """The cluster token from ``STRATAGEM_CLUSTER_TOKEN``; a clear error when it is unset."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_VARIABLE, "")
    if not token.strip():
        raise ClusterConfigError(
            f"{TOKEN_VARIABLE} is not set: every task of a cluster must be given the same "
            "secret token, which proves to the others that it belongs to the cluster. "
            "`stratagem launch` sets it for local clusters; on a real cluster create one "
            "with `python -c \"import secrets; print(secrets.token_hex(32))\"` and put it in "
            f"the environment of every task (coordinator, workers, parameter servers).")
    return token


def _field(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


class _NonceCache:
    """Nonces accepted recently, bucketed by the second of their (authenticated) timestamp.

    A replay carries the same timestamp as the original, so one bucket is enough to look
    in; buckets older than the skew window are dropped whole.
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._buckets: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def add(self, timestamp_ms: int, nonce: str, now: float) -> bool:
        """Records ``nonce``; False if it was already there."""
        second = timestamp_ms // 1000
        with self._lock:
            if now >= self._next_prune:
                oldest = int(now - self._window_s) - 2
                for key in [key for key in self._buckets if key < oldest]:
                    del self._buckets[key]
                self._next_prune = now + 1.0
            bucket = self._buckets.setdefault(second, set())
            if nonce in bucket:
                return False
            bucket.add(nonce)
            return True


class Authenticator:
    """Signs and checks messages with the cluster token (HMAC-SHA256).

    One per server or client; thread-safe. The token must be the same in every task.
    """

    def __init__(self, token: str, *, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        if not isinstance(token, str) or not token:
            raise InvalidArgumentError(
                f"the cluster token must be a non-empty string, got {type(token).__name__}; "
                f"use stratagem.rpc.cluster_token() to read {TOKEN_VARIABLE}.")
        if not max_skew_s > 0:
            raise InvalidArgumentError(f"max_skew_s must be > 0 seconds, got {max_skew_s!r}.")
        self._mac = hmac.new(token.encode("utf-8"), digestmod=hashlib.sha256)
        self._max_skew_ms = int(max_skew_s * 1000)
        self._nonces = _NonceCache(max_skew_s)

    def __repr__(self) -> str:   # never show the token
        return "Authenticator(token=<hidden>)"

    def _digest(self, kind: bytes, method: str, stamp: str, nonce: str,
                body: bytes | memoryview) -> str:
        mac = self._mac.copy()
        mac.update(_field(kind) + _field(method.encode()) + _field(stamp.encode())
                   + _field(nonce.encode()) + struct.pack("<Q", len(body)))
        mac.update(body)
        return mac.hexdigest()

    # --------------------------------------------------------------------- requests

    def sign_request(self, method: str, body: bytes, *,
                     timestamp_ms: int | None = None) -> tuple[tuple[str, str], ...]:
        """gRPC metadata proving that this request comes from a holder of the token."""
        stamp = str(int(time.time() * 1000) if timestamp_ms is None else timestamp_ms)
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        return ((TIMESTAMP_KEY, stamp), (NONCE_KEY, nonce),
                (MAC_KEY, self._digest(b"request", method, stamp, nonce, body)))

    def verify_request(self, method: str, metadata: Mapping[str, str],
                       body: bytes | memoryview) -> str:
        """Returns the request's nonce; raises AuthenticationError saying why it is refused."""
        stamp, nonce, mac = (metadata.get(key) for key in (TIMESTAMP_KEY, NONCE_KEY, MAC_KEY))
        if not (isinstance(stamp, str) and isinstance(nonce, str) and isinstance(mac, str)):
            raise AuthenticationError("no cluster-token proof in the request (is the caller a "
                                      "stratagem client of this cluster?)")
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) < 20):
            raise AuthenticationError("malformed timestamp")
        now = time.time()
        skew_ms = abs(int(now * 1000) - int(stamp))
        if skew_ms > self._max_skew_ms:
            raise AuthenticationError(
                f"stale or future timestamp ({skew_ms / 1000:.0f} s from this host's clock, "
                f"more than {self._max_skew_ms / 1000:.0f} s): synchronise the hosts' clocks")
        expected = self._digest(b"request", method, stamp, nonce, body)
        if not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                f"wrong cluster token: the request's HMAC does not match; give every task "
                f"the same {TOKEN_VARIABLE}")
        if len(nonce) != _NONCE_HEX or not self._nonces.add(int(stamp), nonce, now):
            raise AuthenticationError("replayed request (nonce already used)")
        return nonce

    # ----------------------------------------------------------------------- replies

    def sign_reply(self, method: str, request_nonce: str,
                   body: bytes) -> tuple[tuple[str, str], ...]:
        """gRPC (trailing) metadata authenticating a reply to the request with that nonce."""
        return ((MAC_KEY, self._digest(b"reply", method, "", request_nonce, body)),)

    def verify_reply(self, method: str, request_nonce: str, metadata: Mapping[str, str],
                     body: bytes | memoryview) -> None:
        """Raises AuthenticationError unless the reply was made by a holder of the token."""
        mac = metadata.get(MAC_KEY)
        expected = self._digest(b"reply", method, "", request_nonce, body)
        if not isinstance(mac, str) or not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                "the reply is not signed with this cluster's token: the server at this "
                f"address does not share {TOKEN_VARIABLE} (or is not a stratagem server)")

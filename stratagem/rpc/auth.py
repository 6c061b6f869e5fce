"""Proof of the cluster token on every message, checked before anything is unpickled.

Cluster processes accept work only from members of their own cluster, which
share a secret, ``STRATAGEM_CLUSTER_TOKEN`` (the launcher makes one per job; one read from
the environment must be random and at least 32 characters long, see
:func:`check_token_strength`). The token itself never travels. Every request carries, in gRPC metadata:

- ``sg-ts``: the sender's wall-clock time in milliseconds;
- ``sg-nonce``: 96 random bits, hex;
- ``sg-mac``: the message's authentication code (below).

The code is two keyed functions, both derived from the token. The body -- megabytes of
tensors, often -- is authenticated by GMAC (AES-256-GCM with the body as associated data
and nothing encrypted; the nonce is the GCM IV): OpenSSL runs it at 10-20 GB/s with AES-NI
and carry-less multiplication, against about 1.5 GB/s for HMAC-SHA256, which made the MAC
the largest cost of a parameter server moving 7 MB per step. The 16-byte GMAC tag and the
small fields (message kind, method, timestamp, nonce, body length) then go through
HMAC-SHA256, whose hex digest is ``sg-mac``. Requests and replies use different GMAC keys,
so an IV is never reused between the two directions.

The server recomputes the code over the raw bytes it received and compares in constant
time; only then does the transport decode (unpickle) the body. It refuses a timestamp more
than ``max_skew_s`` (default 5 minutes) from its own clock -- cluster hosts need roughly
synchronised clocks -- and a nonce it has already accepted with the same timestamp (a
replayed request); nonces are forgotten once their timestamp leaves the window, when a
replay would be refused as stale anyway.

Replies are authenticated the same way, with a fresh random IV of their own (``sg-iv``):
the code covers ("reply", method, the request's nonce, the IV, body), so a reply cannot be
forged, altered, or replayed for another request; the client checks it before it decodes
the reply.

Random 96-bit IVs keep GCM within its bounds for 2**32 messages per token; the launcher
makes a new token per job. This is authentication and integrity, not secrecy: the bytes
travel in clear (plain HTTP/2). Run clusters on a private network.

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

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc.errors import AuthenticationError

__all__ = ["Authenticator", "MIN_TOKEN_CHARS", "TOKEN_VARIABLE", "check_token_strength", "cluster_token"]

TOKEN_VARIABLE = "STRATAGEM_CLUSTER_TOKEN"
TIMESTAMP_KEY, NONCE_KEY, MAC_KEY, IV_KEY = "sg-ts", "sg-nonce", "sg-mac", "sg-iv"
DEFAULT_MAX_SKEW_S = 300.0
_NONCE_HEX = 24      # 96 bits: the GCM IV
_REQUEST, _REPLY = b"request", b"reply"


MIN_TOKEN_CHARS = 32        # 128 bits as hex, the launcher's kind (it makes 64 hex digits)
MIN_TOKEN_DISTINCT = 8      # a long run of a few characters ("aaaa...") is not a secret
_MAKE_TOKEN = "python -c \"import secrets; print(secrets.token_hex(32))\""


def cluster_token(environ: Mapping[str, str] | None = None) -> str:
    """The cluster token from ``STRATAGEM_CLUSTER_TOKEN``; a clear error when it is unset or weak.

    Every task reads the token here (the coordinator's strategy, ``stratagem server``, the
    workers), so a weak token stops the task at start-up; see :func:`check_token_strength`.
    """
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_VARIABLE, "")
    if not token.strip():
        raise ClusterConfigError(
            f"{TOKEN_VARIABLE} is not set: every task of a cluster must be given the same "
            "secret token, which proves to the others that it belongs to the cluster. "
            "`stratagem launch` sets it for local clusters; on a real cluster create one "
            f"with `{_MAKE_TOKEN}` and put it in the environment of every task "
            "(coordinator, workers, parameter servers).")
    check_token_strength(token)
    return token


def check_token_strength(token: str) -> None:
    """Raises ClusterConfigError unless ``token`` is strong enough to keep others out.

    Anyone who guesses the token can run code on every task of the cluster, so it must be
    random: at least ``MIN_TOKEN_CHARS`` characters (128 bits as hex digits) with at least
    ``MIN_TOKEN_DISTINCT`` different ones. A random token passes (the chance that 32 random
    hex digits have fewer than 8 different ones is below 1e-7); "secret" or "aaaa..." does
    not. The message gives the token's length, never the token.
    """
    distinct = len(set(token))
    if len(token) >= MIN_TOKEN_CHARS and distinct >= MIN_TOKEN_DISTINCT:
        return
    what = (f"{len(token)} character{'s' * (len(token) != 1)}" if len(token) < MIN_TOKEN_CHARS
            else f"only {distinct} different character{'s' * (distinct != 1)}")
    raise ClusterConfigError(
        f"{TOKEN_VARIABLE} is too weak: it has {what}, and a cluster token needs at least "
        f"{MIN_TOKEN_CHARS} characters with at least {MIN_TOKEN_DISTINCT} different ones "
        "(128 random bits), because whoever guesses it can run code on every task. Make a "
        f"random one with `{_MAKE_TOKEN}` and give the same one to every task "
        "(`stratagem launch` makes one per job).")


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
    """Signs and checks messages with the cluster token (GMAC over bodies, HMAC-SHA256 over the rest).

    One per server or client; thread-safe. The token must be the same in every task.
    """

    def __init__(self, token: str, *, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        if not isinstance(token, str) or not token:
            raise InvalidArgumentError(
                f"the cluster token must be a non-empty string, got {type(token).__name__}; "
                f"use stratagem.rpc.cluster_token() to read {TOKEN_VARIABLE}.")
        if not max_skew_s > 0:
            raise InvalidArgumentError(f"max_skew_s must be > 0 seconds, got {max_skew_s!r}.")
        secret = token.encode("utf-8")
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        self._body_keys = {   # one GMAC key per direction, derived from the token
            kind: AESGCM(hmac.digest(secret, b"stratagem body key: " + kind, "sha256"))
            for kind in (_REQUEST, _REPLY)}
        self._max_skew_ms = int(max_skew_s * 1000)
        self._nonces = _NonceCache(max_skew_s)

    def __repr__(self) -> str:   # never show the token
        return "Authenticator(token=<hidden>)"

    def _digest(self, kind: bytes, method: str, bound: str, iv_hex: str,
                body: bytes | memoryview) -> str:
        """The code of a message: GMAC of ``body`` with IV ``iv_hex`` (already checked as hex),
        then HMAC over the fields and that tag. ``bound`` ties the message to its context:
        a request's timestamp, or the nonce of the request that a reply answers."""
        body_tag = self._body_keys[kind].encrypt(bytes.fromhex(iv_hex), b"", body)
        mac = self._mac.copy()
        mac.update(_field(kind) + _field(method.encode()) + _field(bound.encode())
                   + _field(iv_hex.encode()) + struct.pack("<Q", len(body)) + body_tag)
        return mac.hexdigest()

    # --------------------------------------------------------------------- requests

    def sign_request(self, method: str, body: bytes, *,
                     timestamp_ms: int | None = None) -> tuple[tuple[str, str], ...]:
        """gRPC metadata proving that this request comes from a holder of the token."""
        stamp = str(int(time.time() * 1000) if timestamp_ms is None else timestamp_ms)
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        return ((TIMESTAMP_KEY, stamp), (NONCE_KEY, nonce),
                (MAC_KEY, self._digest(_REQUEST, method, stamp, nonce, body)))

    def verify_request(self, method: str, metadata: Mapping[str, str],
                       body: bytes | memoryview) -> str:
        """Returns the request's nonce; raises AuthenticationError saying why it is refused."""
        stamp, nonce, mac = (metadata.get(key) for key in (TIMESTAMP_KEY, NONCE_KEY, MAC_KEY))
        if not (isinstance(stamp, str) and isinstance(nonce, str) and isinstance(mac, str)):
            raise AuthenticationError("no cluster-token proof in the request (is the caller a "
                                      "stratagem client of this cluster?)")
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) < 20):
            raise AuthenticationError("malformed timestamp")
        if not _is_hex(nonce, _NONCE_HEX):
            raise AuthenticationError(f"malformed nonce (expected {_NONCE_HEX} hex digits)")
        now = time.time()
        skew_ms = abs(int(now * 1000) - int(stamp))
        if skew_ms > self._max_skew_ms:
            raise AuthenticationError(
                f"stale or future timestamp ({skew_ms / 1000:.0f} s from this host's clock, "
                f"more than {self._max_skew_ms / 1000:.0f} s): synchronise the hosts' clocks")
        expected = self._digest(_REQUEST, method, stamp, nonce, body)
        if not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                f"wrong cluster token: the request's authentication code does not match; give "
                f"every task the same {TOKEN_VARIABLE}")
        if not self._nonces.add(int(stamp), nonce, now):
            raise AuthenticationError("replayed request (nonce already used)")
        return nonce

    # ----------------------------------------------------------------------- replies

    def sign_reply(self, method: str, request_nonce: str,
                   body: bytes) -> tuple[tuple[str, str], ...]:
        """gRPC (trailing) metadata authenticating a reply to the request with that nonce."""
        iv = secrets.token_hex(_NONCE_HEX // 2)
        return ((IV_KEY, iv), (MAC_KEY, self._digest(_REPLY, method, request_nonce, iv, body)))

    def verify_reply(self, method: str, request_nonce: str, metadata: Mapping[str, str],
                     body: bytes | memoryview) -> None:
        """Raises AuthenticationError unless the reply was made by a holder of the token."""
        iv, mac = metadata.get(IV_KEY), metadata.get(MAC_KEY)
        if (not isinstance(mac, str) or not isinstance(iv, str) or not _is_hex(iv, _NONCE_HEX)
                or not hmac.compare_digest(
                    self._digest(_REPLY, method, request_nonce, iv, body), mac)):
            raise AuthenticationError(
                "the reply is not signed with this cluster's token: the server at this "
                f"address does not share {TOKEN_VARIABLE} (or is not a stratagem server)")


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(char in "0123456789abcdef" for char in text)

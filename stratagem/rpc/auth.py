"""Proof of the cluster token on every message, checked before a request's body is read.

Cluster processes accept work only from members of their own cluster, which
share a secret, ``STRATAGEM_CLUSTER_TOKEN`` (the launcher makes one per job; every token,
from the environment or given to a server or client, must be random: at least 96 bits by
the estimate of :mod:`stratagem.rpc.tokens`). The token itself never travels. Every request carries, in
gRPC metadata:

- ``sg-ts``: the sender's wall-clock time in milliseconds;
- ``sg-nonce``: 96 random bits, hex;
- ``sg-to``: the name of the server the request is meant for ("ps 0");
- ``sg-inc``: that server's incarnation, a random id it draws each time it starts (clients
  learn name and incarnation with the server's ``_rpc_hello`` method, the one request that
  may leave both empty);
- ``sg-len``: the body's length in bytes;
- ``sg-tag``: the body's authentication tag (below), hex;
- ``sg-mac``: the header's authentication code (below), hex.

The codes are two keyed functions, both derived from the token. The body -- megabytes of
tensors, often -- is authenticated by GMAC (AES-256-GCM with the body as associated data
and nothing encrypted; the nonce is the GCM IV): OpenSSL runs it at 10-20 GB/s with AES-NI
and carry-less multiplication, against about 1.5 GB/s for HMAC-SHA256, which made the MAC
the largest cost of a parameter server moving 7 MB per step. Its 16-byte tag is
``sg-tag``. The small fields -- message kind ("request"), method, timestamp, nonce,
destination, incarnation, body length and body tag -- then go through HMAC-SHA256, whose
hex digest is ``sg-mac``. Requests and replies use different GMAC keys, so an IV is never
reused between the two directions.

The server checks a request in two steps, the first from its metadata alone, before it
reads a byte of the body (:meth:`Authenticator.verify_header`):

1. every field is present and well formed;
2. the timestamp is within ``max_skew_s`` (default 5 minutes) of the server's clock --
   cluster hosts need roughly synchronised clocks; a request outside is refused with
   :class:`~stratagem.rpc.errors.ClockSkewError`, whose message opens with the two clocks
   (the server also sends its time, ``sg-clock``, so that the client's error can say it);
3. ``sg-mac`` matches (compared in constant time): the fields come from a token holder;
4. ``sg-to`` is this server's name: a request captured on its way to another server of the
   cluster is refused;
5. ``sg-inc`` is this server's current incarnation: a request signed before the server
   restarted is refused. (Both refusals are
   :class:`~stratagem.rpc.errors.WrongServerError`, which a client answers by learning the
   server's name and incarnation again and signing the call anew, once.)
6. the nonce was not accepted before with the same timestamp (a replay); nonces are
   forgotten once their timestamp leaves the skew window, when a replay would be refused
   as stale anyway.

Then (:meth:`Authenticator.verify_body`) the server reads the body -- the transport first
compares ``sg-len`` with the method's size limit -- checks that its length is ``sg-len`` and
that its GMAC tag is ``sg-tag`` (constant time); only then does the transport decode
(unpickle) it. A caller without the token thus never makes a server receive a body.

Replies are authenticated the same way, with a fresh random IV of their own (``sg-iv``):
the code covers ("reply", method, the request's nonce, the IV, body length, body tag), so a
reply cannot be forged, altered, or replayed for another request; the client checks it
before it decodes the reply.

Random 96-bit IVs keep GCM within its bounds for 2**32 messages per token; the launcher
makes a new token per job. This is authentication and integrity, not secrecy: the bytes
travel in clear (plain HTTP/2). Run clusters on a private network.

Example::

    >>> from stratagem.rpc.auth import Authenticator
    >>> token = "3d5b0f7e9a1c4d2b8e6f0a3c5d7b9e1f"   # secrets.token_hex(16), say
    >>> sender, receiver = Authenticator(token), Authenticator(token)
    >>> metadata = dict(sender.sign_request("pull", b"body", to="ps 0", incarnation="1a2b"))
    >>> receiver.verify_header("pull", metadata, to="ps 1", incarnation="1a2b")
    Traceback (most recent call last):
    ...
    stratagem.rpc.errors.WrongServerError: the request is meant for 'ps 0', not for 'ps 1'
    >>> header = receiver.verify_header("pull", metadata, to="ps 0", incarnation="1a2b")
    >>> receiver.verify_body(header, b"body")
    >>> receiver.verify_header("pull", metadata, to="ps 0", incarnation="1a2b")
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
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc.errors import AuthenticationError, ClockSkewError, WrongServerError
from stratagem.rpc.tokens import MAKE_TOKEN, MIN_TOKEN_BITS, check_token_strength

__all__ = ["Authenticator", "MIN_TOKEN_BITS", "RequestHeader", "TOKEN_VARIABLE",
           "check_token_strength", "clock_refusal", "cluster_token"]

TOKEN_VARIABLE = "STRATAGEM_CLUSTER_TOKEN"
TIMESTAMP_KEY, NONCE_KEY, MAC_KEY, IV_KEY = "sg-ts", "sg-nonce", "sg-mac", "sg-iv"
CLOCK_KEY = "sg-clock"   # a refusal for the time: "<server's time in ms>,<its max skew in ms>"
TO_KEY, INCARNATION_KEY, LENGTH_KEY, TAG_KEY = "sg-to", "sg-inc", "sg-len", "sg-tag"
_REQUEST_KEYS = (TIMESTAMP_KEY, NONCE_KEY, TO_KEY, INCARNATION_KEY, LENGTH_KEY, TAG_KEY, MAC_KEY)
DEFAULT_MAX_SKEW_S = 300.0
_NONCE_HEX = 24      # 96 bits: the GCM IV
_TAG_HEX = 32        # the 128-bit GMAC tag
_REQUEST, _REPLY = b"request", b"reply"


def cluster_token(environ: Mapping[str, str] | None = None) -> str:
    """The cluster token from ``STRATAGEM_CLUSTER_TOKEN``; a clear error when it is unset or weak.

    Every task reads the token here (the coordinator's strategy, ``stratagem server``, the
    workers), so a weak token stops the task at start-up; see
    :func:`~stratagem.rpc.tokens.check_token_strength`.
    """
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_VARIABLE, "")
    if not token.strip():
        raise ClusterConfigError(
            f"{TOKEN_VARIABLE} is not set: every task of a cluster must be given the same "
            "secret token, which proves to the others that it belongs to the cluster. "
            "`stratagem launch` sets it for local clusters; on a real cluster create one "
            f"with `{MAKE_TOKEN}` and put it in the environment of every task "
            "(coordinator, workers, parameter servers).")
    check_token_strength(token, source=TOKEN_VARIABLE)
    return token


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def skew_message(offset_s: float, here_s: float, max_skew_s: float, here: str, there: str) -> str:
    """Why a request was refused for the time it was signed at, opening with the cause:
    ``here``'s clock (reading ``here_s``) is ``offset_s`` seconds ahead of ``there``'s."""
    return (f"the clocks of {here} and {there} differ by {abs(offset_s):.0f} s ({here} reads "
            f"{_utc(here_s)}, {there} {_utc(here_s - offset_s)}), more than the {max_skew_s:.0f} s "
            f"a cluster allows between a request's signature and its check: synchronise the hosts' "
            f"clocks (NTP: chrony or systemd-timesyncd on every host); the cluster token is not in question")


def clock_refusal(err: Any, who: str, method: str) -> ClockSkewError | None:
    """A client's error for a gRPC refusal (``err``: a ``grpc.RpcError``) that carries the
    server's clock (``sg-clock``): a ClockSkewError naming both clocks; None for another refusal."""
    try:
        trailing = dict(err.trailing_metadata() or ())   # type: ignore[attr-defined]
        server_ms, max_ms = (int(part) for part in trailing[CLOCK_KEY].split(","))
    except Exception:   # no such metadata, or not ours: an ordinary refusal
        return None
    now = time.time()
    offset = now - server_ms / 1000
    if abs(offset) * 1000 <= max_ms:   # the clocks agree: the request itself was that old
        return AuthenticationError(
            f"{who} refused {method!r} as signed more than {max_ms / 1000:.0f} s before it was checked, "
            f"though the two hosts' clocks agree within {abs(offset):.0f} s: the request waited that long "
            "on its way (a stalled process or an overloaded server)")
    return ClockSkewError(f"{skew_message(offset, now, max_ms / 1000, 'this host', who)}. ({who} refused "
                          f"{method!r} for that.)", offset_s=-offset)


def _field(value: str) -> bytes:
    encoded = value.encode()
    return struct.pack("<Q", len(encoded)) + encoded


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and text.isascii() and not text.strip("0123456789abcdef")


def _is_count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) < 20


_KIND_FIELDS = {kind: _field(kind.decode()) for kind in (_REQUEST, _REPLY)}


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


@dataclass(frozen=True)
class RequestHeader:
    """A request's metadata once :meth:`Authenticator.verify_header` accepted it: what the
    body must then be (``length`` bytes with GMAC tag ``tag``) and the nonce its reply
    answers."""

    method: str
    nonce: str
    length: int
    tag: str


class Authenticator:
    """Signs and checks messages with the cluster token (GMAC over bodies, HMAC-SHA256 over the rest).

    One per server or client; thread-safe. The token must be the same in every task, and
    random: a weak one (see :func:`~stratagem.rpc.tokens.check_token_strength`) is refused
    with ClusterConfigError, so every :class:`~stratagem.rpc.server.RpcServer` and
    :class:`~stratagem.rpc.client.RpcClient` applies the same rule as the environment's token.
    """

    def __init__(self, token: str, *, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        if not isinstance(token, str):
            raise InvalidArgumentError(
                f"the cluster token must be a string, got {type(token).__name__}; "
                f"use stratagem.rpc.cluster_token() to read {TOKEN_VARIABLE}.")
        check_token_strength(token, source="the cluster token given to this server or client")
        if not max_skew_s > 0:
            raise InvalidArgumentError(f"max_skew_s must be > 0 seconds, got {max_skew_s!r}.")
        secret = token.encode("utf-8")
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        self._body_keys = {   # one GMAC key per direction, derived from the token
            kind: AESGCM(hmac.digest(secret, b"stratagem body key: " + kind, "sha256"))
            for kind in (_REQUEST, _REPLY)}
        self._lane_secret = hmac.digest(secret, b"stratagem lane key", "sha256")
        self._max_skew_ms = int(max_skew_s * 1000)
        self._nonces = _NonceCache(max_skew_s)

    def __repr__(self) -> str:   # never show the token
        return "Authenticator(token=<hidden>)"

    def lane_key(self, session: bytes) -> bytes:
        """The key of one lane connection (:mod:`~stratagem.rpc.lane`): derived from the token
        and the connection's random session id, so only token holders can compute it."""
        return hmac.digest(self._lane_secret, session, "sha256")

    def clock_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a server adds to its refusal of a request signed outside the skew window:
        its time and window, so that the caller's error can name both clocks."""
        return ((CLOCK_KEY, f"{int(time.time() * 1000)},{self._max_skew_ms}"),)

    def _tag(self, kind: bytes, iv_hex: str, body: bytes | memoryview) -> str:
        """The GMAC tag of ``body`` with IV ``iv_hex`` (already checked as hex), hex."""
        return self._body_keys[kind].encrypt(bytes.fromhex(iv_hex), b"", body).hex()

    def _code(self, kind: bytes, *fields: str) -> str:
        """HMAC-SHA256 over the message kind and ``fields``, each prefixed by its length."""
        mac = self._mac.copy()
        mac.update(b"".join([_KIND_FIELDS[kind], *map(_field, fields)]))
        return mac.hexdigest()

    # --------------------------------------------------------------------- requests

    def sign_request(self, method: str, body: bytes, *, to: str, incarnation: str,
                     timestamp_ms: int | None = None) -> tuple[tuple[str, str], ...]:
        """gRPC metadata proving that this request comes from a holder of the token and is
        meant for server ``to`` in its incarnation ``incarnation``."""
        stamp = str(int(time.time() * 1000) if timestamp_ms is None else timestamp_ms)
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        length, tag = str(len(body)), self._tag(_REQUEST, nonce, body)
        mac = self._code(_REQUEST, method, stamp, nonce, to, incarnation, length, tag)
        return ((TIMESTAMP_KEY, stamp), (NONCE_KEY, nonce), (TO_KEY, to),
                (INCARNATION_KEY, incarnation), (LENGTH_KEY, length), (TAG_KEY, tag), (MAC_KEY, mac))

    def verify_header(self, method: str, metadata: Mapping[str, str], *, to: str,
                      incarnation: str, unbound_ok: bool = False) -> RequestHeader:
        """Checks a request's metadata, before its body is read, on server ``to`` in its
        incarnation ``incarnation`` (``unbound_ok``: the request may also leave both empty).

        Returns what the body must then be; raises AuthenticationError saying why the
        request is refused (WrongServerError when it is addressed to another server or to
        an earlier incarnation of this one). The nonce counts as used once this returns.
        """
        fields = [metadata.get(key) for key in _REQUEST_KEYS]
        if not all(isinstance(value, str) for value in fields):
            raise AuthenticationError("no cluster-token proof in the request (is the caller a "
                                      "stratagem client of this cluster?)")
        stamp, nonce, sent_to, sent_incarnation, length, tag, mac = fields
        if not _is_count(stamp):
            raise AuthenticationError("malformed timestamp")
        if not _is_hex(nonce, _NONCE_HEX):
            raise AuthenticationError(f"malformed nonce (expected {_NONCE_HEX} hex digits)")
        if not (_is_count(length) and _is_hex(tag, _TAG_HEX)):
            raise AuthenticationError("malformed body length or tag")
        now = time.time()
        offset_ms = int(now * 1000) - int(stamp)
        if abs(offset_ms) > self._max_skew_ms:
            raise ClockSkewError(skew_message(offset_ms / 1000, now, self._max_skew_ms / 1000,
                                              "this host", "the sender"), offset_s=offset_ms / 1000)
        expected = self._code(_REQUEST, method, stamp, nonce, sent_to, sent_incarnation, length, tag)
        if not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                f"wrong cluster token: the request's authentication code does not match; give "
                f"every task the same {TOKEN_VARIABLE}")
        if not (unbound_ok and sent_to == sent_incarnation == ""):
            if not (sent_to and sent_incarnation):
                raise AuthenticationError("the request is not addressed to a server and its incarnation")
            if sent_to != to:
                raise WrongServerError(f"the request is meant for {sent_to!r}, not for {to!r}")
            if sent_incarnation != incarnation:
                raise WrongServerError(
                    f"stale incarnation: the request was signed for an earlier run of {to!r}, "
                    "which has restarted since")
        if not self._nonces.add(int(stamp), nonce, now):
            raise AuthenticationError("replayed request (nonce already used)")
        return RequestHeader(method, nonce, int(length), tag)

    def verify_body(self, header: RequestHeader, body: bytes | memoryview) -> None:
        """Raises AuthenticationError unless ``body`` is the one ``header`` was signed with."""
        if len(body) != header.length:
            raise AuthenticationError(
                f"the body is {len(body)} bytes where the signed header says {header.length}")
        if not hmac.compare_digest(self._tag(_REQUEST, header.nonce, body), header.tag):
            raise AuthenticationError(
                "wrong cluster token: the body's authentication tag does not match (the body "
                f"was altered, or the sender's {TOKEN_VARIABLE} differs)")

    def verify_request(self, method: str, metadata: Mapping[str, str], body: bytes | memoryview,
                       *, to: str, incarnation: str) -> str:
        """:meth:`verify_header` then :meth:`verify_body`, for a body at hand; returns the nonce."""
        header = self.verify_header(method, metadata, to=to, incarnation=incarnation)
        self.verify_body(header, body)
        return header.nonce

    # ----------------------------------------------------------------------- replies

    def sign_reply(self, method: str, request_nonce: str,
                   body: bytes) -> tuple[tuple[str, str], ...]:
        """gRPC (trailing) metadata authenticating a reply to the request with that nonce."""
        iv = secrets.token_hex(_NONCE_HEX // 2)
        mac = self._code(_REPLY, method, request_nonce, iv, str(len(body)), self._tag(_REPLY, iv, body))
        return ((IV_KEY, iv), (MAC_KEY, mac))

    def verify_reply(self, method: str, request_nonce: str, metadata: Mapping[str, str],
                     body: bytes | memoryview) -> None:
        """Raises AuthenticationError unless the reply was made by a holder of the token."""
        iv, mac = metadata.get(IV_KEY), metadata.get(MAC_KEY)
        if (not isinstance(mac, str) or not isinstance(iv, str) or not _is_hex(iv, _NONCE_HEX)
                or not hmac.compare_digest(self._code(
                    _REPLY, method, request_nonce, iv, str(len(body)), self._tag(_REPLY, iv, body)), mac)):
            raise AuthenticationError(
                "the reply is not signed with this cluster's token: the server at this "
                f"address does not share {TOKEN_VARIABLE} (or is not a stratagem server)")

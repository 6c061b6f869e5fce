"""Authenticator and cluster_token, without a network: what is accepted and what is refused."""

from __future__ import annotations

import base64
import random
import secrets
import time

import pytest

from stratagem.errors import ClusterConfigError, InvalidArgumentError
from stratagem.rpc import AuthenticationError, Authenticator, cluster_token
from stratagem.rpc.auth import MIN_TOKEN_BITS, check_token_strength
from stratagem.rpc.tokens import token_bits
from stratagem.rpc.errors import ClockSkewError, WrongServerError

pytestmark = pytest.mark.timeout(30)

BODY = b"\x00payload\xff" * 10
TO, INC = "ps 0", "7" * 32   # the destination and its incarnation
BOUND = {"to": TO, "incarnation": INC}
TOKEN, OTHER = secrets.token_urlsafe(32), secrets.token_urlsafe(32)   # two clusters' tokens


def _signed(token: str = TOKEN, method: str = "push", body: bytes = BODY, **kwargs: object) -> dict[str, str]:
    return dict(Authenticator(token).sign_request(method, body, **{**BOUND, **kwargs}))


def test_a_signed_request_is_accepted_once() -> None:
    server = Authenticator(TOKEN)
    metadata = _signed()
    assert len(server.verify_request("push", metadata, BODY, **BOUND)) == 24
    with pytest.raises(AuthenticationError, match="replayed"):
        server.verify_request("push", metadata, BODY, **BOUND)


@pytest.mark.parametrize("change", ["token", "method", "body", "timestamp", "nonce", "mac",
                                    "to", "inc", "len", "tag"])
def test_any_change_is_refused(change: str) -> None:
    server = Authenticator(TOKEN)
    metadata = _signed(OTHER if change == "token" else TOKEN)
    method, body = "push", BODY
    if change == "method":
        method = "pull"
    elif change == "body":
        body = BODY[:-1] + b"\x00"
    elif change in ("timestamp", "nonce", "mac", "to", "inc", "len", "tag"):
        key = {"timestamp": "sg-ts", "nonce": "sg-nonce", "mac": "sg-mac"}.get(change, f"sg-{change}")
        value = metadata[key]
        metadata[key] = value[:-1] + ("0" if value[-1] != "0" else "1")
    with pytest.raises(AuthenticationError, match="wrong cluster token"):
        server.verify_request(method, metadata, body, **BOUND)


def test_the_header_is_checked_without_the_body_and_the_body_against_it() -> None:
    server = Authenticator(TOKEN)
    metadata = _signed()
    assert metadata["sg-len"] == str(len(BODY)) and len(metadata["sg-tag"]) == 32
    header = server.verify_header("push", metadata, **BOUND)   # no body needed
    assert (header.length, header.nonce) == (len(BODY), metadata["sg-nonce"])
    with pytest.raises(AuthenticationError, match="the body is 89 bytes where the signed header says 90"):
        server.verify_body(header, BODY[:-1])
    with pytest.raises(AuthenticationError, match="body's authentication tag does not match"):
        server.verify_body(header, BODY[:-1] + b"\x01")
    server.verify_body(header, BODY)


def test_requests_are_bound_to_their_server_and_its_incarnation() -> None:
    server = Authenticator(TOKEN)
    with pytest.raises(WrongServerError, match="meant for 'ps 0', not for 'ps 1'"):
        server.verify_header("push", _signed(), to="ps 1", incarnation=INC)
    with pytest.raises(WrongServerError, match="earlier run of 'ps 0'"):
        server.verify_header("push", _signed(), to=TO, incarnation="8" * 32)
    for unbound in (_signed(to="", incarnation=""), _signed(incarnation="")):
        with pytest.raises(AuthenticationError, match="not addressed to a server") as info:
            server.verify_header("push", unbound, **BOUND)
        assert not isinstance(info.value, WrongServerError)
    server.verify_header("_rpc_hello", _signed(method="_rpc_hello", to="", incarnation=""),
                         unbound_ok=True, **BOUND)   # only where the server allows it


def test_missing_proof_is_refused() -> None:
    with pytest.raises(AuthenticationError, match="no cluster-token proof"):
        Authenticator(TOKEN).verify_request("push", {}, BODY, **BOUND)
    partial = {key: value for key, value in _signed().items() if key != "sg-tag"}
    with pytest.raises(AuthenticationError, match="no cluster-token proof"):
        Authenticator(TOKEN).verify_header("push", partial, **BOUND)


@pytest.mark.parametrize("offset_s", [-600, 600])
def test_stale_and_future_timestamps_are_refused(offset_s: int) -> None:
    metadata = _signed(timestamp_ms=int((time.time() + offset_s) * 1000))
    with pytest.raises(ClockSkewError, match=r"^the clocks of this host and the sender differ by 600 s "
                       r"\(this host reads .* UTC, the sender .* UTC\).*synchronise") as info:
        Authenticator(TOKEN).verify_request("push", metadata, BODY, **BOUND)
    assert round(info.value.offset_s) == -offset_s   # the server's clock minus the sender's


def test_skew_within_the_window_is_accepted() -> None:
    metadata = _signed(timestamp_ms=int((time.time() - 60) * 1000))
    Authenticator(TOKEN).verify_request("push", metadata, BODY, **BOUND)


def test_replies_are_bound_to_their_request() -> None:
    client, server = Authenticator(TOKEN), Authenticator(TOKEN)
    reply = server.sign_reply("pull", "a" * 24, b"reply")
    client.verify_reply("pull", "a" * 24, dict(reply), b"reply")
    for method, nonce, body in [("pull", "b" * 24, b"reply"), ("push", "a" * 24, b"reply"),
                                ("pull", "a" * 24, b"reply!")]:
        with pytest.raises(AuthenticationError):
            client.verify_reply(method, nonce, dict(reply), body)
    with pytest.raises(AuthenticationError):
        Authenticator(OTHER).verify_reply("pull", "a" * 24, dict(reply), b"reply")
    with pytest.raises(AuthenticationError):
        client.verify_reply("pull", "a" * 24, {}, b"reply")
    for iv in ("0" * 24, "not hex" + "0" * 17, "", None):   # another, malformed or missing IV
        changed = {**dict(reply), "sg-iv": iv}
        with pytest.raises(AuthenticationError, match="not signed"):
            client.verify_reply("pull", "a" * 24, {k: v for k, v in changed.items() if v is not None},
                                b"reply")


def test_a_malformed_nonce_is_refused_before_any_work() -> None:
    metadata = _signed()
    metadata["sg-nonce"] = "zz" + metadata["sg-nonce"][2:]
    with pytest.raises(AuthenticationError, match="malformed nonce"):
        Authenticator(TOKEN).verify_request("push", metadata, BODY, **BOUND)


def test_large_bodies_are_covered_whole() -> None:
    body = bytes(range(256)) * 40_000   # 10 MB: one flipped byte anywhere is caught
    metadata = _signed(body=body)
    tampered = bytearray(body)
    tampered[len(body) // 2] ^= 1
    with pytest.raises(AuthenticationError, match="wrong cluster token"):
        Authenticator(TOKEN).verify_request("push", metadata, bytes(tampered), **BOUND)
    Authenticator(TOKEN).verify_request("push", metadata, memoryview(body), **BOUND)


def test_the_token_is_never_shown() -> None:
    auth = Authenticator(TOKEN)
    assert TOKEN not in repr(auth)
    metadata = _signed(TOKEN)
    assert all(TOKEN not in value for value in metadata.values())


def test_cluster_token_reads_the_environment_with_a_clear_error() -> None:
    strong = secrets.token_hex(16)
    assert cluster_token({"STRATAGEM_CLUSTER_TOKEN": strong}) == strong
    for env in ({}, {"STRATAGEM_CLUSTER_TOKEN": "  "}):
        with pytest.raises(ClusterConfigError, match="STRATAGEM_CLUSTER_TOKEN is not set.*secrets.token_urlsafe"):
            cluster_token(env)


WEAK = [
    ("x", "1 character;"),
    ("s3cret-password", "15 characters;"),
    ("0123456789abcdef0123456789abcde", "31 characters;"),
    ("a" * 64, "64 characters;"),
    ("abcd" * 16, "64 characters;"),
    ("abcdefgh" * 4, "32 characters;"),         # 32 characters, 8 different ones: the old rule let it in
    ("0123456789" * 5, "50 characters;"),
    ("hunter2-hunter2-hunter2-hunter2-", "32 characters;"),
    ("Password1Password1Password1Password1", "36 characters;"),
]


@pytest.mark.parametrize("token, shape", WEAK)
def test_weak_tokens_are_refused_without_showing_them(token: str, shape: str) -> None:
    with pytest.raises(ClusterConfigError) as info:
        cluster_token({"STRATAGEM_CLUSTER_TOKEN": token})
    message = str(info.value)
    assert message.startswith("STRATAGEM_CLUSTER_TOKEN is too weak: it has about "), message
    assert f"random bits by stratagem's estimate ({shape}" in message
    assert f"needs at least {MIN_TOKEN_BITS}" in message
    assert 'python -c "import secrets; print(secrets.token_urlsafe(32))"' in message
    assert len(token) == 1 or token not in message
    assert token_bits(token) < MIN_TOKEN_BITS


def test_blank_and_tiny_tokens_are_refused_by_servers_and_clients_too() -> None:
    # the same rule wherever a token enters: the public RpcServer and RpcClient
    from stratagem.rpc import RpcClient, RpcServer
    for token, shape in [("", "blank"), ("   ", "blank"), ("x", "1 character;"), ("abcdefgh" * 4, "32 characters;")]:
        with pytest.raises(ClusterConfigError, match=r"the token given to RpcServer\('127.0.0.1:0'\) is too weak"
                           rf".*\({shape}"):
            RpcServer("127.0.0.1:0", {"echo": lambda x: x}, token)
        with pytest.raises(ClusterConfigError, match=r"the token given to RpcClient\('127.0.0.1:9'\) is too weak"):
            RpcClient("127.0.0.1:9", token)
        with pytest.raises(ClusterConfigError, match="too weak"):
            Authenticator(token)


@pytest.mark.parametrize("token", [
    secrets.token_hex(32),           # what `stratagem launch` makes
    secrets.token_hex(16),           # 128 bits
    secrets.token_urlsafe(32),       # what the messages and docs suggest
    secrets.token_urlsafe(16),       # 128 bits in 22 characters
    secrets.token_hex(16).upper(),
    "9f86d081-884c-7d65-9a2f-eaa0c55ad015",   # a uuid4's text
], ids=["hex32", "hex16", "urlsafe32", "urlsafe16", "HEX16", "uuid4"])   # (tokens are new each collection)
def test_random_tokens_are_strong_enough(token: str) -> None:
    check_token_strength(token)
    assert cluster_token({"STRATAGEM_CLUSTER_TOKEN": token}) == token


def test_random_tokens_pass_with_room_to_spare() -> None:
    # the estimate of a random token's bits is close to what it has: 128 for 32 hex digits,
    # less only by the repeats and runs a random string happens to have (fixed draws: the
    # lowest of 200,000 token_hex(16) was 98, one in about a million may fall below 96)
    draw = random.Random(21)
    for make, bits in [(lambda: draw.randbytes(16).hex(), 128),
                       (lambda: base64.urlsafe_b64encode(draw.randbytes(32)).rstrip(b"=").decode(), 256)]:
        estimates = sorted(token_bits(make()) for _ in range(2000))
        assert estimates[0] >= MIN_TOKEN_BITS, estimates[:5]
        assert abs(estimates[len(estimates) // 2] - bits) <= 6, estimates[len(estimates) // 2]


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a string"):
        Authenticator(b"0123456789abcdef0123456789abcdef")
    with pytest.raises(InvalidArgumentError, match="max_skew_s"):
        Authenticator(TOKEN, max_skew_s=0)

"""RpcServer / RpcClient over loopback: calls, authentication, errors, limits, failures.

Most tests call server_script.py processes (see conftest.py); a few build an in-process
server when they need an unusual configuration. Requests that must be refused carry a
payload whose unpickling would create a file: that the file never appears proves that the
server did not unpickle them.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from .rpc_processes import TOKEN, ServerProcess, free_port
from stratagem.errors import ClusterConfigError, UnavailableError
from stratagem.rpc.codec import Pickler, Unpickler
from stratagem.rpc.server import EncodedReply, decodes_request, reads_only
from stratagem.rpc import (AuthenticationError, Authenticator, MessageTooLargeError, RemoteError,
                           RpcClient, RpcServer, decode, encode)

pytestmark = pytest.mark.timeout(60)
WRONG_TOKEN = secrets.token_urlsafe(32)   # another cluster's


class CreatesFile:
    """Unpickling this creates ``path`` (pickle calls ``open(path, "w")``)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.fixture
def server(server_pair: list[ServerProcess]) -> ServerProcess:
    return server_pair[0]


@pytest.fixture
def client(server: ServerProcess):
    with RpcClient(server.address, TOKEN, task="ps 0", default_timeout=20) as rpc_client:
        yield rpc_client


def _raw_call(address: str, method: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/stratagem.Rpc/{method}")(body, metadata=metadata, timeout=10)


def _bound_to(server: ServerProcess) -> dict[str, str]:
    """The keyword arguments that address a request to ``server`` (its name, incarnation)."""
    return {"to": server.name, "incarnation": server.incarnation}


# ---------------------------------------------------------------------------- calls


@pytest.mark.multiprocess
def test_round_trip_of_a_structure_with_tensors(client: RpcClient) -> None:
    request = {"weights": [torch.randn(4, 3), torch.arange(5)], "step": 3, "name": "dense"}
    reply = client.call("echo", request)
    assert reply["step"] == 3 and reply["name"] == "dense"
    for sent, got in zip(request["weights"], reply["weights"]):
        assert torch.equal(sent, got)


@pytest.mark.multiprocess
def test_messages_beyond_grpc_default_4_mib_go_through(client: RpcClient) -> None:
    tensor = torch.randn(3 << 20)   # 12 MiB
    assert torch.equal(client.call("echo", tensor), tensor)


@pytest.mark.multiprocess
def test_remote_exception_reaches_the_caller_with_its_traceback(client: RpcClient) -> None:
    with pytest.raises(RemoteError) as info:
        client.call("fail", "embedding/shard_3")
    err = info.value
    assert err.remote_type == "builtins.KeyError" and err.task == "ps 0" and err.method == "fail"
    assert "_look_up" in err.remote_traceback and "server_script.py" in err.remote_traceback
    assert "Remote traceback (ps 0)" in str(err) and "embedding/shard_3" in str(err)
    assert isinstance(err.__cause__, KeyError) and err.remote_exception is err.__cause__


@pytest.mark.multiprocess
def test_unknown_method_is_a_remote_error_listing_the_methods(client: RpcClient) -> None:
    with pytest.raises(RemoteError, match="has no method 'nope'.*'echo'"):
        client.call("nope", 1)


@pytest.mark.multiprocess
def test_threads_share_one_client(client: RpcClient) -> None:
    def work(index: int) -> bool:
        return all(torch.equal(client.call("echo", torch.full((64,), float(index * 100 + i))),
                               torch.full((64,), float(index * 100 + i))) for i in range(25))

    with futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))


@pytest.mark.multiprocess
def test_call_async_returns_futures_of_replies_and_errors(client: RpcClient) -> None:
    pending = [client.call_async("echo", torch.tensor(i)) for i in range(8)]
    assert [future.result(timeout=20).item() for future in pending] == list(range(8))
    with pytest.raises(RemoteError, match="KeyError"):
        client.call_async("fail", "x").result(timeout=20)


@pytest.mark.multiprocess
def test_a_silent_server_hits_the_deadline(client: RpcClient) -> None:
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="did not answer 'sleep' within 0.3 s") as info:
        client.call("sleep", 3.0, timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert info.value.task == "ps 0"


# -------------------------------------------------------------------- authentication


@pytest.mark.multiprocess
def test_wrong_token_is_refused_logged_and_never_unpickled(server: ServerProcess, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    decode(encode(CreatesFile(tmp_path / "control")))   # the payload works when unpickled
    assert (tmp_path / "control").exists()
    echoes = server.handler_calls("echo")
    with RpcClient(server.address, WRONG_TOKEN, task="ps 0") as intruder:
        with pytest.raises(AuthenticationError, match="wrong cluster token"):   # at its hello
            intruder.call("echo", CreatesFile(marker))
    body = encode(CreatesFile(marker))   # and a request addressed right, with the wrong token
    metadata = Authenticator(WRONG_TOKEN).sign_request("echo", body, **_bound_to(server))
    with pytest.raises(grpc.RpcError, match="wrong cluster token"):
        _raw_call(server.address, "echo", body, metadata)
    assert not marker.exists()
    assert server.handler_calls("echo") == echoes
    with RpcClient(server.address, TOKEN) as member:
        assert member.call("_rpc_stats")["refused"] >= 2
    log = (server.marker_dir / "server.log").read_text()
    assert "refused a '_rpc_hello' request" in log and "refused a 'echo' request" in log
    assert "wrong cluster token" in log
    assert TOKEN not in log and WRONG_TOKEN not in log


@pytest.mark.multiprocess
def test_request_without_proof_is_refused(server: ServerProcess, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(server.address, "echo", encode(CreatesFile(marker)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no cluster-token proof" in info.value.details()
    assert not marker.exists()


@pytest.mark.multiprocess
def test_replayed_and_stale_requests_are_refused(server: ServerProcess) -> None:
    auth = Authenticator(TOKEN)
    body = encode("hello")
    metadata = auth.sign_request("echo", body, **_bound_to(server))
    reply = _raw_call(server.address, "echo", body, metadata)
    assert decode(reply) == ("ok", "hello")
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(server.address, "echo", body, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in info.value.details()
    stale = auth.sign_request("echo", body, timestamp_ms=int((time.time() - 600) * 1000), **_bound_to(server))
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(server.address, "echo", body, stale)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "the clocks of this host and the sender differ by 600 s" in info.value.details()
    server_ms, window_ms = map(int, dict(info.value.trailing_metadata())["sg-clock"].split(","))
    assert abs(server_ms / 1000 - time.time()) < 60 and window_ms == 300_000   # the server's clock, for the error


def test_client_refuses_an_unsigned_reply_before_unpickling_it(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"

    def impostor(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((("sg-mac", "0" * 64),))
        return encode(("ok", CreatesFile(marker)))

    handler = grpc.method_handlers_generic_handler(   # its hello is answered unsigned too
        "stratagem.Rpc", {name: grpc.unary_unary_rpc_method_handler(impostor)
                          for name in ("echo", "_rpc_hello")})
    fake = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        with RpcClient(f"127.0.0.1:{port}", TOKEN) as victim:
            with pytest.raises(AuthenticationError, match="not signed with this cluster's token"):
                victim.call("echo", 1)
    finally:
        fake.stop(None)
    assert not marker.exists()


# ------------------------------------------------------------------------- limits


@pytest.mark.multiprocess
def test_client_refuses_to_send_more_than_its_limit(server: ServerProcess) -> None:
    echoes = server.handler_calls("echo")
    with RpcClient(server.address, TOKEN, max_message_bytes=1 << 20) as small:
        with pytest.raises(MessageTooLargeError, match="max_message_bytes=1048576"):
            small.call("echo", torch.zeros(1 << 19))
    assert server.handler_calls("echo") == echoes


def test_size_limits_on_the_server_and_on_the_client_receiving() -> None:
    limit = 64 << 10
    big = torch.zeros(limit // 2)   # 128 KiB
    handlers = {"echo": lambda x: x, "big": lambda _: big}
    with RpcServer("127.0.0.1:0", handlers, TOKEN, max_message_bytes=limit) as server:
        with RpcClient(server.address, TOKEN) as client:
            with pytest.raises(MessageTooLargeError, match="larger than max"):
                client.call("echo", big)                       # the server refuses to receive it
            with pytest.raises(RemoteError, match="MessageTooLargeError") as info:
                client.call("big")                             # the server refuses to send it
            assert info.value.remote_type.endswith("MessageTooLargeError")
    with RpcServer("127.0.0.1:0", handlers, TOKEN) as server:
        with RpcClient(server.address, TOKEN, max_message_bytes=limit) as client:
            with pytest.raises(MessageTooLargeError, match="larger than max"):
                client.call("big")                             # the client refuses to receive it


# --------------------------------------------------------------------- addresses


@pytest.mark.multiprocess
def test_servers_bind_exactly_their_address(server: ServerProcess) -> None:
    with pytest.raises(ClusterConfigError, match="every interface"):
        RpcServer("0.0.0.0:2222", {}, TOKEN)
    with pytest.raises(ClusterConfigError, match="every interface"):
        RpcServer("[::]:2222", {}, TOKEN)
    RpcServer("0.0.0.0:2222", {}, TOKEN, allow_wildcard=True)   # when meant (not started)
    with pytest.raises(ClusterConfigError, match=f"cannot listen on {server.address}"):
        RpcServer(server.address, {}, TOKEN).start()           # taken: no silent port sharing


# ---------------------------------------------------------------------- failures


@pytest.mark.multiprocess
def test_dead_server_is_unavailable_at_once_and_a_restarted_one_is_reached_again(
        server_pair: list[ServerProcess]) -> None:
    victim = server_pair[1]
    client = RpcClient(victim.address, TOKEN, task="ps 1", default_timeout=20)
    assert client.call("ping") == "pong"
    in_flight = client.call_async("sleep", 30.0)
    time.sleep(0.2)
    victim.process.kill()
    victim.process.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match=r"ps 1 \(127.0.0.1:\d+\) is unavailable") as info:
        client.call("ping")
    assert time.monotonic() - started < 1.0
    assert info.value.task == "ps 1"
    assert isinstance(in_flight.exception(timeout=2), UnavailableError)

    # A new server on the same address: the client reconnects by itself (backoff <= 1 s).
    with RpcServer(victim.address, {"ping": lambda _: "pong again"}, TOKEN):
        restarted = time.monotonic()
        while True:
            try:
                assert client.call("ping", timeout=1.0) == "pong again"
                break
            except UnavailableError:
                assert time.monotonic() - restarted < 5.0, "not reconnected within 5 s"
                time.sleep(0.05)
    client.close()


def test_wait_ready_times_out_with_unavailable() -> None:
    client = RpcClient(f"127.0.0.1:{free_port()}", TOKEN, task="worker 3")
    with pytest.raises(UnavailableError, match="worker 3 .* did not accept a connection"):
        client.wait_ready(timeout=0.3)
    client.close()


def test_handlers_run_in_parallel_threads() -> None:
    barrier = threading.Barrier(3, timeout=5)
    with RpcServer("127.0.0.1:0", {"meet": lambda _: barrier.wait()}, TOKEN, max_workers=4) as server:
        with RpcClient(server.address, TOKEN) as client:
            pending = [client.call_async("meet") for _ in range(3)]
            assert sorted(future.result(timeout=10) for future in pending) == [0, 1, 2]


def test_reads_only_handlers_and_read_only_replies_skip_the_copy_and_keep_values() -> None:
    seen: list[bool] = []

    def inspect(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(_is_view_of_bytes(tensor))
        return tensor * 2

    handlers = {"reads": reads_only(lambda t: inspect(t)), "copies": inspect,
                "writes": lambda t: t.add_(1), "framed": lambda t: EncodedReply({"t": t, "n": 1})}
    with RpcServer("127.0.0.1:0", handlers, TOKEN) as server, RpcClient(server.address, TOKEN) as client:
        for method in ("reads", "copies"):
            assert torch.equal(client.call(method, torch.ones(1000)), torch.full((1000,), 2.0))
        assert seen == [True, False]   # a view of gRPC's bytes only where the handler only reads
        assert torch.equal(client.call("writes", torch.ones(3)), torch.full((3,), 2.0))
        reply = client.call("framed", torch.arange(4.0), writable_reply=False)
        assert reply["n"] == 1 and torch.equal(reply["t"], torch.arange(4.0))
        writable = client.call("framed", torch.arange(4.0))
        writable["t"].add_(1)   # an ordinary reply may be written
        assert torch.equal(writable["t"], torch.arange(1.0, 5.0))


class _NamePickler(Pickler):
    """Sends a ``_Named`` object as its name only."""

    def persistent_id(self, obj: object) -> object:
        return ("name", obj.name) if isinstance(obj, _Named) else super().persistent_id(obj)


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def test_a_client_pickler_and_a_handler_that_decodes_its_request_pass_references() -> None:
    class Resolve(Unpickler):
        def persistent_load(self, pid: object) -> object:
            return f"resolved {pid[1]}" if isinstance(pid, tuple) else super().persistent_load(pid)

    handlers = {"resolve": decodes_request(lambda message: Resolve(message).load())}
    with RpcServer("127.0.0.1:0", handlers, TOKEN) as server, \
            RpcClient(server.address, TOKEN, pickler=_NamePickler) as client:
        reply = client.call("resolve", {"who": _Named("w"), "t": torch.arange(3)})
    assert reply["who"] == "resolved w" and torch.equal(reply["t"], torch.arange(3))


def test_calls_and_their_handling_are_labelled_for_the_profiler() -> None:
    with RpcServer("127.0.0.1:0", {"echo": lambda x: x}, TOKEN) as server, \
            RpcClient(server.address, TOKEN) as client:
        with torch.profiler.profile() as profile:
            client.call("echo", 1)
    assert "stratagem.rpc.call" in {event.key for event in profile.key_averages()}


def _is_view_of_bytes(tensor: torch.Tensor) -> bool:
    """True when the tensor's memory belongs to an immutable bytes object (gRPC's request)."""
    import gc

    return any(type(obj) is memoryview and type(obj.obj) is bytes and _inside(tensor, obj)
               for obj in gc.get_objects())


def _inside(tensor: torch.Tensor, view: memoryview) -> bool:
    import ctypes

    start = ctypes.cast(ctypes.c_char_p(view.obj), ctypes.c_void_p).value or 0
    return start <= tensor.data_ptr() < start + len(view.obj)

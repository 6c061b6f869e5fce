"""Requests are bound to one server and one run of it; calls can be cancelled.

A request signed for server A is refused by server B (same token, another name) and by A
once restarted (another incarnation), while a client of A carries on across the restart by
learning the new incarnation. Cancelling a call_async Future cancels the call, which the
handler sees through caller_gone(). The servers are server_script.py processes.
"""

from __future__ import annotations

import signal
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from .rpc_processes import TOKEN, ServerProcess, launch_server, start_server_processes, wait_ready
from stratagem.errors import ClusterConfigError, UnavailableError
from stratagem.rpc import Authenticator, RpcClient, RpcServer, decode, encode
from stratagem.rpc.server import caller_gone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def servers(tmp_path: Path):
    """Two fresh server processes, "ps 0" and "ps 1" (the tests restart them)."""
    started = start_server_processes(2, tmp_path)
    yield started
    for server in started:
        server.stop(signal.SIGKILL)


def _restart(servers: list[ServerProcess], index: int) -> ServerProcess:
    """Kills ``servers[index]`` and puts in its place (for the fixture to stop) a new
    process with the same name at the same address."""
    old = servers[index]
    old.stop(signal.SIGKILL)
    servers[index] = wait_ready(launch_server(old.address, old.marker_dir, old.name))
    return servers[index]


def _send(address: str, body: bytes, metadata: tuple[tuple[str, str], ...]) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary("/stratagem.Rpc/echo")(body, metadata=metadata, timeout=10)


def _refused(address: str, body: bytes, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _send(address, body, metadata)
    return info.value


@pytest.mark.multiprocess
def test_a_captured_request_is_refused_by_another_server_and_after_a_restart(
        servers: list[ServerProcess]) -> None:
    first, second = servers
    body = encode("push 1")
    captured = Authenticator(TOKEN).sign_request("echo", body, to=first.name,
                                                 incarnation=first.incarnation)
    assert decode(_send(first.address, body, captured)) == ("ok", "push 1")   # it is valid

    err = _refused(second.address, body, captured)   # same token, another server
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "meant for 'ps 0', not for 'ps 1'" in err.details()
    assert second.handler_calls("echo") == 0

    echoes = first.handler_calls("echo")
    restarted = _restart(servers, 0)                 # a new run forgets the nonces it saw
    assert restarted.incarnation != first.incarnation
    err = _refused(restarted.address, body, captured)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale incarnation" in err.details() and "earlier run of 'ps 0'" in err.details()
    assert restarted.handler_calls("echo") == echoes


@pytest.mark.multiprocess
def test_a_client_carries_on_across_restarts_of_its_server(servers: list[ServerProcess]) -> None:
    client = RpcClient(servers[0].address, TOKEN, task="ps 0", default_timeout=20)
    assert client.call("echo", 1) == 1
    for round_ in range(2):
        server = _restart(servers, 0)
        deadline = time.monotonic() + 10
        while True:   # the channel reconnects within about a second
            try:
                if round_ == 0:
                    assert client.call("echo", 2) == 2
                else:
                    assert client.call_async("echo", 3).result(timeout=20) == 3
                break
            except UnavailableError:
                assert time.monotonic() < deadline, "not reconnected within 10 s"
                time.sleep(0.05)
        log = (server.marker_dir / "server.log").read_text()   # (every run appends to it)
        assert log.count("stale incarnation") == round_ + 1   # refused once, then re-sent
    client.close()


@pytest.mark.multiprocess
def test_a_client_told_another_task_refuses_the_server(servers: list[ServerProcess]) -> None:
    with RpcClient(servers[0].address, TOKEN, task="ps 1") as client:
        with pytest.raises(ClusterConfigError, match=r"serves 'ps 0', not 'ps 1'.*\(TF_CONFIG\)"):
            client.call("ping")
        assert isinstance(client.call_async("ping").exception(timeout=20), ClusterConfigError)
    with RpcClient(servers[0].address, TOKEN) as anyone:   # no task given: any name will do
        assert anyone.call("ping") == "pong"
    with RpcServer("127.0.0.1:0", {"ping": lambda _: "pong"}, TOKEN) as unnamed:
        with RpcClient(unnamed.address, TOKEN, task="ps 7") as client:   # goes by its address
            assert client.call("ping") == "pong"


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.multiprocess
def test_cancelling_a_call_cancels_it_on_the_server(server_pair: list[ServerProcess]) -> None:
    server = server_pair[0]
    waits, gone = server.handler_calls("wait"), server.handler_calls("gone")
    with RpcClient(server.address, TOKEN, task=server.name) as client:
        future = client.call_async("wait_until_gone", 30.0, timeout=60)
        assert _wait_for(lambda: server.handler_calls("wait") == waits + 1, 10)
        assert future.cancel() and future.cancelled()
        with pytest.raises(futures.CancelledError):
            future.result(timeout=1)
        assert _wait_for(lambda: server.handler_calls("gone") == gone + 1, 3), "the handler ran on"

        with pytest.raises(UnavailableError, match="did not answer"):   # a deadline, likewise
            client.call("wait_until_gone", 30.0, timeout=1.0)
        assert _wait_for(lambda: server.handler_calls("gone") == gone + 2, 3)
        assert client.call("ping") == "pong"


def test_caller_gone_is_false_outside_a_call_and_while_the_caller_waits() -> None:
    assert caller_gone() is False
    with RpcServer("127.0.0.1:0", {"gone": lambda _: caller_gone()}, TOKEN) as server, \
            RpcClient(server.address, TOKEN) as client:
        assert client.call("gone") is False


def test_a_new_client_is_not_held_back_by_an_earlier_clients_failures_at_its_address() -> None:
    """A client made after another client to the same address failed (its server gone, a new
    one now listening on the port) reaches the new server at once: gRPC's process-wide
    connection pool would hand it the failed connection and its reconnection backoff, and its
    first call would fail with "Connection refused" (the kernel gives ports out again, so in
    a long process this happened to unrelated servers, 20 times in 20 here)."""
    for _ in range(3):
        with RpcServer("127.0.0.1:0", {"which": lambda _: "first"}, TOKEN) as first:
            address = first.address
            earlier = RpcClient(address, TOKEN)
            assert earlier.call("which") == "first"
        with pytest.raises(UnavailableError):
            earlier.call("which", timeout=2)   # its connection now fails and backs off
        with RpcServer(address, {"which": lambda _: "second"}, TOKEN), \
                RpcClient(address, TOKEN) as client:
            assert client.call("which", timeout=10) == "second"
        earlier.close()

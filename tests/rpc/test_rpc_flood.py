"""A caller without the token cannot make a server hold the bodies of its requests.

The server checks a request's signed header from its metadata before it receives the body
(its handlers are stream-unary), and keeps its HTTP/2 receive windows small (no BDP
probing), so a flood of large unauthenticated requests is refused at once and leaves the
server's memory as it was. Before, each 256 MiB request was received whole and MAC-checked
(seconds each), and four of them grew the server from ~240 MB to ~1.8 GB.

Each test starts a server process of its own, whose peak resident memory (VmHWM) it reads
before and after.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from .rpc_processes import TOKEN, ServerProcess, memory_mb, start_server_processes
from stratagem.rpc import MessageTooLargeError, RpcClient

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MAX_GROWTH_MB = 50      # what unauthenticated callers may add to the server's peak memory
MAX_REFUSAL_S = 5.0     # how long one may wait for its refusal


@pytest.fixture
def server(tmp_path: Path):
    started = start_server_processes(1, tmp_path)[0]
    yield started
    started.stop(signal.SIGKILL)


def _forged(server: ServerProcess, size: int) -> tuple[tuple[str, str], ...]:
    """Metadata of the right shape, addressed right, with a made-up authentication code."""
    return (("sg-ts", str(int(time.time() * 1000))), ("sg-nonce", "0" * 24), ("sg-to", server.name),
            ("sg-inc", server.incarnation), ("sg-len", str(size)), ("sg-tag", "0" * 32),
            ("sg-mac", "0" * 64))


def _flood(server: ServerProcess, count: int, size: int, channels: int) -> list[tuple[str, float]]:
    """Sends ``count`` requests of ``size`` bytes at once over ``channels`` connections, half
    without proof and half forged; returns each one's status and seconds to its answer."""
    body = bytes(size)
    outcomes: list[tuple[str, float]] = []
    opened = [grpc.insecure_channel(server.address) for _ in range(channels)]
    try:
        pending = []
        for index in range(count):
            call = opened[index % channels].unary_unary("/stratagem.Rpc/echo")
            metadata = _forged(server, size) if index % 2 else ()
            pending.append((time.monotonic(), call.future(body, metadata=metadata, timeout=60)))
        for started, future in pending:
            try:
                future.result()
                outcomes.append(("OK", time.monotonic() - started))
            except grpc.RpcError as err:
                outcomes.append((err.code().name, time.monotonic() - started))
    finally:
        for channel in opened:
            channel.close()
    return outcomes


def _check_refused_and_bounded(server: ServerProcess, floods: list[tuple[int, int, int]]) -> None:
    before = memory_mb(server.process.pid)
    for count, size, channels in floods:
        outcomes = _flood(server, count, size, channels)
        assert [status for status, _ in outcomes] == ["UNAUTHENTICATED"] * count, outcomes
        assert max(seconds for _, seconds in outcomes) < MAX_REFUSAL_S, outcomes
    after = memory_mb(server.process.pid)
    assert after["VmHWM"] - before["VmHWM"] < MAX_GROWTH_MB, (before, after)
    assert server.handler_calls("echo") == 0
    with RpcClient(server.address, TOKEN, task=server.name) as member:   # still serving
        assert member.call("ping") == "pong"


def test_large_unauthenticated_requests_are_refused_before_their_bodies_are_received(
        server: ServerProcess) -> None:
    _check_refused_and_bounded(server, [(4, 256 << 20, 4)])


def test_many_unauthenticated_streams_on_one_connection_stay_bounded(server: ServerProcess) -> None:
    # Many streams share one connection's window; with BDP probing on, the server widened it
    # round after round (~60-110 MB for these floods).
    _check_refused_and_bounded(server, [(16, 64 << 20, 1)] + [(100, 4 << 20, 1)] * 5)


def test_a_request_over_its_methods_limit_is_refused_before_it_is_received(
        server: ServerProcess) -> None:
    with RpcClient(server.address, TOKEN, task=server.name) as client:
        client.call("ping")
        before = memory_mb(server.process.pid)
        with pytest.raises(MessageTooLargeError, match=r"'ping' takes requests of at most 4194304 "
                                                      r"bytes .*stratagem.rpc.server.large_requests"):
            client.call("ping", torch.zeros(64 << 20, dtype=torch.uint8))
        after = memory_mb(server.process.pid)
        assert after["VmHWM"] - before["VmHWM"] < 16, (before, after)
        echoed = client.call("echo", torch.ones(8 << 20, dtype=torch.uint8))   # marked large
        assert echoed.numel() == 8 << 20

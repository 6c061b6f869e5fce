"""RpcClient.start: a call sent on the lane whose reply one thread awaits in steps (the
parameter-server dispatcher's ``run``), against gRPC's answers and on real failures."""

from __future__ import annotations

import logging
import secrets
import signal
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import pytest
import torch

from .rpc_processes import TOKEN, launch_server, wait_ready, free_port
from stratagem.errors import UnavailableError
from stratagem.rpc import AuthenticationError, RemoteError, RpcClient, RpcServer
from stratagem.rpc.pending import LanePending
from stratagem.rpc.server import fast_lane, large_requests
from stratagem.rpc.transport import LANE_METHOD

pytestmark = pytest.mark.timeout(120)


def _served(handlers: dict, **kwargs) -> RpcServer:
    return RpcServer("127.0.0.1:0", handlers, TOKEN, name="worker 0", **kwargs).start()


def _look_up(key: str) -> None:
    raise KeyError(f"no entry {key!r} here")


def _handlers(calls: list) -> dict:
    return {"echo": fast_lane(large_requests(lambda x: calls.append(x) or x)),
            "fail": fast_lane(lambda x: _look_up(x)),
            "plain": lambda x: x + 1}


def test_start_gives_the_replies_and_errors_that_grpc_gives() -> None:
    calls: list = []
    server = _served(_handlers(calls))
    client = RpcClient(server.address, TOKEN, task="worker 0")
    grpc_only = RpcClient(server.address, TOKEN, task="worker 0", lane=False)
    try:
        value = {"x": torch.arange(6.).reshape(2, 3), "n": 3}
        started = client.start("echo", value)
        assert isinstance(started, LanePending)
        reply = started.result(timeout=10)
        assert started.done() and not started.cancel()
        torch.testing.assert_close(reply["x"], grpc_only.call("echo", value)["x"], rtol=0, atol=0)
        reply["x"] += 1   # writable, as gRPC's replies are
        errors = []
        for make in (lambda: client.start("fail", "k").result(timeout=10), lambda: grpc_only.call("fail", "k")):
            with pytest.raises(RemoteError, match="no entry 'k' here") as info:
                make()
            errors.append(info.value)
        assert [type(e.remote_exception) for e in errors] == [KeyError, KeyError]
        assert errors[0].task == errors[1].task == "worker 0"
        not_on_lane = client.start("plain", 1)   # not marked fast_lane: gRPC's Future
        assert isinstance(not_on_lane, futures.Future) and not_on_lane.result(timeout=10) == 2
        for _ in range(5):
            assert client.start("echo", 1).result(timeout=10) == 1
        assert server.stats()["methods"][LANE_METHOD]["calls"] == 1   # one connection, reused
    finally:
        client.close(), grpc_only.close(), server.stop()


def test_a_started_call_is_awaited_in_steps_cancelled_and_bounded_by_its_timeout() -> None:
    release, entered = threading.Event(), threading.Semaphore(0)

    def held(x):
        entered.release()
        release.wait(30)
        return x

    server = _served({"held": fast_lane(held)})
    client = RpcClient(server.address, TOKEN, task="worker 0")
    try:
        started = client.start("held", 5)
        assert entered.acquire(timeout=30)   # the handler runs
        with pytest.raises(futures.TimeoutError):
            started.result(timeout=0.05)    # not yet: the call goes on
        release.set()
        assert started.result(timeout=30) == 5 and started.result() == 5

        release.clear()
        cancelled = client.start("held", 6)
        assert entered.acquire(timeout=30)
        assert cancelled.cancel() and cancelled.done()
        with pytest.raises(futures.CancelledError):
            cancelled.result(timeout=1)
        release.set()
        assert client.start("held", 7).result(timeout=30) == 7   # a new connection: no stale reply read

        release.clear()
        late = client.start("held", 8, timeout=0.5)
        assert entered.acquire(timeout=30)
        started_at = time.monotonic()
        with pytest.raises(UnavailableError, match="worker 0 did not answer 'held' within 0.5 s"):
            while True:
                try:
                    late.result(timeout=0.1)
                except futures.TimeoutError:
                    assert time.monotonic() - started_at < 20
        release.set()
        assert client.start("held", 9).result(timeout=30) == 9
    finally:
        release.set()
        client.close(), server.stop()


def test_a_killed_server_fails_a_started_call_at_once_naming_it(tmp_path: Path) -> None:
    victim = wait_ready(launch_server(f"127.0.0.1:{free_port()}", tmp_path / "s", "worker 1"))
    client = RpcClient(victim.address, TOKEN, task="worker 1", default_timeout=20)
    try:
        started = client.start("lane_sleep", 60.0)
        deadline = time.monotonic() + 30
        while victim.handler_calls("sleep") == 0:   # the handler has begun
            assert time.monotonic() < deadline
            with pytest.raises(futures.TimeoutError):
                started.result(timeout=0.05)
        victim.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            while True:
                try:
                    started.result(timeout=0.5)
                except futures.TimeoutError:
                    assert time.monotonic() - killed_at < 10
        assert time.monotonic() - killed_at < 10
        assert info.value.task == "worker 1" and "worker 1" in str(info.value)
        with pytest.raises(UnavailableError):   # its lane is gone: the next start says so too
            client.start("lane_sleep", 0.0, timeout=5).result(timeout=5)
    finally:
        client.close()
        victim.stop(signal.SIGKILL)


def test_a_wrong_token_runs_nothing_and_a_closed_lane_port_means_grpc(caplog) -> None:
    calls: list = []
    server = _served(_handlers(calls))
    other = RpcClient(server.address, secrets.token_urlsafe(32), task="worker 0")
    try:
        with pytest.raises(AuthenticationError):
            other.start("echo", 1).result(timeout=10)
        assert calls == [] and server.stats()["refused"] >= 1
    finally:
        other.close(), server.stop()

    server = _served(_handlers(calls))
    server._lane.stop()    # as a firewall between hosts would: gRPC answers, the lane port not
    client = RpcClient(server.address, TOKEN, task="worker 0")
    logger = logging.getLogger("stratagem.rpc")
    logger.addHandler(caplog.handler)
    try:
        first, second = client.start("echo", 1), client.start("echo", 2)
        assert isinstance(first, futures.Future) and isinstance(second, futures.Future)
        # (two calls in flight over gRPC: its threads may run them in either order, each once)
        assert first.result(timeout=10) == 1 and second.result(timeout=10) == 2 and sorted(calls) == [1, 2]
        assert "worker 0's lane" in caplog.text and "go over gRPC" in caplog.text
    finally:
        client.close(), server.stop()
        logger.removeHandler(caplog.handler)


def test_a_small_body_of_parts_is_tagged_as_one_stream_and_a_large_one_alike() -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from stratagem.rpc.lane_frames import _IV, _JOIN_BYTES, _Connection

    key = secrets.token_bytes(16)
    ends = socket.socketpair()
    try:
        connection = _Connection(ends[0], key, server=False)
        for parts in ([b"head", bytes(100), b"tail"], [bytes(_JOIN_BYTES), b"x", bytearray(b"yz")]):
            tagger = Cipher(algorithms.AES(key), modes.GCM(_IV.pack(1, connection.counter))).encryptor()
            for part in parts:
                tagger.authenticate_additional_data(part)
            tagger.finalize()
            assert connection._tag(1, parts) == tagger.tag == connection._tag(1, [b"".join(parts)])
    finally:
        ends[0].close(), ends[1].close()

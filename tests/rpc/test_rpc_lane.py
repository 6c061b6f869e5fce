"""The lane beside gRPC (stratagem/rpc/lane.py): same results, same token, same failures."""

from __future__ import annotations

import logging
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from .rpc_processes import TOKEN, ServerProcess, launch_server, wait_ready, free_port
from stratagem.errors import UnavailableError
from stratagem.ps import ParameterServer, ParameterServerClient
from stratagem.rpc import (AuthenticationError, Authenticator, MessageTooLargeError, RemoteError, RpcClient,
                           RpcServer)
from stratagem.rpc.lane import _Connection
from stratagem.rpc.server import fast_lane, large_requests
from stratagem.rpc.transport import LANE_METHOD, STATS_METHOD

pytestmark = pytest.mark.timeout(120)


def _served(handlers: dict, **kwargs) -> RpcServer:
    return RpcServer("127.0.0.1:0", handlers, TOKEN, name="ps 0", **kwargs).start()


def _refused(server: RpcServer, before: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.stats()["refused"] > before:
            return True
        time.sleep(0.02)
    return False


def test_lane_and_grpc_give_the_same_replies_and_errors() -> None:
    ps = ParameterServer(name="ps 0")
    server = _served(ps.handlers())
    lane = ParameterServerClient(server.address, TOKEN, task="ps 0")
    grpc_only = ParameterServerClient(server.address, TOKEN, task="ps 0")
    grpc_only.rpc._lane = None
    try:
        lane.call("create", var_id="w", value=torch.arange(12.).reshape(4, 3),
                  optimizer_spec=(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}))
        for step in range(3):
            client = (lane, grpc_only)[step % 2]
            client.call("push", grads={"w": torch.full((4, 3), float(step + 1))},
                        rows=[("w", torch.tensor([1, 1, 3]), torch.ones(3, 3))])
        via_lane, via_grpc = lane.call("pull", var_ids=["w"]), grpc_only.call("pull", var_ids=["w"])
        torch.testing.assert_close(via_lane["w"], via_grpc["w"], rtol=0, atol=0)
        torch.testing.assert_close(lane.call("pull_rows", var_id="w", row_ids=[3, 0]),
                                   via_grpc["w"][[3, 0]], rtol=0, atol=0)
        for client in (lane, grpc_only):
            with pytest.raises(RemoteError, match="ps 0 has no variable 'nope'") as info:
                client.call("pull", var_ids=["nope"])
            assert type(info.value.remote_exception).__name__ == "InvalidArgumentError"
        methods = server.stats()["methods"]
        assert methods[LANE_METHOD]["calls"] == 1      # one session: one connection, reused
        assert methods["push"]["calls"] == 3 and methods["pull"]["calls"] == 4
    finally:
        lane.close(), grpc_only.close(), server.stop()


def test_a_server_without_a_lane_is_called_over_grpc() -> None:
    server = _served({"echo": fast_lane(lambda x: x)}, lane=False)
    client = RpcClient(server.address, TOKEN, task="ps 0")
    try:
        assert client.call("echo", torch.ones(2)).tolist() == [1.0, 1.0]
        assert client.call("echo", 7) == 7 and server.stats()["methods"]["echo"]["calls"] == 2
    finally:
        client.close(), server.stop()


def test_a_wrong_token_gets_no_session_and_runs_nothing() -> None:
    calls = []
    server = _served({"echo": fast_lane(lambda x: calls.append(x) or x)})
    other = RpcClient(server.address, secrets.token_urlsafe(32), task="ps 0")
    try:
        with pytest.raises(AuthenticationError):
            other.call("echo", 1)
        assert calls == [] and server.stats()["refused"] >= 1
    finally:
        other.close(), server.stop()


def _session(server: RpcServer) -> tuple[socket.socket, bytes]:
    """A connection to the lane, opened with a session asked for with the right token."""
    with RpcClient(server.address, TOKEN, task="ps 0", lane=False) as client:
        answer = client.call(LANE_METHOD)
    sock = socket.create_connection(("127.0.0.1", answer["port"]), timeout=5)
    sock.sendall(answer["session"])
    return sock, answer["session"]


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_without_a_session_or_with_another_key_is_closed_unread() -> None:
    calls = []
    server = _served({"echo": fast_lane(lambda x: calls.append(x) or x)})
    try:
        port = RpcClient(server.address, TOKEN, lane=False).call(LANE_METHOD)["port"]
        before = server.stats()["refused"]
        stranger = socket.create_connection(("127.0.0.1", port), timeout=5)
        stranger.sendall(secrets.token_bytes(16) + b"SGL1" + bytes(100))
        assert _closed(stranger) and _refused(server, before)

        before = server.stats()["refused"]
        sock, session = _session(server)
        forged = _Connection(sock, Authenticator(secrets.token_urlsafe(32)).lane_key(session), server=False)
        from stratagem.rpc.codec import encode_parts
        forged.send("echo", encode_parts(1), None)
        assert _closed(sock) and _refused(server, before)
        assert calls == []
    finally:
        server.stop()


def test_a_replayed_frame_is_refused_and_runs_once() -> None:
    calls = []
    server = _served({"echo": fast_lane(lambda x: calls.append(x) or x)})
    try:
        sock, session = _session(server)
        sent: list[bytes] = []
        real_sendmsg = sock.sendmsg
        sock = _Recording(sock, sent)
        connection = _Connection(sock, Authenticator(TOKEN).lane_key(session), server=False)
        from stratagem.rpc.codec import encode_parts
        connection.send("echo", encode_parts("once"), None)
        connection.receive(lambda _: 1 << 20, time.monotonic() + 5)
        before = server.stats()["refused"]
        real_sendmsg([b"".join(sent)])          # the same frame again, on the same connection
        assert _closed(sock.sock) and _refused(server, before)
        assert calls == ["once"]
    finally:
        server.stop()


class _Recording:
    """A socket whose sent bytes are kept (to replay them)."""

    def __init__(self, sock: socket.socket, sent: list[bytes]) -> None:
        self.sock, self.sent = sock, sent

    def sendmsg(self, views: list) -> int:
        n = self.sock.sendmsg(views)
        self.sent.append(b"".join(bytes(v) for v in views)[:n])
        return n

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_a_push_cut_off_by_its_deadline_is_applied_at_most_once_with_its_fence() -> None:
    ps = ParameterServer(name="ps 0")
    server = _served(ps.handlers())
    client = ParameterServerClient(server.address, TOKEN, task="ps 0")
    try:
        client.call("create", var_id="w", value=torch.zeros(16 << 20), optimizer_spec=(torch.optim.SGD, {"lr": 1.0}))
        ps.renew_lease("c", lease_s=60.0, sent_at=time.time())
        fence = {"coordinator": "c", "closure": 1, "attempt": 1, "index": 0, "floor": 1}
        grad = torch.ones(16 << 20)
        with pytest.raises(UnavailableError, match="ps 0 did not answer 'push' within"):
            client.call("push", grads={"w": grad}, fence=fence, timeout=0.002)
        for attempt in (2, 3):   # the closure runs again: its update is applied once in all
            client.call("push", grads={"w": grad}, fence={**fence, "attempt": attempt})
        assert ps.variables()["w"]["updates"] == 1
        assert client.call("pull", var_ids=["w"])["w"][:3].tolist() == [-1.0, -1.0, -1.0]
    finally:
        client.close(), server.stop()


def test_a_killed_server_is_unavailable_at_once_and_a_restarted_one_is_reached(tmp_path: Path) -> None:
    victim = wait_ready(launch_server(f"127.0.0.1:{free_port()}", tmp_path / "s", "ps 1"))
    client = RpcClient(victim.address, TOKEN, task="ps 1", default_timeout=20)
    try:
        assert client.call("lane_echo", torch.ones(3)).tolist() == [1.0] * 3
        assert victim.handler_calls("lane") == 1
        failure: list[BaseException] = []
        caller = threading.Thread(target=lambda: _catch(failure, client.call, "lane_sleep", 30.0))
        caller.start()
        time.sleep(0.5)
        victim.process.send_signal(signal.SIGKILL)
        caller.join(10)
        assert len(failure) == 1 and isinstance(failure[0], UnavailableError), failure
        assert failure[0].task == "ps 1" and "ps 1" in str(failure[0])

        restarted: ServerProcess = wait_ready(launch_server(victim.address, tmp_path / "s2", "ps 1"))
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert client.call("lane_echo", 5, timeout=2.0) == 5
                    break
                except UnavailableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert restarted.handler_calls("lane") == 1
        finally:
            restarted.stop(signal.SIGKILL)
    finally:
        client.close()
        victim.stop(signal.SIGKILL)


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001
        out.append(error)


def test_large_requests_are_limited_on_the_lane_as_over_grpc() -> None:
    server = _served({"small": fast_lane(lambda x: x), "big": fast_lane(large_requests(lambda x: x.numel()))})
    client = RpcClient(server.address, TOKEN, task="ps 0")
    try:
        assert client.call("big", torch.zeros(2 << 20)) == 2 << 20
        with pytest.raises(MessageTooLargeError, match="'small' on ps 0 takes requests of at most 4194304"):
            client.call("small", torch.zeros(2 << 20))   # 8 MiB: refused before it is sent
        assert client.call("small", 3) == 3
    finally:
        client.close(), server.stop()


def test_a_lane_port_closed_to_the_client_means_grpc_with_a_warning(caplog) -> None:
    calls = []
    server = _served({"echo": fast_lane(lambda x: calls.append(x) or x)})
    server._lane.stop()    # as a firewall between hosts would: gRPC answers, the lane port not
    client = RpcClient(server.address, TOKEN, task="ps 0")
    logger = logging.getLogger("stratagem.rpc")
    logger.addHandler(caplog.handler)
    try:
        assert client.call("echo", 1) == 1 and client.call("echo", 2) == 2 and calls == [1, 2]
        assert "ps 0's lane" in caplog.text and "go over gRPC" in caplog.text
        assert server.stats()["methods"][LANE_METHOD]["calls"] == 1   # asked once, then gRPC only
    finally:
        client.close(), server.stop()
        logger.removeHandler(caplog.handler)

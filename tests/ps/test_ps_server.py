"""``stratagem server``: a ps task in a real process, its errors, and the service registry."""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import stratagem
from stratagem.cli import main as cli_main
from stratagem.rpc import AuthenticationError, RpcClient
from stratagem.ps import ParameterServerClient
import stratagem.ps.server as server_module
from stratagem.ps.server import TaskInfo, register_service, resolve_task, serve

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(stratagem.__file__).resolve().parent.parent
TOKEN = secrets.token_urlsafe(32)
INTRUDER = secrets.token_urlsafe(32)   # another cluster's token


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tf_config(task_type: str, ps_port: int, worker_port: int = 3) -> str:
    return json.dumps({"cluster": {"chief": ["127.0.0.1:2"], "worker": [f"127.0.0.1:{worker_port}"],
                                   "ps": [f"127.0.0.1:{ps_port}"]},
                       "task": {"type": task_type, "index": 0}})


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        if select.select([process.stdout], [], [], 0.1)[0]:
            return process.stdout.readline().strip()
    process.kill()
    raise AssertionError(f"no output within {timeout} s")


@pytest.mark.multiprocess
def test_ps_task_serves_and_stops_quickly_on_sigterm() -> None:
    port = _free_port()
    env = {**os.environ, "TF_CONFIG": _tf_config("ps", port), "STRATAGEM_CLUSTER_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "stratagem", "server"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _read_line(process, 60) == f"[stratagem server] ps 0 listening on 127.0.0.1:{port}"
        with ParameterServerClient(f"127.0.0.1:{port}", TOKEN, task="ps 0") as client:
            assert client.call("ping")["name"] == "ps 0"
            client.call("create", var_id="w", value=torch.zeros(3), optimizer_spec=(torch.optim.SGD, {"lr": 1.0}))
            client.call("push", grads={"w": torch.ones(3)})
            assert torch.equal(client.call("pull", var_ids=["w"])["w"], -torch.ones(3))
        with RpcClient(f"127.0.0.1:{port}", INTRUDER) as intruder:
            with pytest.raises(AuthenticationError):
                intruder.call("ping", {})
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # Serving stops within the grace period; the interpreter's own teardown (torch) then
        # takes a further ~0.7 s, several seconds on a loaded 2-core host.
        assert _read_line(process, 5) == "[stratagem server] ps 0 stopped (SIGTERM)"
        assert time.monotonic() - started < 2.0
        out, err = process.communicate(timeout=15)
        assert process.returncode == 0, err
        assert "refused" in err and TOKEN not in err + out and INTRUDER not in err + out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.multiprocess
def test_server_with_a_weak_token_exits_at_once_without_showing_it() -> None:
    weak = "hunter2-hunter2"
    env = {**os.environ, "TF_CONFIG": _tf_config("ps", _free_port()), "STRATAGEM_CLUSTER_TOKEN": weak,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "stratagem", "server"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # It stops before listening: the time is the interpreter's start and imports.
        out, err = process.communicate(timeout=45)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 2, (out, err)
    assert "STRATAGEM_CLUSTER_TOKEN is too weak: it has about" in err and "(15 characters;" in err
    assert "secrets.token_urlsafe(32)" in err
    assert "listening" not in out and weak not in out + err


@pytest.mark.parametrize(("env", "message"), [
    ({}, "needs TF_CONFIG naming the cluster and this task"),
    ({"TF_CONFIG": _tf_config("ps", 5)}, "STRATAGEM_CLUSTER_TOKEN is not set"),
    ({"TF_CONFIG": _tf_config("worker", 5), "STRATAGEM_CLUSTER_TOKEN": TOKEN},
     "'worker' task, which `stratagem server` cannot serve: no service is registered"),
    ({"TF_CONFIG": _tf_config("chief", 5), "STRATAGEM_CLUSTER_TOKEN": TOKEN},
     "the chief runs the training script"),
    ({"TF_CONFIG": '{"cluster": ', "STRATAGEM_CLUSTER_TOKEN": TOKEN}, "TF_CONFIG is not valid JSON"),
    ({"TF_CONFIG": _tf_config("ps", 5), "STRATAGEM_CLUSTER_TOKEN": "x"},
     "STRATAGEM_CLUSTER_TOKEN is too weak: it has about 5 random bits"),
])
def test_misconfigured_server_fails_with_a_clear_error(
        env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for key in ("TF_CONFIG", "STRATAGEM_CLUSTER_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    services = {"ps": server_module.SERVICES["ps"]}            # as if no worker service existed
    monkeypatch.setattr(server_module, "SERVICES", services)
    assert cli_main(["server"]) == 2
    assert message in capsys.readouterr().err


def test_a_registered_worker_service_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    class EchoWorker:
        def __init__(self, task: TaskInfo) -> None:
            self.task = task
            self.closed = False

        def handlers(self) -> dict[str, object]:
            return {"whoami": lambda _: self.task.name}

        def close(self) -> None:
            self.closed = True

    made: list[EchoWorker] = []
    monkeypatch.setattr(server_module, "SERVICES", dict(server_module.SERVICES))   # restored after

    def factory(task: TaskInfo) -> EchoWorker:
        made.append(EchoWorker(task))
        return made[-1]

    register_service("worker", factory)
    port = _free_port()
    task = resolve_task({"TF_CONFIG": _tf_config("worker", 5, worker_port=port)})
    assert (task.task_type, task.task_id, task.address) == ("worker", 0, f"127.0.0.1:{port}")
    stop, lines = threading.Event(), []
    thread = threading.Thread(target=serve, args=(task, TOKEN, stop), kwargs={"announce": lines.append})
    thread.start()
    try:
        with RpcClient(task.address, TOKEN) as client:
            client.wait_ready(10)
            assert client.call("whoami") == "worker 0"
    finally:
        stop.set()
        thread.join(10)
    assert lines == [f"[stratagem server] worker 0 listening on 127.0.0.1:{port}"]
    assert made[0].closed

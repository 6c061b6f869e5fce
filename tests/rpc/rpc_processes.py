"""Helpers for the RPC tests: free loopback ports, child environments, server processes, memory."""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import stratagem

REPO_ROOT = Path(stratagem.__file__).resolve().parent.parent
SERVER_SCRIPT = Path(__file__).with_name("server_script.py")
TOKEN = secrets.token_urlsafe(32)   # the test cluster's (children get it in their environment)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(token: str | None = TOKEN) -> dict[str, str]:
    """The environment of a child process: this checkout first on the path, the token set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("STRATAGEM_CLUSTER_TOKEN", None)
    if token is not None:
        env["STRATAGEM_CLUSTER_TOKEN"] = token
    return env


def read_line(process: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line of ``process``'s stdout starting with ``prefix``; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            line = process.stdout.readline()
            if line.startswith(prefix):
                return line.strip()
            if not line and process.poll() is not None:
                break
    process.kill()
    raise AssertionError(f"no {prefix!r} line within {timeout} s; stderr: "
                         f"{process.stderr.read() if process.stderr else ''}")


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    address: str
    marker_dir: Path
    name: str
    incarnation: str = ""

    def handler_calls(self, name: str) -> int:
        return len(list(self.marker_dir.glob(f"handler-{name}-*")))

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stops the process; returns its stderr."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            _, err = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return err or ""


def launch_server(address: str, marker_dir: Path, name: str,
                  max_bytes: int | None = None) -> ServerProcess:
    """A server_script.py process serving ``name`` at ``address``; see :func:`wait_ready`."""
    marker_dir.mkdir(exist_ok=True)
    args = [sys.executable, str(SERVER_SCRIPT), address, str(marker_dir), name]
    if max_bytes is not None:
        args.append(str(max_bytes))
    process = subprocess.Popen(args, env=child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    return ServerProcess(process, address, marker_dir, name)


def wait_ready(server: ServerProcess, timeout: float = 60) -> ServerProcess:
    """Waits for the server's READY line; records its incarnation."""
    server.incarnation = read_line(server.process, "READY", timeout).split()[2]
    return server


def start_server_processes(count: int, tmp: Path, max_bytes: int | None = None) -> list[ServerProcess]:
    """``count`` server_script.py processes named "ps 0", "ps 1"..., started at once (torch
    imports overlap)."""
    started = [launch_server(f"127.0.0.1:{free_port()}", tmp / f"server{index}", f"ps {index}",
                             max_bytes) for index in range(count)]
    return [wait_ready(server) for server in started]


def memory_mb(pid: int) -> dict[str, int]:
    """The process's resident memory now (VmRSS) and at its peak (VmHWM), in MB."""
    sizes = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                sizes[key] = int(value.split()[0]) // 1024
    return sizes

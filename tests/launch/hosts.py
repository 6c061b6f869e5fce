"""Test "hosts" for multi-node tests: :func:`make_hosts` (network namespaces, each with its own
address; the test skips, saying why, where they cannot be made), :func:`start` runs a command on
one, :func:`wait_for` waits for a line of a log."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratagem.launch.forks import FORK_SERVER_VARIABLE
from stratagem.testing.forked import fork_server_variable
from stratagem.testing.hosts import HostsUnavailable, network_hosts


@contextlib.contextmanager
def make_hosts(count: int) -> Iterator[list[tuple[str, str]]]:
    """:func:`stratagem.testing.hosts.network_hosts`, skipping the test where it cannot be had."""
    try:
        with network_hosts(count) as hosts:
            yield hosts
    except HostsUnavailable as reason:
        pytest.skip(str(reason))


def start(namespace: str, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in ``namespace`` (`ip netns exec` execs it: the pid is the command's). In a module
    of forked launches (``forked_launches``), a ``stratagem launch`` there forks its tasks from a fork
    server in that namespace."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TF_CONFIG", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "STRATAGEM_CLUSTER_TOKEN")}
    environment.update(env, PYTHONUNBUFFERED="1")
    if FORK_SERVER_VARIABLE in environment:   # (a module of forked launches: a server in the namespace forks them)
        environment.update(fork_server_variable(environment, namespace=namespace))
    with log.open("a") as out:
        return subprocess.Popen(["ip", "netns", "exec", namespace, *command], env=environment,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_for(log: Path, text: str, timeout: float, *processes: subprocess.Popen) -> None:
    """Waits until ``text`` is in ``log``; fails, showing the log, when time runs out or a process ends."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        ended = [p.args[-1] for p in processes if p.poll() is not None]
        assert not ended, f"ended before {text!r} was seen:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{text!r} not seen within {timeout} s:\n{log.read_text()}"
        time.sleep(0.1)


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def launch_command(*options: str) -> list[str]:
    return [sys.executable, "-m", "stratagem", "launch", *options]

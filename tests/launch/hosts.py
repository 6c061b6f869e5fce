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
from stratagem.testing.forked import fork_server_variable, shared_server
from stratagem.testing.hosts import HostsUnavailable, network_hosts


@contextlib.contextmanager
def make_hosts(count: int) -> Iterator[list[tuple[str, str]]]:
    """:func:`stratagem.testing.hosts.network_hosts`, skipping the test where it cannot be had. In a
    module of forked launches (``forked_launches``), a fork server in each namespace, ready before
    any node starts (nodes started together must not wait for one another's servers)."""
    try:
        with network_hosts(count) as hosts:
            if FORK_SERVER_VARIABLE in os.environ:
                for namespace, _ in hosts:   # (their imports run side by side)
                    shared_server(_environment({}), namespace=namespace)
                for namespace, _ in hosts:
                    fork_server_variable(_environment({}), namespace=namespace)
            yield hosts
    except HostsUnavailable as reason:
        pytest.skip(str(reason))


def _environment(env: dict[str, str]) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TF_CONFIG", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "STRATAGEM_CLUSTER_TOKEN")}
    environment.update(env, PYTHONUNBUFFERED="1")
    return environment


def start(namespace: str, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in ``namespace`` (`ip netns exec` execs it: the pid is the command's). In a module
    of forked launches (``forked_launches``), a ``stratagem launch`` there forks its tasks from the fork
    server in that namespace."""
    environment = _environment(env)
    if FORK_SERVER_VARIABLE in environment:
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

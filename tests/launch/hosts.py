"""Test "hosts": network namespaces on one bridge, each with its own address, for multi-node tests.

:func:`make_hosts` creates ``count`` namespaces (10.214.0.1, 10.214.0.2, ...) whose veth ends
meet on a bridge in a namespace of its own, so nothing is added to the machine's own
interfaces and no traffic leaves the namespaces. :func:`start` runs a command in one of them.
Skips (with the reason) where namespaces cannot be made: not root, or no ``ip`` command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SUBNET = "10.214.0"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def make_hosts(count: int) -> Iterator[list[tuple[str, str]]]:
    """Yields ``[(namespace, address), ...]``; removes every namespace afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (Debian package iproute2) to create network namespaces")
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"
    bridge = f"sgbr-{tag}"
    hosts = [(f"sgnode{i}-{tag}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        for name in [bridge] + [name for name, _ in hosts]:
            step = _ip("netns", "add", name)
            if step.returncode != 0:
                pytest.skip(f"cannot create a network namespace (ip netns add): {step.stderr.strip()}")
            made.append(name)
        commands = [["-n", bridge, "link", "add", "sgbr", "type", "bridge"],
                    ["-n", bridge, "link", "set", "sgbr", "up"]]
        for i, (name, address) in enumerate(hosts):
            commands += [["-n", name, "link", "set", "lo", "up"],
                         ["-n", name, "link", "add", "sgeth", "type", "veth", "peer", "name", f"sgp{i}",
                          "netns", bridge],
                         ["-n", name, "addr", "add", f"{address}/24", "dev", "sgeth"],
                         ["-n", name, "link", "set", "sgeth", "up"],
                         ["-n", bridge, "link", "set", f"sgp{i}", "master", "sgbr"],
                         ["-n", bridge, "link", "set", f"sgp{i}", "up"]]
        for command in commands:
            step = _ip(*command)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the namespaces (ip {' '.join(command)}): {step.stderr.strip()}")
        yield hosts
    finally:
        for name in made:
            _ip("netns", "del", name)


def start(namespace: str, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in ``namespace`` (`ip netns exec` execs it: the pid is the command's)."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TF_CONFIG", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "STRATAGEM_CLUSTER_TOKEN")}
    environment.update(env, PYTHONUNBUFFERED="1")
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

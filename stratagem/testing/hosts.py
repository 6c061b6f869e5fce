"""Test "hosts" on one machine: network namespaces on one bridge, each with its own address.

:func:`network_hosts` creates ``count`` namespaces (10.214.0.1, 10.214.0.2, ...) whose veth ends
meet on a bridge in a namespace of its own: nothing is added to the machine's own interfaces,
and no traffic leaves the namespaces. A process runs on host ``i`` with
``ip netns exec NAMESPACE command`` (which execs the command: its pid is the command's). It
needs root and the ``ip`` command (Debian's iproute2); without them it raises
:class:`HostsUnavailable`, saying why.

Example (as root)::

    import subprocess
    from stratagem.testing.hosts import network_hosts
    with network_hosts(2) as hosts:
        (first, address), (second, _) = hosts
        subprocess.run(["ip", "netns", "exec", second, "ping", "-c", "1", address], check=True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

from stratagem.testing.forked import close_server

__all__ = ["HostsUnavailable", "SUBNET", "network_hosts"]

SUBNET = "10.214.0"


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip`` command, no bridge)."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def network_hosts(count: int) -> Iterator[list[tuple[str, str]]]:
    """Yields ``[(namespace, address), ...]``; removes every namespace afterwards."""
    if shutil.which("ip") is None:
        raise HostsUnavailable("no `ip` command (Debian package iproute2) to create network namespaces")
    if os.geteuid() != 0:
        raise HostsUnavailable("network namespaces need root")
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**6}"
    bridge = f"sgbr-{tag}"
    hosts = [(f"sgnode{i}-{tag}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        for name in [bridge] + [name for name, _ in hosts]:
            step = _ip("netns", "add", name)
            if step.returncode != 0:
                raise HostsUnavailable(f"cannot create a network namespace (ip netns add): {step.stderr.strip()}")
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
                raise HostsUnavailable(f"cannot set up the namespaces (ip {' '.join(command)}): {step.stderr.strip()}")
        yield hosts
    finally:
        for name in made:
            close_server(name)   # (a test's fork server there, which would keep the namespace alive)
            _ip("netns", "del", name)

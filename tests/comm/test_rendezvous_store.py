"""The rendezvous store listens only on the chief's address; a stopped heartbeat is never silent.

Tests send traffic only to loopback or to a network namespace they create themselves.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem.comm import processes
from stratagem.comm.processes import WorkerGroup
from stratagem.errors import UnavailableError
from stratagem.testing import run_local_cluster

from . import listen_script

pytestmark = pytest.mark.timeout(120)
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every socket the process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != LISTEN or inode not in inodes:
                continue
            host, port = local.split(":")
            raw = bytes.fromhex(host)  # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


@pytest.mark.multiprocess
def test_the_chief_store_listens_only_on_the_loopback_address_of_the_cluster(tmp_path: Path) -> None:
    seen: dict = {}

    def inspect() -> None:
        deadline = time.monotonic() + 60
        ready = tmp_path / "ready.json"
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            info = json.loads(ready.read_text())
            seen["address"] = info["address"]
            seen["listening"] = _listening(info["pid"])
        finally:
            (tmp_path / "done").touch()

    inspector = threading.Thread(target=inspect)
    inspector.start()
    try:
        results = run_local_cluster(Path(listen_script.__file__), 2, args=[str(tmp_path)], timeout=90)
    finally:
        (tmp_path / "done").touch()
        inspector.join(timeout=70)
    for r in results:
        assert r.returncode == 0, r.output
        assert "sum 3" in r.output, r.output
    port = int(seen["address"].rpartition(":")[2])
    store = [host for host, p in seen["listening"] if p == port]
    assert store == ["127.0.0.1"], seen
    wildcard = [(host, p) for host, p in seen["listening"] if host in ("0.0.0.0", "::")]
    assert not wildcard, f"the chief listens on every interface: {seen['listening']}"


NAMESPACE_CHECK = """
import datetime, socket
import torch.distributed as dist
from stratagem.comm.processes import rendezvous_store
timeout = datetime.timedelta(seconds=10)
store = rendezvous_store("10.211.0.1:29500", 0, 1, timeout)
client = dist.TCPStore("10.211.0.1", 29500, None, is_master=False, timeout=timeout)
client.set("k", "v")
assert store.get("k") == b"v"
for other in ("10.211.0.2", "127.0.0.1"):
    try:
        socket.create_connection((other, 29500), timeout=5).close()
    except ConnectionRefusedError:
        print("refused", other)
    else:
        print("REACHED", other)
"""


@pytest.mark.multiprocess
def test_a_chief_bound_to_one_address_is_not_reachable_on_another() -> None:
    """In a namespace of our own with two addresses (both ends of a veth pair live in it)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command to create a network namespace")
    namespace = f"stratagem-store-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        for command in (["link", "set", "lo", "up"],
                        ["link", "add", "sgstore0", "type", "veth", "peer", "name", "sgstore1"],
                        ["addr", "add", "10.211.0.1/24", "dev", "sgstore0"],
                        ["addr", "add", "10.211.0.2/24", "dev", "sgstore1"],
                        ["link", "set", "sgstore0", "up"],
                        ["link", "set", "sgstore1", "up"]):
            step = subprocess.run(["ip", "-n", namespace, *command], capture_output=True, text=True)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the namespace (ip {' '.join(command)}): {step.stderr.strip()}")
        done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", NAMESPACE_CHECK],
                              capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused 10.211.0.2" in done.stdout and "refused 127.0.0.1" in done.stdout, done.stdout


# ------------------------------------------------------------------ heartbeat


class _Store:
    """A store that accepts ``beats`` heartbeats, then fails like a store whose chief is gone."""

    def __init__(self, beats: int, on_failure=None) -> None:
        self.beats = beats
        self.on_failure = on_failure

    def set(self, key: str, value: str) -> None:
        if self.beats <= 0:
            if self.on_failure is not None:
                self.on_failure()
            raise RuntimeError("Connection reset by peer\nException raised from recvBytes")
        self.beats -= 1

    def get(self, key: str) -> bytes:
        raise RuntimeError("Connection refused")


def _group(store: _Store) -> WorkerGroup:
    """worker 1 of 2, without a process group: only the heartbeat and guard() are exercised."""
    group = WorkerGroup.__new__(WorkerGroup)
    group.rank, group.world_size, group.names = 1, 2, ["worker 0", "worker 1"]
    group.timeout, group._beats, group._store = 5.0, 0, store
    group._stop, group.heartbeat_failure = threading.Event(), None
    group._snapshots = collections.deque(maxlen=8)
    return group


def test_a_failed_heartbeat_warns_once_and_the_next_collective_error_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(processes, "HEARTBEAT_SECONDS", 0.01)
    group = _group(_Store(beats=3))
    with caplog.at_level(logging.WARNING, logger="stratagem.comm"):
        thread = threading.Thread(target=group._heartbeat)
        thread.start()
        thread.join(timeout=10)
    assert not thread.is_alive()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "worker 1's heartbeat stopped" in warnings[0] and "Connection reset by peer" in warnings[0]
    assert "worker 0" in warnings[0]
    assert "Connection reset by peer" in group.heartbeat_failure

    with pytest.raises(UnavailableError) as caught:
        with group.guard("all_reduce"):
            raise RuntimeError("[gloo] Connection closed by peer")
    message = str(caught.value)
    assert "worker 0 stopped answering" in message, message
    assert "worker 1's heartbeat stopped" in message and "Connection reset by peer" in message, message


def test_a_heartbeat_ended_by_close_is_not_reported(monkeypatch, caplog) -> None:
    monkeypatch.setattr(processes, "HEARTBEAT_SECONDS", 0.01)
    store = _Store(beats=2)
    group = _group(store)
    store.on_failure = group._stop.set  # the group closes while a beat is in flight
    with caplog.at_level(logging.WARNING, logger="stratagem.comm"):
        group._heartbeat()
    assert group.heartbeat_failure is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

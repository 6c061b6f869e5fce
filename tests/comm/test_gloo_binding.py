"""gloo listens on the interface of the task's address in the cluster spec, nowhere else.

The job tests run `stratagem launch` inside a network namespace of their own (A) whose host
name resolves to a routable address (10.212.0.1, on a veth pair whose other end is in a
second namespace, B) -- where gloo, left to itself, listens -- and connect from B to every
port the job listens on. Tests send traffic only to loopback or to namespaces they create.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.cluster import ClusterSpec, SimpleClusterResolver, TorchrunClusterResolver
from stratagem.comm.binding import GLOO_VARIABLE, bind_gloo, interface_of
from stratagem.comm.options import CommunicationOptions
from stratagem.comm.processes import WorkerGroup
from stratagem.errors import ClusterConfigError

from . import bind_script

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
HOST_NAME = "stratagem-bind-test"
ROUTABLE = "10.212.0.1"   # namespace A's end of the veth pair to B; the host name's address
PEER = "10.212.0.2"       # namespace B's end
SIDE = "10.213.0.1"       # a second interface of A (sgside0), which B has no route to
LOOPBACK = interface_of("127.0.0.1")
NO_INTERFACE = "203.0.113.77"   # a documentation address, on no interface of a test machine

# Run the rest of the command line with HOST_NAME as the host name (in a UTS namespace).
AS_HOST = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execv(sys.argv[2], sys.argv[2:])"

CONNECT = """
import socket, sys
for port in sys.argv[2:]:
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=5).close()
    except ConnectionRefusedError:
        print("refused", port)
    except OSError as error:
        print("failed", port, error)
    else:
        print("REACHED", port)
"""


# ------------------------------------------------------------------ choices (no network)


def _worker(address: str, index: int = 0, count: int = 2) -> SimpleClusterResolver:
    others = [f"127.0.0.1:{2300 + i}" for i in range(count)]
    others[index] = address
    return SimpleClusterResolver(ClusterSpec({"worker": others}), task_type="worker", task_id=index)


def test_interface_of_finds_the_loopback_interface_and_nothing_for_a_foreign_address() -> None:
    assert LOOPBACK is not None
    assert interface_of("localhost") == interface_of("[::1]") == LOOPBACK
    assert interface_of(NO_INTERFACE) is None
    assert interface_of("no-such-host.invalid") is None


def test_a_loopback_task_binds_loopback_and_a_lone_task_too() -> None:
    environ: dict[str, str] = {}
    assert bind_gloo(_worker("127.0.0.1:2400", index=1), "worker 1", environ) == LOOPBACK
    assert environ[GLOO_VARIABLE] == LOOPBACK
    lone: dict[str, str] = {}
    assert bind_gloo(SimpleClusterResolver(ClusterSpec()), "worker 0", lone) == LOOPBACK
    assert lone[GLOO_VARIABLE] == LOOPBACK


def test_the_users_gloo_socket_ifname_is_kept(caplog) -> None:
    environ = {GLOO_VARIABLE: "eth7"}
    with caplog.at_level(logging.INFO, logger="stratagem.comm"):
        assert bind_gloo(_worker("127.0.0.1:2400"), "worker 0", environ) == "eth7"
    assert environ == {GLOO_VARIABLE: "eth7"}
    assert "as GLOO_SOCKET_IFNAME says" in caplog.text


def test_an_address_on_no_interface_warns_and_drops_an_earlier_choice_of_ours(caplog) -> None:
    environ: dict[str, str] = {}
    bind_gloo(_worker("127.0.0.1:2400"), "worker 0", environ)   # ours, from an earlier group
    with caplog.at_level(logging.WARNING, logger="stratagem.comm"):
        assert bind_gloo(_worker(f"{NO_INTERFACE}:2400"), "worker 0", environ) is None
    assert environ == {}
    assert f"'{NO_INTERFACE}:2400'" in caplog.text and "GLOO_SOCKET_IFNAME" in caplog.text


def test_torchrun_binds_loopback_only_for_a_loopback_master_addr(caplog) -> None:
    def torchrun(master: str) -> TorchrunClusterResolver:
        return TorchrunClusterResolver(environment={"RANK": "1", "WORLD_SIZE": "2",
                                                    "MASTER_ADDR": master, "MASTER_PORT": "2400"})

    assert bind_gloo(torchrun("127.0.0.1"), "worker 1", {}) == LOOPBACK
    assert bind_gloo(torchrun("localhost"), "worker 1", {}) == LOOPBACK
    with caplog.at_level(logging.INFO, logger="stratagem.comm"):
        assert bind_gloo(torchrun(NO_INTERFACE), "worker 1", {}) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", ["0.0.0.0:2400", "[::]:2400"])
def test_a_wildcard_address_is_refused_before_any_rendezvous(address: str) -> None:
    started = time.monotonic()
    with pytest.raises(ClusterConfigError, match="means every interface") as caught:
        WorkerGroup(_worker(address), CommunicationOptions(timeout_seconds=5), uses_cuda=False)
    assert "worker 0's address" in str(caught.value) and "127.0.0.1:PORT" in str(caught.value)
    assert time.monotonic() - started < 5   # refused at once, not after a rendezvous timeout


# ------------------------------------------------------------------ namespaces


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces():
    """Namespaces A and B joined by a veth pair; A's host name resolves to its end of it."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (Debian package iproute2) to create network namespaces")
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` command (Debian package util-linux) to give a namespace its host name")
    a, b = f"stratagem-bind-a-{os.getpid()}", f"stratagem-bind-b-{os.getpid()}"
    hosts = Path("/etc/netns") / a
    made: list[str] = []
    try:
        for name in (a, b):
            step = _ip("netns", "add", name)
            if step.returncode != 0:
                pytest.skip(f"cannot create a network namespace (ip netns add): {step.stderr.strip()}")
            made.append(name)
        for command in (["-n", a, "link", "set", "lo", "up"],
                        ["-n", b, "link", "set", "lo", "up"],
                        ["-n", a, "link", "add", "sgveth0", "type", "veth", "peer", "name", "sgveth1",
                         "netns", b],
                        ["-n", a, "addr", "add", f"{ROUTABLE}/24", "dev", "sgveth0"],
                        ["-n", b, "addr", "add", f"{PEER}/24", "dev", "sgveth1"],
                        ["-n", a, "link", "set", "sgveth0", "up"],
                        ["-n", b, "link", "set", "sgveth1", "up"],
                        ["-n", a, "link", "add", "sgside0", "type", "veth", "peer", "name", "sgside1"],
                        ["-n", a, "addr", "add", f"{SIDE}/24", "dev", "sgside0"],
                        ["-n", a, "link", "set", "sgside0", "up"],
                        ["-n", a, "link", "set", "sgside1", "up"]):
            step = _ip(*command)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the namespaces (ip {' '.join(command)}): {step.stderr.strip()}")
        try:
            hosts.mkdir(parents=True)
            (hosts / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{ROUTABLE} {HOST_NAME}\n")
        except OSError as error:
            pytest.skip(f"cannot give namespace A its own /etc/hosts ({hosts}): {error}")
        probe = subprocess.run(
            ["ip", "netns", "exec", a, "unshare", "--uts", sys.executable, "-c", AS_HOST, HOST_NAME,
             sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"],
            capture_output=True, text=True, timeout=60)
        if probe.stdout.strip() != ROUTABLE:
            pytest.skip(f"cannot make the host name resolve to {ROUTABLE} in a namespace: "
                        f"{(probe.stdout + probe.stderr).strip()}")
        yield a, b
    finally:
        for name in made:
            _ip("netns", "del", name)
        shutil.rmtree(hosts, ignore_errors=True)


def _sockets(pid: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(every listening socket in ``pid``'s network namespace, those ``pid`` holds)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    everyone, own = [], []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)  # each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = (str(ipaddress.ip_address(raw)), int(port, 16))
            everyone.append(address)
            if fields[9] in inodes:
                own.append(address)
    return everyone, own


def _run_job(namespace: str, directory: Path, launch: list[str], env: dict[str, str],
             inspect) -> str:
    """Runs a 2-worker `stratagem launch` in ``namespace``; ``inspect(tasks)`` while it is up."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in (GLOO_VARIABLE, "STRATAGEM_GLOO_SOCKET_IFNAME", "TF_CONFIG")}
    environment.update(env, PYTHONUNBUFFERED="1")
    log = directory / "job.log"
    with log.open("w") as out:
        job = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "unshare", "--uts", sys.executable, "-c", AS_HOST,
             HOST_NAME, sys.executable, "-m", "stratagem", "launch", "--workers", "2", *launch,
             bind_script.__file__, str(directory)],
            env=environment, stdout=out, stderr=subprocess.STDOUT, text=True)
    files = [directory / f"task-{rank}.json" for rank in range(2)]
    tasks: list[dict] = []
    try:
        deadline = time.monotonic() + 150
        while not all(f.exists() for f in files):
            assert job.poll() is None, f"the job ended early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the workers did not join:\n{log.read_text()}"
            time.sleep(0.1)
        tasks = [json.loads(f.read_text()) for f in files]
        inspect(tasks)
        (directory / "done").touch()
        assert job.wait(timeout=120) == 0, log.read_text()
    finally:
        (directory / "done").touch()
        if job.poll() is None:
            job.terminate()   # the launcher stops its tasks
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait(timeout=10)
        for task in tasks:   # in case the launcher could not
            try:
                os.kill(task["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    output = log.read_text()
    assert "rank 0 sum 3" in output and "rank 1 sum 3" in output, output
    return output


def _gloo_sockets(tasks: list[dict]) -> tuple[list[tuple[str, int]], int, list[list[tuple[str, int]]]]:
    """(every listening socket of namespace A, the store's port, each worker's gloo sockets)."""
    store = int(tasks[0]["chief"].rpartition(":")[2])
    everyone, _ = _sockets(tasks[0]["pid"])
    gloo = [[s for s in _sockets(task["pid"])[1] if s[1] != store] for task in tasks]
    assert all(gloo), f"a worker has no gloo socket: {gloo}"
    return everyone, store, gloo


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_loopback_job_listens_on_loopback_only_and_another_namespace_reaches_none_of_its_ports(
        namespaces, tmp_path: Path) -> None:
    a, b = namespaces
    seen: dict = {}

    def inspect(tasks: list[dict]) -> None:
        seen["tasks"] = tasks
        seen["everyone"], _, seen["gloo"] = _gloo_sockets(tasks)
        ports = sorted({port for _, port in seen["everyone"]})
        seen["from_b"] = subprocess.run(
            ["ip", "netns", "exec", b, sys.executable, "-c", CONNECT, ROUTABLE, *map(str, ports)],
            capture_output=True, text=True, timeout=120)

    _run_job(a, tmp_path, [], {}, inspect)
    exposed = [s for s in seen["everyone"] if not ipaddress.ip_address(s[0]).is_loopback]
    assert not exposed, f"the job listens beyond loopback: {seen['everyone']} (gloo: {seen['gloo']})"
    from_b = seen["from_b"]
    assert from_b.returncode == 0, from_b.stderr
    lines = from_b.stdout.splitlines()
    assert len(lines) == len({port for _, port in seen["everyone"]}) >= 3, from_b.stdout
    assert all(line.startswith("refused ") for line in lines), from_b.stdout
    assert [task["gloo_interface"] for task in seen["tasks"]] == [LOOPBACK, LOOPBACK]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_job_naming_a_real_address_listens_on_that_addresss_interface(namespaces, tmp_path: Path) -> None:
    a, _ = namespaces
    seen: dict = {}

    def inspect(tasks: list[dict]) -> None:
        seen["tasks"] = tasks
        seen["everyone"], _, seen["gloo"] = _gloo_sockets(tasks)

    _run_job(a, tmp_path, ["--host", SIDE], {}, inspect)
    # Not on the address the host name resolves to (gloo's default), nor anywhere else.
    assert {host for host, _ in seen["everyone"]} == {SIDE}, seen
    assert [task["gloo_interface"] for task in seen["tasks"]] == ["sgside0", "sgside0"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_users_gloo_socket_ifname_is_respected_by_a_job(namespaces, tmp_path: Path) -> None:
    a, _ = namespaces
    seen: dict = {}

    def inspect(tasks: list[dict]) -> None:
        seen["tasks"] = tasks
        seen["everyone"], seen["store"], seen["gloo"] = _gloo_sockets(tasks)

    _run_job(a, tmp_path, [], {GLOO_VARIABLE: "sgside0"}, inspect)
    assert [task["gloo_interface"] for task in seen["tasks"]] == ["sgside0", "sgside0"]
    assert ("127.0.0.1", seen["store"]) in seen["everyone"]   # the store stays on the spec's address
    assert {host for sockets in seen["gloo"] for host, _ in sockets} == {SIDE}, seen

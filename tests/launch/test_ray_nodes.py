"""The launcher on a Ray cluster of several nodes, each a network namespace with its own address.

Four namespaces on a bridge (a fifth namespace) stand for four machines: the head
(10.77.0.1, no CPUs for actors, as on a real cluster) and three worker nodes (10.77.0.2-4, 2
CPUs each). Every node has the same ``STRATAGEM_CLUSTER_TOKEN`` in the environment of its
``ray start``, as a user sets it; across machines Ray's messages are not encrypted, so that
is the way the token reaches the tasks. The launcher runs as a user runs it, on the head:
``ip netns exec HEAD python -m stratagem.launch --ray 10.77.0.1:6379 ...``. Nothing is sent to
or listens on the machine's own interfaces: each namespace has only its address and loopback.

Tests: ``--ray-spread`` puts the two workers on two nodes and they train as plain PyTorch
does; a node lost mid-training (every process of its namespace killed) restarts the group
on the nodes left, which resumes from its backup to the same parameters.

Needs root and ``ip`` (iproute2); skipped otherwise, or without ray.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .ray_fixtures import SCRIPT, assert_as_plain_pytorch, assert_gone, listeners, ray_env, start_node, stop_session

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (pip install 'stratagem[ray]')"),
              pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0
                                 or shutil.which("ip") is None,
                                 reason="network namespaces need Linux, root and `ip` (iproute2)")]

TOKEN = "Qm3xV9-pL2sK8dR4tY7wZ1nB6cF0hJ5gA_eU3iO9kM2"   # the nodes' own (a test value)
HEAD, WORKER_NODES = "10.77.0.1", ["10.77.0.2", "10.77.0.3", "10.77.0.4"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_pids(namespace: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in result.stdout.split()]


def _kill_namespace(namespace: str) -> None:
    """Every process in ``namespace`` gets SIGKILL: the machine is gone."""
    for _ in range(20):   # a dying process may start another before it goes
        pids = _netns_pids(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@dataclass
class Nodes:
    namespaces: dict[str, str]     # address: its namespace
    env: dict[str, str]

    def run(self, address: str, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[address], *command]


@pytest.fixture(scope="module")
def nodes():
    prefix = f"sgray{os.getpid()}"
    hub, namespaces = f"{prefix}-hub", {}
    temp = tempfile.mkdtemp(prefix="sg-ray-", dir="/tmp")
    sessions = []
    try:
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, address in enumerate([HEAD, *WORKER_NODES]):
            namespace = namespaces[address] = f"{prefix}-n{i}"
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", hub)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", hub, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"h{i}", "up")
        cluster = Nodes(namespaces, ray_env(STRATAGEM_CLUSTER_TOKEN=TOKEN))
        started = time.monotonic()
        sessions.append(start_node(["--head", f"--node-ip-address={HEAD}", "--port=6379", "--num-cpus=0",
                                    "--include-dashboard=false", f"--temp-dir={temp}/n0"],
                                   cluster.env, ["ip", "netns", "exec", namespaces[HEAD]]))
        for i, address in enumerate(WORKER_NODES, start=1):
            sessions.append(start_node([f"--address={HEAD}:6379", f"--node-ip-address={address}", "--num-cpus=2",
                                        f"--temp-dir={temp}/n{i}"],
                                       cluster.env, ["ip", "netns", "exec", namespaces[address]]))
        print(f"\n4 Ray nodes up in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        stop_session(*sessions)
        for namespace in [*namespaces.values(), hub]:
            _kill_namespace(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def _launcher(nodes: Nodes, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(nodes.run(HEAD, sys.executable, "-m", "stratagem.launch", "--ray", f"{HEAD}:6379",
                                      *args), env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(launcher: subprocess.Popen[str], lines: list[str], timeout: float) -> str:
    try:
        rest, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)   # the launcher stops its tasks on every node
            launcher.communicate(timeout=60)
    return "".join(lines) + rest


def test_spread_puts_each_worker_on_its_own_node_and_they_train_as_plain_pytorch(nodes: Nodes,
                                                                                   tmp_path: Path) -> None:
    launcher = _launcher(nodes, "--workers", "2", "--ray-spread", str(SCRIPT), str(tmp_path))
    lines: list[str] = []
    for line in launcher.stdout:
        lines.append(line)
        if "rank 1 step 0 done" in line:
            break
    starts = {rank: (int(pid), host) for rank, pid, host in
              re.findall(r"restart 0 rank (\d) pid (\d+) actor \d+ at ([\d.]+):\d+", "".join(lines))}
    assert sorted(starts) == ["0", "1"], "".join(lines)
    hosts = {host for _, host in starts.values()}
    assert len(hosts) == 2 and hosts <= set(WORKER_NODES), starts   # two machines, not the head
    for pid, host in starts.values():   # the task's sockets (store, gloo): its node's address only
        listening = listeners([pid], ["ip", "netns", "exec", nodes.namespaces[host]])
        assert all(re.match(rf"(\[::ffff:)?{re.escape(host)}\]?:", entry) for entry in listening), listening
    assert listeners([starts["0"][0]], ["ip", "netns", "exec", nodes.namespaces[starts["0"][1]]]), \
        "the chief's rendezvous store should listen"
    output = _finish(launcher, lines, timeout=180)
    assert launcher.returncode == 0, output
    assert "restart 0 rank 0 finished" in output and "restart 0 rank 1 finished" in output
    assert_as_plain_pytorch(tmp_path)


def test_the_tasks_use_the_token_of_their_nodes(nodes: Nodes, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent('''
        import hashlib, os, sys
        token = os.environ["STRATAGEM_CLUSTER_TOKEN"]
        print("digest", hashlib.sha256(token.encode()).hexdigest(), token in " ".join(sys.argv))
    '''))
    launcher = _launcher(nodes, "--workers", "2", "--ray-spread", str(script))
    output = _finish(launcher, [], timeout=120)
    assert launcher.returncode == 0, output
    assert output.count(f"digest {hashlib.sha256(TOKEN.encode()).hexdigest()} False") == 2, output
    assert TOKEN not in output


def test_a_node_lost_mid_training_restarts_the_group_on_the_nodes_left(nodes: Nodes, tmp_path: Path) -> None:
    launcher = _launcher(nodes, "--workers", "2", "--ray-spread", "--max-restarts", "1", "--grace-period", "2",
                         str(SCRIPT), str(tmp_path), "--hold", "0:1:3", "--timeout", "30")
    lines: list[str] = []
    for line in launcher.stdout:
        lines.append(line)
        if "rank 1 holds after step 3" in line:
            break
    first = {rank: (int(pid), host) for rank, pid, host in
             re.findall(r"restart 0 rank (\d) pid (\d+) actor \d+ at ([\d.]+):", "".join(lines))}
    assert sorted(first) == ["0", "1"], "".join(lines)
    lost = first["1"][1]
    lost_at = time.monotonic()
    _kill_namespace(nodes.namespaces[lost])   # the machine of worker 1: raylet, actors, tasks
    output = _finish(launcher, lines, timeout=240)   # the node stays down: this test runs last
    assert launcher.returncode == 0, output
    assert re.search(r"\[launch\] (worker 1's Ray actor died \(.*\)|worker 0 exited with code 1); restarting all 2 "
                     r"tasks \(restart 1/1\)", output), output
    assert "started all 2 tasks again with a new rendezvous (STRATAGEM_RESTART=1)" in output
    again = dict(re.findall(r"restart 1 rank (\d) pid \d+ actor \d+ at ([\d.]+):", output))
    assert sorted(again) == ["0", "1"] and lost not in again.values() and len(set(again.values())) == 2, again
    for rank in ("0", "1"):
        assert f"restart 1 rank {rank} resumes at step 4" in output
    assert_as_plain_pytorch(tmp_path)
    assert_gone([first["0"][0]], timeout=10)   # the survivor's first process did not outlive its group
    print(f"\nnode {lost} lost -> job done in {time.monotonic() - lost_at:.1f} s:\n"
          + "\n".join(line for line in output.splitlines() if line.startswith("[launch]")))

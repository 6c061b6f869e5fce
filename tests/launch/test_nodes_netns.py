"""`stratagem launch --nnodes` on real "hosts": network namespaces, each with its own address.

Every node runs the same command in its namespace; node 0 (10.214.0.1) hosts the rendezvous.
The jobs run ``restart_script.py`` (two MultiWorkerMirroredStrategy workers, one per node,
BackupAndRestore every 2 steps) and must end as an uninterrupted local run of it does: the
same parameters and the same committed sample ids, nothing skipped or trained twice. The
tests wait for lines the scripts print, never for a fixed time.
"""

from __future__ import annotations

import io
import ipaddress
import os
import secrets
import signal
from pathlib import Path

import pytest

from stratagem.launch import launch_local

from .hosts import launch_command, make_hosts, start, stop, wait_for
from .test_restarts import SCRIPT, _assert_as_uninterrupted, _committed

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]

PORT = 29517
LISTEN = "0A"


@pytest.fixture(scope="module")
def hosts():
    with make_hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    stdout, stderr = io.StringIO(), io.StringIO()
    assert launch_local(SCRIPT, [str(out)], num_workers=2, stdout=stdout, stderr=stderr) == 0, stderr.getvalue()
    return {"params": __import__("torch").load(out / "final.pt", weights_only=True),
            "committed": [_committed(out, rank)[0] for rank in (0, 1)]}


def _node(hosts, rank: int, out: Path, token: str, *extra: str, script: tuple[str, ...] = ()):
    namespace, address = hosts[rank]
    log = out / f"node{rank}.log"
    command = launch_command("--nnodes", "2", "--node-rank", str(rank), "--rdzv", f"{hosts[0][1]}:{PORT}",
                             "--workers", "1", "--max-restarts", "2", "--node-timeout", "10", *extra,
                             str(SCRIPT), str(out), "--save-every", "2", "--timeout", "15", *script)
    return start(namespace, command, log, {"STRATAGEM_CLUSTER_TOKEN": token}), log


def _listeners(pid: int) -> list[tuple[str, int]]:
    """Every listening TCP socket of ``pid``'s network namespace."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(raw)
                address = getattr(address, "ipv4_mapped", None) or address   # gRPC's ::ffff:a.b.c.d
                found.append((str(address), int(port, 16)))
    return found


def test_a_node_killed_mid_training_restarts_the_job_on_every_node_and_it_resumes_exactly(
        hosts, reference: dict, tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    first, log0 = _node(hosts, 0, tmp_path, token)
    second, log1 = _node(hosts, 1, tmp_path, token)
    again = None
    try:
        wait_for(log1, "restart 0 rank 1 step 5", 240, first, second)
        for (namespace, address), process in zip(hosts, (first, second)):   # nothing beyond the node's address
            listening = _listeners(process.pid)
            assert listening and all(host == address for host, _ in listening), (address, listening)
        second.kill()   # the whole node: its launcher, and with it its tasks
        second.wait(timeout=30)
        wait_for(log0, "restarting all 2 tasks on 2 node(s) (restart 1/2)", 120, first)
        again, _ = _node(hosts, 1, tmp_path, token)   # the node comes back (a scheduler's restart)
        assert first.wait(timeout=240) == 0, log0.read_text()
        assert again.wait(timeout=60) == 0, log1.read_text()
    finally:
        stop(*(p for p in (first, second, again) if p is not None))
    output = log0.read_text()
    assert "round 1: 2 node(s), this node runs worker 0" in output, output
    resumes = _assert_as_uninterrupted(tmp_path, reference)
    assert resumes[0] == 0 and 0 < resumes[1] <= 6 and resumes[1] % 2 == 0, resumes


def test_sigterm_on_one_node_is_a_preemption_for_the_job_and_it_resumes_when_the_node_is_back(
        hosts, reference: dict, tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    first, log0 = _node(hosts, 0, tmp_path, token, "--grace-period", "30", script=("--watch",))
    second, log1 = _node(hosts, 1, tmp_path, token, "--grace-period", "30", script=("--watch",))
    again = None
    try:
        wait_for(log1, "restart 0 rank 1 step 3", 240, first, second)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 143, log1.read_text()
        wait_for(log0, "for preemption 1/100 (does not count against --max-restarts)", 60, first)
        again, _ = _node(hosts, 1, tmp_path, token, "--grace-period", "30", script=("--watch",))
        assert first.wait(timeout=240) == 0, log0.read_text()
        assert again.wait(timeout=60) == 0, log1.read_text()
    finally:
        stop(*(p for p in (first, second, again) if p is not None))
    assert "node 1 (10.214.0.2) is leaving the job (its launcher got SIGTERM)" in log0.read_text()
    _assert_as_uninterrupted(tmp_path, reference)

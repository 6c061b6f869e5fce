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
import json
import os
import secrets
import signal
from pathlib import Path

import pytest
import torch

from stratagem.launch import launch_local

from .hosts import launch_command, make_hosts, start, stop, wait_for
from .test_restarts import SCRIPT, _assert_as_uninterrupted, _committed

# (forked launches: the uninterrupted references' tasks fork from the test's fork server, a node's from
# a fork server in the node's network namespace: tests/launch/hosts.py's start)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400), pytest.mark.usefixtures("forked_launches"),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]

PORT = 29517
LISTEN = "0A"


ELASTIC = Path(__file__).with_name("elastic_script.py")


@pytest.fixture(scope="module")
def hosts():
    with make_hosts(3) as made:
        yield made


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    stdout, stderr = io.StringIO(), io.StringIO()
    assert launch_local(SCRIPT, [str(out)], num_workers=2, stdout=stdout, stderr=stderr) == 0, stderr.getvalue()
    return {"params": torch.load(out / "final.pt", weights_only=True),
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
    slow = ("--step-seconds", "0.2")   # (the kill lands mid-training even on a busy machine)
    first, log0 = _node(hosts, 0, tmp_path, token, script=slow)
    second, log1 = _node(hosts, 1, tmp_path, token, script=slow)
    again = None
    try:
        wait_for(log1, "restart 0 rank 1 step 5", 240, first, second)
        for (namespace, address), process in zip(hosts, (first, second)):   # nothing beyond the node's address
            listening = _listeners(process.pid)
            assert listening and all(host == address for host, _ in listening), (address, listening)
        second.kill()   # the whole node: its launcher, and with it its tasks
        second.wait(timeout=30)
        wait_for(log0, "restarting all 2 tasks on 2 node(s) (restart 1/2)", 120, first)
        again, _ = _node(hosts, 1, tmp_path, token, script=slow)   # the node comes back (a scheduler's restart)
        assert first.wait(timeout=240) == 0, log0.read_text()
        assert again.wait(timeout=60) == 0, log1.read_text()
    finally:
        stop(*(p for p in (first, second, again) if p is not None))
    output = log0.read_text()
    assert "round 1: 2 node(s), this node runs worker 0" in output, output
    resumes = _assert_as_uninterrupted(tmp_path, reference)
    # from the last backup (every 2 steps) before the kill, which came at step 5 or a little later
    assert resumes[0] == 0 and resumes[1] in (4, 6, 8, 10), resumes


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
    news = [line for line in log0.read_text().splitlines() if "for preemption 1/100" in line]
    assert len(news) == 1 and ("exited with code 75" in news[0] or  # (whichever the host hears first)
                               "node 1 (10.214.0.2) is leaving the job (its launcher got SIGTERM)" in news[0]), news
    assert "restarting" not in log0.read_text().replace(news[0], "")   # no restart spent
    _assert_as_uninterrupted(tmp_path, reference)


def _global_batches(out: Path) -> dict[int, list[int]]:
    """Step -> the sorted sample ids of its global batch, as committed: each restart's run drops
    the steps from where it resumed (trained after the last backup, lost with the group)."""
    committed: dict[int, list[int]] = {}
    restarts = sorted({int(path.stem.rpartition("restart")[2]) for path in out.glob("ids-rank*-restart*.jsonl")})
    for restart in restarts:
        lines = [json.loads(line) for path in sorted(out.glob(f"ids-rank*-restart{restart}.jsonl"))
                 for line in path.read_text().splitlines()]
        resume = {line["resume"] for line in lines if "resume" in line}
        assert len(resume) == 1, f"the workers of restart {restart} resumed at different steps: {resume}"
        start = resume.pop()
        for step in [step for step in committed if step >= start]:
            del committed[step]
        for line in lines:
            if "step" in line:
                committed.setdefault(line["step"], []).extend(line["ids"])
    return {step: sorted(ids) for step, ids in sorted(committed.items())}


def test_an_elastic_job_loses_a_node_for_good_and_finishes_on_two_as_three_would_have(
        hosts, tmp_path: Path) -> None:
    reference = tmp_path / "three"
    reference.mkdir()
    stdout, stderr = io.StringIO(), io.StringIO()
    assert launch_local(ELASTIC, [str(reference)], num_workers=3, stdout=stdout, stderr=stderr) == 0, stderr.getvalue()
    out = tmp_path / "elastic"
    out.mkdir()
    token = secrets.token_urlsafe(32)
    nodes = []
    for rank, (namespace, _) in enumerate(hosts):
        command = launch_command("--nnodes", "2:3", "--node-rank", str(rank), "--rdzv", f"{hosts[0][1]}:{PORT}",
                                 "--workers", "1", "--max-restarts", "1", "--node-timeout", "8",
                                 str(ELASTIC), str(out))
        log = out / f"node{rank}.log"
        nodes.append((start(namespace, command, log, {"STRATAGEM_CLUSTER_TOKEN": token}), log))
    (first, log0), (second, log1), (third, log2) = nodes
    try:
        wait_for(log2, "restart 0 rank 2 of 3 step 5", 240, first, second, third)
        third.kill()   # node 2 is gone for good
        assert first.wait(timeout=300) == 0, log0.read_text()
        assert second.wait(timeout=60) == 0, log1.read_text()
    finally:
        stop(first, second, third)
    assert "round 1: 2 node(s), this node runs worker 0" in log0.read_text(), log0.read_text()
    assert "restart 1 rank 1 of 2 done" in log1.read_text(), log1.read_text()
    final, expected = (torch.load(path / "final.pt", weights_only=True) for path in (out, reference))
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    batches = _global_batches(out)
    assert batches == _global_batches(reference) and len(batches) == 12   # nothing skipped or repeated

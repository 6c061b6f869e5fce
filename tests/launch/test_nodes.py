"""`stratagem launch --nnodes` faults with real launchers on loopback (two "nodes" on one machine):
a node with the wrong token, a rendezvous that never completes, the host lost, a node started
with other options, bad command lines. Each ends with a clear error in bounded time and no
process left behind. The real hosts (network namespaces) are in test_nodes_netns.py."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.launch.ports import free_ports

from .hosts import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180), pytest.mark.usefixtures("forked_launches")]

HELLO = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("hello from", task["type"], task["index"], "restart", os.environ["STRATAGEM_RESTART"], "args", sys.argv[1:],
      flush=True)
print("torchrun's rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"), flush=True)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text(HELLO)
    return path


def _node(tmp_path: Path, name: str, *options: str, token: str | None = None) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "STRATAGEM_CLUSTER_TOKEN")}
    if token is not None:
        env["STRATAGEM_CLUSTER_TOKEN"] = token
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "stratagem", "launch", *options], env=env,
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, log


def _finish(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_two_nodes_on_loopback_run_one_cluster(tmp_path: Path, script: Path) -> None:
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    common = ("--nnodes", "2", "--rdzv", rdzv, "--workers", "2", "--node-timeout", "10", "--per-node-args")
    copy = tmp_path / "elsewhere" / script.name   # the same script at another path
    copy.parent.mkdir()
    copy.write_text(script.read_text())
    host, log0 = _node(tmp_path, "node0", *common, "--node-rank", "0", str(script), token=token)
    other, log1 = _node(tmp_path, "node1", *common, "--node-rank", "1", str(copy), "0.1", token=token)
    try:
        assert host.wait(timeout=120) == 0, log0.read_text()
        assert other.wait(timeout=30) == 0, log1.read_text()
    finally:
        _finish(host, other)
    assert "[worker 0] hello from worker 0 restart 0 args []" in log0.read_text()
    assert "[worker 3] hello from worker 3 restart 0 args ['0.1']" in log1.read_text()   # --per-node-args
    assert "[worker 3] torchrun's rank 3 of 4" in log1.read_text()   # RANK and WORLD_SIZE follow TF_CONFIG
    assert token not in log0.read_text() + log1.read_text()


def test_without_node_ranks_the_node_that_binds_the_rendezvous_hosts_it_and_the_others_follow(
        tmp_path: Path, script: Path) -> None:
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    common = ("--nnodes", "2", "--rdzv", rdzv, "--workers", "1", "--node-timeout", "10")
    first, log0 = _node(tmp_path, "node0", *common, str(script), token=token)
    wait_for(log0, "serving the rendezvous", 60, first)
    second, log1 = _node(tmp_path, "node1", *common, str(script), token=token)
    try:
        assert first.wait(timeout=120) == 0, log0.read_text()
        assert second.wait(timeout=30) == 0, log1.read_text()
    finally:
        _finish(first, second)
    assert "[worker 0] hello from worker 0" in log0.read_text()   # the host is first
    assert "serving" not in log1.read_text() and "[worker 1] hello from worker 1" in log1.read_text()


def test_the_chief_and_the_evaluator_run_on_node_0_and_the_job_waits_for_the_evaluator(
        tmp_path: Path, script: Path) -> None:
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    common = ("--nnodes", "2", "--rdzv", rdzv, "--workers", "1", "--chief", "--evaluator", "1")
    host, log0 = _node(tmp_path, "node0", *common, "--node-rank", "0", str(script), token=token)
    other, log1 = _node(tmp_path, "node1", *common, "--node-rank", "1", str(script), token=token)
    try:
        assert host.wait(timeout=120) == 0, log0.read_text()
        assert other.wait(timeout=30) == 0, log1.read_text()
    finally:
        _finish(host, other)
    assert "this node runs chief, worker 0, evaluator" in log0.read_text(), log0.read_text()
    assert "[evaluator 0] hello from evaluator 0" in log0.read_text()
    assert "this node runs worker 1\n" in log1.read_text() and "[worker 1] hello from worker 1" in log1.read_text()


def test_a_node_with_the_wrong_token_is_refused_and_the_host_names_its_address(tmp_path: Path, script: Path) -> None:
    rdzv = f"127.0.0.1:{free_ports(1)[0]}"
    common = ("--nnodes", "2", "--rdzv", rdzv, "--rdzv-timeout", "60", "--node-timeout", "10")
    host, log0 = _node(tmp_path, "node0", *common, "--node-rank", "0", str(script), token=secrets.token_urlsafe(32))
    stranger, log1 = _node(tmp_path, "node1", *common, "--node-rank", "1", str(script), token=secrets.token_urlsafe(32))
    try:
        wait_for(log0, "serving the rendezvous", 60, host)
        assert stranger.wait(timeout=60) == 1, log1.read_text()
        assert "refused this node" in log1.read_text() and "the same cluster token" in log1.read_text()
        wait_for(log0, "request from ipv4:127.0.0.1:", 30, host)
        assert "rendezvous refused a " in log0.read_text() and "wrong cluster token" in log0.read_text()
        assert "hello from" not in log0.read_text()   # nothing ran
    finally:
        _finish(host, stranger)


def test_a_rendezvous_that_never_completes_fails_in_time_naming_the_missing_node(tmp_path: Path, script: Path) -> None:
    started = time.monotonic()
    host, log0 = _node(tmp_path, "node0", "--nnodes", "3", "--node-rank", "0", "--rdzv",
                       f"127.0.0.1:{free_ports(1)[0]}", "--rdzv-timeout", "3", str(script),
                       token=secrets.token_urlsafe(32))
    try:
        assert host.wait(timeout=90) == 1, log0.read_text()
    finally:
        _finish(host)
    assert time.monotonic() - started < 60
    assert ("1 of 3 nodes joined (node 0 (127.0.0.1)); missing: node-rank 1, node-rank 2" in log0.read_text())


def test_losing_the_host_stops_the_other_nodes_tasks_with_a_clear_error(tmp_path: Path, script: Path) -> None:
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    common = ("--nnodes", "2", "--rdzv", rdzv, "--node-timeout", "3")
    host, log0 = _node(tmp_path, "node0", *common, "--node-rank", "0", str(script), "600", token=token)
    other, log1 = _node(tmp_path, "node1", *common, "--node-rank", "1", str(script), "600", token=token)
    try:
        wait_for(log1, "hello from worker 1", 90, host, other)
        host.send_signal(signal.SIGKILL)
        assert other.wait(timeout=60) == 1, log1.read_text()
    finally:
        _finish(host, other)
    assert "has not answered for" in log1.read_text() and "node-rank 0" in log1.read_text()


UNTIL_RESTARTED = """
import os, time
print("hello from restart", os.environ["STRATAGEM_RESTART"], flush=True)
if os.environ["STRATAGEM_RESTART"] == "0":
    time.sleep(600)
"""


def test_a_killed_node_is_lost_at_once_and_an_elastic_job_goes_on_without_waiting_for_it(tmp_path: Path) -> None:
    script = tmp_path / "until_restarted.py"
    script.write_text(UNTIL_RESTARTED)
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    # --node-timeout 120: before the fix, noticing the loss took that long, and so did settling after it
    common = ("--nnodes", "2:3", "--rdzv", rdzv, "--node-timeout", "120", "--max-restarts", "1")
    nodes = [_node(tmp_path, f"node{rank}", *common, "--node-rank", str(rank), str(script), token=token)
             for rank in range(3)]
    (host, log0), (other, log1), (doomed, log2) = nodes
    try:
        for rank, (_, log) in enumerate(nodes):
            wait_for(log, f"[worker {rank}] hello from restart 0", 90, host, other, doomed)
        doomed.send_signal(signal.SIGKILL)
        assert host.wait(timeout=60) == 0, log0.read_text()
        assert other.wait(timeout=30) == 0, log1.read_text()
    finally:
        _finish(host, other, doomed)
    assert ("node 2 (127.0.0.1) is gone: its launcher's connection to the rendezvous closed (the launcher "
            "died); restarting all 3 tasks on 3 node(s) (restart 1/1)") in log0.read_text()
    assert "round 1: 2 node(s)" in log0.read_text() and "[worker 1] hello from restart 1" in log1.read_text()


def test_a_node_started_with_other_options_another_script_or_other_arguments_stops_every_node_naming_them(
        tmp_path: Path, script: Path) -> None:
    rdzv, token = f"127.0.0.1:{free_ports(1)[0]}", secrets.token_urlsafe(32)
    other_script = tmp_path / "other" / script.name   # the same name, other contents
    other_script.parent.mkdir()
    other_script.write_text(HELLO + "print('changed')\n")
    host, log0 = _node(tmp_path, "node0", "--nnodes", "2", "--node-rank", "0", "--rdzv", rdzv,
                       "--grace-period", "30", "--node-timeout", "20", "--rdzv-timeout", "60", "--join-timeout", "100",
                       "--max-restarts", "3", str(script), "0", "--lr", "0.1", token=token)
    wait_for(log0, "serving the rendezvous", 60, host)
    other, log1 = _node(tmp_path, "node1", "--nnodes", "2", "--node-rank", "1", "--rdzv", rdzv,
                        str(other_script), "0", "--lr", "0.2", token=token)
    try:
        assert other.wait(timeout=60) == 1, log1.read_text()
        assert host.wait(timeout=60) == 1, log0.read_text()   # the job cannot start: every node says why
    finally:
        _finish(host, other)
    digests = [hashlib.sha256(path.read_bytes()).hexdigest()[:12] for path in (other_script, script)]
    for log in (log0, log1):
        text = log.read_text()
        for difference in ("--grace-period 5 on node 1 (127.0.0.1), 30 on the rendezvous host",
                           "--node-timeout 30 on node 1 (127.0.0.1), 20 on the rendezvous host",
                           "--rdzv-timeout 600 on node 1 (127.0.0.1), 60 on the rendezvous host",
                           "--join-timeout 600 on node 1 (127.0.0.1), 100 on the rendezvous host",
                           "--max-restarts 0 on node 1 (127.0.0.1), 3 on the rendezvous host",
                           f"the script's contents differ: hello.py (sha256 {digests[0]}) on node 1 (127.0.0.1), "
                           f"hello.py (sha256 {digests[1]}) on the rendezvous host",
                           "the script's arguments differ: ['0', '--lr', '0.2'] on node 1 (127.0.0.1), "
                           "['0', '--lr', '0.1'] on the rendezvous host; give --per-node-args"):
            assert difference in text, text
        assert "hello from" not in text and "--nnodes" not in text.partition("started otherwise")[2]


@pytest.mark.parametrize("options, message", [
    (("--nnodes", "2"), "needs both --nnodes and --rdzv"),
    (("--nnodes", "2", "--rdzv", "0.0.0.0:29400"), "wildcard address"),
    (("--nnodes", "2:1", "--rdzv", "127.0.0.1:29400"), "--nnodes must be N or MIN:MAX"),
    (("--nnodes", "2", "--rdzv", "127.0.0.1:29400", "--ps", "1"), "--ps and --port-base are for one machine"),
    (("--nnodes", "2", "--rdzv", "127.0.0.1:29400", "--node-rank", "2"), "--node-rank must be 0 to 1"),
    (("--nnodes", "2", "--rdzv", "no-such-host.invalid:29400", "--node-rank", "1"),
     "cannot find this node's way to the rendezvous host"),
])
def test_bad_multi_node_command_lines_are_refused_before_anything_starts(tmp_path: Path, script: Path,
                                                                         options, message) -> None:
    process, log = _node(tmp_path, "bad", *options, str(script), token=secrets.token_urlsafe(32))
    assert process.wait(timeout=60) == 2, log.read_text()
    assert message in log.read_text()


def test_no_token_is_refused_with_how_to_make_one(tmp_path: Path, script: Path) -> None:
    process, log = _node(tmp_path, "bad", "--nnodes", "2", "--rdzv", "127.0.0.1:29400", str(script))
    assert process.wait(timeout=60) == 2, log.read_text()
    assert "needs the cluster token on every node" in log.read_text() and "secrets.token_urlsafe" in log.read_text()

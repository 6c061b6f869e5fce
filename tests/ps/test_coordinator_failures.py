"""ClusterCoordinator failures that used to wait forever or die silently, on real processes.

Each test starts `stratagem server` processes (ps and workers) and a coordinator script
(``coordinator_failures.py``) as the chief, all on loopback, and waits for the lines the
script prints; every process is killed at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing import free_ports, local_cluster, start_task
from stratagem.testing.forked import ForkedTask

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]
HERE = Path(__file__).parent
SCRIPT = HERE / "coordinator_failures.py"
# `stratagem server` on a host whose clock is off by argv[1] seconds, as stratagem's RPC layer reads
# it (the clock that signs and checks requests, and names the clocks in errors). gRPC's core keeps
# the real clock: shifting time.time for the whole process makes it wait out its polling deadlines.
SKEWED_SERVER = """
import runpy, sys, time, types
import stratagem.rpc.auth, stratagem.rpc.client
offset = float(sys.argv[1])
shifted = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
shifted.time = lambda: time.time() + offset
stratagem.rpc.auth.time = stratagem.rpc.client.time = shifted
sys.argv = ["stratagem", "server"]
runpy.run_module("stratagem", run_name="__main__", alter_sys=True)
"""


class Cluster:
    """Processes of one test cluster, each logging to its own file under ``tmp_path``."""

    def __init__(self, tmp_path: Path, num_workers: int, num_ps: int = 1):
        self.tmp_path = tmp_path
        self.spec = local_cluster(num_workers, chief=True, num_ps=num_ps)
        self.token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen | ForkedTask] = {}

    def env(self, task_type: str, index: int, *, cluster: dict | None = None,
            token: str | None = None) -> dict[str, str]:
        config = {"cluster": cluster or self.spec, "task": {"type": task_type, "index": index}}
        return {**os.environ, "TF_CONFIG": json.dumps(config), "PYTHONUNBUFFERED": "1",
                "STRATAGEM_CLUSTER_TOKEN": token or self.token}

    def start(self, name: str, command: list[str], env: dict[str, str], *,
              fresh: bool = False) -> subprocess.Popen | ForkedTask:
        """``command`` as task ``name``: forked from the test fork server where it can be, unless
        ``fresh`` (a child of this process: killed, it stays a zombie until it is waited for)."""
        log = self.tmp_path / f"{name.replace(' ', '-')}.log"
        if not fresh:
            self.procs[name] = start_task(command, env=env, log=str(log))
            return self.procs[name]
        with open(log, "ab") as output:
            self.procs[name] = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                                start_new_session=True)
        return self.procs[name]

    def server(self, task_type: str, index: int, *, clock_offset: float = 0.0,
               **env_options) -> subprocess.Popen | ForkedTask:
        """`stratagem server` for a task; ``clock_offset``: its clock runs that many seconds
        ahead (see SKEWED_SERVER)."""
        name = f"{task_type} {index}"
        (self.tmp_path / f"{name.replace(' ', '-')}.log").unlink(missing_ok=True)
        command = [sys.executable, "-m", "stratagem", "server"]
        if clock_offset:
            command = [sys.executable, "-c", SKEWED_SERVER, str(clock_offset)]
        return self.start(name, command, self.env(task_type, index, **env_options))

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name.replace(' ', '-')}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, name: str, text: str, timeout: float = 60.0) -> str:
        """The first line of ``name``'s log containing ``text``; fails (with the logs) after timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log(name).splitlines():
                if text in line:
                    return line
            if self.procs[name].poll() is not None:
                time.sleep(0.2)  # the last lines may still be on their way to the file
                line = next((l for l in self.log(name).splitlines() if text in l), None)
                if line is not None:
                    return line
                break
            time.sleep(0.05)
        pytest.fail(f"no {text!r} from {name} (exit status {self.procs[name].poll()}); logs:\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)[-3000:]}" for name in self.procs)

    def coordinator(self, mode: str, worker_timeout: float, *args: str, cluster: dict | None = None) -> None:
        self.start("chief 0", [sys.executable, str(SCRIPT), mode, str(worker_timeout), *args],
                   self.env("chief", 0, cluster=cluster))

    def result(self, timeout: float = 90.0) -> dict:
        return json.loads(self.wait_for("chief 0", "RESULT ", timeout).split("RESULT ", 1)[1])

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def cluster_factory(tmp_path: Path):
    clusters: list[Cluster] = []

    def make(num_workers: int, num_ps: int = 1) -> Cluster:
        clusters.append(Cluster(tmp_path, num_workers, num_ps))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.close()


def test_all_workers_killed_join_and_fetch_raise_unavailable_naming_them(cluster_factory) -> None:
    cluster = cluster_factory(2)
    servers = [cluster.server("ps", 0), cluster.server("worker", 0), cluster.server("worker", 1)]
    for name in ("ps 0", "worker 0", "worker 1"):
        cluster.wait_for(name, "listening")
    cluster.coordinator("all-killed", 15.0, str(servers[1].pid), str(servers[2].pid))
    cluster.wait_for("chief 0", "KILLED")
    cluster.server("worker", 0)          # back within worker_timeout: it gets the work
    report = cluster.result()

    for key in ("join_timeout", "fetch_timeout", "coordinator_fetch_timeout"):
        assert report[key]["type"] == "TimeoutError", report
        assert report[key]["seconds"] < 2.5, report
    assert report["restart_join"]["type"] is None, report
    assert len(report["restart_pids"]) == 1 and report["restart_pids"][0] not in report["killed_pids"]
    for key in ("dead_join", "dead_fetch"):
        assert report[key]["type"] == "UnavailableError", report
        assert "worker 0" in report[key]["message"] and "worker 1" in report[key]["message"], report
        assert report[key]["task"] == "worker 0, worker 1"
    assert report["dead_join"]["seconds"] < 30, report


def test_worker_with_another_token_fails_the_closures_within_seconds(cluster_factory) -> None:
    cluster = cluster_factory(1)
    cluster.server("ps", 0)
    cluster.wait_for("ps 0", "listening")
    cluster.coordinator("wrong-token", 60.0)
    cluster.wait_for("chief 0", "SCHEDULED")
    cluster.server("worker", 0, token=secrets.token_hex(16))
    cluster.wait_for("worker 0", "listening")
    started = time.monotonic()
    report = cluster.result()

    assert time.monotonic() - started < 10, report
    assert report["schedule"]["type"] is None, report
    for key in ("join", "fetch", "coordinator_fetch", "schedule_after"):
        assert report[key]["type"] == "AuthenticationError", report
        assert "worker 0" in report[key]["message"] and "token" in report[key]["message"], report
        assert "differs" in report[key]["message"], report
    assert report["status"] == ["FAILED"] * 3


def test_worker_with_a_clock_10_minutes_ahead_fails_saying_so_first(cluster_factory) -> None:
    cluster = cluster_factory(1)
    cluster.server("ps", 0)
    cluster.wait_for("ps 0", "listening")
    cluster.coordinator("skewed-clock", 60.0)
    cluster.wait_for("chief 0", "SCHEDULED")
    cluster.server("worker", 0, clock_offset=600.0)
    cluster.wait_for("worker 0", "listening")
    started = time.monotonic()
    report = cluster.result()

    assert time.monotonic() - started < 10, report
    assert report["schedule"]["type"] is None, report
    for key in ("join", "fetch", "coordinator_fetch", "schedule_after"):
        message = report[key]["message"]
        assert report[key]["type"] == "ClockSkewError", report
        # the cause first: both clocks, the offset and the fix; the token is not blamed
        assert message.startswith("the clocks of this host and worker 0 (127.0.0.1:"), message
        assert " differ by 600 s (this host reads " in message and "more than the 300 s" in message, message
        assert "synchronise the hosts' clocks (NTP: chrony or systemd-timesyncd" in message, message
        assert "differs from the coordinator's" not in message, message
    assert report["status"] == ["FAILED"] * 3
    assert "the clocks of this host and the sender differ by 600 s" in cluster.log("worker 0")


def test_ps_address_as_a_worker_fails_saying_it_is_not_a_worker(cluster_factory) -> None:
    # (the same ps written twice, "localhost:P" and "127.0.0.1:P", is refused by the cluster spec
    # itself; here the worker address is another cluster's ps, which only the dispatcher can see)
    cluster = cluster_factory(1)
    cluster.server("ps", 0)
    cluster.wait_for("ps 0", "listening")
    other_ps = f"127.0.0.1:{free_ports(1)[0]}"
    cluster.server("ps", 1, cluster={**cluster.spec, "ps": [*cluster.spec["ps"], other_ps]})
    cluster.wait_for("ps 1", "listening")
    wrong = {**cluster.spec, "worker": [other_ps]}
    cluster.coordinator("not-worker", 60.0, cluster=wrong)
    report = cluster.result()

    # the dispatcher may see the ps before or after the closures are scheduled
    assert report["schedule"]["type"] in (None, "ClusterConfigError"), report
    keys = ["join", "schedule_after"] + (["fetch", "coordinator_fetch"] if report["status"] else [])
    for key in keys:
        assert report[key]["type"] == "ClusterConfigError", report
        assert "worker 0" in report[key]["message"] and "not a worker" in report[key]["message"], report
        assert "ps 1" in report[key]["message"], report
    assert report["join"]["seconds"] < 10, report
    assert set(report["status"]) <= {"FAILED"}, report
    assert "Traceback" not in cluster.log("chief 0"), cluster.log("chief 0")

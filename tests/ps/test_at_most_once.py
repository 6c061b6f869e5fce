"""Each scheduled step is applied at most once, and a ps stall is not a loss, on real processes.

``at_most_once.py`` (the chief) trains one weight that every applied step raises by exactly
1, so its value counts the updates the ps applied; these tests start the ps and workers as
``stratagem server`` processes, stop them with SIGSTOP at moments the script reports, and
check what it saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .test_coordinator_failures import HERE, Cluster, cluster_factory  # noqa: F401

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
SCRIPT = HERE / "at_most_once.py"


def run(cluster: Cluster, tmp_path: Path, mode: str, pid: int) -> dict:
    gate = tmp_path / "gate"
    gate.mkdir()
    cluster.start("chief 0", [sys.executable, str(SCRIPT), mode, str(gate), str(pid)],
                  cluster.env("chief", 0))
    return json.loads(cluster.wait_for("chief 0", "RESULT ", 150).split("RESULT ", 1)[1])


def start(cluster: Cluster, num_workers: int) -> dict[str, int]:
    procs = {"ps 0": cluster.server("ps", 0).pid}
    for i in range(num_workers):
        procs[f"worker {i}"] = cluster.server("worker", i).pid
    for name in procs:
        cluster.wait_for(name, "listening")
    return procs


def test_a_stopped_worker_that_resumes_does_not_apply_its_step_twice(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    pids = start(cluster, 2)
    report = run(cluster, tmp_path, "stop-worker", pids["worker 1"])

    # the held step ran again on worker 0 once worker 1 missed its heartbeats
    assert report["updates_after_join"] == 42 and report["join_seconds"] < 30, report
    # worker 1 resumed and pushed its step late: refused, nothing applied twice
    (late,) = report["late_push"]
    assert late.startswith("SupersededError") or "superseded" in late, report
    assert report["refused"] >= 1 and report["updates"] == 42, report
    assert report["after"] and report["weight"] == 43.0, report
    assert report["run_on_lane"] == [True, True], report   # the closures went on the workers' lanes


def test_a_three_second_ps_stall_is_not_a_loss(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    pids = start(cluster, 2)
    report = run(cluster, tmp_path, "ps-stall", pids["ps 0"])

    assert report["join"] is None, report
    assert report["statuses"] == ["READY"], report
    assert report["updates"] == 42 and report["weight"] == 42.0, report


def test_a_ps_declared_lost_applies_nothing_more_when_it_resumes(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    pids = start(cluster, 2)
    report = run(cluster, tmp_path, "ps-lost", pids["ps 0"])

    assert report["join"]["type"] == "UnavailableError" and report["join"]["task"] == "ps 0", report
    assert "lost" in report["join"]["message"] and "restore" in report["join"]["message"], report
    assert report["join_seconds"] < 20, report
    assert report["schedule_after"]["type"] == "UnavailableError", report
    # the two pushes the stopped ps held were refused when it resumed: its lease had run out
    assert report["refused"] >= 2 and report["updates_after"] == report["updates_before"], report
    assert report["statuses"] == ["FAILED"], report

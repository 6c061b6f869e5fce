"""Back-pressure and bounded worker caches, on real processes (1 ps, 1 worker, a chief script).

``bounded_coordinator.py`` runs the scenarios and prints what it saw; these tests check it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .test_coordinator_failures import HERE, Cluster, cluster_factory  # noqa: F401

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SCRIPT = HERE / "bounded_coordinator.py"


def run(cluster: Cluster, tmp_path: Path, mode: str, *args: str) -> dict:
    cluster.start("chief 0", [sys.executable, str(SCRIPT), mode, str(tmp_path / "gate"), *args],
                  cluster.env("chief", 0))
    return json.loads(cluster.wait_for("chief 0", "RESULT ", 90).split("RESULT ", 1)[1])


def test_schedule_blocks_at_the_bound_and_worker_caches_stay_bounded(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(1)
    cluster.server("ps", 0)
    cluster.start("worker 0", [sys.executable, "-m", "stratagem", "server"],
                  {**cluster.env("worker", 0), "STRATAGEM_WORKER_CLOSURE_CACHE": "8"})
    report = run(cluster, tmp_path, "bound")
    assert report["blocked_while_full"] and report["unfinished_while_full"] == 2
    assert report["after_gate"]["type"] is None and report["after_gate"]["seconds"] < 10
    assert report["peak_unfinished"] <= 2 and report["lambda_values_ok"]
    assert report["cache_after_300"] <= 8
    assert report["first"] == 1000 and report["evicted_rerun"] == 1000
    assert report["datasets_after"] <= 1 and report["iterators_after"] <= 1
    assert report["coordinator_datasets"] <= 1
    assert report["on_shutdown"]["type"] == "InvalidArgumentError", report
    assert "shut down" in report["on_shutdown"]["message"] and report["on_shutdown"]["seconds"] < 5


def test_blocked_schedule_raises_when_the_ps_is_lost(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(1)
    ps = cluster.server("ps", 0)
    cluster.server("worker", 0)
    report = run(cluster, tmp_path, "ps-lost", str(ps.pid))
    assert report["on_ps_lost"]["type"] == "UnavailableError", report
    assert "ps 0" in report["on_ps_lost"]["message"] and report["on_ps_lost"]["seconds"] < 15

"""A step dispatched before a ps is declared lost fails with the loss and applies nothing,
even when it ends after the variables were restored; on real processes.

``lost_then_restored.py`` (the chief) trains one weight that every applied step raises by
exactly 1; the test starts the ps and two workers as ``stratagem server`` processes, and the
script SIGSTOPs the ps while steps are held at a gate, restores the weight once the ps is
declared lost, and only then opens the gate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .test_coordinator_failures import HERE, Cluster, cluster_factory  # noqa: F401

pytestmark = [pytest.mark.timeout(200), pytest.mark.multiprocess]
SCRIPT = HERE / "lost_then_restored.py"


def run(cluster: Cluster, tmp_path: Path, mode: str) -> dict:
    procs = {"ps 0": cluster.server("ps", 0).pid}
    for i in range(2):
        procs[f"worker {i}"] = cluster.server("worker", i).pid
    for name in procs:
        cluster.wait_for(name, "listening")
    gate = tmp_path / "gate"
    gate.mkdir()
    cluster.start("chief 0", [sys.executable, str(SCRIPT), mode, str(gate), str(procs["ps 0"])],
                  cluster.env("chief", 0))
    return json.loads(cluster.wait_for("chief 0", "RESULT ", 170).split("RESULT ", 1)[1])


def check(report: dict, held: int) -> None:
    assert report["saved"] == 3.0, report
    assert report["join"]["type"] == "UnavailableError" and report["join"]["task"] == "ps 0", report
    assert "lost" in report["join"]["message"], report
    assert report["join_seconds"] < 30, report
    # every held step fails with the loss, although it ended after the restore
    assert len(report["held"]) == held, report
    for outcome in report["held"]:
        assert outcome.get("type") == "UnavailableError" and outcome["task"] == "ps 0", report
        assert "is lost" in outcome["message"], report
    # the loss was raised and the variables restored: join() does not raise it again
    assert report["join_after"] is None and report["join_more"] is None, report
    # nothing of the held steps was applied to the restored weight; the later steps were, once each
    assert report["weight_after_held"] == 3.0, report
    assert report["weight"] == 5.0, report


def test_a_step_held_before_its_run_through_a_ps_loss_and_restore_fails_and_applies_nothing(
        cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    report = run(cluster, tmp_path, "held")
    check(report, held=1)
    assert report["held_when_lost"] == ["PENDING"], report


def test_a_step_running_through_a_ps_loss_and_restore_fails_and_its_late_push_is_refused(
        cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2)
    report = run(cluster, tmp_path, "running")
    check(report, held=2)
    # the two steps pushed after the restore: the ps refused both (they belong to before the loss)
    assert len(report["pushes"]) == 2 and report["refused_after_restore"] >= 2, report
    for pushed in report["pushes"]:
        assert "SupersededError" in pushed and "before a restore after a ps loss" in pushed, report

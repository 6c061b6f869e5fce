"""A new coordinator takes long-lived `stratagem server` processes over; a live one is refused.

Each test starts 2 parameter servers and 2 workers as `stratagem server` processes, then
coordinators (``takeover.py``) one after the other against them, as a job manager re-running
or restarting the chief would; they count the updates each ps applied (every applied step
adds exactly 1), so a step applied twice, or a push of a coordinator taken over, would show.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from .test_coordinator_failures import HERE, Cluster, cluster_factory  # noqa: F401

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = HERE / "takeover.py"


def servers(cluster: Cluster) -> None:
    for task_type, index in (("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)):
        cluster.server(task_type, index)
    for name in ("ps 0", "ps 1", "worker 0", "worker 1"):
        cluster.wait_for(name, "listening")


def coordinator(cluster: Cluster, name: str, mode: str, gate: Path, *options: str, fresh: bool = False) -> int:
    return cluster.start(name, [sys.executable, str(SCRIPT), mode, str(gate), *options],
                         cluster.env("chief", 0), fresh=fresh).pid


def result(cluster: Cluster, name: str, timeout: float = 120.0) -> dict:
    report = json.loads(cluster.wait_for(name, "RESULT ", timeout).split("RESULT ", 1)[1])
    assert cluster.procs[name].wait(30) == 0, cluster.logs()
    return report


def test_a_clean_rerun_against_the_same_servers_starts_fresh_or_restores(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2, num_ps=2)
    servers(cluster)
    gate, saved = tmp_path / "gate", tmp_path / "checkpoints"
    gate.mkdir()

    first_pid = coordinator(cluster, "chief a", "train", gate, "--steps", "4", "--save", str(saved))
    first = result(cluster, "chief a")
    assert first["took_over"] == [] and first["weight"] == [4.0, 4.0], first

    # no checkpoint: its own fresh values replace the first run's (another shape under the same ids)
    coordinator(cluster, "chief b", "train", gate, "--steps", "3", "--width", "2")
    second = result(cluster, "chief b")
    assert second["created"] == [0.0] * 4 and second["weight"] == [3.0] * 4, second
    assert len(second["took_over"]) == 2 and all(f"pid {first_pid} " in line and "it released it" in line
                                                  for line in second["took_over"]), second
    assert second["claim_seconds"] < 20, second     # released at exit: no lease to wait for

    # restoring the first run's checkpoint: its values, then this run's steps on top
    coordinator(cluster, "chief c", "train", gate, "--steps", "2", "--restore", str(saved))
    third = result(cluster, "chief c")
    assert third["restored"].endswith("ckpt-1") and third["after_restore"] == [4.0, 4.0], third
    assert third["weight"] == [6.0, 6.0] and third["owner"] == [third["pid"]] * 2, third


def test_a_live_coordinator_refuses_a_second_then_a_stopped_one_is_taken_over_and_fenced(
        cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2, num_ps=2)
    servers(cluster)
    gate = tmp_path / "gate"
    gate.mkdir()
    first = coordinator(cluster, "chief a", "hold", gate)
    coordinator(cluster, "chief b", "train", gate, "--wait-for", str(tmp_path / "second"))
    cluster.wait_for("chief a", "HOLDING")
    cluster.wait_for("chief b", "READY")

    # a second coordinator while the first runs: refused within seconds, naming the first
    (tmp_path / "second").touch()
    started = time.monotonic()
    assert cluster.procs["chief b"].wait(60) != 0
    refused_after = time.monotonic() - started
    print(f"refused {refused_after:.1f} s after it was told to claim")
    log = cluster.log("chief b")
    assert "CoordinatorConflictError: another coordinator drives these parameter servers and is alive" in log, log
    assert f"the coordinator of pid {first} on " in log and " UTC, id " in log and "stop that program first" in log
    assert refused_after < 30, (refused_after, log)   # two renewals seen, a second apart (slack for a loaded machine)

    # the first one stopped (SIGSTOP): not provably gone, so the next waits for its lease to run out
    os.kill(first, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        coordinator(cluster, "chief c", "takeover", gate, "--steps", "6")
        report = result(cluster, "chief c")
    finally:
        os.kill(first, signal.SIGCONT)
    # (its last renewal came at most a second before it stopped; the lease is 10 s)
    assert report["claimed_at"] - stopped_at > 8, report
    assert all(f"pid {first} " in line and "lease ran out" in line for line in report["took_over"]), report
    assert report["created"] == [0.0, 0.0], report                   # the first one's 5 are gone
    # the first one's held push came after the takeover: refused; each ps applied the 6 steps once
    assert report["fenced_after"] > report["fenced_before"], report
    assert report["weight_before_open"] == [5.0, 5.0] and report["weight"] == [6.0, 6.0], report

    # the first one, resumed, is told it was taken over, and by whom
    (gate / "go").touch()
    old = result(cluster, "chief a")
    assert old["before_hold"] == [5.0, 5.0], old
    for key in ("join", "schedule"):
        assert old[key]["type"] == "FencedError", old
        assert f"pid {report['pid']} " in old[key]["message"] and "no longer drives the parameter servers" in old[key]["message"], old


def test_a_killed_coordinator_is_taken_over_at_once_and_its_late_push_is_refused(cluster_factory, tmp_path) -> None:  # noqa: F811
    cluster = cluster_factory(2, num_ps=2)
    servers(cluster)
    gate = tmp_path / "gate"
    gate.mkdir()
    first = coordinator(cluster, "chief a", "hold", gate, fresh=True)   # our child: unreaped once killed
    coordinator(cluster, "chief b", "takeover", gate, "--steps", "6", "--wait-for", str(tmp_path / "killed"))
    cluster.wait_for("chief a", "HOLDING")
    cluster.wait_for("chief b", "READY")   # started up: it claims as soon as it is told
    os.kill(first, signal.SIGKILL)   # (left unreaped: a zombie counts as gone too)
    killed_at = time.time()
    (tmp_path / "killed").touch()

    report = result(cluster, "chief b")
    # taken over at once: the old holder's process is gone, so chief b did not wait for its lease
    # (10 s from the last renewal) to run out (said by the log, not a clock: a busy machine is slow)
    assert report["claimed_at"] >= killed_at and "waiting up to" not in cluster.log("chief b"), report
    assert all(f"pid {first} " in line and "has exited" in line for line in report["took_over"]), report
    assert f"took ps 0 over from the coordinator of pid {first} " in cluster.log("chief b")
    assert report["created"] == [0.0, 0.0], report
    assert report["fenced_after"] > report["fenced_before"], report
    assert report["weight_before_open"] == [5.0, 5.0] and report["weight"] == [6.0, 6.0], report

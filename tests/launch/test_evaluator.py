"""``stratagem launch --evaluator 1``: an evaluator task runs the script beside training,
outside the group; the job needs training to succeed and the evaluator to exit 0 after it."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.errors import InvalidArgumentError
from stratagem.launch import launch_local
from stratagem.launch.tasks import plan_cluster, server_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60), pytest.mark.usefixtures("forked_launches")]

_PRELUDE = '''
import json, os, sys, time
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
OUT = sys.argv[1]

def wait_for(name, timeout=30):
    deadline = time.time() + timeout
    while not os.path.exists(os.path.join(OUT, name)):
        if time.time() > deadline:
            sys.exit(99)
        time.sleep(0.02)
'''


def _launch(tmp_path: Path, body: str, **options: object) -> tuple[int, str, str]:
    script = tmp_path / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, [str(tmp_path)], stdout=out, stderr=err, num_evaluators=1, **options)
    return status, out.getvalue(), err.getvalue()


def test_the_evaluator_outlives_a_group_restart_and_the_job_waits_for_it(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, '''
        if TASK["type"] == "evaluator":
            print("evaluator started", json.loads(os.environ["TF_CONFIG"])["cluster"]["evaluator"] != [])
            wait_for("trained")
            time.sleep(0.3)   # the workers are done by now: the launcher must still wait
            print("evaluator done")
        elif os.environ["STRATAGEM_RESTART"] == "0" and TASK["index"] == 1:
            sys.exit(3)
        else:
            wait_for("go") if TASK["index"] == 1 else open(os.path.join(OUT, "go"), "w").close()
            if TASK["index"] == 0:
                open(os.path.join(OUT, "trained"), "w").close()
    ''', num_workers=2, max_restarts=1)
    assert status == 0, out + err
    assert out.count("[evaluator 0] evaluator started True") == 1   # not restarted with the group
    assert "[evaluator 0] evaluator done" in out
    assert "restarting all 2 tasks (restart 1/1)" in err


def test_an_evaluator_failure_fails_the_job_after_training(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, '''
        if TASK["type"] == "evaluator":
            sys.exit(4)
        time.sleep(1.0)
        print("trained")
    ''', num_workers=2)
    assert status == 4
    assert "evaluator 0 failed with exit code 4; training goes on" in err
    assert out.count("trained") == 2


def test_an_evaluator_that_never_exits_is_stopped(tmp_path: Path) -> None:
    status, out, err = _launch(tmp_path, '''
        if TASK["type"] == "evaluator":
            with open(os.path.join(OUT, "evaluator.pid.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(OUT, "evaluator.pid.tmp"), os.path.join(OUT, "evaluator.pid"))
            time.sleep(60)
        else:
            wait_for("evaluator.pid")   # training ends once the evaluator surely runs
    ''', num_workers=1, evaluator_timeout=0.5, grace_period=0.5)
    assert status == 1
    assert "evaluator 0 still running 0.5 s after training ended" in err
    pid = int((tmp_path / "evaluator.pid").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the evaluator outlived the launcher")


def test_evaluator_plan_and_errors(tmp_path: Path) -> None:
    spec, tasks = plan_cluster(["train.py"], num_workers=1, num_ps=1, chief=False, ports=[1, 2, 3, 4],
                               num_evaluators=1)
    assert spec.jobs == ["chief", "evaluator", "ps", "worker"]
    assert [(t.name, t.runs_script, t.trains) for t in tasks] == [
        ("chief", True, True), ("worker 0", False, True), ("ps 0", False, True), ("evaluator 0", True, False)]
    assert tasks[-1].command == (sys.executable, "train.py") and tasks[1].command == tuple(server_command())
    script = tmp_path / "x.py"
    script.write_text("")
    with pytest.raises(InvalidArgumentError, match="at most one evaluator"):
        launch_local(script, num_evaluators=2)
    with pytest.raises(InvalidArgumentError, match="evaluator-timeout"):
        launch_local(script, num_evaluators=1, evaluator_timeout=0)

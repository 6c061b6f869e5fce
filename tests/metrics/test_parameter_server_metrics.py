"""sg.metrics under ParameterServerStrategy: real ps, worker and coordinator processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(__file__).with_name("ps_script.py")


def test_metrics_updated_on_ps_workers_are_global_and_a_step_run_twice_counts_once(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "1",
                           str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["all_equal"] and report["workers_used"] == [0, 1]
    assert report["executions"] > report["steps"], report   # the stopped worker's steps ran again...
    assert report["steps_counted"] == report["steps"]       # ...and counted once
    assert "metric 'outside' was created under DefaultStrategy()" in report["outside_error"]
    assert "strategy.scope()" in report["outside_error"]

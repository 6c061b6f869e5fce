"""benchmarks/ps_closure_cost.py runs (so that the script does not rot): one short round of no-op
closures on a real 2-worker, 1-ps cluster; only the printed lines' shape is checked, no timing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ps_closure_cost.py"


def test_ps_closure_cost_prints_cpu_per_closure_and_the_rate() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--closures", "20", "--rounds", "1"],
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for key in ("closures_per_s", "wall_ms", "coordinator_cpu_ms", "cluster_cpu_ms"):
        assert re.search(rf"^{key} +median +[0-9.]+ +\(rounds: [0-9.]+\)$", run.stdout, re.M), run.stdout

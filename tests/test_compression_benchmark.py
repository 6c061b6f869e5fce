"""benchmarks/compression.py runs (so that the script does not rot): PowerSGD, ours and DDP's hook,
two workers in network namespaces (root; skipped where they cannot be made), a few steps on a
shaped link and a short loss comparison. Only the tables' shape is checked, no timing; both sides
sum their first two steps exactly (``--powersgd-start``), so their first losses agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compression.py"
NUMBER = r"[0-9]+\.[0-9]+"


def test_quick_powersgd_run_prints_both_tables() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--compressions", "powersgd"],
                         capture_output=True, text=True, timeout=220)
    if run.returncode == 2 and "cannot run" in run.stderr:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert re.search(rf"^100mbit +powersgd +{NUMBER} +{NUMBER} +{NUMBER} *$", run.stdout, re.M), run.stdout
    row = re.search(rf"^powersgd +({NUMBER}) \(({NUMBER})\) +({NUMBER}) \(({NUMBER})\)$", run.stdout, re.M)
    assert row, run.stdout
    assert row.group(2) == row.group(4), run.stdout   # (the same first loss: the same data and weights)


def test_powersgd_start_below_ddps_least_is_refused() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--powersgd-start", "1"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "--powersgd-start must be >= 2" in run.stderr, run.stderr

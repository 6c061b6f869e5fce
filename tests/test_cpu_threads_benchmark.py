"""benchmarks/cpu_threads.py runs (so that the script does not rot): one round of one step of each
configuration on a small batch; only the table's shape is checked, no timing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_threads.py"


def test_cpu_threads_benchmark_prints_each_configuration_against_intra_op() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--batch", "8", "--steps", "1", "--rounds", "1"],
                         capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("intra-op (2 threads, whole batch)", "one thread, whole batch",
                 "2 replica threads x 1 thread, half batch each"):
        assert re.search(rf"^{re.escape(name)} +[0-9.]+ +[0-9.]+-[0-9.]+ +[0-9]+\.[0-9]{{2}}$", run.stdout, re.M), \
            run.stdout

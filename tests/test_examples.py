"""The example script runs as its docstring says, and every way of running it agrees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _run(*command: str) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_mirrored_and_multi_worker_runs_print_the_same_losses() -> None:
    mirrored = _run(sys.executable, str(EXAMPLE), "--strategy", "mirrored", "--epochs", "1")
    launched = _run(sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLE),
                    "--strategy", "multi_worker", "--epochs", "1")
    loss_line = [line for line in mirrored.splitlines() if line.startswith("epoch 1")][0]
    assert f"[worker 0] {loss_line}" in launched and f"[worker 1] {loss_line}" in launched

"""benchmarks/ddp.py runs (so that the script does not rot): one round of two steps of a tiny
GPT, eager, under DDP and its stratagem port (2 worker processes each) and under plain PyTorch
and Mirrored(2) (one process each). No timing is checked: only that the ratio lines are printed
and that the port trained as DDP did and Mirrored(2) as plain PyTorch (the check lines). The
compiled configurations are left out: compiling takes minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ddp.py"
NUMBER = r"[0-9]+\.[0-9]{3}"


def test_ddp_benchmark_prints_the_ratios_of_one_round() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--configs", "ddp:eager", "ours:eager", "plain:eager",
                          "mirrored:eager", "--rounds", "1", "--steps", "2", "--warmup", "1", "--layers", "1",
                          "--dim", "32", "--block", "16", "--accumulate", "2", "--max-wait", "0", "--patience", "0"],
                         capture_output=True, text=True, timeout=220)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert re.search(rf"^ours/DDP eager: {NUMBER}!? .*  target <=1\.05 (undecided|n/a) \(.*\)$", out, re.M), out
    assert re.search(rf"^Mirrored\(2\)/plain eager: {NUMBER}!? ", out, re.M), out
    assert "Check (ours vs ddp, eager): " in out and "Check (mirrored vs plain, eager): " in out, out
    assert "DIFFERENT TRAINING" not in out, out


def test_paired_ddp_benchmark_prints_the_ratio_and_the_same_training() -> None:
    """benchmarks/ddp_paired.py: DDP and the port in the same two worker processes, two pairs of one-step
    chunks; both models trained alike (their losses equal at the end)."""
    run = subprocess.run([sys.executable, str(SCRIPT.with_name("ddp_paired.py")), "--modes", "eager", "--pairs", "2",
                          "--chunk", "1", "--warmup", "1", "--layers", "1", "--dim", "32", "--block", "16",
                          "--accumulate", "2"], capture_output=True, text=True, timeout=220)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert re.search(rf"^ours/DDP eager: {NUMBER}  IQR .*  target (<=1\.05 undecided|n/a) ", out, re.M), out
    check = re.search(r"^Check \(eager\): after 3 steps each, .* max relative difference ([0-9.e+-]+) ", out, re.M)
    assert check and float(check.group(1)) <= 1e-6, out

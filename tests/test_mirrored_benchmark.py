"""benchmarks/mirrored.py runs (so that the script does not rot): the MLP under plain PyTorch and
Mirrored(2), in fresh processes (``--quick``) and paired in one process (``--paired``). No timing
is checked: only that the ratio lines are printed and that Mirrored(2) trained as plain PyTorch
did (the check lines)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mirrored.py"
NUMBER = r"[0-9]+\.[0-9]{3}"


def _run(*argv: str) -> str:
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout


def test_fresh_processes_print_the_ratio_and_the_same_training() -> None:
    out = _run("--quick", "--configs", "plain", "mirrored_hier")
    assert re.search(rf"^Mirrored\(2\) HierarchicalCopy\*.* 128 .* {NUMBER} ", out, re.M), out
    assert "same training" in out and "DIFFERENT TRAINING" not in out, out


def test_paired_in_one_process_prints_the_ratio_and_the_same_training() -> None:
    """Two pairs of two-step chunks at batch 128: plain and both Mirrored(2) ops in one process;
    after the same steps, the models' losses agree."""
    out = _run("--paired", "--quick", "--configs", "plain", "mirrored_hier", "mirrored_r1d", "tf_mirrored",
               "thread_floor", "sum_floor")
    assert "--paired leaves out tf_mirrored" in out, out
    assert re.search(r"^batch 128: 2 pairs of 2-step chunks \([0-9] undisturbed\)", out, re.M), out
    for name in (r"HierarchicalCopy\*", "ReductionToOneDevice"):
        assert re.search(rf"^  Mirrored\(2\) {name} / plain at batch 128: {NUMBER}  IQR .*  target "
                         rf"(<=1\.15 (undecided|ok|MISSED) .*|n/a \(no pair undisturbed\)); CPU time ratio {NUMBER}$",
                         out, re.M), out
    # the floor (two threads, no strategy) is timed beside them, without a target, and left out of the check
    assert re.search(rf"^  two threads, no strategy \(floor\) / plain at batch 128: {NUMBER}  IQR .*  target "
                     rf"(interval .*|n/a \(no pair undisturbed\)); CPU time ratio {NUMBER}$", out, re.M), out
    # the floor with the sum trains as plain PyTorch: timed without a target, and in the check
    assert re.search(rf"^  two threads and the sum, no strategy / plain at batch 128: {NUMBER}  IQR .*  target "
                     rf"(interval .*|n/a \(no pair undisturbed\)); CPU time ratio {NUMBER}$", out, re.M), out
    check = re.search(r"^  Check: after [0-9]+ steps each, loss on batch 0 vs plain, max relative difference "
                      r"([0-9.e+-]+): same training$", out, re.M)
    assert check and float(check.group(1)) < 1e-5, out


def test_paired_counts_are_checked() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--paired", "--chunk", "0"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--pairs and --chunk must be >= 1" in run.stderr, run.stderr


@pytest.mark.parametrize("floor", ["thread_floor", "sum_floor"])
def test_the_floors_run_only_paired(floor: str) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--configs", "plain", floor], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and f"{floor} runs only with --paired" in run.stderr, run.stderr

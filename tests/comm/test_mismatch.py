"""Workers that pass mismatched collectives: every worker refuses, naming both sides, in bounded time.

Two real worker processes over gloo on loopback run :mod:`mismatch_script`: worker 1 passes something
else than worker 0 (another dtype, 4 vs 5 elements, 4 x float32 vs 2 x float64 -- the same bytes --,
another structure, another collective, another metric). Each worker must raise a clear error naming
what both passed, within seconds, and stay in step with the other (the next all-reduce is right); the
last case is left uncaught, so each process exits with status 1: never gloo's SIGABRT, never a peer
blamed for "stopped answering". Once with ``sg.testing.run_local_cluster``, once with
``stratagem launch``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster

from . import mismatch_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240),
              pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(mismatch_script.__file__)
NEVER = ["terminate called", "stopped answering", "UnavailableError", "core dumped", "Aborted", "timed out"]


def check_reports(out: Path) -> None:
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert set(report) == set(mismatch_script.CASES), report.keys()
        for name, outcome in report.items():
            assert outcome["error"] in ("InvalidArgumentError", "CollectiveMismatchError"), (rank, name, outcome)
            for words in mismatch_script.CASES[name][1]:
                assert words in outcome["message"], (rank, name, words, outcome["message"])
            assert outcome["seconds"] < 30, (rank, name, outcome)   # the collective timeout is 120 s
            assert outcome["after"] and all(v == outcome["expected_after"] for v in outcome["after"]), \
                (rank, name, outcome)


@pytest.mark.parametrize("local,last", [(1, "dtype"), (2, "count")], ids=["2x1", "2x2-hierarchical"])
def test_every_worker_refuses_a_mismatch_naming_both_sides(tmp_path: Path, local: int, last: str) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--replicas-per-worker", str(local), "--last", last],
                                timeout=200)
    for r in results:
        assert r.returncode == 1, f"{r.task} exited with {r.returncode}:\n{r.output}"
        line = next((x for x in r.output.splitlines() if f"{r.task} refused the last case" in x), "")
        for words in mismatch_script.CASES[last][1]:
            assert words in line, r.output
        for never in NEVER:
            assert never not in r.output, r.output
    check_reports(tmp_path)


def test_every_worker_refuses_a_mismatch_under_stratagem_launch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "stratagem.launch", "--workers", "2", str(SCRIPT), str(tmp_path),
                           "--last", "same_bytes"], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "failed with exit code 1" in output, output   # a worker's own error, not a signal
    for worker in (0, 1):
        line = next((x for x in output.splitlines()
                     if x.startswith(f"[worker {worker}] worker {worker} refused the last case")), "")
        assert "InvalidArgumentError" in line and "worker 0 all-reduces float32[4]" in line \
            and "worker 1 float64[2]" in line, output
    for never in NEVER:
        assert never not in output, output
    check_reports(tmp_path)

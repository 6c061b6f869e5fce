"""Multi-worker failures end in clear errors within bounded time, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster

from . import train_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SCRIPT = Path(train_script.__file__)


def test_parameter_mismatch_fails_every_worker_naming_the_parameter(tmp_path: Path) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--wrong-shape-on-rank", "1", "--timeout", "30"],
                                timeout=90)
    for r in results:
        assert r.returncode != 0, r.output
        assert "different models" in r.output, r.output
        assert "Linear.weight" in r.output and "[4, 16]" in r.output and "[5, 16]" in r.output, r.output


def test_killed_worker_makes_the_others_raise_unavailable_in_bounded_time(tmp_path: Path) -> None:
    started = time.monotonic()
    results = run_local_cluster(SCRIPT, 3, args=[str(tmp_path), "--die-on-rank", "2", "--timeout", "20",
                                                 "--batches", "12", "--repeat", "200"], timeout=90)
    elapsed = time.monotonic() - started
    by_task = {r.task: r for r in results}
    assert by_task["worker 2"].returncode == 17
    for name in ("worker 0", "worker 1"):
        out = by_task[name].output
        assert by_task[name].returncode != 0, out
        assert "UnavailableError" in out, out
        assert "worker 2" in out, out
    assert elapsed < 60


def test_hung_worker_makes_the_others_raise_unavailable_after_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--timeout", "6",
                                                 "--batches", "12", "--repeat", "1000000"],
                                stop_after={"worker 1": "rank 1 reached step 1"}, timeout=90)
    elapsed = time.monotonic() - started
    survivor = {r.task: r for r in results}["worker 0"]
    assert survivor.returncode != 0, survivor.output
    assert "UnavailableError" in survivor.output and "worker 1" in survivor.output, survivor.output
    assert elapsed < 60

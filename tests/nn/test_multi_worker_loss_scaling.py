"""The loss-scaling trap across workers: refused on every worker before the gradients' all-reduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratagem.testing import assert_succeeded, run_local_cluster

from . import loss_scaling_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]
SCRIPT = Path(loss_scaling_script.__file__)


def test_workers_refuse_the_trap_and_go_on(tmp_path: Path) -> None:
    # MultiWorkerMirroredStrategy, one replica per worker (nothing summed locally): every worker
    # refuses (no hang), the next, scaled step is plain PyTorch's, a doubtful loss warns once
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path)], timeout=120)
    assert_succeeded(results)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["num_replicas"] == 2
        assert "per-replica mean loss" in report["trap"] and "2 replicas in sync are summed" in report["trap"]
        assert report["grad_error"] < 1e-12
        assert len(report["warnings"]) == 1 and "times 0.25" in report["warnings"][0]

"""Every collective across real worker processes (gloo), alone and with several replicas per worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratagem.testing import assert_succeeded, run_local_cluster

from . import collectives_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(collectives_script.__file__)


@pytest.mark.parametrize("workers,local", [(2, 1), (2, 2)], ids=["2x1", "2x2-hierarchical"])
def test_every_collective_results_gradients_and_errors(tmp_path: Path, workers: int, local: int) -> None:
    results = run_local_cluster(SCRIPT, workers, args=[str(tmp_path), "--replicas-per-worker", str(local)],
                                timeout=200)
    assert_succeeded(results)
    for rank in range(workers):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [], f"worker {rank}"

"""sg.metrics over real worker processes (MultiWorkerMirroredStrategy, gloo over loopback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratagem.testing import run_local_cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
SCRIPT = Path(__file__).with_name("multi_worker_script.py")


def test_every_metric_over_two_workers_of_two_replicas_equals_the_metric_on_all_rows():
    results = run_local_cluster(SCRIPT, 2, timeout=150)
    for r in results:
        assert r.returncode == 0 and "metrics ok" in r.output, f"{r.task} failed:\n{r.output}"

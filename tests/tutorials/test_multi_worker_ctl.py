"""TensorFlow's "Custom training loop with Keras and MultiWorkerMirroredStrategy", ported by
renaming (multi_worker_ctl.py), as 2 real worker processes: the job learns, checkpoints through
the tutorial's write_filepath pattern, and a restarted job resumes at the saved epoch and ends
with the weights of a job never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stratagem.testing import run_local_cluster
from tests.tutorials.ports import listing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(__file__).parent / "multi_worker_ctl.py"


def run(tmp_path: Path, *args: str) -> list[dict]:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), *args], timeout=360)
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
    return [torch.load(tmp_path / f"report{i}.pt", weights_only=False) for i in range(2)]


def test_multi_worker_custom_loop_tutorial_resumes_like_an_uninterrupted_job(tmp_path: Path) -> None:
    first = run(tmp_path, "2")                      # two epochs, a checkpoint after each
    assert listing(tmp_path / "ckpt") == ["ckpt-2"]              # the chief's; max_to_keep=1
    assert listing(tmp_path / "workertemp_1") == []              # the worker's, deleted by the script
    assert [report["resumed_at"] for report in first] == [0, 0]
    resumed = run(tmp_path, "3", "uninterrupted")   # the job restarted: resumes at epoch 2, trains the third
    for report in resumed:
        assert report["resumed_at"] == 2 and report["epoch"] == 3 and len(report["epochs"]) == 1
        for name, value in report["uninterrupted"].items():
            torch.testing.assert_close(report["state"][name], value, rtol=0, atol=0)
    torch.testing.assert_close(resumed[0]["state"], resumed[1]["state"], rtol=0, atol=0)
    accuracies = [epoch["accuracy"] for epoch in first[0]["epochs"] + resumed[0]["epochs"]]
    assert accuracies[-1] > 0.8 and accuracies[-1] > accuracies[0], accuracies
    assert first[0]["epochs"] == first[1]["epochs"]              # the metrics are global: every worker reads them

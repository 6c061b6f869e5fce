"""Callbacks and the sidecar evaluator with real processes: one ``stratagem launch`` of 2 workers
and an evaluator checks the early stop is global, files and summaries come from the chief
only, and the evaluator evaluates every checkpoint exactly once, then exits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from . import workers_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(workers_script.__file__)


def test_two_workers_and_an_evaluator(tmp_path: Path) -> None:
    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--evaluator", "1",
                                "--evaluator-timeout", "60", str(SCRIPT), str(tmp_path)],
                               capture_output=True, text=True, timeout=200)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    # EarlyStopping: the chief's val_loss (improving until epoch 2) decides for both workers;
    # worker 1's own values would have stopped it at epoch 1.
    for report in ranks:
        assert report["epochs"] == [0, 1, 2, 3] and report["stopped_epoch"] == 3 and report["best_epoch"] == 2
        assert report["lr"] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
        assert report["final_weights"] == pytest.approx(report["weights"][2])   # restore_best_weights
    assert ranks[0]["weights"] == ranks[1]["weights"]

    # ModelCheckpoint best-only by the chief's value; CSVLogger and TensorBoard on the chief alone.
    names = {path.name for path in tmp_path.iterdir()}
    assert {"best-1", "best-2", "best-3", "log-rank0.csv", "tb-rank0"} <= names
    assert not names & {"best-4", "log-rank1.csv", "tb-rank1"}
    rows = (tmp_path / "log-rank0.csv").read_text().splitlines()
    assert rows[0] == "epoch,loss,lr,val_loss" and len(rows) == 5

    # The same callbacks with sg.Model.fit: stopped together, the chief's files only.
    fits = [report["fit"] for report in ranks]
    assert fits[0] == fits[1] and fits[0]["epochs"] == [0, 1] and fits[0]["lr"] == [0.05, 0.05]
    assert sorted(p.name for p in tmp_path.glob("fit-*")) == sorted(
        ["fit-rank0.csv", "fit-tb-rank0", *(f"fit-{e + 1}-{loss:.4f}" for e, loss in enumerate(fits[0]["val_loss"]))])
    # ... and the chief writes every worker's step clock: per epoch, each worker's median step, its
    # gradient exchange and the bytes it moved (nn.Linear(4, 1): 16 + 4 bytes of gradients a step, and
    # the pack's flag per parameter, 2 x 4 bytes: comm/gradients.py)
    from .test_callbacks import read_scalars
    train = read_scalars(tmp_path / "fit-tb-rank0" / "train")
    for worker in (0, 1):
        assert [len(train[f"epoch_{name}/worker_{worker}"]) for name in ("step_seconds", "exchange_seconds")] == [2, 2]
        assert [value for _, value in train[f"epoch_exchange_bytes/worker_{worker}"]] == [28, 28], train

    # The sidecar evaluator: each checkpoint once, the weights training saved, then it exited.
    saved = dict(re.findall(r"rank 0 saved ckpt-(\d+) weight_sum=(\S+)", completed.stdout))
    assert sorted(saved) == ["1", "2", "3", "4"]
    evaluated = re.findall(r"\[evaluator 0\] SidecarEvaluator: evaluated ckpt-(\d+):", completed.stdout)
    assert evaluated == ["1", "2", "3", "4"], output
    results = json.loads((tmp_path / "evaluator.json").read_text())
    for number, weights in saved.items():
        assert results[number]["weight_sum"] == pytest.approx(float(weights), abs=1e-5)
    assert "training finished (last checkpoint ckpt-4); 4 evaluated" in completed.stdout
    assert any((tmp_path / "eval").iterdir())

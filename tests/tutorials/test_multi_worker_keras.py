"""TensorFlow's "Multi-worker training with Keras", ported by renaming (multi_worker_keras.py), as 2
workers under ``stratagem launch``: fit trains, the write_filepath pattern saves the model and a
checkpoint of it from every worker (the chief's kept, the others' deleted), the checkpoint of the
Keras model holds its module and optimizer and restores under another strategy, and a job whose
worker dies mid-epoch is restarted and resumes from BackupAndRestore to the weights of a job never
stopped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stratagem as sg
from tests.tutorials.ports import launch, listing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]


@pytest.fixture(scope="module")
def main_phase(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("multi_worker_keras")
    launch("multi_worker_keras.py", out, "main", workers=2, timeout=260)
    return out, [torch.load(out / f"main{i}.pt", weights_only=False) for i in range(2)]


def test_fit_and_checkpoints_with_the_write_filepath_pattern(main_phase: tuple[Path, list[dict]]) -> None:
    out, reports = main_phase
    losses = reports[0]["history"]["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert reports[0]["history"] == reports[1]["history"]          # global metrics, every worker
    assert listing(out / "ckpt") == ["ckpt-1"] and listing(out / "workertemp_1") == []
    assert reports[0]["checkpoint"] == reports[1]["checkpoint"] == str(out / "ckpt" / "ckpt-1")
    assert len(reports[0]["after_restore"]["loss"]) == 2
    # the checkpoint of the Keras model: module and optimizer, restored here under another strategy
    saved = reports[0]["saved"]
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        keras_model = sg.Model(torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 28)), torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * 26 * 26, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
        keras_model.compile(torch.optim.SGD(keras_model.module.parameters(), lr=0.5), "mse")
    sg.Checkpoint(model=keras_model).restore(out / "ckpt" / "ckpt-1")
    for name, value in saved["state"].items():
        torch.testing.assert_close(keras_model.module.state_dict()[name], value, rtol=0, atol=0)
    assert keras_model.optimizer.state_dict() == saved["optimizer"]   # its hyperparameters (lr 0.01, not 0.5)


def test_model_save_with_the_write_filepath_pattern(main_phase: tuple[Path, list[dict]]) -> None:
    out, reports = main_phase
    assert os.path.isfile(out / "keras-model") and not os.path.exists(out / "workertemp_1" / "keras-model")
    for report in reports:
        assert report["loaded_equal"]
        assert len(report["loaded_history"]["loss"]) == 2


def test_backup_and_restore_resumes_a_restarted_job_like_one_never_stopped(tmp_path: Path) -> None:
    output = launch("multi_worker_keras.py", tmp_path, "backup", workers=2, max_restarts=1, timeout=260)
    assert "worker 1: dying in epoch 2" in output
    reports = [torch.load(tmp_path / f"backup{i}.pt", weights_only=False) for i in range(2)]
    for report in reports:
        assert report["restart"] == "1"                 # the job's second attempt finished it
        assert len(report["history"]["loss"]) == 2      # it resumed in the second epoch
        for name, value in report["uninterrupted"].items():
            torch.testing.assert_close(report["state"][name], value, rtol=0, atol=0)
    assert listing(tmp_path / "backup") == []           # a finished fit deletes its backup

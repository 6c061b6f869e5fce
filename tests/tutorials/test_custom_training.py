"""TensorFlow's "Custom training with tf.distribute.Strategy", ported by renaming
(custom_training.py): the loop learns, the restored checkpoint is the trained model, the
other ways of iterating the distributed dataset train on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tutorials.ports import run_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]


def test_custom_training_tutorial(tmp_path: Path) -> None:
    report = run_port("custom_training.py", tmp_path)
    epochs = report["epochs"]
    assert epochs[-1]["loss"] < epochs[0]["loss"] and epochs[-1]["test_loss"] < epochs[0]["test_loss"]
    assert epochs[-1]["test_accuracy"] > 0.8, epochs
    # epochs 1 and 3 saved ckpt; the one restored without a strategy is the model as trained
    assert sorted(p.name for p in (tmp_path / "training_checkpoints").iterdir()) == ["ckpt"]
    assert report["restored_equal"]
    assert report["restored_optimizer_steps"] == report["optimizer_steps"] == 3 * 12
    assert abs(report["restored_accuracy"] - epochs[-1]["test_accuracy"]) <= 1 / 256
    # training goes on through an iterator and through a function that runs a whole epoch
    assert report["iterator_loss"] < epochs[-1]["loss"]
    assert report["epoch_function"]["accuracy"] > 0.9
    assert "Accuracy after restoring the saved model without strategy: " in report["output"]

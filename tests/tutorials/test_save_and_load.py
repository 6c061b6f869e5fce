"""TensorFlow's "Save and load a model using a distribution strategy", ported by renaming
(save_and_load.py): a model saved under MirroredStrategy loads without a strategy, under
OneDeviceStrategy, in plain PyTorch and under another MirroredStrategy, predicts what it
predicted, and trains on from where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tutorials.ports import run_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]


def test_save_and_load_tutorial(tmp_path: Path) -> None:
    report = run_port("save_and_load.py", tmp_path)
    expected = report["expected"]
    assert expected.shape == (256, 10)
    for name in ("restored_predict", "one_device_predict", "io_device_predict"):   # 1, 1 and 2 replicas
        torch.testing.assert_close(report[name], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(report["plain_predict"], report["expected_first"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(report["distributed_predict"]), report["expected_first"],
                               rtol=1e-5, atol=1e-5)
    # every loaded model trains on from the trained weights (and, loaded whole, the optimizer's state)
    first = report["fit"]["loss"]
    for name in ("restored_fit", "one_device_fit", "hub_fit"):
        history = report[name]
        assert history["loss"][0] < first[-1] and history["sparse_categorical_accuracy"][-1] > 0.9, (name, history)
    assert report["subclassed_equal"]

"""TensorFlow's multi-worker custom-loop tutorial's checkpointing, ported by renaming, in 2 real
processes: a Checkpoint made outside the scope over a scoped module, non-chief temporary
directories, resuming from ``sg.latest_checkpoint`` after a restart, ``sg.Checkpoint(model=sg.Model)``.
The oracle: the same training in this process, uninterrupted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.testing import run_local_cluster

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).parent / "tutorial_ckpt_script.py"


def plain(epochs: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    for _ in range(epochs):
        for start in range(0, 64, 16):
            optimizer.zero_grad()
            ((model(x[start:start + 16]) - y[start:start + 16]) ** 2).mean().backward()
            optimizer.step()
    return model.state_dict()


def run(tmp_path: Path, epochs: int) -> list[dict]:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), str(epochs)], timeout=240)
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
    return [torch.load(tmp_path / f"worker{i}.pt", weights_only=False) for i in range(2)]


def test_the_custom_loop_tutorial_checkpoints_and_resumes_by_renaming(tmp_path: Path) -> None:
    first = run(tmp_path, 2)             # two epochs, a checkpoint after each
    assert os.listdir(tmp_path / "ckpt") == ["ckpt-2"]          # the chief's; max_to_keep=1
    assert os.listdir(tmp_path / "workertemp_1") == []           # the worker's, deleted by the script
    resumed = run(tmp_path, 3)           # the job restarted: resumes at epoch 2, trains the third
    expected = plain(3)
    for report in resumed:
        assert report["epoch"] == 3
        for name, value in expected.items():
            torch.testing.assert_close(report["state"][name], value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first[0]["state"], first[1]["state"], rtol=0, atol=0)

    # the sg.Model checkpoint: module and optimizer state, restored here under another strategy
    report = resumed[0]
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        keras_model = sg.Model(torch.nn.Linear(4, 1).double())
        keras_model.compile(torch.optim.Adam(keras_model.module.parameters(), lr=0.01), "mse")
    sg.Checkpoint(model=keras_model).restore(report["keras_path"])
    for name, value in report["keras_state"].items():
        torch.testing.assert_close(keras_model.module.state_dict()[name], value, rtol=0, atol=0)
    restored = keras_model.optimizer.state_dict()["state"]
    for index, entry in report["keras_optimizer"]["state"].items():
        torch.testing.assert_close(restored[index]["exp_avg"], entry["exp_avg"], rtol=0, atol=0)

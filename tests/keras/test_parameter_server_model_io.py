"""sg.Model's save / load_model under ParameterServerStrategy: a coordinator, 2 workers and 2 ps as real
processes. The coordinator saves one logical copy (pulled from the shards), rebuilds it on the parameter
servers with load_model in the scope, and trains on; the file loads here under the default strategy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(__file__).parent / "ps_model_io_script.py"


def test_save_and_load_model_under_parameter_servers(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "2",
                           str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = torch.load(tmp_path / "report.pt", weights_only=False)
    assert report["optimizer_class"] == report["loaded_class"] == "ParameterServerAdam"
    assert report["lr"] == 0.001 and report["loaded_lr"] == 0.01
    for name, value in report["saved"].items():   # rebuilt on the ps: the same values and optimizer state
        assert torch.equal(report["loaded"][name], value), name
    saved, loaded = report["saved_optimizer"], report["loaded_optimizer"]
    assert saved["param_groups"] == loaded["param_groups"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    assert report["loaded_changed"] and len(report["loaded_trained"]) == 1   # and it trains there

    assert b"stratagem" not in torch.load(tmp_path / "model.pt", weights_only=True)["architecture"]   # no ps hooks
    model = sg.models.load_model(tmp_path / "model.pt")   # here: the default strategy
    for name, value in model.module.state_dict().items():
        assert torch.equal(value, report["saved"][name]), name
    assert model.optimizer.learning_rate == 0.01
    assert torch.equal(model.optimizer.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])

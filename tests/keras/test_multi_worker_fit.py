"""sg.Model under MultiWorkerMirroredStrategy: 2 real worker processes over loopback (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.testing import assert_succeeded, run_local_cluster

from .common import data, fit, state

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).parent / "mw_fit_script.py"


def test_two_workers_fit_evaluate_predict_like_one_device(tmp_path: Path) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--replicas", "2"], timeout=200)
    assert_succeeded(results)
    reference, history = fit(sg.get_strategy())
    expected = state(reference)
    x, y, w = data()
    expected_logs = reference.evaluate(x, y, batch_size=7, sample_weight=w, verbose=0, return_dict=True)
    with torch.no_grad():
        expected_predict = reference.module(torch.from_numpy(x))
    for index in range(2):
        got = torch.load(tmp_path / f"worker{index}.pt", weights_only=False)
        for name, value in expected.items():     # 4 replicas over 2 workers, shuffled, uneven last batch
            torch.testing.assert_close(got["state"][name], value, rtol=2e-5, atol=2e-6)
        for name, values in history.history.items():
            assert got["history"][name] == pytest.approx(values, rel=1e-5), name
        assert got["evaluate"] == pytest.approx(expected_logs, rel=1e-5)
        torch.testing.assert_close(got["predict"], expected_predict, rtol=1e-5, atol=1e-6)   # input order
        assert got["stopped_epochs"] == [0, 1]   # stop_training honoured at the same epoch everywhere
    chief, other = results[0].output, results[1].output
    epoch_lines = [line for line in chief.splitlines() if line.startswith("Epoch ")]
    assert len(epoch_lines) == 2 and epoch_lines[0].startswith("Epoch 1/5 11/11 steps (100%) loss: ")
    assert "Epoch " not in other and "\r" not in chief   # the chief alone prints, plain lines

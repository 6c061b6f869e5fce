"""sg.Model's save / load_model across processes: 2 MultiWorkerMirroredStrategy workers (gloo on loopback)
save one logical copy that loads under MirroredStrategy here, bit for bit; TensorFlow's non-chief
temporary-directory pattern works; resuming, save_weights / load_weights and learning_rate on every worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.testing import assert_succeeded, run_local_cluster

from . import model_io_script as script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
SCRIPT = Path(script.__file__)


def assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("sharding", [None, "optimizer"])
def test_two_workers_save_one_copy_that_loads_under_mirrored(tmp_path: Path, sharding: str | None) -> None:
    args = [str(tmp_path)] + (["--sharding", sharding] if sharding else [])
    results = run_local_cluster(SCRIPT, 2, args=args, timeout=240)
    assert_succeeded(results)
    reports = [torch.load(tmp_path / f"worker{i}.pt", weights_only=False) for i in range(2)]
    assert reports[0]["module_file"] == sg.__file__   # the workers ran this checkout
    chief = reports[0]
    for report in reports:
        assert report["lr_before"] == 0.001 and report["optimizer_class"] == "MirroredAdam"
        assert report["restored_lr"] == 0.0005 and report["restored_class"] == "MirroredAdam"
        assert_equal(report["saved"], chief["saved"])
        assert_equal(report["tutorial_loaded"], chief["saved"])
        assert report["tutorial_default"]
        assert "exists and overwrite=False" in report["overwrite_error"]
        assert_equal(report["resumed"], report["uninterrupted"])   # optimizer state restored on every worker
        assert_equal(report["weights_loaded"], report["uninterrupted"])
        assert_equal(report["copied"], chief["uninterrupted"])   # saved after the resumed epoch
    assert reports[1]["copy_warnings"] and not chief["copy_warnings"]   # the stale file was not read
    # the non-chief's temporary directory is gone; no temporary file is left
    assert sorted(os.listdir(tmp_path)) == ["keras-model.pt", "model.pt", "private0", "private1", "weights.pt",
                                            "worker0.pt", "worker1.pt"]
    assert os.listdir(tmp_path / "private0") == ["model.pt"]

    content = torch.load(tmp_path / "model.pt", weights_only=True)
    assert content["info"]["strategy"] == "MultiWorkerMirroredStrategy"
    assert content["info"]["num_replicas_in_sync"] == 2
    plain = script.make_module()
    plain.load_state_dict(content["state_dict"])
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        loaded = sg.models.load_model(tmp_path / "model.pt")
    assert_equal({k: v.detach() for k, v in loaded.module.state_dict().items()}, chief["saved"])
    assert loaded.optimizer.learning_rate == 0.0005
    x = torch.from_numpy(script.arrays()[0])
    with torch.no_grad():   # each replica computes its half of the batch
        expected = torch.cat([plain(x[:50]), plain(x[50:])])
    assert torch.equal(loaded.predict(x, batch_size=100), expected)   # float64, bit for bit, on both replicas
    torch.testing.assert_close(chief["predict_after_load_weights"], _forward(chief["uninterrupted"], x),
                               rtol=1e-12, atol=1e-12)


def test_a_worker_that_does_not_save_fails_the_save_in_bounded_time(tmp_path: Path) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--absent", "--timeout", "10"], timeout=200)
    assert_succeeded(results)
    seen = json.loads((tmp_path / "absent.json").read_text())
    assert seen["error"] is not None and "model.save" in seen["error"], seen
    assert seen["seconds"] < 90, seen   # the 10 s timeout, not gloo's 30 minutes
    assert not (tmp_path / "absent.pt").exists() and not list(tmp_path.glob(".absent.pt.tmp-*"))


def _forward(state: dict, x: torch.Tensor) -> torch.Tensor:
    module = script.make_module()
    module.load_state_dict(state)
    with torch.no_grad():
        return module(x)

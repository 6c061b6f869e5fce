"""The callbacks with ``sg.Model.fit`` under ParameterServerStrategy (a coordinator, a worker and a
ps as real processes): the learning rate reaches the servers, the coordinator writes the files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(__file__).parent / "ps_script.py"


def test_callbacks_under_parameter_server_fit(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "1", "--ps", "1",
                           str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["epochs"] == [0, 1] and report["lr"] == [0.1, 0.0]
    assert report["weights"][0] != report["initial"]        # epoch 0 trained at lr 0.1
    assert report["weights"][1] == report["weights"][0]     # lr 0 reached the parameter server
    assert {"ckpt-1", "ckpt-2", "log.csv", "tb"} <= {p.name for p in tmp_path.iterdir()}
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 3


def test_tensorboard_writes_each_workers_ps_traffic(tmp_path: Path) -> None:
    """Per worker and epoch, the bytes it pulled and pushed per step are what the variables weigh:
    each step pushes every gradient once and pulls every value once (through its push's reply),
    but for a worker's first step, which pulls before its push brings the values."""
    from .test_callbacks import read_scalars
    script = SCRIPT.with_name("ps_traffic_script.py")
    proc = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    weight = json.loads((tmp_path / "report.json").read_text())["variable_bytes"]
    assert weight == (8 * 4 + 4) * 4
    scalars = read_scalars(tmp_path / "tb" / "train")
    workers = {tag.rsplit("_", 1)[1] for tag in scalars if tag.startswith("epoch_ps_")}
    assert workers == {"0", "1"}, sorted(scalars)   # (each ran steps in some epoch)
    for worker in workers:
        pushed = scalars[f"epoch_ps_push_bytes/worker_{worker}"]
        pulled = scalars[f"epoch_ps_pull_bytes/worker_{worker}"]
        assert [epoch for epoch, _ in pushed] == [epoch for epoch, _ in pulled]
        assert all(value == weight for _, value in pushed), pushed
        assert weight < pulled[0][1] <= 2 * weight and all(value == weight for _, value in pulled[1:]), pulled
        assert all(value > 0 for _, value in scalars[f"epoch_ps_call_seconds/worker_{worker}"])

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

"""The same script under `stratagem launch` (TF_CONFIG) and under torchrun gives the same parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.testing import free_ports

from ..strategies import train_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
SCRIPT = Path(train_script.__file__)


def test_torchrun_and_tf_config_agree(tmp_path: Path) -> None:
    by_tf_config, by_torchrun = tmp_path / "tf_config", tmp_path / "torchrun"
    by_tf_config.mkdir()
    by_torchrun.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    launched = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(SCRIPT),
                               str(by_tf_config), "--optimizer", "adam"],
                              env=env, capture_output=True, text=True, timeout=150)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "[worker 1] rank 1 done" in launched.stdout
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)[0]),
         str(SCRIPT), str(by_torchrun), "--optimizer", "adam"],
        env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        a = json.loads((by_tf_config / f"rank{rank}.json").read_text())
        b = json.loads((by_torchrun / f"rank{rank}.json").read_text())
        assert a["history"][-1]["params"] == b["history"][-1]["params"]

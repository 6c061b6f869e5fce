"""Multi-worker checkpoints with real processes: a 2-worker job saves (only the chief writes), a
3-worker job restores it and trains on, equal to plain PyTorch, input position included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from . import workers_script

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(workers_script.__file__)


def launch(num_workers: int, *args: str) -> None:
    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", str(num_workers),
                                str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def reference() -> tuple[list[list[int]], dict]:
    """Plain PyTorch, one process: the global batches' sample ids and the final parameters."""
    torch.manual_seed(0)
    model = workers_script.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(42)
    loader = DataLoader(workers_script.dataset(), batch_size=8, shuffle=True)
    seen = []
    for _ in range(workers_script.EPOCHS):
        for x, y, ids in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            seen.append(ids.tolist())
    return seen, model.state_dict()


def test_two_workers_save_three_workers_restore(tmp_path: Path) -> None:
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpts"
    out.mkdir()
    launch(2, str(out), str(ckpt_dir), "--mode", "save", "--steps", "7")
    saved = [json.loads((out / f"save-rank{r}.json").read_text()) for r in range(2)]
    assert [len(s["writes"]) for s in saved] == [1, 0]            # only the chief wrote
    assert all(s["complete_on_return"] for s in saved)            # complete when save returned, everywhere
    assert saved[0]["saved"] == saved[1]["saved"] == str(ckpt_dir / "ckpt-1")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["ckpt-1"]
    assert sorted(p.name for p in (ckpt_dir / "ckpt-1").iterdir()) == [
        "data.pt", "manifest.json", "model.pt", "optimizer.pt"]

    launch(3, str(out), str(ckpt_dir), "--mode", "restore")
    resumed = [json.loads((out / f"restore-rank{r}.json").read_text()) for r in range(3)]
    assert all(r["restored"] == str(ckpt_dir / "ckpt-1") and r["steps"] == 10 for r in resumed)
    assert all(not r["writes"] for r in resumed)

    expected_ids, expected_params = reference()
    ids = [saved[0]["ids"][i] + saved[1]["ids"][i] for i in range(7)]
    ids += [resumed[0]["ids"][i] + resumed[1]["ids"][i] + resumed[2]["ids"][i] for i in range(3)]
    assert ids == expected_ids                                   # nothing skipped, nothing repeated
    for r in resumed:
        for name, value in expected_params.items():
            torch.testing.assert_close(torch.tensor(r["final"][name]), value, rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"worker {r['rank']}, {name}: {m}")

"""Multi-worker checkpoints with real processes: a 2-worker job saves (only the chief writes), a
3-worker job restores it and trains on, equal to plain PyTorch, input position included -- from a
shared directory, and from disks of their own where only the chief's holds the checkpoint.
Checkpoints swapped on disk are refused on every worker, naming both."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from . import workers_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(workers_script.__file__)


def launch(num_workers: int, *args: str) -> str:
    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", str(num_workers),
                                str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout + completed.stderr


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


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """A 2-worker job that trained 7 steps and saved: its output folder, checkpoint folder and reports."""
    root = tmp_path_factory.mktemp("saved")
    out, ckpt_dir = root / "out", root / "ckpts"
    out.mkdir()
    launch(2, str(out), str(ckpt_dir), "--mode", "save", "--steps", "7")
    return out, ckpt_dir, [json.loads((out / f"save-rank{r}.json").read_text()) for r in range(2)]


def assert_resumed_as_uninterrupted(saved: list[dict], resumed: list[dict]) -> None:
    expected_ids, expected_params = reference()
    ids = [saved[0]["ids"][i] + saved[1]["ids"][i] for i in range(7)]
    ids += [resumed[0]["ids"][i] + resumed[1]["ids"][i] + resumed[2]["ids"][i] for i in range(3)]
    assert ids == expected_ids                                   # nothing skipped, nothing repeated
    for r in resumed:
        assert r["steps"] == 10 and not r["writes"]
        for name, value in expected_params.items():
            torch.testing.assert_close(torch.tensor(r["final"][name]), value, rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"worker {r['rank']}, {name}: {m}")


def test_two_workers_save_three_workers_restore(saved: tuple[Path, Path, list[dict]]) -> None:
    out, ckpt_dir, reports = saved
    assert [len(s["writes"]) for s in reports] == [1, 0]            # only the chief wrote
    assert all(s["complete_on_return"] for s in reports)            # complete when save returned, everywhere
    assert reports[0]["saved"] == reports[1]["saved"] == str(ckpt_dir / "ckpt-1")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["ckpt-1"]
    assert sorted(p.name for p in (ckpt_dir / "ckpt-1").iterdir()) == [
        "data.pt", "manifest.json", "model.pt", "optimizer.pt"]

    output = launch(3, str(out), str(ckpt_dir), "--mode", "restore")
    resumed = [json.loads((out / f"restore-rank{r}.json").read_text()) for r in range(3)]
    assert all(r["restored"] == str(ckpt_dir / "ckpt-1") for r in resumed)
    assert "not shared" not in output
    assert_resumed_as_uninterrupted(reports, resumed)


def test_workers_without_the_chiefs_checkpoint_restore_the_copy_it_sends(
        saved: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    # three hosts with their own disks, the same path "ckpts" on each: the chief's disk has the
    # checkpoint, worker 1's nothing, worker 2's a valid older checkpoint of the same name
    _, ckpt_dir, reports = saved
    out, disks = tmp_path / "out", tmp_path / "disks"
    out.mkdir()
    shutil.copytree(ckpt_dir, disks / "worker0" / "ckpts")
    (disks / "worker1").mkdir()
    stale = disks / "worker2" / "ckpts" / "ckpt-1"
    shutil.copytree(ckpt_dir / "ckpt-1", stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    manifest["objects"]["steps"]["value"] = 3   # restored by itself, it would resume at step 3
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (stale / "manifest.json").write_text(json.dumps(manifest))

    output = launch(3, str(out), str(disks), "--mode", "restore", "--own-disk")
    resumed = [json.loads((out / f"restore-rank{r}.json").read_text()) for r in range(3)]
    assert all(r["restored"] == str(Path("ckpts", "ckpt-1")) for r in resumed)
    assert "[worker 1] " in output and "worker 1 sees nothing at ckpts/ckpt-1" in output, output
    assert "worker 2 sees another checkpoint (a different manifest) at ckpts/ckpt-1" in output, output
    assert "the checkpoint directory is not shared" in output and "worker 0 sees" not in output
    assert not (disks / "worker1" / "ckpts").exists()            # the others never write
    assert_resumed_as_uninterrupted(reports, resumed)


def test_backups_are_deleted_only_once_every_worker_finished_training(tmp_path: Path) -> None:
    script = Path(__file__).with_name("backup_end_script.py")
    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(script),
                                str(tmp_path)], capture_output=True, text=True, timeout=180)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "BACKUPS 2" in output, output          # still there while worker 1 had not finished
    assert output.count("DONE") == 2, output
    assert not [p for p in (tmp_path / "backups").iterdir() if p.name.startswith("backup-")]


def test_checkpoints_swapped_on_disk_are_refused_on_every_worker(tmp_path: Path) -> None:
    # 2 workers save ckpt-a (step 3) and ckpt-b (step 5); the chief copies the folder whole, then
    # swaps them on disk; every worker's restore of ckpt-a is refused, naming both, and changes nothing
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpts"
    out.mkdir()
    launch(2, str(out), str(ckpt_dir), "--mode", "swap")
    reports = [json.loads((out / f"swap-rank{r}.json").read_text()) for r in range(2)]
    job = json.loads((ckpt_dir / "ckpt-b" / "manifest.json").read_text())["identity"]["job"]
    for report in reports:
        assert report["refused"] is not None, f"worker {report['rank']} restored the swapped ckpt-a"
        for worker in (0, 1):
            assert (f"worker {worker}: checkpoint {ckpt_dir / 'ckpt-a'}: manifest.json: asked for 'ckpt-a', found "
                    f"the checkpoint saved as 'ckpt-b' (save 2 of job {job}, at ") in report["refused"], report
        assert report["unchanged"], report
        assert report["moved"] == {"steps": 3, "params": reports[0]["step3"]}      # the copy elsewhere restores
        assert report["saved_as"] == {"steps": 5, "params": reports[0]["step5"]}   # renamed, said on purpose

"""A checkpoint is what its name says: checkpoints swapped on disk are refused naming both, a
whole checkpoint folder moved elsewhere restores, a copy renamed on purpose restores when the
caller says which one it is, and a resumed job goes on counting its saves in the same job."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import storage

from .common import build

pytestmark = pytest.mark.timeout(120)


def identity(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["identity"]


@pytest.fixture()
def two(tmp_path: Path) -> tuple[Path, dict]:
    """``runs/ckpt-a`` (step 3, every weight 3) and ``runs/ckpt-b`` (step 5), saved by one Checkpoint."""
    model, optimizer, _ = build(None)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
    for name, step in (("ckpt-a", 3), ("ckpt-b", 5)):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(step))
        ckpt.step = step
        ckpt.save(tmp_path / "runs" / name)
    return tmp_path / "runs", identity(tmp_path / "runs" / "ckpt-a")


def fresh() -> sg.Checkpoint:
    model, optimizer, _ = build(None, seed=7)
    return sg.Checkpoint(model=model, optimizer=optimizer, step=0)


def weight(ckpt: sg.Checkpoint) -> list[float]:
    return ckpt.model.fc1.weight.unique().tolist()


def test_checkpoints_swapped_on_disk_are_refused_naming_both(two: tuple[Path, dict]) -> None:
    runs, first = two
    assert first["name"] == "ckpt-a" and first["save_counter"] == 1 and len(first["job"]) == 16
    assert identity(runs / "ckpt-b") | {"id": None} == first | {"name": "ckpt-b", "save_counter": 2, "id": None}
    os.rename(runs / "ckpt-a", runs / "swap")
    os.rename(runs / "ckpt-b", runs / "ckpt-a")
    os.rename(runs / "swap", runs / "ckpt-b")

    ckpt = fresh()
    before = {k: v.clone() for k, v in ckpt.model.state_dict().items()}
    with pytest.raises(sg.errors.CheckpointError) as caught:
        ckpt.restore(runs / "ckpt-a")
    message = str(caught.value)
    assert message.startswith(f"checkpoint {runs / 'ckpt-a'}: manifest.json: asked for 'ckpt-a', found the "
                              f"checkpoint saved as 'ckpt-b' (save 2 of job {first['job']}, at "), message
    assert "nothing was restored" in message and "restore(path, saved_as='ckpt-b')" in message
    assert ckpt.step == 0 and not ckpt.optimizer.state_dict()["state"]
    assert all(torch.equal(v, before[k]) for k, v in ckpt.model.state_dict().items())
    with pytest.raises(sg.errors.CheckpointError, match=r"asked for 'ckpt-b', found the checkpoint saved as 'ckpt-a'"):
        ckpt.restore(runs / "ckpt-b")

    # said on purpose: the checkpoint it really is restores; another name is refused, naming both
    with pytest.raises(sg.errors.CheckpointError, match=r"asked for the checkpoint saved as 'ckpt-a', found the "
                                                         r"checkpoint saved as 'ckpt-b' \(save 2"):
        ckpt.restore(runs / "ckpt-a", saved_as="ckpt-a")
    assert ckpt.step == 0
    ckpt.restore(runs / "ckpt-a", saved_as="ckpt-b")
    assert ckpt.step == 5 and weight(ckpt) == [5.0]


def test_a_checkpoint_moved_elsewhere_restores_and_its_job_goes_on(two: tuple[Path, dict], tmp_path: Path) -> None:
    runs, first = two
    moved = tmp_path / "other_disk" / "runs"
    shutil.copytree(runs, moved)   # the whole folder, names kept
    shutil.rmtree(runs)
    ckpt = fresh()
    assert identity(moved / "ckpt-a")["job"] != ckpt._job[0]
    ckpt.restore(moved / "ckpt-a")
    assert ckpt.step == 3 and weight(ckpt) == [3.0]
    (tmp_path / "latest").symlink_to(moved / "ckpt-b")   # a link restores as the checkpoint it points to
    ckpt.restore(tmp_path / "latest")
    assert ckpt.step == 5 and weight(ckpt) == [5.0]

    # the resumed job is the job that saved it: its next save is that job's third
    ckpt.save(moved / "ckpt-c")
    assert identity(moved / "ckpt-c") | {"id": None} == first | {"name": "ckpt-c", "save_counter": 3, "id": None}
    assert len({identity(moved / n)["id"] for n in ("ckpt-a", "ckpt-b", "ckpt-c")}) == 3


def test_a_checkpoint_of_an_older_version_restores_with_a_warning(two: tuple[Path, dict]) -> None:
    runs, _ = two
    path = runs / "ckpt-b"
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["manifest_sha256"], manifest["identity"]
    manifest["manifest_sha256"] = hashlib.sha256(storage._canonical(manifest)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    ckpt = fresh()
    with pytest.warns(RuntimeWarning, match=rf"checkpoint {path} records no identity \(it was written by an older "
                                            r"stratagem\), so it cannot be checked that it is the checkpoint saved "
                                            r"as 'ckpt-b'"):
        ckpt.restore(path)
    assert ckpt.step == 5

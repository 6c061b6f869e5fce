"""CheckpointManager: numbering, retention (oldest deleted first), latest; atomic writes under SIGKILL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

from .common import killed_at_line

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).parent


def test_numbering_retention_and_latest(tmp_path: Path) -> None:
    ckpt = sg.Checkpoint(step=0)
    manager = sg.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=3)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert manager.restore_or_initialize() is None
    paths = []
    for step in range(1, 6):
        ckpt.step = step
        paths.append(manager.save())
    assert paths == [str(tmp_path / "run" / f"ckpt-{n}") for n in range(1, 6)]
    assert manager.checkpoints == paths[2:]             # the oldest went first
    assert manager.latest_checkpoint == paths[-1]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.endswith(".lock")) == ["ckpt-3", "ckpt-4", "ckpt-5"]
    assert manager.save(checkpoint_number=10).endswith("ckpt-10")
    assert manager.save().endswith("ckpt-11")
    ckpt.step = 0
    assert manager.restore_or_initialize() == paths[-1].replace("ckpt-5", "ckpt-11") and ckpt.step == 5
    keep_all = sg.CheckpointManager(sg.Checkpoint(step=0), tmp_path / "all", max_to_keep=None)
    for _ in range(7):
        keep_all.save()
    assert len(keep_all.checkpoints) == 7


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(sg.errors.InvalidArgumentError, match="max_to_keep"):
        sg.CheckpointManager(sg.Checkpoint(step=0), tmp_path, max_to_keep=0)
    with pytest.raises(sg.errors.InvalidArgumentError, match="an sg.Checkpoint"):
        sg.CheckpointManager({"step": 0}, tmp_path)


@pytest.mark.multiprocess
def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    killed_at_line([sys.executable, str(HERE / "crash_script.py"), str(tmp_path)], "writing")
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("ckpt-2.tmp-")

    model = torch.nn.Linear(64, 64)
    ckpt = sg.Checkpoint(model=model, step=0)
    manager = sg.CheckpointManager(ckpt, tmp_path)
    assert manager.checkpoints == [str(tmp_path / "ckpt-1")]    # the unfinished write is not a checkpoint
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1") and ckpt.step == 1
    assert not torch.equal(model.weight, torch.full_like(model.weight, 7.0))
    with pytest.raises(sg.errors.CheckpointError, match="unfinished write"):
        ckpt.restore(tmp_path / leftovers[0])
    manager.save()                                              # the next writer cleans up
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["ckpt-1", "ckpt-2"]

"""A truncated, bit-flipped or mismatched checkpoint raises CheckpointError naming the file and the
problem, before anything is changed; the manager falls back to the previous good one with a warning."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import storage

from .common import Net, batches, build, train

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, sg.Checkpoint]:
    model, optimizer, scheduler = build(None)
    train(None, model, optimizer, scheduler, batches(2))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=2)
    return Path(ckpt.save(tmp_path / "ckpt-1")), ckpt


def fresh() -> tuple[sg.Checkpoint, dict]:
    model, optimizer, _ = build(None, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    return sg.Checkpoint(model=model, optimizer=optimizer, step=0), before


def assert_unchanged(ckpt: sg.Checkpoint, before: dict) -> None:
    for name, value in ckpt.model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a failed restore"
    assert ckpt.step == 0 and not ckpt.optimizer.state_dict()["state"]


def test_truncated_file(saved) -> None:
    path, _ = saved
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[:len(data) // 2])
    ckpt, before = fresh()
    with pytest.raises(sg.errors.CheckpointError, match=r"ckpt-1: model\.pt: .* bytes where the manifest says"):
        ckpt.restore(path)
    assert_unchanged(ckpt, before)


@pytest.mark.parametrize("name", ["optimizer.pt", "manifest.json"])
def test_flipped_byte(saved, name: str) -> None:
    path, _ = saved
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))
    ckpt, before = fresh()
    with pytest.raises(sg.errors.CheckpointError, match=rf"ckpt-1: {name}: .*(corrupt|JSON)"):
        ckpt.restore(path)
    assert_unchanged(ckpt, before)


def test_missing_manifest_and_missing_directory(saved, tmp_path: Path) -> None:
    path, _ = saved
    ckpt, _ = fresh()
    with pytest.raises(sg.errors.CheckpointError, match="does not exist"):
        ckpt.restore(tmp_path / "nothing")
    (path / "manifest.json").unlink()
    with pytest.raises(sg.errors.CheckpointError, match=r"manifest\.json: missing"):
        ckpt.restore(path)


def test_wrong_shape_names_the_parameter_and_both_shapes(saved) -> None:
    path, _ = saved
    model = Net()
    model.fc1 = torch.nn.Linear(5, 9)   # the first entry that differs, in state_dict order
    with pytest.raises(sg.errors.CheckpointError,
                       match=r"ckpt-1: model\.pt: 'fc1\.weight' has shape \[8, 5\] in the checkpoint but \[9, 5\]"):
        sg.Checkpoint(model=model).restore(path)


def test_optimizer_state_of_another_shape_names_the_parameter(saved) -> None:
    path, _ = saved
    model = Net(hidden=9)
    optimizer = torch.optim.Adam(model.parameters())
    # objects are verified in the order they are named: the optimizer first, the model names its parameters
    with pytest.raises(sg.errors.CheckpointError,
                       match=r"optimizer\.pt: the optimizer's 'exp_avg' for model\.fc1\.weight has shape \[8, 5\] "
                             r"in the checkpoint but the parameter has shape \[9, 5\]"):
        sg.Checkpoint(optimizer=optimizer, model=model).restore(path)


def test_names_and_kinds_must_match(saved) -> None:
    path, _ = saved
    with pytest.raises(sg.errors.CheckpointError, match="holds no 'scheduler'"):
        sg.Checkpoint(scheduler=torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1), 1)
                      ).restore(path)
    with pytest.raises(sg.errors.CheckpointError, match="'step' was saved as a int, but here it is a tensor"):
        sg.Checkpoint(step=torch.zeros(1)).restore(path)


def test_restore_or_initialize_falls_back_to_the_previous_good_checkpoint(tmp_path: Path) -> None:
    model, optimizer, scheduler = build(None)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=0)
    manager = sg.CheckpointManager(ckpt, tmp_path, max_to_keep=3)
    for step in (1, 2, 3):
        train(None, model, optimizer, scheduler, batches(1, seed=step))
        ckpt.step = step
        manager.save()
        if step == 2:
            good_model = {k: v.clone() for k, v in model.state_dict().items()}
    latest = Path(manager.latest_checkpoint)
    data = (latest / "model.pt").read_bytes()
    (latest / "model.pt").write_bytes(data[:-10])

    model2, optimizer2, _ = build(None, seed=4)
    ckpt2 = sg.Checkpoint(model=model2, optimizer=optimizer2, step=0)
    with pytest.warns(RuntimeWarning, match=r"ckpt-3 cannot be restored .*model\.pt.*falling back"):
        restored = sg.CheckpointManager(ckpt2, tmp_path).restore_or_initialize()
    assert restored.endswith("ckpt-2") and ckpt2.step == 2
    for name, value in model2.state_dict().items():
        assert torch.equal(value, good_model[name])

    for path in manager.checkpoints[:-1]:
        shutil.rmtree(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(sg.errors.CheckpointError, match=r"none of the 1 checkpoints .* can be restored"):
            sg.CheckpointManager(ckpt2, tmp_path).restore_or_initialize()


def test_restored_optimizer_state_is_its_own_and_files_of_the_first_format_still_verify(saved) -> None:
    """Restoring maps the files; what an optimizer keeps must not live in the map. Manifests of the
    first format (a sha256 per file) still restore and still catch a flipped byte."""
    path, _ = saved
    ckpt, _ = fresh()
    ckpt.restore(path)
    gc.collect()
    maps = Path("/proc/self/maps")
    if maps.exists():   # Linux: no file of the checkpoint is still mapped
        assert str(path) not in maps.read_text()
    assert ckpt.step == 2 and ckpt.optimizer.state_dict()["state"]

    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    for name, entry in manifest["files"].items():
        del entry["crc32"]
        entry["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    manifest["manifest_sha256"] = hashlib.sha256(storage._canonical(manifest)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    ckpt.restore(path)
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x04
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(sg.errors.CheckpointError, match=r"model\.pt: its sha256 does not match the manifest"):
        ckpt.restore(path)

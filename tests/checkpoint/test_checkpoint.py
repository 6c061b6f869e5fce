"""sg.Checkpoint: round trips of every kind of object, the on-disk format, what it refuses."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import storage

from .common import assert_same_state, batches, build, make_strategy, train

pytestmark = pytest.mark.timeout(120)


def test_round_trip_model_adam_scheduler_int_tensor(tmp_path: Path) -> None:
    model, optimizer, scheduler = build(None)
    train(None, model, optimizer, scheduler, batches(3))
    ema = torch.arange(4.0)
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, step=3, ema=ema)
    path = ckpt.save(tmp_path / "first")
    assert path == str(tmp_path / "first")

    model2, optimizer2, scheduler2 = build(None, seed=7)
    ema2 = torch.zeros(4)
    restored = sg.Checkpoint(model=model2, optimizer=optimizer2, scheduler=scheduler2, step=0, ema=ema2)
    assert restored.restore(path) == path
    assert restored.step == 3
    assert torch.equal(ema2, ema)   # tensors are restored in place
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert_same_state(model, optimizer, model2, optimizer2)
    # both continue identically
    train(None, model, optimizer, scheduler, batches(2, seed=9))
    train(None, model2, optimizer2, scheduler2, batches(2, seed=9))
    assert_same_state(model, optimizer, model2, optimizer2)


def test_directory_format(tmp_path: Path) -> None:
    model, optimizer, _ = build(None)
    path = Path(sg.Checkpoint(model=model, optimizer=optimizer, step=5).save(tmp_path / "c"))
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.pt", "optimizer.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "stratagem-checkpoint" and manifest["version"] == 1
    assert manifest["objects"]["step"] == {"kind": "int", "type": "int", "value": 5}
    assert manifest["files"]["model.pt"]["bytes"] == (path / "model.pt").stat().st_size
    assert manifest["files"]["model.pt"]["crc32"] == zlib.crc32((path / "model.pt").read_bytes())
    # every file reads back with weights_only=True: nothing but tensors and plain values
    state = torch.load(path / "model.pt", weights_only=True)
    assert set(state) == set(model.state_dict())
    assert not list(tmp_path.glob("*.tmp-*"))


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path: Path) -> None:
    ckpt = sg.Checkpoint(step=1, value=torch.zeros(2))
    ckpt.save(tmp_path / "c")
    ckpt.step = 2
    ckpt.save(tmp_path / "c")
    ckpt.step = 0
    ckpt.restore(tmp_path / "c")
    assert ckpt.step == 2
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["c"]


def test_it_refuses_what_it_cannot_track_or_restore_safely(tmp_path: Path) -> None:
    with pytest.raises(sg.errors.InvalidArgumentError, match="cannot track thing=str"):
        sg.Checkpoint(thing="hello")
    with pytest.raises(sg.errors.InvalidArgumentError, match="names start with a letter"):
        sg.Checkpoint(**{"my model": torch.nn.Linear(1, 1)})
    with pytest.raises(sg.errors.InvalidArgumentError, match="bool"):
        sg.Checkpoint(done=True)

    class Holder:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, state):
            pass

    with pytest.raises(sg.errors.InvalidArgumentError, match=r"holder.state_dict\(\)\['fn'\].*builtin_function"):
        sg.Checkpoint(holder=Holder()).save(tmp_path / "c")
    assert not tmp_path.joinpath("c").exists()
    ckpt = sg.Checkpoint(step=1)
    with pytest.raises(AttributeError, match="tracks no 'stpe'"):
        ckpt.stpe = 3
    with pytest.raises(sg.errors.InvalidArgumentError, match="tracked as a int"):
        ckpt.step = torch.zeros(1)


def test_save_inside_run_is_refused(tmp_path: Path) -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    ckpt = sg.Checkpoint(step=1)
    with pytest.raises(sg.errors.ContextError, match="outside run"):
        strategy.run(lambda: ckpt.save(tmp_path / "c"))


def test_callbacks_backup_and_restore_in_a_custom_loop(tmp_path: Path) -> None:
    def job(stop_after: int | None):
        model, optimizer, scheduler = build(None)
        ckpt = sg.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, steps=0)
        backup = sg.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2)
        start_epoch, start_step = backup.restore(ckpt)
        data = batches(3)
        done = 0
        for epoch in range(start_epoch, 3):
            for step in range(start_step if epoch == start_epoch else 0, 3):
                train(None, model, optimizer, scheduler, [data[step]])
                ckpt.steps += 1
                backup.on_train_batch_end(step)
                done += 1
                if stop_after is not None and done == stop_after:
                    return None, (start_epoch, start_step)
            backup.on_epoch_end(epoch)
        backup.on_train_end()
        return (model, optimizer, ckpt.steps), (start_epoch, start_step)

    assert job(stop_after=5) == (None, (0, 0))     # killed after 5 steps: backups after steps 2 and 4
    (model, optimizer, steps), start = job(None)  # resumes at step 4 = epoch 1, step 1
    assert start == (1, 1) and steps == 9
    assert not list((tmp_path / "backup").iterdir())   # delete_checkpoint
    (reference, ref_opt, ref_steps), fresh_start = job(None)
    assert fresh_start == (0, 0) and ref_steps == 9
    assert_same_state(reference, ref_opt, model, optimizer)


def test_backup_and_restore_arguments() -> None:
    with pytest.raises(sg.errors.InvalidArgumentError, match="save_freq"):
        sg.callbacks.BackupAndRestore("/tmp/x", save_freq=0)
    backup = sg.callbacks.BackupAndRestore("/tmp/x")
    with pytest.raises(sg.errors.InvalidArgumentError, match="needs the training state"):
        backup.on_train_begin()
    with pytest.raises(sg.errors.InvalidArgumentError, match="keeps its own backup_step"):
        backup.restore(sg.Checkpoint(backup_step=1))


def test_a_save_that_does_not_block_writes_the_state_of_its_call(tmp_path: Path, monkeypatch) -> None:
    strategy = make_strategy("mirrored2")
    model, optimizer, scheduler = build(strategy)
    train(strategy, model, optimizer, scheduler, batches(2))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, step=2)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    path = ckpt.save(tmp_path / "c", blocking=False)   # the state is copied; a thread writes it
    train(strategy, model, optimizer, scheduler, batches(2, seed=8))   # training goes on meanwhile
    ckpt.wait()
    plain, plain_opt, _ = build(None, seed=4)
    sg.Checkpoint(model=plain, optimizer=plain_opt, step=0).restore(path)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved_model[name]), name

    def broken(path, value):
        raise OSError("disk full")

    monkeypatch.setattr(storage, "_write_file", broken)
    with pytest.warns(RuntimeWarning, match=r"background save of the checkpoint .*d failed \(OSError: disk full\)"):
        ckpt.save(tmp_path / "d", blocking=False)   # said when it happens, and raised by wait()
        with pytest.raises(sg.errors.CheckpointError, match=r"background save failed: cannot write the checkpoint .*d: disk full"):
            ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["c"]   # nothing at d, no temporary left
    ckpt.wait()   # told once

"""Parameter-server checkpoints with real ps processes: every ps writes its own shards, the
coordinator the skeleton and manifest; they restore under Mirrored and under another number of
ps (resharded, through the coordinator), in the same layout with every ps reading its own files,
and a Mirrored checkpoint restores onto the shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.checkpoint.pieces import pieces_descriptor
from stratagem.checkpoint.storage import write_directory

from .common import assert_same_state, batches, build, make_strategy

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
HERE = Path(__file__).parent


def launch(num_ps: int, out: Path, source: str, name: str) -> dict:
    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "1", "--ps", str(num_ps),
                                str(HERE / "ps_script.py"), str(out), source, name],
                               capture_output=True, text=True, timeout=200)
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text())


def plain_step(model, optimizer, batch) -> None:
    x, y = batch
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def assert_report_state(state: dict, model, optimizer) -> None:
    for name, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(state["model"][name]), value, rtol=2e-5, atol=2e-6)
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(torch.tensor(state["optimizer"][str(index)][key]), value, rtol=2e-5,
                                       atol=2e-6)


@pytest.mark.multiprocess
def test_mirrored_to_two_ps_to_three_ps_to_mirrored(tmp_path: Path) -> None:
    data = batches(4)
    strategy = make_strategy("mirrored2")
    model, optimizer, _ = build(strategy)
    for x, y in data[:2]:
        def step(batch):
            bx, by = batch
            loss = sg.nn.compute_average_loss(F.cross_entropy(model(bx), by, reduction="none"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for batch in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(step, args=(batch,))
    source = sg.Checkpoint(model=model, optimizer=optimizer, step=2).save(tmp_path / "mirrored")
    plain, plain_opt, _ = build(None)
    sg.Checkpoint(model=plain, optimizer=plain_opt).restore(source)

    two = launch(2, tmp_path, source, "two_ps")        # onto 2 shards per variable, one step on a worker
    assert two["shards"] == 2 and two["step"] == 2
    assert_report_state(two["restored"], plain, plain_opt)
    plain_step(plain, plain_opt, data[2])
    assert_report_state(two["trained"], plain, plain_opt)

    saved = Path(two["saved"])                            # every ps wrote its own shards
    assert sorted(p.name for p in saved.iterdir()) == [
        "manifest.json", "model.ps0.pt", "model.ps1.pt", "model.pt",
        "optimizer.ps0.pt", "optimizer.ps1.pt", "optimizer.pt"]
    skeleton = torch.load(saved / "model.pt", weights_only=True)
    assert skeleton["fc1.weight"] == {"sg_pieces": [["model.ps0.pt", skeleton["fc1.weight"]["sg_pieces"][0][1], 0, 4],
                                                    ["model.ps1.pt", skeleton["fc1.weight"]["sg_pieces"][1][1], 4, 8]],
                                      "shape": [8, 5]}

    # restored again in the same layout: each ps read its own files, nothing went through the coordinator
    assert two["ps_loads"] == [2, 2] and two["step_again"] == 3
    assert two["restored_again"] == two["trained"]
    assert "optimizer.ps1.pt: its CRC-32 does not match" in two["broken"]
    assert two["step_after_broken"] == 0 and two["after_broken"] == two["restored_again"]   # nothing changed
    # swapped on disk after every ps verified its files: each ps refuses the other checkpoint's files
    race, job = str(tmp_path / "race" / "two_ps"), json.loads((saved / "manifest.json").read_text())["identity"]["job"]
    for ps in (0, 1):   # (the job that saved `source` goes on: two_ps is its second save, `other` its third)
        assert (f"checkpoint {race}: model.ps{ps}.pt: ps {ps} reads the checkpoint saved as 'other' (save 3 of "
                f"job {job}, at ") in two["race"], two["race"]
    assert f"but the coordinator restores the checkpoint saved as 'two_ps' (save 2 of job {job}, at " in two["race"]
    assert two["race_unchanged"]

    three = launch(3, tmp_path, str(saved), "three_ps")   # resharded: 3 shards over 3 ps
    assert three["shards"] == 3 and three["step"] == 3
    assert three["ps_loads"] == [2, 2, 2] and three["restored_again"] == three["trained"]
    assert_report_state(three["restored"], plain, plain_opt)
    plain_step(plain, plain_opt, data[2])
    assert_report_state(three["trained"], plain, plain_opt)

    mirrored, mirrored_opt, _ = build(make_strategy("mirrored3"), seed=8)
    ckpt = sg.Checkpoint(model=mirrored, optimizer=mirrored_opt, step=0)
    ckpt.restore(three["saved"])
    assert ckpt.step == 4
    assert_same_state(plain, plain_opt, mirrored, mirrored_opt, rtol=2e-5, atol=2e-6)


def test_a_corrupt_ps_shard_file_is_named(tmp_path: Path) -> None:
    """Pieces files are verified like any other (no cluster needed: the files are plain)."""
    pieces = {"w/part_0": {"value": torch.ones(2, 3), "optimizer_state": None},
              "w/part_1": {"value": torch.zeros(1, 3), "optimizer_state": None}}
    skeleton = {"weight": pieces_descriptor([["model.ps0.pt", "w/part_0", 0, 2], ["model.ps1.pt", "w/part_1", 2, 3]],
                                            (3, 3)), "bias": torch.zeros(3)}
    files = {"model.pt": skeleton, "model.ps0.pt": {"w/part_0": pieces["w/part_0"]},
             "model.ps1.pt": {"w/part_1": pieces["w/part_1"]}}
    path = write_directory(tmp_path / "c", files, {"model": {"kind": "module", "type": "Linear", "file": "model.pt"}},
                           {})
    model = torch.nn.Linear(3, 3)
    sg.Checkpoint(model=model).restore(path)
    assert torch.equal(model.weight, torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    data = bytearray((path / "model.ps1.pt").read_bytes())
    data[-5] ^= 0xFF
    (path / "model.ps1.pt").write_bytes(bytes(data))
    with pytest.raises(sg.errors.CheckpointError, match=r"model\.ps1\.pt: its CRC-32 does not match"):
        sg.Checkpoint(model=model).restore(path)

"""Parameter-server checkpoints: the coordinator saves one logical copy (pulled from the shards)
and restoring writes it back to the shards -- to and from the synchronous strategies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

from .common import assert_same_state, batches, build, make_strategy

pytestmark = pytest.mark.timeout(240)
HERE = Path(__file__).parent


def test_mirrored_to_parameter_servers_and_back(tmp_path: Path) -> None:
    # saved under Mirrored(2) after two Adam steps (no scheduler: the ps job has none)
    strategy = make_strategy("mirrored2")
    model, optimizer, _ = build(strategy)
    data = batches(3)
    for x, y in data[:2]:
        for batch in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(_step(model, optimizer), args=(batch,))
    source = sg.Checkpoint(model=model, optimizer=optimizer, step=2).save(tmp_path / "mirrored")

    completed = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "1", "--ps", "2",
                                str(HERE / "ps_script.py"), str(tmp_path), source],
                               capture_output=True, text=True, timeout=200)
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "ps.json").read_text())
    assert report["sharded"] and report["step"] == 2
    for name, value in model.state_dict().items():          # restored onto 2 shards per variable
        assert torch.equal(torch.tensor(report["restored"]["model"][name]), value), name
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.tensor(report["restored"]["optimizer"][str(index)][key]), value), (index, key)

    # the plain PyTorch continuation of the saved state ...
    plain, plain_opt, _ = build(None)
    sg.Checkpoint(model=plain, optimizer=plain_opt).restore(source)
    x, y = data[2]
    plain_opt.zero_grad()
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    plain_opt.step()
    # ... equals the step the ps job took, and its checkpoint restores under Mirrored(3)
    mirrored, mirrored_opt, _ = build(make_strategy("mirrored3"), seed=8)
    ckpt = sg.Checkpoint(model=mirrored, optimizer=mirrored_opt, step=0)
    ckpt.restore(report["saved"])
    assert ckpt.step == 3
    assert_same_state(plain, plain_opt, mirrored, mirrored_opt, rtol=2e-5, atol=2e-6)


def _step(model, optimizer):
    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step

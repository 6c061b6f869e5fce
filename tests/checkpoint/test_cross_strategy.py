"""Portability: saved under one strategy, restored under any other, parameters and optimizer state
equal; training then goes on as plain PyTorch would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint.storage import CheckpointReader

from .common import assert_same_state, batches, build, make_strategy, train

pytestmark = pytest.mark.timeout(180)
KINDS = ["one_device", "mirrored2", "mirrored3", "central2"]
DATA = batches(3)


@pytest.fixture(scope="module")
def reference():
    """Plain PyTorch: state after 2 steps, and after the third."""
    model, optimizer, scheduler = build(None)
    train(None, model, optimizer, scheduler, DATA[:2])
    two = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict())
    train(None, model, optimizer, scheduler, DATA[2:])
    return two, model, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, reference) -> dict[str, str]:
    paths = {}
    for kind in KINDS:
        strategy = make_strategy(kind)
        model, optimizer, scheduler = build(strategy)
        train(strategy, model, optimizer, scheduler, DATA[:2])
        ckpt = sg.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, step=2)
        paths[kind] = ckpt.save(tmp_path_factory.mktemp(kind) / "ckpt-1")
        manifest_info = CheckpointReader(paths[kind]).manifest["info"]
        assert manifest_info["num_replicas_in_sync"] == strategy.num_replicas_in_sync
    return paths


@pytest.mark.parametrize("source", KINDS)
@pytest.mark.parametrize("target", KINDS)
def test_save_under_one_restore_under_another(source: str, target: str, saved, reference) -> None:
    (ref_params, _), ref_model, ref_optimizer = reference
    strategy = make_strategy(target)
    model, optimizer, scheduler = build(strategy, seed=11)   # other initial values: the restore must win
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler, step=0)
    ckpt.restore(saved[source])
    assert ckpt.step == 2 and scheduler.last_epoch == 2
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_params[name], rtol=2e-5, atol=2e-6)
    # the restored state is exactly what was saved, under whatever strategy
    saved_state = torch.load(Path(saved[source]) / "optimizer.pt", weights_only=True)
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, saved_state["state"][index][key]), (index, key)
    train(strategy, model, optimizer, scheduler, DATA[2:])
    assert_same_state(ref_model, ref_optimizer, model, optimizer, rtol=2e-5, atol=2e-6)

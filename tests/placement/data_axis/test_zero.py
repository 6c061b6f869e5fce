"""ZeRO sharding of MultiWorkerMirroredStrategy: equivalence with plain PyTorch (float64, SGD with
momentum and Adam), optimizer state per worker halved, checkpoints saved under sharding restored
under sharding and under OneDeviceStrategy, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.testing import assert_succeeded, run_local_cluster

from ..._support import clips
from . import sharding_script

pytestmark = pytest.mark.timeout(200)
SCRIPT = Path(sharding_script.__file__)


def save_plain(path: Path) -> None:
    """The reference training (one device, no sharding) saved after STEPS steps."""
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():
        models = sharding_script.make_model(0), sharding_script.make_model(0)
        optimizers = sharding_script.make_optimizers(*models)
    for x, y in sharding_script.make_data()[:sharding_script.STEPS]:
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    sg.Checkpoint(model_sgd=models[0], model_adam=models[1], sgd=optimizers[0], adam=optimizers[1]).save(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["optimizer", "gradients"])
def test_two_workers_match_one_process_with_half_the_state(tmp_path: Path, stage: str) -> None:
    save_plain(tmp_path / "plain")
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "--sharding", stage], timeout=150)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, out in enumerate(outputs):
        assert out["num_replicas"] == 2
        assert out["worst"] < 1e-12, f"worker {rank}: parameters differ from plain PyTorch by {out['worst']}"
        assert out["state_error"] < 1e-12, f"worker {rank}: gathered state differs by {out['state_error']}"
        assert out["resumed_equal"], f"worker {rank}: training restored from the checkpoint went differently"
        assert out["plain_error"] < 1e-12, f"worker {rank}: restored from a plain checkpoint: {out['plain_error']}"
        assert out["accumulated_error"] < 1e-12, f"worker {rank}: two backward passes: {out['accumulated_error']}"
        assert out["older_refused"] in ((None,) if stage == "optimizer" else (True,)), out["older_refused"]
        check_clipping(out["clipping"], f"worker {rank}")
        for mine, full in zip(out["state_bytes"], out["full_bytes"]):
            assert 0 < mine <= full // 2 + 8 * 8, (rank, mine, full)   # half, within one element per piece
    assert sum(o["state_bytes"][0] for o in outputs) == outputs[0]["full_bytes"][0]

    restores_as_plain_pytorch(tmp_path / "ckpt")


def check_clipping(out: dict, where: str) -> None:
    """clip_grad_norm_ / clip_grad_value_ between backward and step: plain PyTorch's norms and parameters."""
    for got, want in zip(out["got"], out["want"]):   # the SGD model, the Adam model
        clips.check(got, want, where)
    assert out["worst"] < 1e-12, f"{where}: clipped training differs from plain PyTorch by {out['worst']}"


def restores_as_plain_pytorch(path: Path) -> None:
    """The checkpoint reads as one logical copy: restored under one device, it holds plain PyTorch's
    parameters and optimizer state after STEPS steps."""
    history, states, _ = sharding_script.reference()
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():
        models = sharding_script.make_model(7), sharding_script.make_model(7)
        optimizers = sharding_script.make_optimizers(*models)
    sg.Checkpoint(model_sgd=models[0], model_adam=models[1], sgd=optimizers[0],
                  adam=optimizers[1]).restore(path)
    for model, want in zip(models, history[sharding_script.STEPS - 1]):
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
    for optimizer, want in zip(optimizers, states):
        got = optimizer.state_dict()["state"]
        for index, entry in want.items():
            for key, value in entry.items():
                torch.testing.assert_close(got[index][key], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_one_worker_is_plain_pytorch(stage: str) -> None:
    try:
        one_worker_is_plain_pytorch(stage)
    finally:   # a lone worker's stage 3 opened a one-process group for its mesh: leave it
        if dist.is_initialized() and dist.get_world_size() == 1:
            dist.destroy_process_group()


def one_worker_is_plain_pytorch(stage: str) -> None:
    strategy = sg.MultiWorkerMirroredStrategy(sharding=stage)
    assert strategy.sharding == stage
    with strategy.scope():
        model = sharding_script.make_model(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if stage == "parameters":
        assert type(optimizer).__name__ == "FullyShardedAdam"
    ref = sharding_script.make_model(0)
    ref_optimizer = torch.optim.Adam(ref.parameters(), lr=0.01)
    for x, y in sharding_script.make_data()[:3]:
        def step(x, y):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        strategy.run(step, args=(x, y))
        ref_optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_optimizer.step()
    state = model.state_dict()
    for key, want in ref.state_dict().items():
        assert type(state[key]) is torch.Tensor   # full tensors (not DTensors under stage 3)
        torch.testing.assert_close(state[key], want, rtol=1e-13, atol=1e-13)
    saved = optimizer.state_dict()
    torch.testing.assert_close(saved["state"][0]["exp_avg"], ref_optimizer.state_dict()["state"][0]["exp_avg"])
    optimizer.load_state_dict(ref_optimizer.state_dict())   # plain state dicts load back
    model.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("sharding, devices, match", [
    ("zero1", None, "sharding must be None, 'optimizer', 'gradients' or 'parameters', got 'zero1'"),
    ("optimizer", ["cpu:0", "cpu:1"], "needs one replica per worker"),
])
def test_refused_configurations(sharding, devices, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        sg.MultiWorkerMirroredStrategy(sharding=sharding, devices=devices)


def test_refused_optimizers_and_models() -> None:
    strategy = sg.MultiWorkerMirroredStrategy(sharding="optimizer")
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        lbfgs = torch.optim.LBFGS(model.parameters())
        mixed = torch.nn.Linear(3, 1)
        mixed.bias.data = mixed.bias.data.double()
        sgd = torch.optim.SGD(mixed.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="element-wise"):
        lbfgs.state_dict()
    with pytest.raises(InvalidArgumentError, match="one dtype"):
        sgd.state_dict()


def test_step_pre_hooks_are_refused_when_gradients_are_sharded() -> None:
    strategy = sg.MultiWorkerMirroredStrategy(sharding="gradients")
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *args: None)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(InvalidArgumentError, match="pre-hooks see whole gradients"):
        optimizer.step()

"""TensorParallelStrategy in one process (a 1 x 1 mesh): the plan's checks, state dicts, the step.

The multi-process meshes are in tests/placement/layout/test_multi_worker_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.placement.layout.tensor_parallel import torch_style

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, scope="module")
def leave_the_process_group():
    """A 1 x 1 mesh needs a (one-process) default group: leave it, so later tests find none."""
    yield
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
        torch.distributed.destroy_process_group()


class MLP(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def make(plan=PLAN, mesh=None):
    strategy = sg.experimental.TensorParallelStrategy(mesh=mesh, plan=plan)
    with strategy.scope():
        model = MLP()
    return strategy, model


def test_plan_and_mesh_misuse_is_refused_clearly() -> None:
    with pytest.raises(InvalidArgumentError, match=r"names 'fc3'.*available: \['fc1', 'norm', 'fc2'\]"):
        make({"fc3": "colwise"})
    with pytest.raises(InvalidArgumentError, match="unknown style 'diagonal'"):
        make({"fc1": "diagonal"})
    with pytest.raises(InvalidArgumentError, match="non-empty dict"):
        make({})
    with pytest.raises(InvalidArgumentError, match="is a LayerNorm"):
        make({"norm": "colwise"})
    with pytest.raises(InvalidArgumentError, match=r"has 4 processes, but the cluster has 1"):
        make(mesh={"data": 2, "model": 2})
    with pytest.raises(InvalidArgumentError, match="positive integer sizes"):
        make(mesh={"pipeline": 2})


def test_glob_patterns_pick_modules() -> None:
    _, model = make({"fc*": "colwise"})
    assert isinstance(model.fc1.weight, DTensor) and isinstance(model.fc2.weight, DTensor)
    assert not isinstance(model.norm.weight, DTensor)


def test_training_matches_plain_torch_and_state_dicts_are_full_tensors(tmp_path) -> None:
    torch.manual_seed(0)
    reference = MLP().double()
    strategy = sg.experimental.TensorParallelStrategy(plan=PLAN)
    with strategy.scope():
        model = MLP().double()
        params = list(model.parameters())   # built before the plan replaced them: the optimizer gets the new ones
        optimizer = torch.optim.Adam(params, lr=0.01)
    model.load_state_dict(reference.state_dict())
    assert all(isinstance(p, DTensor) for p in optimizer.param_groups[0]["params"][:2])
    expected_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g))
               for _ in range(3)]

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        return loss.detach()

    for batch in strategy.experimental_distribute_dataset(batches):
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        x, y = batch
        expected_optimizer.zero_grad()
        want = nn.functional.cross_entropy(reference(x), y)
        want.backward()
        expected_optimizer.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    state = model.state_dict()
    assert not any(isinstance(v, DTensor) for v in state.values())
    torch.testing.assert_close(state, reference.state_dict(), rtol=1e-12, atol=1e-12)
    saved = optimizer.state_dict()
    assert not any(isinstance(v, DTensor) for s in saved["state"].values() for v in s.values())
    torch.testing.assert_close(saved["state"], expected_optimizer.state_dict()["state"], rtol=1e-12, atol=1e-12)
    optimizer.load_state_dict(saved)
    model.load_state_dict(state)
    assert isinstance(model.fc1.weight, DTensor) and isinstance(optimizer.state[model.fc1.weight]["exp_avg"], DTensor)
    assert type(optimizer).__name__ == "TensorParallelAdam"
    # sg.Checkpoint: one logical copy of plain tensors; restored, each process keeps its shard
    path = sg.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    assert set(model.state_dict(keep_vars=True)) == set(state)   # the DTensors themselves: no gather
    assert isinstance(model.state_dict(keep_vars=True)["fc1.weight"], DTensor)
    with torch.no_grad():
        model.fc1.weight.zero_()
    sg.Checkpoint(model=model, optimizer=optimizer).restore(path)
    assert isinstance(model.fc1.weight, DTensor)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimizer.state_dict()["state"], expected_optimizer.state_dict()["state"],
                               rtol=1e-12, atol=1e-12)
    assert not any(isinstance(v, DTensor) for v in torch.load(f"{path}/model.pt", weights_only=True).values())


def test_an_embedding_takes_its_token_ids_whole() -> None:
    # torch's RowwiseParallel() takes its input as this process's share of the last dimension; an Embedding's
    # token ids are the same on every process of the model axis (test_multi_worker_tensor_parallel.py beside
    # this file trains one on two processes): the plan string gives it RowwiseParallel(input_layouts=Replicate())
    embedding = nn.Embedding(8, 4)
    assert torch_style("rowwise", embedding).input_layouts == (Replicate(),)
    assert torch_style("rowwise", nn.Linear(4, 4)).input_layouts == (Shard(-1),)
    assert torch_style("colwise", embedding).input_layouts == (Replicate(),)
    # "sequence" takes its input whole too (it cuts this process's share itself), so it is refused after a
    # style object that hands on a share of the sequence (torchtitan's layout: SequenceParallel() there)
    assert isinstance(torch_style("sequence", nn.LayerNorm(4)), SequenceParallel)
    with pytest.raises(InvalidArgumentError, match=r"plan entry '0' is RowwiseParallel\(.*share along dimension 1, "
                                                   r"but 'sequence' \(plan entries \['1'\]\) takes a plain input as whole"):
        sg.experimental.TensorParallelStrategy(plan={"0": RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Shard(1)), "1": "sequence"})

    def model():
        return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    refused = {RowwiseParallel(): r"'0' gives an nn.Embedding RowwiseParallel with input_layouts=Shard\(dim=-1\).*"
                                  r"pass RowwiseParallel\(input_layouts=Replicate\(\), \.\.\.\).*the plan string 'rowwise'",
               ColwiseParallel(input_layouts=Shard(0)): r"ColwiseParallel with input_layouts=Shard\(dim=0\)",
               "sequence": r"'0' is 'sequence' on an nn.Embedding: 'sequence' splits activations",
               SequenceParallel(): "SequenceParallel would take the token ids as this process's share"}
    for style, message in refused.items():
        with pytest.raises(InvalidArgumentError, match=message):
            with sg.experimental.TensorParallelStrategy(plan={"0": style}).scope():
                model()
        pipeline = sg.experimental.PipelineStrategy({"data": 1, "pipe": 1, "model": 1}, plan={"0": style},
                                                    num_microbatches=1, schedule="gpipe")
        with pytest.raises(InvalidArgumentError, match=message):
            with pipeline.scope():
                model()

"""Parameters a MultiWorkerMirroredStrategy with one replica per worker does not hold, used in
every way the test names; each case prints ``case NAME: refused: ...`` or ``case NAME: trained
...`` (the test then checks every worker refused the same cases).

Usage (one process per worker, TF_CONFIG set): python unscoped_script.py SHARDING
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository

import stratagem as sg  # noqa: E402
from stratagem.errors import ContextError, InvalidArgumentError  # noqa: E402

strategy: sg.MultiWorkerMirroredStrategy = None   # set by main()
rank = 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        y = self.body(x)
        if "head" in self._modules:
            y = self.head(y)
        if "scale" in self._parameters:
            y = y * self.scale
        return y


def unscoped_net() -> Net:
    torch.manual_seed(rank)   # every worker its own values: only the chief's may count
    return Net()


def scoped_net() -> Net:
    with strategy.scope():
        return unscoped_net()


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = sg.nn.compute_average_loss(model(x).pow(2).sum(1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def in_run(model, optimizer):
    return strategy.run(step, args=(model, optimizer, torch.ones(2, 4)))


def outside_run(model, optimizer):
    with strategy.scope():
        return step(model, optimizer, torch.ones(2, 4))


def outside_every_scope(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(2, 4)).pow(2).sum().backward()


def module_outside_optimizer_inside():
    model = unscoped_net()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    in_run(model, optimizer)


def module_and_optimizer_outside(where):
    model = unscoped_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    where(model, optimizer)


def head_after_scope(where, optimizer_after):
    model = scoped_net()
    if not optimizer_after:
        with strategy.scope():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.head = nn.Linear(4, 2)
    if optimizer_after:
        with strategy.scope():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    where(model, optimizer)


def scale_after_scope(where):
    model = scoped_net()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.scale = nn.Parameter(torch.randn(4))
    where(model, optimizer)


def keras_model(strategy_argument):
    module = unscoped_net()
    with strategy.scope():
        sg.Model(module, strategy=strategy if strategy_argument else None)


CASES = {
    "module outside, optimizer inside": module_outside_optimizer_inside,
    "module and optimizer outside, in run": lambda: module_and_optimizer_outside(in_run),
    "module and optimizer outside, in the scope outside run": lambda: module_and_optimizer_outside(outside_run),
    "head after the scope, optimizer after": lambda: head_after_scope(in_run, True),
    "head after the scope, optimizer before, in run": lambda: head_after_scope(in_run, False),
    "head after the scope, outside every scope": lambda: head_after_scope(outside_every_scope, False),
    "scale after the scope, in run": lambda: scale_after_scope(in_run),
    "scale after the scope, outside every scope": lambda: scale_after_scope(outside_every_scope),
    "sg.Model in the scope around an unscoped module": lambda: keras_model(False),
    "sg.Model with strategy= around an unscoped module": lambda: keras_model(True),
}




def loss_outside(loss_of, in_scope: bool) -> None:
    """A step outside run: in the scope (acting as this worker's one replica), or outside every scope."""
    model = scoped_net()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    if in_scope:
        with strategy.scope():
            loss = loss_of(model(x))
    else:
        loss = loss_of(model(x))
    loss.backward()
    optimizer.step()


def local_model_outside_every_scope() -> None:
    """A plain model of this worker alone, beside the strategy's: its mean loss is its own business."""
    model = nn.Linear(4, 1)
    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()


#: the step outside run: name -> (case, "refused" or "trained")
LOSS_CASES = {
    "a per-replica mean in the scope": (
        lambda: loss_outside(lambda y: F.mse_loss(y, torch.zeros_like(y)), True), "refused"),
    "a per-replica mean outside every scope": (
        lambda: loss_outside(lambda y: F.mse_loss(y, torch.zeros_like(y)), False), "refused"),
    "compute_average_loss outside every scope (for one replica)": (
        lambda: loss_outside(lambda y: sg.nn.compute_average_loss(y.pow(2).sum(1)), False), "refused"),
    "mean_over_replicas outside every scope (divided by one)": (
        lambda: loss_outside(lambda y: sg.nn.mean_over_replicas(y.pow(2).mean()), False), "refused"),
    "compute_average_loss in the scope": (
        lambda: loss_outside(lambda y: sg.nn.compute_average_loss(y.pow(2).sum(1)), True), "trained"),
    "mean_over_replicas in the scope": (
        lambda: loss_outside(lambda y: sg.nn.mean_over_replicas(y.pow(2).mean()), True), "trained"),
    "a plain local model's mean outside every scope": (local_model_outside_every_scope, "trained"),
}


def main() -> None:
    global strategy, rank
    sharding = None if sys.argv[1] == "none" else sys.argv[1]
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = sg.MultiWorkerMirroredStrategy(sharding=sharding,
                                              communication_options=sg.CommunicationOptions(timeout_seconds=60))
    cases = {**CASES, **{name: case for name, (case, _) in LOSS_CASES.items()}}
    for name, case in cases.items():
        try:
            case()
        except (ContextError, InvalidArgumentError) as error:
            print(f"case {name}: refused: {error}", flush=True)
        else:
            print(f"case {name}: trained", flush=True)

    model = scoped_net()   # and the right way still trains, to the same weights everywhere
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    in_run(model, optimizer)
    outside_run(model, optimizer)
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]   # (ZeRO-3: shards)
    print(f"right way: {sum(p.detach().double().abs().sum().item() for p in full):.12f}", flush=True)


if __name__ == "__main__":
    main()

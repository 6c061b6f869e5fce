"""A ResNet-shaped float64 model with BatchNorm, its data, and its training loops: plain PyTorch on
the whole batch, a strategy's ``run``, and ``sg.Model.fit``. Shared by the in-process tests and the
workers of the multi-worker test (batch_norm_script.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

#: the global batches (uneven: 7 rows over 2 or 4 replicas, 9 over 4)
BATCHES = (8, 7, 9)


class Block(nn.Module):
    """A residual block: conv, BatchNorm, ReLU, conv, BatchNorm, plus the input."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4, momentum=None)   # the cumulative average too
        self.block = Block(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(F.relu(self.bn(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def build(sync: bool) -> nn.Module:
    """The model with the same initial values everywhere (seeded), float64."""
    torch.manual_seed(0)
    model = Net().double()
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 1, torch.randint(0, 3, (n,), generator=g))
            for n in BATCHES]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_plain() -> dict[str, torch.Tensor]:
    """Plain PyTorch on the whole batches."""
    model = build(False)
    opt = optimizer(model)
    for x, y in data():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return state(model)


def train_per_replica(num_replicas: int) -> dict[str, torch.Tensor]:
    """Plain BatchNorm's meaning under ``num_replicas`` replicas, computed in one model: each slice of
    a batch normalized with its own statistics from the same starting buffers, the gradients of the
    slices' shares of the global mean loss summed, the slices' buffers averaged."""
    model = build(False)
    opt = optimizer(model)
    floating = [name for name, b in model.named_buffers() if b.is_floating_point()]
    for x, y in data():
        opt.zero_grad()
        start = state(model)
        ends = []
        for rows in torch.arange(len(x)).tensor_split(num_replicas):
            if ends:
                model.load_state_dict(start)   # every slice starts from the step's buffers
            loss = F.cross_entropy(model(x[rows]), y[rows], reduction="sum") / len(x)
            loss.backward()
            ends.append(state(model))
        averaged = {name: sum(end[name] for end in ends) / num_replicas for name in floating}
        model.load_state_dict({**ends[-1], **averaged}, strict=False)
        opt.step()
    return state(model)


def train(strategy: sg.Strategy, *, sync: bool) -> nn.Module:
    """The same steps inside ``strategy.run``; returns the model."""
    with strategy.scope():
        model = build(sync)
        opt = optimizer(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        opt.step()

    for x, y in strategy.experimental_distribute_dataset(data()):
        strategy.run(step, args=(x, y))
    return model


def fit(strategy: sg.Strategy) -> nn.Module:
    """The same steps through ``sg.Model.fit`` (the batches in order, concatenated)."""
    xs, ys = zip(*data())
    with strategy.scope():
        module = build(True)
        model = sg.Model(module)
        model.compile(optimizer(module), sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in zip(xs, ys):   # one fit per batch: the batches differ in size
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return module

"""The demo's model and training loops: under a strategy, and in plain PyTorch for reference.

:func:`train_with_strategy` trains with ``sg.Model.fit``; every process of a multi-worker
run executes it. :func:`train_plain_pytorch` is the same training on one
device, the oracle that the strategies are checked against (:mod:`stratagem.demo.check`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.demo.data import Digits, ShuffledBatches
from stratagem.keras.progress import LineProgress

__all__ = ["DemoProgress", "OPTIMIZERS", "TrainConfig", "Trained", "accuracy_of", "demo_loss", "make_model", "one_intra_op_thread",
           "progress_bar", "train_plain_pytorch", "train_with_strategy"]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 0.1),     # class, default learning rate
    "adam": (torch.optim.Adam, 0.01),
}


def make_model(num_features: int = 64, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    """The demo's network: a two-layer MLP."""
    return nn.Sequential(nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


@dataclass(frozen=True)
class TrainConfig:
    """The demo's training settings, resolved (``lr`` filled in); the cluster tasks get the same."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str
    seed: int

    def make_optimizer(self, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer][0](params, lr=self.lr)

    def train_batches(self, data: Digits) -> ShuffledBatches:
        return ShuffledBatches(data.x_train, data.y_train, batch_size=self.batch_size, seed=self.seed)

    def test_batches(self, data: Digits) -> ShuffledBatches:
        return ShuffledBatches(data.x_test, data.y_test, batch_size=self.batch_size, shuffle=False)

    def steps_per_epoch(self, data: Digits) -> int:
        return math.ceil(len(data.y_train) / self.batch_size)


@dataclass
class Trained:
    """A strategy's training run: the initial and final parameters, test accuracy, time."""

    initial_state: dict[str, torch.Tensor]
    final_state: dict[str, torch.Tensor]
    accuracy: float
    seconds: float
    steps: int


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run with one intra-op thread per replica, as ``torch.set_num_threads(1)``.

    A 64-wide MLP is too small to gain from splitting a matmul over threads; on a busy
    machine, OpenMP threads waiting for each other made the plain-PyTorch loop 10-30x
    slower (4-8 s instead of 0.3 s). Mirrored replicas still run in parallel, one per
    thread.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def progress_bar(total: int, enabled: bool, ncols: int | None = None, *, lines: bool | None = None) -> Any:
    """The demo's progress on stderr: a tqdm bar on a terminal, else (or when ``lines``) one
    plain line per tenth of the work. ``ncols`` fixes the bar's width (a cluster task's stderr
    is a pipe to the launcher, whose own output may be a terminal)."""
    if lines is None:
        lines = ncols is None and not sys.stderr.isatty()
    if enabled and lines:
        return LineProgress(total, sys.stderr)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=ncols is None, ncols=ncols, leave=True)


class DemoProgress(sg.callbacks.Callback):
    """The demo's callback for ``fit``: sets the epoch of its reshuffled batches, and moves one
    progress bar over the whole run (``epoch e/E loss ...``), where ``fit``'s own progress
    would show one per epoch."""

    def __init__(self, batches: ShuffledBatches | None, bar: Any) -> None:
        super().__init__()
        self._batches, self._bar = batches, bar
        self._epoch = 0
        self._loss = float("nan")   # the last finished epoch's

    def reads_train_batch_logs(self) -> bool:
        # It only counts steps: across workers, reading the loss every step would cost a
        # collective per step (the metrics' global values), a third of the demo's step time.
        return False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._batches is not None:
            self._batches.set_epoch(epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        loss = "" if self._loss != self._loss else f" loss {self._loss:.4f}"   # none before an epoch ends
        self._bar.set_postfix_str(f"epoch {self._epoch + 1}/{self.params['epochs']}{loss}", refresh=False)
        self._bar.update(1)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._loss = float((logs or {}).get("loss", float("nan")))


def demo_loss() -> Any:
    """``F.cross_entropy`` of the logits, as the plain-PyTorch reference computes it."""
    return sg.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_with_strategy(dist_strategy: sg.Strategy, data: Digits, config: TrainConfig, *,
                        progress: bool, ncols: int | None = None, lines: bool | None = None) -> Trained:
    """``sg.Model.fit`` under ``dist_strategy``, then ``evaluate`` for the test accuracy.

    Every worker of a multi-worker strategy runs this same function.
    """
    train, test = config.train_batches(data), config.test_batches(data)
    with dist_strategy.scope():
        torch.manual_seed(config.seed)
        model = sg.Model(make_model(data.num_features))
        model.compile(optimizer=config.make_optimizer(model.module.parameters()), loss=demo_loss(),
                      metrics=["accuracy"])
    initial_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    epochs = config.epochs
    bar = progress_bar(epochs * len(train), enabled=progress, ncols=ncols, lines=lines)
    started = time.perf_counter()
    # fit divides every batch's loss by its true global size (29 rows for the last one)
    model.fit(train, epochs=epochs, callbacks=[DemoProgress(train, bar)], verbose=0)
    seconds = time.perf_counter() - started
    bar.close()
    accuracy = model.evaluate(test, verbose=0, return_dict=True)["accuracy"]
    final_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return Trained(initial_state, final_state, accuracy, seconds, epochs * len(train))


def train_plain_pytorch(initial_state: dict[str, torch.Tensor], data: Digits,
                        config: TrainConfig) -> tuple[nn.Module, float]:
    """The same training in plain single-device PyTorch; returns the model and its test accuracy."""
    train, test = config.train_batches(data), config.test_batches(data)
    reference = make_model(data.num_features)
    reference.load_state_dict(initial_state)
    reference_optimizer = config.make_optimizer(reference.parameters())
    for epoch in range(config.epochs):
        train.set_epoch(epoch)
        for x, y in train:
            loss = F.cross_entropy(reference(x), y)
            reference_optimizer.zero_grad()
            loss.backward()
            reference_optimizer.step()
    return reference, accuracy_of(reference, test)


def accuracy_of(model: nn.Module, test: ShuffledBatches) -> float:
    """The fraction of ``test`` that ``model`` classifies right."""
    with torch.no_grad():
        correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in test)
    return correct / test.num_examples

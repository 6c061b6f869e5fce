"""Callbacks in a real 2-worker job, with a sidecar evaluator beside it.

Run with ``python -m stratagem launch --workers 2 --evaluator 1 workers_script.py OUT``.

The workers train a small model under MultiWorkerMirroredStrategy, calling the callbacks'
hooks from a custom loop with *different* local ``val_loss`` values (worker 0 improves
until epoch 2, worker 1 never does), so that only a global decision stops both at the
same epoch: a worker stopping alone would leave the other waiting in the next step's
all-reduce. Every epoch they save ``OUT/ckpts/ckpt-<n>`` with a CheckpointManager and print
the weights' sum; at the end they mark training finished. Each worker writes
``OUT/rank<r>.json``.

The evaluator task (TF_CONFIG type "evaluator") runs an ``sg.SidecarEvaluator`` on
``OUT/ckpts`` and writes ``OUT/evaluator.json``.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

VAL_LOSS = {0: [1.0, 0.9, 0.8, 0.85, 0.7, 0.6], 1: [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    return x, x.sum(1, keepdim=True)


def weight_sum(module: torch.nn.Module) -> float:
    return sum(p.detach().sum().item() for p in module.parameters())


def evaluate(module: torch.nn.Module, batch: tuple, steps: object) -> dict:
    x, y = batch
    with torch.no_grad():
        return {"loss": F.mse_loss(module(x), y).item(), "weight_sum": weight_sum(module)}


def evaluator(out: Path) -> None:
    sidecar = sg.SidecarEvaluator(torch.nn.Linear(4, 1), data(), out / "ckpts", evaluate_fn=evaluate,
                                  summary_dir=out / "eval", poll_interval=0.1, timeout=150)
    results = sidecar.start()
    (out / "evaluator.json").write_text(json.dumps({str(n): r for n, r in results.items()}))


def fit(strategy: sg.Strategy, rank: int, out: Path) -> dict:
    """The same callbacks with sg.Model.fit; EarlyStopping stops it at epoch 1 (nothing beats min_delta)."""
    with strategy.scope():
        torch.manual_seed(0)
        model = sg.Model(torch.nn.Linear(4, 1))
        model.compile("sgd", "mse", metrics=["mae"])
    callbacks = [sg.callbacks.EarlyStopping(monitor="val_mae", min_delta=100.0, patience=1),
                 sg.callbacks.ModelCheckpoint(out / "fit-{epoch}-{val_loss:.4f}"),
                 sg.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05),
                 sg.callbacks.CSVLogger(out / f"fit-rank{rank}.csv"),
                 sg.callbacks.TensorBoard(out / f"fit-tb-rank{rank}")]
    x, y = data()
    history = model.fit(x, y, batch_size=8, epochs=5, validation_data=(x, y), callbacks=callbacks, verbose=0)
    return {"epochs": history.epoch, "val_loss": history.history["val_loss"], "lr": history.history["lr"]}


def train(out: Path) -> None:
    strategy = sg.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_rank
    torch.manual_seed(0)
    with strategy.scope():
        module = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = SimpleNamespace(module=module, optimizer=optimizer, strategy=strategy, stop_training=False)
    callbacks = [sg.callbacks.EarlyStopping(patience=1, restore_best_weights=True),
                 sg.callbacks.ModelCheckpoint(out / "best-{epoch}", save_best_only=True),
                 sg.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5 ** epoch),
                 sg.callbacks.CSVLogger(out / f"log-rank{rank}.csv"),
                 sg.callbacks.TensorBoard(out / f"tb-rank{rank}")]
    manager = sg.CheckpointManager(sg.Checkpoint(model=module, optimizer=optimizer), out / "ckpts", max_to_keep=None)
    loader = strategy.experimental_distribute_dataset(DataLoader(TensorDataset(*data()), batch_size=8))

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(F.mse_loss(module(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        return loss

    for callback in callbacks:
        callback.set_model(model)
        callback.set_params({"epochs": 6, "steps": 2, "verbose": 0})
        callback.on_train_begin()
    report = {"rank": rank, "epochs": [], "weights": [], "lr": []}
    for epoch in range(6):
        for callback in callbacks:
            callback.on_epoch_begin(epoch)
        for index, batch in enumerate(loader):
            loss = strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)
            for callback in callbacks:
                callback.on_train_batch_end(index, {"loss": loss.item()})
        logs = {"loss": loss.item(), "val_loss": VAL_LOSS[rank][epoch]}
        for callback in callbacks:
            callback.on_epoch_end(epoch, logs)
        path = manager.save()
        print(f"rank {rank} saved {Path(path).name} weight_sum={weight_sum(module):.6f}", flush=True)
        report["epochs"].append(epoch)
        report["weights"].append(weight_sum(module))
        report["lr"].append(logs["lr"])
        if model.stop_training:
            break
    for callback in callbacks:
        callback.on_train_end()
    manager.mark_training_finished()
    report.update(stopped_epoch=callbacks[0].stopped_epoch, best_epoch=callbacks[0].best_epoch,
                  final_weights=weight_sum(module), fit=fit(strategy, rank, out))
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    if sg.cluster.TFConfigClusterResolver().task_type == "evaluator":
        evaluator(directory)
    else:
        train(directory)

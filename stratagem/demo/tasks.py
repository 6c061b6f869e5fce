"""What the tasks of ``stratagem demo``'s local cluster run (:mod:`stratagem.demo.cluster` starts them).

Each task is started by :func:`stratagem.launch.launch_local` with its TF_CONFIG and runs
:func:`task_main`: every worker of ``multi_worker`` trains with
``MultiWorkerMirroredStrategy`` (:func:`stratagem.demo.training.train_with_strategy`, as the
strategies of one process do); the coordinator of ``parameter_server`` (the launch's chief)
trains with ``sg.Model.fit``, which schedules the steps on the workers with ``ClusterCoordinator``, the workers and the
parameter server being ``stratagem server`` processes. The chief saves what the demo's
process reads back: initial and final parameters, test accuracy, time and steps.

The data set comes in a file written by the demo, so the tasks need not import scikit-learn.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterator, Sequence

import torch

import stratagem as sg
from stratagem.demo.data import Digits, ShuffledBatches, load_digits_split
from stratagem.demo.training import (DemoProgress, TrainConfig, demo_loss, make_model, one_intra_op_thread,
                                     progress_bar, train_with_strategy)

__all__ = ["task_main", "worker_batches"]


def task_main(argv: Sequence[str] | None = None) -> int:
    """What a task of the demo's cluster runs: ``multi_worker`` (every worker) or ``coordinator``.

    Only the chief writes the result file (``torch.save`` of a dict of tensors and numbers).
    """
    parser = argparse.ArgumentParser(prog="python -m stratagem.demo.tasks",
                                     description="a task of `stratagem demo`'s local cluster "
                                                 "(started by the demo, with TF_CONFIG)")
    parser.add_argument("role", choices=["multi_worker", "coordinator"])
    parser.add_argument("--result", required=True, help="where the chief saves its result")
    parser.add_argument("--data", help="the split data set, saved by the demo (default: load it here)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--ncols", type=int, default=0,
                        help="progress bar width; 0: no progress; -1: plain lines (output is no terminal)")
    args = parser.parse_args(argv)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         optimizer=args.optimizer, seed=args.seed)
    with one_intra_op_thread():
        data = Digits(**torch.load(args.data, weights_only=True)) if args.data else load_digits_split()
        if args.role == "multi_worker":
            saved = _multi_worker_task(data, config, args.replicas, args.ncols)
        else:
            saved = _coordinator_task(data, config, args.ncols)
    if saved is not None:
        partial = args.result + ".partial"
        torch.save(saved, partial)
        os.replace(partial, args.result)
    return 0


def _multi_worker_task(data: Digits, config: TrainConfig, replicas: int, ncols: int) -> dict[str, Any] | None:
    strategy = sg.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    show = ncols != 0 and strategy.is_chief
    trained = train_with_strategy(strategy, data, config, progress=show, ncols=max(ncols, 0) or None,
                                  lines=ncols < 0)
    if not strategy.is_chief:
        return None
    return {"initial": trained.initial_state, "final": trained.final_state, "accuracy": trained.accuracy,
            "seconds": trained.seconds, "steps": trained.steps, "strategy": repr(strategy),
            "num_replicas": strategy.num_replicas_in_sync}


def worker_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int,
                   worker: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A parameter-server worker's dataset: the training set in global batches, epoch after epoch.

    Each worker reshuffles with a seed of its own, so two workers do not compute the same
    batch at the same time.
    """
    batches = ShuffledBatches(x, y, batch_size=batch_size, seed=seed * 1_000 + 1 + worker)
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


def _coordinator_task(data: Digits, config: TrainConfig, ncols: int) -> dict[str, Any]:
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver())
    sg.ClusterCoordinator(strategy)   # the strategy keeps it; fit schedules the steps through it
    with strategy.scope():
        torch.manual_seed(config.seed)
        model = sg.Model(make_model(data.num_features))
        model.compile(optimizer=config.make_optimizer(model.module.parameters()), loss=demo_loss(),
                      metrics=["accuracy"])
    initial = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    x_train, y_train = data.x_train, data.y_train
    batch_size, seed = config.batch_size, config.seed

    def dataset_fn(context: sg.InputContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return worker_batches(x_train, y_train, batch_size, seed, context.input_pipeline_id)

    steps_per_epoch = config.steps_per_epoch(data)
    steps = config.epochs * steps_per_epoch
    bar = progress_bar(steps, enabled=ncols != 0, ncols=max(ncols, 0) or None, lines=ncols < 0)
    started = time.perf_counter()
    # each worker reads its own endless dataset_fn input; fit schedules the steps through the coordinator
    model.fit(dataset_fn, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
              callbacks=[DemoProgress(None, bar)], verbose=0)
    seconds = time.perf_counter() - started
    bar.close()
    accuracy = model.evaluate(config.test_batches(data), verbose=0, return_dict=True)["accuracy"]
    final = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"initial": initial, "final": final, "accuracy": accuracy, "seconds": seconds, "steps": steps,
            "strategy": repr(strategy), "num_replicas": strategy.num_replicas_in_sync}


if __name__ == "__main__":
    sys.exit(task_main())

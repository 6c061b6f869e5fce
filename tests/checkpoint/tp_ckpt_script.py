"""sg.Checkpoint across layouts: trains the Megatron MLP under one layout, saving or restoring on the way.

Usage (one process per task, with TF_CONFIG):
    python tp_ckpt_script.py OUT --layout tp:D,T|mwms --tag NAME
        [--start PATH_FORMAT] [--save DIR_FORMAT --save-at K] [--restore DIR_FORMAT] [--wrong PATH] [--fit DIR]

For each optimizer kind (``{kind}`` in the formats is "sgd" or "adam"): build the model and
optimizer in scope, then either restore ``--start`` (a plain checkpoint of step 0) or
``--restore`` (the newest checkpoint of a CheckpointManager directory), train to the end of
the data, saving with a CheckpointManager after step ``--save-at`` when ``--save`` is given.
``--wrong``: restoring this checkpoint (of another model) must fail on every process.
``--fit``: also trains with sg.Model.fit under the strategy, once with a BackupAndRestore
interrupted after one epoch and resumed, and reports the weights, logs and a reduced value.
``--absent SECONDS`` (instead of training): under a strategy of the layout whose communication timeout
is SECONDS, process 1 does not call save, and process 0's save must raise UnavailableError within it
(written to OUT/NAME-absent.json with the seconds it took). A job of its own: every group of a process
keeps the timeout of its first strategy.
Writes OUT/NAME-rank{R}.json.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: run as a script, or imported
from tests.placement.layout.tp_script import PLAN, MegatronMLP, make_optimizer, per_example_loss  # noqa: E402

STEPS, BATCH = 4, 8
KINDS = ("sgd", "adam")


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(STEPS * BATCH, 8, generator=g, dtype=torch.float64),
                         torch.randn(STEPS * BATCH, 8, generator=g, dtype=torch.float64))


def make_strategy(layout: str, timeout: float | None = None):
    if layout == "mwms":
        return sg.MultiWorkerMirroredStrategy()
    d, t = (int(v) for v in layout.split(":")[1].split(","))
    options = sg.CommunicationOptions(timeout_seconds=timeout)
    return sg.experimental.TensorParallelStrategy(mesh={"data": d, "model": t}, plan=PLAN,
                                                  communication_options=options)


def absent(strategy, out: Path, tag: str) -> None:
    """Process 1 does not call save: process 0's save raises within the timeout; both then leave."""
    with strategy.scope():
        model = MegatronMLP()
        optimizer = make_optimizer("sgd", model.parameters())
    done = out / f"{tag}-absent-done"
    if strategy.checkpoint_collective.worker_index == 0:
        started = time.monotonic()
        try:
            sg.Checkpoint(model=model, optimizer=optimizer).save(out / "absent")
            error = None
        except sg.errors.UnavailableError as failure:
            error = str(failure)
        (out / f"{tag}-absent.json").write_text(json.dumps({"error": error, "seconds": time.monotonic() - started}))
        done.touch()
    else:
        deadline = time.monotonic() + 200
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    print("done", flush=True)
    os._exit(0)   # the process group is broken: leave without its teardown


def listed(state: dict) -> dict:
    return {k: v.tolist() for k, v in state.items()}


def train(strategy, kind: str, args, result: dict) -> None:
    with strategy.scope():
        model = MegatronMLP()
        optimizer = make_optimizer(kind, model.parameters())
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=BATCH))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)
    if args.start:
        ckpt.restore(args.start.format(kind=kind))
    if args.restore:
        result[f"{kind}_restored"] = sg.CheckpointManager(ckpt, args.restore.format(kind=kind)).restore_or_initialize()
        result[f"{kind}_restored_params"] = listed(model.state_dict())
    manager = sg.CheckpointManager(ckpt, args.save.format(kind=kind)) if args.save else None

    def step(x, y):
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(per_example_loss(model(x), y))
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    for x, y in data:
        losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None).item())
        ckpt.step += 1
        if manager is not None and ckpt.step == args.save_at:
            result[f"{kind}_saved"] = manager.save()
    result[f"{kind}_steps"] = ckpt.step
    result[f"{kind}_losses"] = losses
    result[f"{kind}_final"] = listed(model.state_dict())
    result[f"{kind}_is_writer"] = ckpt.is_writer
    if args.wrong and kind == "sgd":
        before = listed(model.state_dict())
        try:
            sg.Checkpoint(model=model, optimizer=optimizer).restore(args.wrong)
            result["wrong"] = None
        except sg.errors.CheckpointError as error:
            result["wrong"] = str(error)
        result["wrong_unchanged"] = listed(model.state_dict()) == before


def fit(strategy, directory: str, result: dict) -> None:
    x, y = samples().tensors

    def build():
        with strategy.scope():
            model = sg.Model(MegatronMLP())
            model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9),
                          loss="mse", metrics=["mae"])
        return model
    model = build()
    model.module.load_state_dict(torch.load(os.path.join(directory, "initial.pt"), weights_only=True))
    backup = sg.callbacks.BackupAndRestore(os.path.join(directory, "backup"), delete_checkpoint=False)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[backup])
    # a fresh job: the backup of epoch 1 is restored, and epoch 2 runs
    model = build()
    backup = sg.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    resumed = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    result["fit_history"] = [history.history, resumed.history]
    result["fit_final"] = listed(model.module.state_dict())
    result["fit_evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    result["fit_predict_shape"] = list(model.predict(x, batch_size=BATCH, verbose=0).shape)
    with strategy.scope():
        mean = sg.metrics.Mean()
    mine = float(strategy.topology.worker_index + 1)   # the data rank + 1: alike in a model group

    def update():
        mean.update_state(torch.tensor([mine]))
        return torch.tensor(mine)
    per_replica = strategy.run(update)
    result["reduced"] = strategy.reduce("sum", per_replica, axis=None).item()
    result["metric"] = float(mean.result())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layout", required=True)
    parser.add_argument("--tag", required=True)
    for option in ("--start", "--save", "--restore", "--wrong", "--fit"):
        parser.add_argument(option)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--absent", type=float)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    rank = sg.cluster.resolve().worker_rank
    torch.manual_seed(100 + rank)   # every process starts elsewhere: restores and the chief's values win
    if args.absent is not None:
        absent(make_strategy(args.layout, args.absent), Path(args.out), args.tag)
    strategy = make_strategy(args.layout, args.timeout)
    result = {"rank": rank}
    # a shuffled loader: the processes of a model group get the same rows (the seed is agreed)
    shuffled = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True)
    result["shuffled"] = [torch.cat(strategy.experimental_local_results(ids)).tolist()
                          for (ids,) in strategy.experimental_distribute_dataset(shuffled)]
    for kind in KINDS:
        train(strategy, kind, args, result)
    if args.fit:
        fit(strategy, args.fit, result)
    Path(args.out, f"{args.tag}-rank{rank}.json").write_text(json.dumps(result))
    print("done", flush=True)


if __name__ == "__main__":
    main()

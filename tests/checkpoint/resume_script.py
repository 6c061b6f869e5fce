"""Trains 3 epochs over a shuffled DataLoader under MirroredStrategy(2), backed up every 3 steps.

Usage: python resume_script.py BACKUP_DIR LOG_FILE [--pause-at STEPS]
Appends one JSON line per step to LOG_FILE ({"step": global step, "ids": sample ids}); prints
"resumed <epoch> <step>" at the start and "saved <steps>" after each backup (after the one at --pause-at
steps it waits 60 s, so that a test can kill it there); at the end writes the final parameters as JSON to LOG_FILE + ".final".
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

EPOCHS = 3


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(27, 5, generator=g), torch.randint(0, 3, (27,), generator=g), torch.arange(27))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("log")
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(42)
    data = strategy.experimental_distribute_dataset(DataLoader(dataset(), batch_size=6, shuffle=True))
    checkpoint = sg.Checkpoint(model=model, optimizer=optimizer, data=data, steps=0)
    backup = sg.callbacks.BackupAndRestore(args.backup_dir, save_freq=3)
    epoch, step = backup.restore(checkpoint)
    print("resumed", epoch, step, flush=True)

    def train_step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    with open(args.log, "a") as log:
        for epoch in range(data.epoch, EPOCHS):
            for x, y, ids in data:
                strategy.run(train_step, args=(x, y))
                checkpoint.steps += 1
                log.write(json.dumps({"step": checkpoint.steps,
                                      "ids": torch.cat(strategy.experimental_local_results(ids)).tolist()}) + "\n")
                log.flush()
                backup.on_train_batch_end()
                if checkpoint.steps % 3 == 0:
                    print("saved", checkpoint.steps, flush=True)
                    if checkpoint.steps == args.pause_at:
                        time.sleep(60)
            backup.on_epoch_end(epoch)
    backup.on_train_end()
    with open(args.log + ".final", "w") as f:
        json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)


if __name__ == "__main__":
    main()

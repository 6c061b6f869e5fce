"""A float64 MultiWorkerMirroredStrategy job that backs itself up every step, for the Ray tests.

Usage (under ``launch_ray`` / ``stratagem launch --ray``, which set TF_CONFIG and
STRATAGEM_RESTART)::

    python ray_script.py OUT [--hold RESTART:RANK:STEP] [--timeout 60]

:data:`EPOCHS` epochs of :func:`samples` in order (global batch :data:`GLOBAL_BATCH`, no
shuffle) go through ``strategy.experimental_distribute_dataset``; the model, the optimizer,
the dataset's position and the global step are in an ``sg.Checkpoint`` that
``sg.callbacks.BackupAndRestore`` backs up to ``OUT/backups`` after every step and restores at
start-up. The chief writes ``OUT/initial.pt`` (the parameters before the first step of the
first run) and ``OUT/final.pt`` (at the end).

Lines: ``restart R rank N pid P actor Q at HOST:PORT`` at start (Q: the process that
started this one, its Ray actor; HOST:PORT: its TF_CONFIG address), ``restart R rank N resumes at step S`` after a restore, ``restart R rank N
step S done`` after each step. ``--hold 0:1:3``: in run 0, rank 1 prints ``rank 1 holds after
step 3`` once step 3 is done and backed up, then waits (up to 120 s) -- for the test to kill
its actor.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH = 2, 4, 8


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    count = STEPS_PER_EPOCH * GLOBAL_BATCH
    return TensorDataset(torch.randn(count, 4, generator=g, dtype=torch.float64),
                         torch.randint(0, 2, (count,), generator=g))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2, dtype=torch.float64))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hold", default="")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    restart = int(os.environ["STRATAGEM_RESTART"])
    strategy = sg.MultiWorkerMirroredStrategy(
        communication_options=sg.CommunicationOptions(timeout_seconds=args.timeout))
    rank = strategy.cluster_resolver.worker_rank
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    address = json.loads(os.environ["TF_CONFIG"])["cluster"][task["type"]][task["index"]]
    print(f"restart {restart} rank {rank} pid {os.getpid()} actor {os.getppid()} at {address}", flush=True)
    hold = tuple(int(part) for part in args.hold.split(":")) if args.hold else None

    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model.parameters())
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=GLOBAL_BATCH))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)
    backup = sg.callbacks.BackupAndRestore(os.path.join(args.out, "backups"), save_freq=1)
    backup.restore(ckpt)
    if ckpt.step:
        print(f"restart {restart} rank {rank} resumes at step {ckpt.step}", flush=True)
    elif strategy.is_chief and restart == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "initial.pt"))

    def train_step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for epoch in range(data.epoch, EPOCHS):
        for x, y in data:
            step = ckpt.step
            strategy.run(train_step, args=(x, y))
            ckpt.step += 1
            backup.on_train_batch_end()
            print(f"restart {restart} rank {rank} step {step} done", flush=True)
            if hold == (restart, rank, step):
                print(f"rank {rank} holds after step {step}", flush=True)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    time.sleep(0.05)
        backup.on_epoch_end(epoch)
    if strategy.is_chief:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    print(f"restart {restart} rank {rank} finished", flush=True)


if __name__ == "__main__":
    sys.exit(main())

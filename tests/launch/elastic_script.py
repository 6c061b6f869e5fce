"""A float64 MultiWorkerMirroredStrategy job whose result must not depend on how many workers ran it.

Usage (under ``stratagem launch``)::

    python elastic_script.py OUT

Two epochs of a shuffled ``DataLoader`` (72 samples, global batch 12: 6 steps an epoch, a global
batch that 1, 2, 3, 4 or 6 workers split evenly) go through
``strategy.experimental_distribute_dataset``; ``sg.callbacks.BackupAndRestore`` backs up the
model, the optimizer (Adam), the data position and the step every 2 steps to ``OUT/backups``
and restores at start-up, whatever the number of workers now. Every step prints
``restart R rank N of W step S``; each worker appends ``{"restart", "workers", "step", "ids"}``
(the ids of its slice of the global batch) to ``OUT/ids-rank<N>-restart<R>.jsonl``, and
``{"resume": step}`` first. The chief writes ``OUT/final.pt`` at the end.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

EPOCHS, SAMPLES, GLOBAL_BATCH = 2, 72, 12


def main():
    out = sys.argv[1]
    restart = int(os.environ["STRATAGEM_RESTART"])
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=15))
    rank, workers = strategy.cluster_resolver.worker_rank, strategy.cluster_resolver.num_workers
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64),
                            torch.randint(0, 3, (SAMPLES,), generator=g), torch.arange(SAMPLES))
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(42)
    data = strategy.experimental_distribute_dataset(DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=True))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)
    backup = sg.callbacks.BackupAndRestore(os.path.join(out, "backups"), delete_checkpoint=False, save_freq=2)
    backup.restore(ckpt)
    log = open(os.path.join(out, f"ids-rank{rank}-restart{restart}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"resume": ckpt.step}) + "\n")

    def train_step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for epoch in range(data.epoch, EPOCHS):
        for x, y, ids in data:
            step = ckpt.step
            print(f"restart {restart} rank {rank} of {workers} step {step}", flush=True)
            strategy.run(train_step, args=(x, y))
            ckpt.step += 1
            local = torch.cat(strategy.experimental_local_results(ids)).tolist()
            log.write(json.dumps({"restart": restart, "workers": workers, "step": step, "ids": local}) + "\n")
            backup.on_train_batch_end()
        backup.on_epoch_end(epoch)
    if strategy.is_chief:
        torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    print(f"restart {restart} rank {rank} of {workers} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())

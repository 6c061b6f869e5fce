"""A small MultiWorkerMirroredStrategy job that backs itself up and resumes, for restart tests.

Usage (under ``stratagem launch``, which sets TF_CONFIG and STRATAGEM_RESTART)::

    python restart_script.py OUT [--save-every 1] [--timeout 20]
                             [--event RESTART:RANK:STEP:ACTION ...] [--watch] [--step-seconds T]

Two epochs of a shuffled ``DataLoader`` (48 samples, global batch 8: :data:`STEPS_PER_EPOCH`
steps an epoch) go through ``strategy.experimental_distribute_dataset``. The model, the
optimizer, the dataset (its position: epoch, step, shuffle state) and the global step are
in an ``sg.Checkpoint`` that ``sg.callbacks.BackupAndRestore`` backs up to ``OUT/backups``
every ``--save-every`` steps (0: only when the workers agree to stop for preemption, with
``--watch``) and restores at start-up, so a restarted job goes on from its last backup.
The chief writes ``OUT/final.pt`` (the parameters) at the end.

The sample-id log: after each trained step every worker appends a line to
``OUT/ids-rank<N>.jsonl`` -- ``{"restart", "epoch", "step", "ids"}`` with the global step
and the ids of the samples in its slice of the batch -- and at start-up
``{"restart", "resume": step}``, the global step its restored backup goes on from.

``--event 0:1:5:kill`` makes rank 1, in the group's first run (STRATAGEM_RESTART=0), do
ACTION just before it trains global step 5 (from 0): ``kill`` (SIGKILL itself), ``stop``
(SIGSTOP itself: a hung worker) or ``term`` (SIGTERM itself: a preemption notice). Each
step prints ``restart R rank N step S``.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
# torch imports dynamo at the first optimizer (a second here, several under load), right before the
# collective that agrees on the model's initial values: with a test's 6 s collective timeout, a worker
# slower to import can make the other time out before any event (a restart no test asked for). Now, before
# the cluster, where the rendezvous absorbs the difference.
import torch._dynamo  # noqa: F401
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH = 2, 6, 8


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    count = STEPS_PER_EPOCH * GLOBAL_BATCH
    return TensorDataset(torch.randn(count, 4, generator=g), torch.randint(0, 2, (count,), generator=g),
                         torch.arange(count))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--event", action="append", default=[])
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep in every step")
    args = parser.parse_args()

    restart = int(os.environ["STRATAGEM_RESTART"])
    options = sg.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.worker_rank
    events = {}
    for event in args.event:
        at_restart, at_rank, step, action = event.split(":")
        if int(at_restart) == restart and int(at_rank) == rank:
            events[int(step)] = action

    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(42)   # the shuffles' source; a restore sets it to its state at the backup
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=GLOBAL_BATCH, shuffle=True))
    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)
    # save_freq in steps; "only on preemption" is a period longer than the job
    backup = sg.callbacks.BackupAndRestore(os.path.join(args.out, "backups"), delete_checkpoint=False,
                                           save_freq=args.save_every or 10**9)
    backup.restore(ckpt)
    log = open(os.path.join(args.out, f"ids-rank{rank}.jsonl"), "a", buffering=1)   # a write per line
    log.write(json.dumps({"restart": restart, "resume": ckpt.step}) + "\n")
    if ckpt.step:
        print(f"restart {restart} rank {rank} resumes at step {ckpt.step}", flush=True)
    watcher = sg.PreemptionWatcher(strategy) if args.watch else None

    def train_step(x, y):
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    try:
        for epoch in range(data.epoch, EPOCHS):   # after a restore: the interrupted epoch, at its step
            for x, y, ids in data:
                step = ckpt.step
                print(f"restart {restart} rank {rank} step {step}", flush=True)
                action = events.get(step)
                if action:   # every save before this step has returned here: it is complete
                    print(f"rank {rank} sends itself SIG{action.upper()} at {time.time():.3f}", flush=True)
                    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP,
                                          "term": signal.SIGTERM}[action])
                strategy.run(train_step, args=(x, y))
                ckpt.step += 1
                local_ids = torch.cat(strategy.experimental_local_results(ids)).tolist()
                log.write(json.dumps({"restart": restart, "epoch": epoch, "step": step, "ids": local_ids}) + "\n")
                time.sleep(args.step_seconds)
                backup.on_train_batch_end()   # a backup every --save-every steps
                if watcher is not None and watcher.should_stop():
                    print(f"rank {rank} stops for preemption after step {step}", flush=True)
                    backup.save()
                    watcher.exit()
            backup.on_epoch_end(epoch)
    except sg.errors.UnavailableError:
        print(f"rank {rank} raised UnavailableError at {time.time():.3f}", flush=True)
        raise
    if strategy.is_chief:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    print(f"restart {restart} rank {rank} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())

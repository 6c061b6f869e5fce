"""Training that survives restarts and preemption: resume from a checkpoint, save on SIGTERM.

The same script runs alone or as several workers (docs/fault_tolerance.md explains each part)::

    python examples/preemptible.py --dir /tmp/run1
    stratagem launch --workers 2 --max-restarts 3 examples/preemptible.py --dir /tmp/run2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/preemptible.py --dir /tmp/run3

While it trains (``--step-seconds 0.05`` slows it down enough to try by hand):

- ``kill -TERM <pid of one worker>``: the workers agree on a step, the chief saves, they
  exit with 75, and ``stratagem launch`` restarts them all; they resume from that step.
- ``kill -KILL <pid of one worker>``: the group restarts (one of ``--max-restarts``) and
  resumes from the last periodic checkpoint (every ``--save-every`` steps).
- run the same command again after it finished: it finds its work done.

The checkpoint (``sg.Checkpoint`` in an ``sg.CheckpointManager``: ``--dir/ckpt-<n>``) holds
the model, the optimizer, the step and the position of the shuffled input, so a resumed
run trains exactly the batches that an uninterrupted run trains and ends with the same
parameters -- also when it resumes with another number of workers.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg


def samples(count: int = 1280) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(count, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long())   # a rule the model can learn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint folder (see docs/checkpoints.md "
                                                     "for folders the workers do not share)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    strategy = sg.MultiWorkerMirroredStrategy(
        communication_options=sg.CommunicationOptions(timeout_seconds=60))   # a hung peer: 60 s
    torch.manual_seed(0)   # the same start in every run (the chief's values are used anyway)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # 20 global batches of 64 an epoch, reshuffled every epoch
    data = strategy.experimental_distribute_dataset(DataLoader(samples(), batch_size=64, shuffle=True))

    ckpt = sg.Checkpoint(model=model, optimizer=optimizer, data=data, step=0)
    manager = sg.CheckpointManager(ckpt, args.dir, max_to_keep=3)
    manager.restore_or_initialize()   # every worker: the newest good checkpoint, or a fresh start
    restart = os.environ.get("STRATAGEM_RESTART", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if strategy.is_chief:
        print(f"restart {restart}: starting at step {ckpt.step} of {args.steps}", flush=True)

    def train_step(inputs):
        x, y = inputs
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    saved = ckpt.step
    with sg.PreemptionWatcher(strategy) as watcher:
        while ckpt.step < args.steps:
            for inputs in data:   # after a restore: the interrupted epoch, from the saved step on
                loss = strategy.reduce("sum", strategy.run(train_step, args=(inputs,)), axis=None)
                ckpt.step += 1
                time.sleep(args.step_seconds)
                if watcher.should_stop():   # every worker asks, at the same point of every step
                    manager.save()          # every worker calls it; the chief writes
                    if strategy.is_chief:
                        print(f"preempted: saved step {ckpt.step}; exiting to be restarted", flush=True)
                    watcher.exit()   # waits for every worker, then exits with 75
                if ckpt.step % args.save_every == 0:
                    saved = ckpt.step
                    manager.save()
                if strategy.is_chief and ckpt.step % 50 == 0:
                    print(f"step {ckpt.step}: loss {loss.item():.4f}", flush=True)
                if ckpt.step == args.steps:
                    break
    if saved != ckpt.step:
        manager.save()
    if strategy.is_chief:
        print(f"done: {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()

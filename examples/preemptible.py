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

Every step's batch is a function of the step number, so a resumed run trains exactly the
steps that an uninterrupted run trains and ends with the same parameters.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

import stratagem as sg


def batch_for(step: int, size: int = 64):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, generator=g)
    return x, (x[:, :4].sum(dim=1) > 0).long()   # a rule the model can learn


def save(path: str, state: dict) -> None:
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)   # whole or absent: a kill never leaves half a checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint folder, shared by the workers")
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

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "checkpoint.pt")
    start = 0
    if os.path.exists(path):   # every worker loads the chief's last save
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    restart = os.environ.get("STRATAGEM_RESTART", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if strategy.is_chief:
        print(f"restart {restart}: starting at step {start} of {args.steps}", flush=True)

    def train_step(inputs):
        x, y = inputs
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def checkpoint(next_step: int) -> None:
        if strategy.is_chief:   # one writer; the others wait in the next collective
            save(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": next_step})

    data = strategy.experimental_distribute_dataset([batch_for(s) for s in range(start, args.steps)])
    with sg.PreemptionWatcher(strategy) as watcher:
        for step, inputs in zip(range(start, args.steps), data):
            loss = strategy.reduce("sum", strategy.run(train_step, args=(inputs,)), axis=None)
            time.sleep(args.step_seconds)
            if watcher.should_stop():   # every worker asks, at the same point of every step
                checkpoint(step + 1)
                if strategy.is_chief:
                    print(f"preempted: saved step {step + 1}; exiting to be restarted", flush=True)
                watcher.exit()   # waits for every worker, then exits with 75
            if (step + 1) % args.save_every == 0:
                checkpoint(step + 1)
            if strategy.is_chief and (step + 1) % 50 == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    checkpoint(args.steps)
    if strategy.is_chief:
        print(f"done: {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()

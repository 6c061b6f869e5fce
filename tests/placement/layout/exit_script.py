"""Trains one step under MultiWorkerMirroredStrategy(sharding="parameters") (FSDP2) and one under a
second MultiWorkerMirroredStrategy in the same processes, then ends: the process must exit 0.

Before the strategies start it registers an ``atexit`` handler, which therefore runs after every
handler the strategies register: by then no heartbeat thread may still be running (it calls
torch's store, C++ code: a daemon thread inside it when the interpreter finalizes aborts the
process with "terminate called without an active exception", some of the time); it exits with
code 3 naming them if one is.

Usage: python exit_script.py
"""

import atexit
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def _check_threads() -> None:
    left = [t.name for t in threading.enumerate() if t.name == "stratagem-heartbeat" and t.is_alive()]
    if left:
        print(f"threads still running at exit: {left}", flush=True)
        os._exit(3)
    print("no threads left at exit", flush=True)


import torch  # noqa: E402

import stratagem as sg  # noqa: E402


def train_one_step(strategy) -> float:
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    loss = strategy.run(step, args=(torch.ones(2, 4),))
    return strategy.reduce("sum", loss, axis=None).item()


def main() -> int:
    options = sg.CommunicationOptions(timeout_seconds=60)
    strategy = sg.MultiWorkerMirroredStrategy(sharding="parameters", communication_options=options)
    rank = strategy.cluster_resolver.worker_rank
    train_one_step(strategy)
    second = sg.MultiWorkerMirroredStrategy(sharding="gradients", communication_options=options)
    train_one_step(second)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    atexit.register(_check_threads)   # before any strategy's: runs after them
    sys.exit(main())

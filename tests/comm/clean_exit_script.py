"""A job's worker that trains one step under MultiWorkerMirroredStrategy and ends, as the Slurm
guide's script does: it must exit 0 with none of gloo's threads left once the strategy has closed.

The check is an ``atexit`` handler registered before the strategy exists, so it runs after the
strategy's own (which leave the process group). A gloo thread still alive then can be releasing a
finished collective's tensors when the interpreter finalizes, which aborts the process
("terminate called without an active exception") after a successful run, a few runs in a hundred on
a busy machine; the handler makes that visible every time: exit 3, naming the threads.

Usage: stratagem launch --workers 2 clean_exit_script.py
"""

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:   # (a thread that ended meanwhile)
            pass
    return [name for name in names if "gloo" in name]


def _check() -> None:
    left = _gloo_threads()
    if left:
        print(f"gloo threads still running at exit: {left}", flush=True)
        os._exit(3)
    print("no gloo threads at exit", flush=True)


atexit.register(_check)   # before the strategy's handlers: runs after them

import torch  # noqa: E402

import stratagem as sg  # noqa: E402

strategy = sg.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x):
    loss = sg.nn.compute_average_loss(model(x).pow(2).sum(dim=1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


loss = strategy.reduce("sum", strategy.run(step, args=(torch.ones(2, 4),)), axis=None)
print(f"worker {strategy.cluster_resolver.task_id} done, loss {loss.item():.4f}", flush=True)

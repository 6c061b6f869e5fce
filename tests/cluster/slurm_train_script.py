"""Trains under ``sg.MultiWorkerMirroredStrategy()`` -- no arguments -- in a Slurm job step.

Every task finds its cluster from Slurm's variables alone, trains a small float64 model on its
share of each global batch, and writes its final parameters to OUT_DIR/rankR.json; the test
compares them with :func:`plain` (one process, plain PyTorch, the whole batches).

Usage: srun --ntasks=2 python slurm_train_script.py OUT_DIR
(``SLURM_TEST_KILL_RANK=R``: rank R kills itself with SIGKILL before its third step.)
"""

import json
import os
import signal
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 6
GLOBAL_BATCH = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make_data() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def listening() -> list[str]:
    """The listening TCP sockets of this network namespace: ``ss -ltnp``'s lines."""
    return subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=30).stdout.splitlines()[1:]


def plain() -> dict:
    """The same training in one process with plain PyTorch."""
    model = make_model()
    optimizer = make_optimizer(model)
    for x, y in make_data():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def main(out: str) -> int:
    import stratagem as sg

    strategy = sg.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    rank = resolver.worker_rank
    print(f"[task {os.environ.get('SLURM_PROCID')}] {type(resolver).__name__}: {resolver.task_type} "
          f"{resolver.task_id}, rank {rank} of {resolver.num_workers}, "
          f"cluster {resolver.cluster_spec().as_dict()}", flush=True)
    sockets = listening()   # the rendezvous store and gloo's sockets are up
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model)

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for i, batch in enumerate(strategy.experimental_distribute_dataset(make_data())):
        if i == 2 and os.environ.get("SLURM_TEST_KILL_RANK") == str(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        strategy.run(step, args=(batch,))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"params": {k: v.tolist() for k, v in model.state_dict().items()},
                   "resolver": type(resolver).__name__, "num_workers": resolver.num_workers,
                   "listening": sockets}, f)
    print(f"[task {os.environ.get('SLURM_PROCID')}] rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Trains with a GradScaler created in scope under MultiWorkerMirroredStrategy; the test compares
the scale and the parameters after every step with plain PyTorch's GradScaler on the whole batch.

Usage (one process per task, each with TF_CONFIG or torchrun variables):
    python amp_script.py OUT_DIR [--replicas-per-worker K] [--sharding optimizer] [--clip 0.5]
                         [--poison STEP:WORKER,...]
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

BATCH = 12
STEPS = 7


def scaled_step(model, optimizer, scaler, loss, clip=None):
    """The GradScaler loop of torch's AMP recipe: scale, backward, unscale, clip, step, update."""
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_data(num_workers: int, poison: dict[int, int]):
    """float64 global batches; at step ``s`` of ``poison`` an inf in the first row of worker
    ``poison[s]``'s slice (the batch divides evenly: worker ``w`` gets rows ``w*B/W ...``)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]
    for step, worker in poison.items():
        data[step][0][worker * BATCH // num_workers, 1] = float("inf")
    return data


def make_scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def parse_poison(text: str) -> dict[int, int]:
    return {int(step): int(worker) for step, worker in (item.split(":") for item in text.split(",") if item)}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas-per-worker", type=int, default=1)
    parser.add_argument("--sharding", default=None)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--poison", default="2:1,5:0")
    args = parser.parse_args(argv)

    devices = [f"cpu:{i}" for i in range(args.replicas_per_worker)]
    strategy = sg.MultiWorkerMirroredStrategy(devices=devices, sharding=args.sharding,
                                              communication_options=sg.CommunicationOptions(timeout_seconds=60))
    rank = strategy.cluster_resolver.worker_rank
    torch.manual_seed(100 + rank)   # the chief's initial values win
    with strategy.scope():
        model = Net().double()
        optimizer = make_optimizer(model.parameters())
        scaler = make_scaler()
    initial = {k: v.tolist() for k, v in model.state_dict().items()}

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaled_step(model, optimizer, scaler, loss, args.clip)
        return torch.tensor(scaler.get_scale())

    data = make_data(strategy.cluster_resolver.num_workers, parse_poison(args.poison))
    history = []
    for batch in strategy.experimental_distribute_dataset(data):
        scales = strategy.experimental_local_results(strategy.run(step, args=(batch,)))
        history.append({"replica_scales": [s.item() for s in scales], "scale": scaler.get_scale(),
                        "params": {k: v.tolist() for k, v in model.state_dict().items()}})
    replicas_equal = all(torch.equal(c, strategy.experimental_local_results(p)[0])
                         for p in model.parameters() for c in strategy.experimental_local_results(p))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"initial": initial, "history": history, "replicas_equal": replicas_equal,
                   "num_replicas": strategy.num_replicas_in_sync, "state": scaler.state_dict()}, f)


if __name__ == "__main__":
    sys.exit(main())

"""Train a digits classifier with any strategy; the same file runs on one process or many.

One process, two logical CPU replicas:
    python examples/train.py
Two worker processes on this host (loopback), via stratagem's launcher or torchrun:
    stratagem launch --workers 2 examples/train.py
    torchrun --nproc-per-node 2 examples/train.py
Two hosts, one process each (run on each host with its own task index):
    TF_CONFIG='{"cluster": {"worker": ["hostA:2222", "hostB:2222"]},
                "task": {"type": "worker", "index": 0}}' python examples/train.py

The default strategy, "auto", is MultiWorkerMirroredStrategy when the process is one task of a
cluster (TF_CONFIG names several tasks, or torchrun started it) and MirroredStrategy on two
logical CPU replicas otherwise; --strategy picks one explicitly.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg


def in_a_cluster() -> bool:
    """Whether this process is one task of a multi-process cluster (TF_CONFIG or torchrun)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    tasks = sum(len(addresses) for addresses in config.get("cluster", {}).values())
    return tasks > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1


def make_strategy(name: str) -> sg.Strategy:
    if name == "auto":
        name = "multi_worker" if in_a_cluster() else "mirrored"
    if name == "mirrored":
        return sg.MirroredStrategy(["cpu:0", "cpu:1"])
    if name == "one_device":
        return sg.OneDeviceStrategy("cpu")
    return sg.MultiWorkerMirroredStrategy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["auto", "mirrored", "one_device", "multi_worker"],
                        default="auto")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True)

    strategy = make_strategy(args.strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train_step(batch):
        inputs, labels = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(inputs), labels, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    dist_data = strategy.experimental_distribute_dataset(loader)
    for epoch in range(args.epochs):
        total, steps = 0.0, 0
        for batch in dist_data:
            total += strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None).item()
            steps += 1
        print(f"epoch {epoch + 1}: mean loss {total / steps:.4f} "
              f"({strategy.num_replicas_in_sync} replicas)", flush=True)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"training accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()

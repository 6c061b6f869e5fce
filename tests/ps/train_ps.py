"""Coordinator script: trains a digits classifier with ParameterServerStrategy.

Run as the chief of `stratagem launch --workers 2 --ps 2 train_ps.py OUT [--steps N]`.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg


def data():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()

    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(args.shards))
    coordinator = sg.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def dataset_fn(ctx):
        x, y = data()
        g = torch.Generator().manual_seed(ctx.input_pipeline_id)

        def batches():
            while True:
                idx = torch.randint(0, len(x), (32,), generator=g)
                yield x[idx], y[idx]
        return batches()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        inputs, labels = next(it)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    started = time.time()
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(args.steps)]
    coordinator.join()
    elapsed = time.time() - started
    losses = [v.fetch().item() for v in values]
    x, y = data()
    model.eval()  # BatchNorm's statistics stay on the workers: evaluate with batch statistics off
    model[1].track_running_stats = False
    model[1].running_mean = model[1].running_var = None
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    weight = model[0].weight
    report = {"accuracy": accuracy, "first_loss": sum(losses[:10]) / 10, "last_loss": sum(losses[-20:]) / 20,
              "steps_per_s": args.steps / elapsed, "sharded": isinstance(weight, sg.ShardedVariable),
              "shard_shapes": weight.shard_shapes if isinstance(weight, sg.ShardedVariable) else None,
              "shards_equal_logical": bool(torch.equal(torch.cat(weight.variables), weight.detach()))
              if isinstance(weight, sg.ShardedVariable) else None}
    print(json.dumps(report))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()

"""Coordinator script: an embedding table on 2 ps; measures the bytes moved per step."""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg


class Model(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.embedding = nn.Embedding(rows, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, ids):
        rows = self.embedding(ids[:, :2])  # the module's own forward ...
        by_hand = sg.nn.embedding_lookup(self.embedding.weight, ids[:, 2:])  # ... and the same by hand
        return self.head(torch.cat([rows, by_hand], dim=1).mean(dim=1))


def traffic(strategy, ops=("pull_rows", "push_rows")):
    total = 0
    for client in strategy.cluster.ps_clients:
        stats = client.call("stats")
        total += sum(op.get("bytes_out", 0) + op.get("bytes_in", 0)
                     for name, op in stats["ops"].items() if ops is None or name in ops)
    return total


def setup_ops(strategy):
    """Per ps operation, calls and bytes, summed over the ps tasks."""
    ops = {}
    for client in strategy.cluster.ps_clients:
        for name, op in client.call("stats")["ops"].items():
            for key, value in op.items():
                ops.setdefault(name, {}).setdefault(key, 0)
                ops[name][key] += value
    return ops


def main(out):
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=sg.FixedShardsPartitioner(2))
    coordinator = sg.ClusterCoordinator(strategy)
    report = {}
    for rows in (1000, 100000):
        torch.manual_seed(0)
        before_setup = setup_ops(strategy)
        with strategy.scope():
            model = Model(rows)
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        strategy.placement.finalize()   # what the first schedule() does: variables, optimizers
        after_setup = setup_ops(strategy)
        setup = {op: {k: after_setup[op][k] - before_setup.get(op, {}).get(k, 0) for k in after_setup[op]}
                 for op in after_setup if after_setup[op]["calls"] > before_setup.get(op, {}).get("calls", 0)}
        before_table = model.embedding.weight.detach().clone()

        def step(ids):
            optimizer.zero_grad()
            loss = F.mse_loss(model(ids), torch.ones(ids.shape[0], 1))
            loss.backward()
            optimizer.step()
            return loss.detach()

        ids = torch.tensor([[1, 5, 7, 5], [3, 999, 1, 2]])
        start = traffic(strategy)
        for _ in range(5):
            coordinator.schedule(step, args=(ids,))
        coordinator.join()
        after_table = model.embedding.weight.detach()
        changed = sorted((after_table != before_table).any(dim=1).nonzero().flatten().tolist())
        report[rows] = {"bytes_per_step": (traffic(strategy) - start) / 5, "changed_rows": changed,
                        "shard_shapes": model.embedding.weight.shard_shapes,
                        "setup": setup,
                        "variable_bytes": sum(c.call("stats")["variable_bytes"] for c in strategy.cluster.ps_clients)}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])

"""Coordinator script: embedding training under several step orders, beside plain PyTorch.

Run as the chief of ``stratagem launch --workers 1 --ps 2 embedding_orders_ps.py OUT``.
For each optimizer, each table (one shard, or two on the two ps) and each order of
``zero_grad`` / forward / backward that is correct in plain PyTorch, it trains a scoped
model for a few steps and the same model in this process, and saves both to ``OUT/cases.pt``
for the test to compare. One worker runs the steps in the order scheduled, so the two must
agree up to float rounding. Every batch uses every row of the table: the parameter servers
update only the rows a step touched ("lazy" updates), which is the dense optimizer's update
exactly when every row is touched.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

STEPS = 4
DIM = 8
# 256-byte shards, at most two: an 8 x 8 float32 table is one shard, a 16 x 8 one is two
PARTITIONER = sg.MinSizePartitioner(min_shard_bytes=256, max_shards=2)
ORDERS = ("zero_grad_first", "zero_grad_after_forward", "accumulate", "retain_graph", "zero_grad_last")
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.3),
}


class Model(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.embedding = nn.Embedding(rows, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        first = self.embedding(ids[:, :2])  # two lookups of one table in one forward
        second = sg.nn.embedding_lookup(self.embedding.weight, ids[:, 2:])
        return self.head(torch.cat([first, second], dim=1).mean(dim=1))


def batches(rows, seed):
    """Batches of 4-id examples; every row appears in every batch, some rows twice."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2 * STEPS):
        ids = torch.cat([torch.randperm(rows, generator=generator),
                         torch.randint(rows, (rows,), generator=generator)]).reshape(-1, 4)
        out.append((ids, torch.randn(ids.shape[0], 1, generator=generator)))
    return out


def make_step(model, optimizer, order):
    def loss_of(ids, y):
        return F.mse_loss(model(ids), y)

    def step(ids, y, ids2, y2):
        if order == "zero_grad_first":
            optimizer.zero_grad()
            loss = loss_of(ids, y)
            loss.backward()
        elif order == "zero_grad_after_forward":   # the usual PyTorch order
            loss = loss_of(ids, y)
            optimizer.zero_grad()
            loss.backward()
        elif order == "accumulate":   # two forwards, zero_grad between forward and backward
            loss = loss_of(ids, y)
            optimizer.zero_grad()
            loss.backward()
            loss = loss_of(ids2, y2)
            loss.backward()
        elif order == "retain_graph":   # a backward, zero_grad, the same backward again
            loss = loss_of(ids, y)
            loss.backward(retain_graph=True)
            optimizer.zero_grad()
            loss.backward()
        elif order == "zero_grad_last":
            loss = loss_of(ids, y)
            loss.backward()
        else:
            raise ValueError(order)
        optimizer.step()
        if order == "zero_grad_last":
            optimizer.zero_grad()
        return loss.detach()

    return step


def main(out):
    strategy = sg.ParameterServerStrategy(sg.cluster.TFConfigClusterResolver(),
                                          variable_partitioner=PARTITIONER)
    coordinator = sg.ClusterCoordinator(strategy)
    cases = {}
    for opt_name, make_optimizer in OPTIMIZERS.items():
        for rows in (8, 16):
            for order in ORDERS:
                torch.manual_seed(0)
                with strategy.scope():
                    model = Model(rows)
                    optimizer = make_optimizer(model.parameters())
                initial = {name: p.detach().clone() for name, p in model.named_parameters()}
                plain = Model(rows)
                plain.load_state_dict(initial)
                plain_step = make_step(plain, make_optimizer(plain.parameters()), order)
                step = make_step(model, optimizer, order)
                data = batches(rows, seed=len(cases))
                for i in range(STEPS):
                    args = (*data[2 * i], *data[2 * i + 1])
                    coordinator.schedule(step, args=args)
                    plain_step(*args)
                coordinator.join()
                cases[f"{opt_name}-{rows}rows-{order}"] = {
                    "initial": initial,
                    "ps": {name: p.detach().clone() for name, p in model.named_parameters()},
                    "plain": {name: p.detach().clone() for name, p in plain.named_parameters()},
                    "embedding_shards": len(getattr(model.embedding.weight, "shard_shapes", [None])),
                }
                print(f"case {opt_name}-{rows}rows-{order} done", flush=True)
    torch.save(cases, os.path.join(out, "cases.pt"))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(sorted(cases), f)


if __name__ == "__main__":
    main(sys.argv[1])

"""One training loop for every layout: ``python train_script.py PLAN OUT MODEL`` in each process of a cluster.

The strategy line is the plan's (``strategy = plan.strategy()``); the rest is the script a
``PipelineStrategy`` runs under any layout. Rank 0 writes the parameters after the last step to ``OUT``.
"""

import sys

import cloudpickle
import torch

import models

plan = cloudpickle.loads(open(sys.argv[1], "rb").read())
kind = sys.argv[3]
build, batches, rows = {"mlp": (models.mlp, models.mlp_batch, 16),
                        "transformer": (models.transformer, models.token_batch, 8)}[kind]   # the plans' global_batch

strategy = plan.strategy()
with strategy.scope():
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

dataset = strategy.experimental_distribute_dataset([batches(rows, seed=s) for s in range(3)])


def train_step(x, y):
    optimizer.zero_grad()
    loss = strategy.forward_backward(model, x, y)
    optimizer.step()
    return loss


for x, y in dataset:
    strategy.run(train_step, args=(x, y))
state = model.state_dict()   # every process: a collective
if torch.distributed.get_rank() == 0:
    torch.save(state, sys.argv[2])
print("trained", flush=True)

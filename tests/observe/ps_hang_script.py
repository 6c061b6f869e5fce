"""The coordinator of a parameter-server job whose worker sleeps inside the third scheduled step."""

import time

import torch
from torch import nn

import stratagem as sg

strategy = sg.ParameterServerStrategy()
coordinator = sg.ClusterCoordinator(strategy)
with strategy.scope():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(n):
    loss = sg.nn.compute_average_loss(model(torch.ones(2, 4)).pow(2).squeeze(1), global_batch_size=2)
    if n == 3:
        time.sleep(3600)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


for n in (1, 2):
    coordinator.schedule(step, args=(n,)).fetch()
    print(f"step {n} done", flush=True)
coordinator.schedule(step, args=(3,))
coordinator.join()
print("finished without hanging", flush=True)

"""Two workers train; at step 3 worker 1 hangs, in one of three ways (``sys.argv[1]``):

- ``stop``: it stops itself (SIGSTOP) inside the step, before backward;
- ``sleep``: it sleeps inside the step, in the user's code, before backward;
- ``skip``: after the step it skips the ``strategy.reduce`` that worker 0 makes, and waits.

``sys.argv[2]`` is the communication timeout (seconds). The tests find the lines they expect
in the messages by their code, which is unique in this file.
"""

import os
import signal
import sys
import time

import torch
import torch._dynamo  # noqa: F401 - now, not at the first optimizer: under load that took longer than --hang-timeout 8

import stratagem as sg

how, timeout = sys.argv[1], float(sys.argv[2])
rank = int(os.environ["RANK"])
strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=timeout))
torch.manual_seed(0)
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, n):
    loss = sg.nn.compute_average_loss(model(x).pow(2).squeeze(1))
    if rank == 1 and n == 3 and how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 1 and n == 3 and how == "sleep":
        time.sleep(3600)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


for n in range(1, 1000):
    loss = strategy.run(step, args=(torch.ones(2, 4), n))
    print(f"step {n} done", flush=True)
    while how == "skip" and rank == 1 and n == 3:
        time.sleep(0.2)
    total = strategy.reduce("sum", loss, axis=None)
print("finished without hanging", flush=True)

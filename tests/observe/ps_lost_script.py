"""The coordinator of a parameter-server job (1 worker, 1 ps) whose ps is stopped (SIGSTOP) after two
steps: the third step's error must say where each task stands. Prints ``UnavailableError: ...``."""

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg

strategy = sg.ParameterServerStrategy()
coordinator = sg.ClusterCoordinator(strategy, ps_timeout=4)
with strategy.scope():
    model = nn.Linear(8, 4)   # 144 bytes of variables, all on ps 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step():
    loss = model(torch.ones(2, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def last_call(folder: Path) -> dict:
    """What ps 0 last wrote of itself in the launcher's folder (stratagem/observe/answer.py)."""
    try:
        return json.loads((folder / "last" / "ps-0.json").read_text())["last_completed"]
    except (OSError, ValueError, KeyError):
        return {}


started = time.time()
for n in (1, 2):
    coordinator.schedule(step).fetch()
    print(f"step {n} done", flush=True)
folder = Path(os.environ["STRATAGEM_OBSERVE_DIR"])
deadline = time.monotonic() + 60
while last_call(folder).get("ended", 0) < started and time.monotonic() < deadline:
    time.sleep(0.05)   # the ps notes its last call within 0.2 s: stop it once it has noted a step's
os.kill(int((folder / "tasks" / "ps-0").read_text()), signal.SIGSTOP)
print("ps 0 stopped", flush=True)
try:
    coordinator.schedule(step).fetch()
    print("step 3 done: the stopped ps was not noticed", flush=True)
except sg.errors.UnavailableError as error:
    print(f"UnavailableError: {error}", flush=True)

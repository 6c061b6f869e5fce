"""What a strategy's start-up loads: training under MirroredStrategy or MultiWorkerMirroredStrategy
without torch.compile, DTensor or FSDP loads none of their modules (seconds of every task's
start-up, sympy with them), in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

#: what only torch.compile, DTensor (tensor parallelism, FSDP) and pipelining need
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor", "torch.distributed.fsdp",
         "torch.distributed.pipelining", "torch.distributed.device_mesh")

_TRAIN = """
import json, sys
import torch
import stratagem as sg

def train(strategy):
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = strategy.experimental_distribute_dataset(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 2)),
                                    batch_size=8))

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(((model(x) - y) ** 2).sum(1))
        optimizer.zero_grad()
        loss.backward()
        sg.nn.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    for batch in data:
        strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)

train(sg.%s)
print("LOADED " + json.dumps(sorted(m for m in %r if m in sys.modules)))
"""


@pytest.mark.parametrize("strategy", ["MirroredStrategy(['cpu:0', 'cpu:1'])", "MultiWorkerMirroredStrategy()"])
def test_training_without_compile_or_dtensor_loads_neither(strategy: str) -> None:
    completed = subprocess.run([sys.executable, "-c", _TRAIN % (strategy, HEAVY)], capture_output=True, text=True,
                               timeout=150)
    assert completed.returncode == 0, completed.stderr[-4000:]
    loaded = json.loads(completed.stdout.rsplit("LOADED ", 1)[1])
    assert loaded == [], (f"sg.{strategy} loaded {loaded} while training without torch.compile, DTensor or "
                          "FSDP: import them where they are used")

"""What a strategy's start-up loads, in a fresh interpreter: MirroredStrategy and
MultiWorkerMirroredStrategy, a model built in their scope and steps run without an optimizer load
none of the modules of torch.compile, DTensor or FSDP (seconds of every task's start-up, sympy
with them); training with an optimizer loads none that plain PyTorch's same loop does not (torch's
optimizers load dynamo themselves, at their first ``add_param_group``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

PACKAGE = Path(__file__).resolve().parents[2] / "stratagem"
#: modules that still call torch.compiler.disable when they are imported (it imports dynamo)
DISABLED_AT_IMPORT = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                            if any(line.startswith("_") and "= torch.compiler.disable(" in line
                                   for line in path.read_text().splitlines()))

#: what only torch.compile, DTensor (tensor parallelism, FSDP) and pipelining need
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor", "torch.distributed.fsdp",
         "torch.distributed.pipelining")

_TRAIN = """
import contextlib, json, sys
import torch
import stratagem as sg

def loaded():
    return sorted(m for m in %(heavy)r if m in sys.modules)

strategy = %(strategy)s
found = {}
with strategy.scope() if strategy else contextlib.nullcontext():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
batches = [(torch.randn(8, 8), torch.randn(8, 2)) for _ in range(2)]
if strategy:
    data = list(strategy.experimental_distribute_dataset(batches))
    with torch.no_grad():
        strategy.reduce("sum", strategy.run(lambda batch: model(batch[0]).sum(), args=(data[0],)), axis=None)
    found["without an optimizer"] = loaded()
with strategy.scope() if strategy else contextlib.nullcontext():
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

def step(batch):
    x, y = batch
    per_example = ((model(x) - y) ** 2).sum(1)
    loss = sg.nn.compute_average_loss(per_example) if strategy else per_example.mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()

for batch in (data if strategy else batches):
    strategy.run(step, args=(batch,)) if strategy else step(batch)
found["training"] = loaded()
print("LOADED " + json.dumps(found))
"""


def _loaded(strategy: str) -> dict[str, list[str]]:
    completed = subprocess.run([sys.executable, "-c", _TRAIN % {"strategy": strategy, "heavy": HEAVY}],
                               capture_output=True, text=True, timeout=200)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.rsplit("LOADED ", 1)[1])


@pytest.mark.xfail(bool(DISABLED_AT_IMPORT), strict=True,
                   reason=f"torch.compiler.disable called at import time loads dynamo: {DISABLED_AT_IMPORT}")
@pytest.mark.parametrize("strategy", ["sg.MirroredStrategy(['cpu:0', 'cpu:1'])", "sg.MultiWorkerMirroredStrategy()"])
def test_a_strategy_loads_no_compiler_nor_dtensor_that_plain_pytorch_does_not(strategy: str) -> None:
    found = _loaded(strategy)
    assert found["without an optimizer"] == [], (
        f"{strategy}, a model in its scope and a step loaded {found['without an optimizer']}: import them "
        "where they are used (torch.compile, tensor parallelism, FSDP)")
    plain = _loaded("None")["training"]
    assert set(found["training"]) <= set(plain), (found["training"], plain)

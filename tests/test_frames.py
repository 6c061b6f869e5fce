"""Few frames of ours between the user's call and torch.

From ``strategy.run(fn)`` to ``fn``, from the end of ``backward()`` (autograd's callback) and
from the gradient hooks to the torch call that reduces (an in-place add of the gradient sum,
``torch.distributed.all_reduce``), and from ``optimizer.step()`` to the one that updates (the
optimizer's own ``step``), at most 3 frames of stratagem's are on the stack. Across workers the
same holds for ``strategy.reduce`` and the gradient sum down to ``torch.distributed`` (for
``strategy.reduce``, its checked message: an all-gather that carries a small sum itself).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import stratagem as sg
from stratagem.testing import run_local_cluster

pytestmark = pytest.mark.timeout(180)
PACKAGE = str(Path(sg.__file__).parent)
MAX_FRAMES = 3


def ours_above(frame) -> int:
    """Stratagem frames directly above the innermost of ours on ``frame``'s stack."""
    while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
        frame = frame.f_back  # torch internals, the recording hook itself
    count = 0
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        count += 1
        frame = frame.f_back
    return count


class _Record(TorchFunctionMode):
    """Frames of ours above every call of the watched torch functions on this thread."""

    def __init__(self, watched: set) -> None:
        super().__init__()
        self.watched = watched
        self.depths: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.watched:
            self.depths.append((getattr(func, "__name__", str(func)), ours_above(sys._getframe(1))))
        return func(*args, **(kwargs or {}))


def _model_and_step(strategy: sg.Strategy, make_optimizer):
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = make_optimizer(model.parameters())

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2
    return step, list(strategy.experimental_distribute_dataset(data))


@pytest.mark.parametrize("devices", [["cpu"], ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"]])
def test_run_reaches_fn_within_three_frames(devices: list[str]) -> None:
    strategy = sg.MirroredStrategy(devices)
    depths = strategy.run(lambda: ours_above(sys._getframe(1)))
    assert max(strategy.experimental_local_results(depths)) <= MAX_FRAMES


@pytest.mark.parametrize("cross_device_ops", [sg.HierarchicalCopyAllReduce(), sg.ReductionToOneDevice(), None],
                         ids=["hierarchical", "one_device", "central_storage"])
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_backward_reaches_the_sum_and_step_the_update_within_three_frames(cross_device_ops, optimizer) -> None:
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # split update over replica threads
            "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01)}[optimizer]  # one twin per replica
    strategy = (sg.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=cross_device_ops) if cross_device_ops
                else sg.CentralStorageStrategy(["cpu:0", "cpu:1"]))
    step, batches = _model_and_step(strategy, make)
    strategy.run(step, args=(batches[0],))  # the first step builds twins and ranges
    record = _Record({torch.Tensor.add_})
    base_step = type(torch.optim.SGD([nn.Parameter(torch.ones(1))]) if optimizer == "sgd"
                     else torch.optim.Adafactor([nn.Parameter(torch.ones(1))]))
    updates = []
    original = base_step.step.__wrapped__ if hasattr(base_step.step, "__wrapped__") else base_step.step

    def counting(self, *args, **kwargs):
        updates.append(ours_above(sys._getframe(1)))
        return original(self, *args, **kwargs)
    wrapped = base_step.step
    base_step.step.__wrapped__ = counting
    try:
        with record:  # replica 0 runs on this thread
            strategy.run(step, args=(batches[1],))
    finally:
        wrapped.__wrapped__ = original
    sums = [depth for name, depth in record.depths if depth]   # (add_ in the optimizer's update: 0)
    assert sums and max(sums) <= MAX_FRAMES, record.depths
    assert updates and max(updates) <= MAX_FRAMES, updates


SCRIPT = """
import json, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
import stratagem as sg
sys.path.insert(0, {root!r})
from tests.test_frames import ours_above

replicas = int(sys.argv[2])
strategy = sg.MultiWorkerMirroredStrategy(devices=[f"cpu:{{i}}" for i in range(replicas)])
with strategy.scope():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
depths = {{"reduce": [], "backward": [], "step": []}}
where = [None]
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
original_all_reduce, original_all_gather = dist.all_reduce, getattr(dist, GATHER)

def all_reduce(*args, **kwargs):
    if where[0]:
        depths[where[0]].append(ours_above(sys._getframe(1)))
    return original_all_reduce(*args, **kwargs)
dist.all_reduce = all_reduce

def all_gather(*args, **kwargs):  # the message before a collective: a small sum rides in it
    if where[0]:
        depths[where[0]].append(ours_above(sys._getframe(1)))
    return original_all_gather(*args, **kwargs)
setattr(dist, GATHER, all_gather)

def step(batch):
    x, y = batch
    loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    optimizer.zero_grad()
    where[0] = "backward"
    loss.backward()
    where[0] = "step"
    optimizer.step()
    where[0] = None
    return loss.detach()

for batch in strategy.experimental_distribute_dataset([(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2):
    per_replica = strategy.run(step, args=(batch,))
    where[0] = "reduce"
    strategy.reduce("sum", per_replica, axis=None)
    where[0] = None
with open(sys.argv[1] + f"/frames{{strategy.topology.worker_index}}.json", "w") as f:
    json.dump(depths, f)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_multi_worker_reaches_torch_distributed_within_three_frames(tmp_path: Path, replicas: int) -> None:
    script = tmp_path / "frames_script.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    results = run_local_cluster(script, 2, args=[str(tmp_path), str(replicas)], timeout=150)
    for r in results:
        assert r.returncode == 0, f"{r.task} failed:\n{r.output}"
    for rank in range(2):
        depths = json.loads((tmp_path / f"frames{rank}.json").read_text())
        assert depths["reduce"] and max(depths["reduce"]) <= MAX_FRAMES, depths
        assert depths["backward"] and max(depths["backward"]) <= MAX_FRAMES, depths
        assert not depths["step"], depths   # the gradients were summed when backward ended

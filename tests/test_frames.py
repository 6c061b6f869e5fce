"""Few frames of ours between the user's call and torch: a budget on depth.

Depth is the number of stratagem's frames on the stack between a user's call and the torch call
it leads to: ``strategy.run(fn)`` to ``fn``; ``loss.backward()`` (autograd's end-of-backward
callback) to the torch call that sums the gradients (the in-place add of the sum, or one
``torch._foreach_add_`` for many pieces, a user's ``batch_reduce``, ``torch.distributed.all_reduce``); ``optimizer.step()`` to the optimizer's own
``step``; across workers ``strategy.reduce`` to ``torch.distributed`` (its checked message: an
all-gather that carries a small sum itself). Every frame of ours between the two counts, also
where torch's frames lie between ours (a decorator such as ``torch.compiler.disable``): the
budget measures how deep a call goes, not how the code is cut into functions. Autograd's engine
calling our hooks and end-of-backward callbacks starts a count of its own, as a user's call does.

The budget is 3 frames, and one more where that frame is a shared helper (``SHARED_HELPERS``):
a function several callers share so that their code is written once -- the shape check and the
closing exchange around each cross-device op's arithmetic, the range update that split
optimizers of every update rule run. One helper per call: a second counts against the 3.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.comm.replicas import ReplicaCollective
from stratagem.placement.data_axis.sharded_update import ShardedUpdate
from stratagem.testing import run_local_cluster

pytestmark = pytest.mark.timeout(180)
PACKAGE = str(Path(sg.__file__).parent)
#: frames that are neither ours nor the user's: torch's, Python's library (site-packages with it)
LIBRARY = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"], "<")
#: where torch calls back into ours: autograd's engine running a backward pass, whose hooks and
#: end-of-backward callbacks start a count of their own, as the user's call does
ENTRIES = frozenset({torch.autograd.graph._engine_run_backward.__code__})
MAX_FRAMES = 3
SHARED_HELPERS = frozenset({ReplicaCollective.sum_exchanged.__code__, ShardedUpdate.step.__code__})


def depth(frame) -> int:
    """Stratagem's frames from ``frame`` (the caller of a torch call) up to where the call began
    (the user's code, or autograd's engine calling back), less one shared helper's."""
    ours = helpers = 0
    while frame is not None and frame.f_code not in ENTRIES:
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE):
            ours += 1
            helpers += code in SHARED_HELPERS
        elif not code.co_filename.startswith(LIBRARY):
            break   # the user's code
        frame = frame.f_back
    return ours - min(helpers, 1)


def test_depth_counts_every_frame_of_ours_and_forgives_one_helper() -> None:
    """The measure itself, on fake frames: torch's between ours do not stop the count; the
    user's code and autograd's engine do; of two helpers, one is forgiven."""
    class Frame:
        def __init__(self, filename, back=None, code=None):
            self.f_code = code or type("Code", (), {"co_filename": filename})()
            self.f_back = back
    user = Frame(__file__, Frame(PACKAGE + "/above_the_user.py"))
    torch_frame = Frame(str(Path(torch.__file__).parent / "nn" / "modules" / "module.py"), user)
    ours = Frame(PACKAGE + "/a.py", Frame(PACKAGE + "/b.py", torch_frame))
    assert depth(ours) == 2
    engine = Frame("", Frame(PACKAGE + "/loss_watch.py", user), next(iter(ENTRIES)))
    assert depth(Frame(PACKAGE + "/gradient_sync.py", Frame(torch_frame.f_code.co_filename, engine))) == 1
    helper = Frame("", ours, ReplicaCollective.sum_exchanged.__code__)
    assert depth(helper) == 2
    assert depth(Frame("", helper, ShardedUpdate.step.__code__)) == 3


_phase = threading.local()   # which part of the user's step each replica thread is in
_recorded: list[tuple[str, str, int]] = []   # (phase, torch call, depth), from every thread


def _record(what: str, frame) -> None:
    phase = getattr(_phase, "name", None)
    if phase is not None:
        _recorded.append((phase, what, depth(frame)))


class _UserOps(sg.CrossDeviceOps):
    """A user's cross-device op: its ``batch_reduce`` is the call the gradient sum reaches."""

    def batch_reduce(self, reduce_op, value_destination_pairs):
        _record("batch_reduce", sys._getframe(1))
        return super().batch_reduce(reduce_op, value_destination_pairs)


def _model_and_step(strategy: sg.Strategy, make_optimizer):
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = make_optimizer(model.parameters())

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        _phase.name = "backward"
        try:
            loss.backward()
            _phase.name = "step"
            optimizer.step()
        finally:
            _phase.name = None
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2
    return step, list(strategy.experimental_distribute_dataset(data))


@pytest.mark.parametrize("devices", [["cpu"], ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"]])
def test_run_reaches_fn_within_three_frames(devices: list[str]) -> None:
    strategy = sg.MirroredStrategy(devices)
    depths = strategy.run(lambda: depth(sys._getframe(1)))
    assert max(strategy.experimental_local_results(depths)) <= MAX_FRAMES


@pytest.mark.parametrize("cross_device_ops", [sg.HierarchicalCopyAllReduce, sg.ReductionToOneDevice,
                                              sg.RingAllReduce, _UserOps, None],
                         ids=["hierarchical", "one_device", "ring", "user_ops", "central_storage"])
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_backward_reaches_the_sum_and_step_the_update_within_three_frames(
        cross_device_ops, optimizer, monkeypatch: pytest.MonkeyPatch) -> None:
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # split update over replica threads
            "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01)}[optimizer]  # one twin per replica
    devices = ["cpu:0", "cpu:1"]
    strategy = (sg.MirroredStrategy(devices, cross_device_ops=cross_device_ops()) if cross_device_ops
                else sg.CentralStorageStrategy(devices))
    step, batches = _model_and_step(strategy, make)
    strategy.run(step, args=(batches[0],))  # the first step builds twins and ranges
    base = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adafactor
    update = base.step.__wrapped__   # the update proper: torch's wrapper runs hooks, which we run once

    def counting_update(self, *args, **kwargs):
        _record("optimizer step", sys._getframe(1))
        return update(self, *args, **kwargs)
    add_, foreach_add_ = torch.Tensor.add_, torch._foreach_add_

    def counting_add_(self, *args, **kwargs):
        _record("add_", sys._getframe(1))
        return add_(self, *args, **kwargs)

    def counting_foreach_add_(*args, **kwargs):   # (the sum of pieces in CPU memory: one call for all)
        _record("_foreach_add_", sys._getframe(1))
        return foreach_add_(*args, **kwargs)
    monkeypatch.setattr(base.step, "__wrapped__", counting_update)
    monkeypatch.setattr(torch.Tensor, "add_", counting_add_)   # seen on every thread, in the callback too
    monkeypatch.setattr(torch, "_foreach_add_", counting_foreach_add_)
    _recorded.clear()
    strategy.run(step, args=(batches[1],))
    monkeypatch.undo()
    sums = [d for phase, what, d in _recorded if phase == "backward" and what != "optimizer step"]
    updates = [d for phase, what, d in _recorded if phase == "step" and what == "optimizer step"]
    assert sums and max(sums) <= MAX_FRAMES, _recorded
    assert updates and max(updates) <= MAX_FRAMES, _recorded
    if cross_device_ops is _UserOps:
        assert ("backward", "batch_reduce", max(sums)) in _recorded


SCRIPT = """
import json, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
import stratagem as sg
sys.path.insert(0, {root!r})
from tests.test_frames import depth

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
        depths[where[0]].append(depth(sys._getframe(1)))
    return original_all_reduce(*args, **kwargs)
dist.all_reduce = all_reduce

def all_gather(*args, **kwargs):  # the message before a collective: a small sum rides in it
    if where[0]:
        depths[where[0]].append(depth(sys._getframe(1)))
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

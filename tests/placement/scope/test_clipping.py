"""Gradient clipping by the global norm (stratagem/placement/scope/clipping.py) in one process: torch's calls
routed while a placement that splits gradients exists, plain PyTorch's results on one-process meshes,
and the refusals. The multi-process checks (ZeRO-2/3, tensor and pipeline parallelism against plain
PyTorch, step by step) are in tests/placement/data_axis/test_zero.py and tests/placement/layout (fully sharded, tensor
parallel, pipeline; tests/_support/clips.py)."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import time
import types
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.placement.scope import clipping

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, scope="module")
def leave_the_process_group():
    """One-process meshes need a (one-process) default group: leave it, so later tests find none."""
    yield
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
        torch.distributed.destroy_process_group()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4)).double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def placed(kind: str):
    if kind == "tensor parallel":
        strategy = sg.experimental.TensorParallelStrategy(plan={"0": "colwise", "2": "rowwise"})
    elif kind == "zero-3":
        strategy = sg.MultiWorkerMirroredStrategy(sharding="parameters")
    else:
        strategy = sg.experimental.PipelineStrategy(num_microbatches=2, schedule="gpipe", loss_fn=loss_fn)
    with strategy.scope():
        model = make_model()
    x, y = batch()
    if kind == "pipeline":
        strategy.forward_backward(model, x, y)
    else:
        loss_fn(model(x), y).backward()
    return strategy, model


def whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


@pytest.mark.parametrize("kind", ["tensor parallel", "zero-3", "pipeline"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_one_process_meshes_clip_as_plain_pytorch(kind: str, norm_type: float) -> None:
    strategy, model = placed(kind)
    plain = make_model()
    loss_fn(plain(batch()[0]), batch()[1]).backward()
    assert clipping.installed()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type)
    assert type(got) is torch.Tensor and got.dtype == want.dtype   # torch's own gives a DTensor on a mesh
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(whole(p.grad), q.grad, rtol=1e-13, atol=1e-15)
    sg.nn.clip_grad_value_(model.parameters(), 0.004)
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.004)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(whole(p.grad), q.grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind, axis", [("tensor parallel", "model"), ("zero-3", "data")])
def test_a_part_counts_on_rank_0_of_every_axis_that_replicates_it(kind: str, axis: str) -> None:
    plain = torch.ones(2)
    assert clipping.counts_here(plain, {}) and clipping.counts_here(plain, {"model": 0, "data": 0})
    assert not clipping.counts_here(plain, {"model": 0, "data": 1})
    _, model = placed(kind)
    shard = model[0].weight.grad   # a DTensor sharded over the axis: its own mesh says for that axis
    assert shard.device_mesh.mesh_dim_names == (axis,)
    assert clipping.counts_here(shard, {axis: 1})
    assert not clipping.counts_here(shard, {axis: 0, "pipe": 1})


def test_refusals_name_the_way() -> None:
    strategy, model = placed("tensor parallel")
    other = nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    with pytest.raises(InvalidArgumentError, match=r"together with others \(shapes \[\(2, 2\)"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    with pytest.raises(InvalidArgumentError, match="norm_type=0.0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=0)
    with pytest.raises(InvalidArgumentError, match="norm_type=-inf"):
        sg.nn.clip_grad_norm_(model.parameters(), 1.0, norm_type=-math.inf)
    with pytest.raises(InvalidArgumentError, match=r"get_total_norm.*torch.nn.utils.clip_grad_norm_\(parameters"):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(3.0))
    with pytest.raises(RuntimeError, match="non-finite"):
        next(model.parameters()).grad.to_local()[0, 0] = math.nan
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_other_parameters_get_torchs_own_clipping() -> None:
    strategy, _ = placed("zero-3")
    model = make_model()
    loss_fn(model(batch()[0]), batch()[1]).backward()
    plain = make_model()
    loss_fn(plain(batch()[0]), batch()[1]).backward()
    assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1),
                       clipping._torch_norm(plain.parameters(), 0.1))
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, torch.tensor(2.0))
    with pytest.warns(UserWarning, match="empty generator"):   # torch's warning, as before
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchs_functions_come_back_when_the_last_such_strategy_goes() -> None:
    # In a fresh interpreter: in the suite's process, objects other tests leave behind (a
    # ReplicaContext kept in a list somewhere) can keep a placement alive, which says nothing
    # about this property. The child prints OK, or what holds the placement.
    code = ("import sys; from tests.placement.scope import test_clipping as t; "
            "sys.exit(t.check_torchs_functions_come_back())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


def check_torchs_functions_come_back() -> int:
    """The body of the test above, run in its own process."""
    strategy, model = placed("pipeline")
    ref, key = weakref.ref(strategy.placement), id(strategy.placement)
    assert key in clipping._placements
    del strategy, model
    deadline = time.monotonic() + 30   # (a thread of the step may still hold its frame a moment)
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None, f"the placement outlived its strategy and model; held by:\n{_holders(ref())}"
    assert key not in clipping._placements
    assert not clipping._placements and not clipping.installed()
    cell = torch.nn.utils.clip_grad_norm_.__closure__[0]
    assert cell.cell_contents is torch.nn.utils.clip_grad_norm_.__wrapped__
    print("OK")
    return 0


def _holders(obj: object) -> str:
    """What still refers to ``obj`` (two levels), for the message of a failed collection."""
    lines = []
    for holder in gc.get_referrers(obj):
        if isinstance(holder, types.FrameType) or holder is lines:
            continue
        outer = [type(h).__name__ for h in gc.get_referrers(holder) if not isinstance(h, types.FrameType)][:6]
        lines.append(f"{type(holder).__name__} {repr(holder)[:160]} <- {outer}")
    return "\n".join(lines)

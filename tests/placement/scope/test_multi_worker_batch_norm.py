"""BatchNorm across processes: ``stratagem launch --workers 2`` runs batch_norm_script.py.

``torch.nn.SyncBatchNorm`` trains to plain PyTorch's whole-batch parameters and running statistics
(float64, uneven batches) with one and two replicas per worker, through ``fit``, and under
``sharding="parameters"``; outside ``run`` it synchronizes the workers' halves. Plain BatchNorm
ends with the same buffers on every worker -- the replicas' average, step by step -- under every
``sharding=``, and a checkpoint saved after a forward with no step holds the workers' average.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import batch_norm_model, batch_norm_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300),
              pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(batch_norm_script.__file__)


def _assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-11, atol=1e-12, msg=lambda m: f"{what}, {name}: {m}")


def test_batch_norm_on_two_workers(tmp_path: Path) -> None:
    launched = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(SCRIPT),
                               str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    plain = batch_norm_model.train_plain()
    for name, (replicas, _, sync, _) in batch_norm_script.CONFIGS.items():
        want = plain if sync else batch_norm_model.train_per_replica(2 * replicas)
        for rank in range(2):
            _assert_equal_states(torch.load(tmp_path / f"{name}.{rank}.pt")["state"], want, f"{name}, worker {rank}")
    # plain BatchNorm: a forward without a step leaves each worker's own statistics; a checkpoint averages them
    results = [torch.load(tmp_path / f"plain_2x1.{rank}.pt") for rank in range(2)]
    mean = results[0]["diverged"]["bn.running_mean"], results[1]["diverged"]["bn.running_mean"]
    assert (mean[0] - mean[1]).abs().max() > 1e-3, "the workers' own statistics differ before the save"
    for rank in range(2):
        after = results[rank]["after_save"]
        torch.testing.assert_close(after["bn.running_mean"], (mean[0] + mean[1]) / 2)
        _assert_equal_states(after, results[0]["after_save"], f"after the save, worker {rank}")
    _assert_equal_states(results[0]["saved"], results[0]["after_save"], "the chief's file")
    # SyncBatchNorm outside run: each worker's half of one batch, normalized with the whole batch's statistics
    model = batch_norm_model.build(False)
    x, _ = batch_norm_model.data()[1]
    x = x.clone().requires_grad_()
    out = model.bn(model.stem(x))
    (out * out.detach().cos()).sum().backward()
    halves = [torch.load(tmp_path / f"outside_run.{rank}.pt") for rank in range(2)]
    torch.testing.assert_close(torch.cat([h["out"] for h in halves]), out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([h["grad"] for h in halves]), x.grad, rtol=1e-12, atol=1e-12)
    for h in halves:
        for name in ("bn.running_mean", "bn.running_var"):
            torch.testing.assert_close(h["state"][name], model.state_dict()[name], rtol=1e-12, atol=1e-12)

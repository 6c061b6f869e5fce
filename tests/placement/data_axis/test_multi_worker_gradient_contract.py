"""The gradient contract across processes: nanoGPT's loop under `stratagem launch --workers 2`.

After every ``backward()`` each worker's ``.grad`` is plain PyTorch's for the whole global batch,
so ``clip_grad_norm_`` returns plain PyTorch's norm and clips by it; parameters equal plain
PyTorch step for step (float64) with one or two replicas per worker, DDP's
``require_backward_grad_sync``, an exchange at every backward with small packs, ZeRO stage 1
with activation checkpointing, and the step written without ``strategy.run`` as under
DistributedDataParallel (a per-replica mean through ``sg.nn.mean_over_replicas``; ZeRO 1 too; an
exchange at every backward with small packs, which leave while that backward runs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import nanogpt_loop, nanogpt_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]
SCRIPT = Path(nanogpt_script.__file__)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def test_nanogpt_loop_equals_plain_pytorch_on_two_workers(tmp_path: Path) -> None:
    launched = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(SCRIPT),
                               str(tmp_path)], capture_output=True, text=True, timeout=220)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    for name, (_, _, _, recompute, _, _) in nanogpt_script.CONFIGS.items():
        plain = nanogpt_loop.train(None, recompute=recompute)
        assert max(n[0] for n in plain["norms"]) > 0.5, "the clip must really clip"
        for rank in range(2):
            history = torch.load(tmp_path / f"{name}.{rank}.pt")
            for step, (norms, grads, params) in enumerate(zip(history["norms"], history["grads"], history["params"])):
                for norm in norms:
                    assert abs(norm - plain["norms"][step][0]) <= 1e-12 * plain["norms"][step][0], (name, step)
                for replica in grads:
                    for g, ref in zip(replica, plain["grads"][step][0]):
                        assert _relative(g, ref) < 1e-12, (name, rank, step)
                for p, ref in zip(params, plain["params"][step]):
                    assert _relative(p, ref) < 1e-11, (name, rank, step)

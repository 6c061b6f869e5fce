"""Gradient compression across two real worker processes (gloo): ``compression_script.py``.

Every worker ends with the same parameters; the first step's summed gradient is computed
independently here from each worker's own gradient (taken under ``no_sync``): bf16 is exactly
``bf16(g0) + bf16(g1)``, fp16 exactly ``2 * (fp16(g0 / 2) + fp16(g1 / 2))``, PowerSGD sums the
biases exactly; the loss falls like plain PyTorch's on the whole batch; and at most 3 frames of
stratagem's lie between the end of backward (or a gradient hook) and each all-reduce. The same holds with
ZeRO-1 (``sharding="optimizer"``) and over a tensor-parallel mesh's data axis. With
``powersgd_start_step`` the first sum is exact; workers that disagree on it are refused at start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stratagem.testing import run_local_cluster

from . import compression_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
SCRIPT = Path(compression_script.__file__)
STEPS = 150


def _plain_losses(steps: int) -> list[float]:
    """Plain PyTorch on the whole batch: what an exact sum trains."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = compression_script.make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = compression_script.make_data()
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compression,strategy,start", [
    ("bf16", "mirrored", None), ("fp16", "mirrored", None), ("powersgd", "mirrored", None), ("powersgd", "zero1", None),
    ("bf16", "tensor_parallel", None), ("powersgd", "mirrored", 1)])
def test_compressed_gradient_sums_across_two_workers(tmp_path: Path, compression: str, strategy: str,
                                                     start: int | None) -> None:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), compression, str(STEPS), strategy]
                                + ([] if start is None else [str(start)]), timeout=100, env={"OMP_NUM_THREADS": "1"})
    for r in results:
        assert r.returncode == 0, f"{r.task} failed:\n{r.output}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    for rank in ranks:   # the frame budget of tests/test_frames.py, two rounds per pack for PowerSGD
        assert rank["depths"] and max(rank["depths"]) <= 3, rank["depths"]
        assert len(rank["depths"]) >= (4 if compression == "powersgd" and not start else 2), rank["depths"]
    g0, g1 = ranks[0]["local"], ranks[1]["local"]
    for rank in ranks:
        for summed, a, b in zip(rank["summed"], g0, g1):
            if compression == "bf16":
                assert torch.equal(summed, (a.bfloat16() + b.bfloat16()).float())
            elif compression == "fp16":
                assert torch.equal(summed, ((a / 2).half() + (b / 2).half()).float() * 2)
            elif summed.dim() == 1 or start:   # PowerSGD: vectors travel exactly, and everything before it starts
                assert torch.equal(summed, a + b)
            else:
                assert torch.linalg.matrix_rank(summed) == 1
    plain, losses = _plain_losses(STEPS), ranks[0]["losses"]
    assert losses == ranks[1]["losses"]
    assert abs(losses[0] - plain[0]) < 1e-6
    assert losses[-1] < 0.25 * losses[0]
    assert losses[-1] < 1.05 * plain[-1], (losses[-1], plain[-1])


def test_workers_that_disagree_on_the_compression_are_refused_at_start_up(tmp_path: Path) -> None:
    """A mismatched peer: worker 1 was started with another ``powersgd_start_step``; both fail before
    training, naming the setting and each worker's value."""
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), "powersgd", "3", "mirrored", "1,2"], timeout=100,
                                env={"OMP_NUM_THREADS": "1"})
    for r in results:
        assert r.returncode != 0, f"{r.task} trained:\n{r.output}"
        assert ("the workers run different strategy configurations: compression is ('powersgd', 1, 1) on "
                "worker 0 but ('powersgd', 1, 2) on worker 1") in r.output, r.output
    assert not list(tmp_path.glob("rank*.pt"))

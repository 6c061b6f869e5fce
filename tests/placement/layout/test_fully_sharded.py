"""ZeRO stage 3 (MultiWorkerMirroredStrategy(sharding="parameters"), on FSDP2): equivalence with plain
PyTorch (float64, SGD with momentum and Adam), parameters and optimizer state per worker halved,
reduce / metrics / fit, clipping, checkpoints across layouts (stage 3 <-> no sharding <-> stage 2, 2 -> 3
workers), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.testing import assert_succeeded, run_local_cluster

from . import exit_script, zero3_script
from ..data_axis.test_zero import check_clipping, restores_as_plain_pytorch, save_plain

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(zero3_script.__file__)


@pytest.fixture
def solo_group():
    """A lone worker's stage 3 opens a one-process group for its mesh: leave it afterwards."""
    yield
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()


def _read(path: Path, workers: int) -> list[dict]:
    return [json.loads((path / f"rank{rank}.json").read_text()) for rank in range(workers)]


@pytest.mark.multiprocess
def test_two_workers_match_one_process_and_checkpoints_cross_layouts(tmp_path: Path) -> None:
    save_plain(tmp_path / "plain")
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path)], timeout=200)
    assert_succeeded(results)
    outputs = _read(tmp_path, 2)
    for rank, out in enumerate(outputs):
        assert out["num_replicas"] == 2
        assert out["worst"] < 1e-12, f"worker {rank}: parameters differ from plain PyTorch by {out['worst']}"
        assert out["state_error"] < 1e-12, f"worker {rank}: gathered state differs by {out['state_error']}"
        assert out["resumed_error"] == 0.0, f"worker {rank}: restored under stage 3: {out['resumed_error']}"
        assert out["plain_error"] < 1e-12, f"worker {rank}: restored from a plain checkpoint: {out['plain_error']}"
        assert out["stage2_error"] < 1e-12, f"worker {rank}: stage 3 -> stage 2: {out['stage2_error']}"
        assert out["back_error"] < 1e-12, f"worker {rank}: stage 2 -> stage 3: {out['back_error']}"
        # each worker holds about half (dimension 0 split as torch.chunk: 9 rows -> 5 + 4)
        assert out["param_bytes"] < 0.6 * out["full_param_bytes"], out
        for mine, full in zip(out["state_bytes"], out["full_bytes"]):
            assert 0 < mine < 0.6 * full, (rank, mine, full)
        assert out["reduced"] == 3.0
        assert out["metric"] == pytest.approx(2 / 3)   # rows [0] and [1, 1]
        assert len(out["fit_loss"]) == 2 and all(loss == loss for loss in out["fit_loss"])
        check_clipping(out["clipping"], f"worker {rank}")
    assert outputs[0]["fit_loss"] == outputs[1]["fit_loss"]
    torch.testing.assert_close(outputs[0]["fit_loss"], zero3_script.fit(sg.OneDeviceStrategy("cpu")), rtol=1e-5, atol=0)
    assert sum(o["param_bytes"] for o in outputs) == outputs[0]["full_param_bytes"]
    assert sum(o["state_bytes"][1] for o in outputs) == outputs[0]["full_bytes"][1]

    restores_as_plain_pytorch(tmp_path / "ckpt3")   # one logical copy, as plain PyTorch's

    # written by 2 workers, restored by 3 (uneven shards: 9 rows -> 3 + 3 + 3, 3 rows -> 1 + 1 + 1)
    three = tmp_path / "three"
    three.mkdir()
    results = run_local_cluster(SCRIPT, 3, args=[str(three), "--restore", str(tmp_path / "ckpt3")], timeout=200)
    assert_succeeded(results)
    for rank, out in enumerate(_read(three, 3)):
        assert out["num_replicas"] == 3
        assert out["restored_error"] < 1e-12, f"worker {rank} of 3: {out['restored_error']}"
        assert out["stage2_error"] < 1e-12, f"worker {rank} of 3, stage 2: {out['stage2_error']}"


@pytest.mark.multiprocess
def test_a_script_that_ends_after_training_exits_0() -> None:
    """Two strategies in one process (the second on a sub-group): at exit, after every strategy's
    exit handler, no heartbeat thread may still run (one inside torch's store when the interpreter
    finalizes aborts the process, some of the time: exit -6)."""
    results = run_local_cluster(Path(exit_script.__file__), 2, timeout=200)
    assert_succeeded(results)
    for result in results:
        assert "no threads left at exit" in result.output, result.output


def test_refusals(solo_group) -> None:
    with pytest.raises(InvalidArgumentError, match="needs one replica per worker"):
        sg.MultiWorkerMirroredStrategy(sharding="parameters", devices=["cpu:0", "cpu:1"])
    strategy = sg.MultiWorkerMirroredStrategy(sharding="parameters")
    outside = torch.nn.Linear(3, 2)
    with strategy.scope():
        with pytest.raises(InvalidArgumentError, match="created outside the scope.*did not shard"):
            torch.optim.SGD(outside.parameters(), lr=0.1)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mixed = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1).double())
        with pytest.raises(InvalidArgumentError, match="one dtype"):
            torch.optim.SGD(mixed.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="add_param_group"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(InvalidArgumentError, match="only sg.Checkpoint.save called on every worker"):
        strategy.placement.write_checkpoint_state(model, None, "model")   # not gathered first

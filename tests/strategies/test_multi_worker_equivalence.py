"""The equivalence guarantee across processes: MultiWorkerMirroredStrategy equals single-device PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stratagem.testing import assert_succeeded, run_local_cluster

from . import train_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
SCRIPT = Path(train_script.__file__)


def reference_history(optimizer_kind: str, batch_sizes: list[int], initial: dict) -> list[dict]:
    model = train_script.Net()
    model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
    optimizer = train_script.make_optimizer(optimizer_kind, model.parameters())
    history = []
    for x, y in train_script.make_data(batch_sizes):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        history.append({"loss": loss.item(), "params": {k: v.clone() for k, v in model.state_dict().items()}})
    return history


def run_and_compare(tmp_path: Path, num_workers: int, *, optimizer: str = "sgd", bytes_per_pack: int = 0,
                    replicas_per_worker: int = 1, batches: str = "12,12,7,12", input_kind: str = "list") -> None:
    args = [str(tmp_path), "--optimizer", optimizer, "--bytes-per-pack", str(bytes_per_pack),
            "--replicas-per-worker", str(replicas_per_worker), "--batches", batches, "--input", input_kind,
            "--timeout", "60"]
    results = run_local_cluster(SCRIPT, num_workers, args=args, timeout=150)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(num_workers)]
    chief = outputs[0]
    assert chief["num_replicas"] == num_workers * replicas_per_worker
    expected = reference_history(optimizer, [int(b) for b in batches.split(",")], chief["initial"])
    for rank, out in enumerate(outputs):
        assert out["initial"] == chief["initial"], f"worker {rank} did not start from the chief's values"
        assert out["replicas_equal"]
        assert len(out["history"]) == len(expected)
        for step, (got, want) in enumerate(zip(out["history"], expected)):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5, abs=2e-6), f"step {step}"
            for name, value in want["params"].items():
                torch.testing.assert_close(torch.tensor(got["params"][name]), value, rtol=2e-5, atol=2e-6,
                                           msg=lambda m: f"worker {rank}, step {step}, {name}: {m}")


def test_two_workers_one_replica_each(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, optimizer="sgd")


def test_two_workers_two_logical_replicas_each(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, optimizer="adam", replicas_per_worker=2, batches="12,12,7,2")


def test_three_workers_uneven_last_batch_and_tiny_packs(tmp_path: Path) -> None:
    # 7 rows over 3 workers is 3/2/2; 2 rows leave worker 2 an empty slice; one pack per parameter
    run_and_compare(tmp_path, 3, optimizer="adam", bytes_per_pack=1, batches="12,12,7,2")


def test_one_large_pack_and_a_dataloader_read_by_shards(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, optimizer="sgd", bytes_per_pack=1 << 30, batches="8,8,8,5", input_kind="loader")

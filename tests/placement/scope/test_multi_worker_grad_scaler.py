"""A GradScaler created in scope across processes: an inf in one worker's slice skips the step on
every worker and replica, and the scale history and parameters equal plain PyTorch's GradScaler
on the whole batch (float64)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stratagem.testing import assert_succeeded, run_local_cluster

from . import amp_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
SCRIPT = Path(amp_script.__file__)


def plain_history(initial: dict, num_workers: int, poison: str, clip: float | None) -> tuple[list, dict]:
    model = amp_script.Net().double()
    model.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in initial.items()})
    optimizer = amp_script.make_optimizer(model.parameters())
    scaler = amp_script.make_scaler()
    history = []
    for x, y in amp_script.make_data(num_workers, amp_script.parse_poison(poison)):
        amp_script.scaled_step(model, optimizer, scaler, F.cross_entropy(model(x), y), clip)
        history.append((scaler.get_scale(), {k: v.clone() for k, v in model.state_dict().items()}))
    return history, scaler.state_dict()


def run_and_compare(tmp_path: Path, num_workers: int, *, replicas_per_worker: int = 1, sharding: str | None = None,
                    clip: float | None = 0.5, poison: str = "2:1,5:0") -> None:
    args = [str(tmp_path), "--replicas-per-worker", str(replicas_per_worker), "--poison", poison]
    if sharding is not None:
        args += ["--sharding", sharding]
    if clip is not None:
        args += ["--clip", str(clip)]
    results = run_local_cluster(SCRIPT, num_workers, args=args, timeout=150)
    assert_succeeded(results)
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(num_workers)]
    assert outputs[0]["num_replicas"] == num_workers * replicas_per_worker
    expected, final_state = plain_history(outputs[0]["initial"], num_workers, poison, clip)
    scales = [scale for scale, _ in expected]
    for step in amp_script.parse_poison(poison):
        assert scales[step] < scales[step - 1], f"the reference did not back off at step {step}"
    for rank, out in enumerate(outputs):
        assert out["replicas_equal"]
        assert out["state"] == final_state, f"worker {rank}"
        assert len(out["history"]) == len(expected)
        for step, (got, (want_scale, want_params)) in enumerate(zip(out["history"], expected)):
            assert got["replica_scales"] == [want_scale] * replicas_per_worker, f"worker {rank}, step {step}"
            assert got["scale"] == want_scale
            for name, value in want_params.items():
                torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value,
                                           rtol=1e-12, atol=1e-14,
                                           msg=lambda m: f"worker {rank}, step {step}, {name}: {m}")


def test_two_workers_one_replica_each(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2)


def test_two_workers_two_replicas_each(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, replicas_per_worker=2)


def test_two_workers_zero_stage_one(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, sharding="optimizer")

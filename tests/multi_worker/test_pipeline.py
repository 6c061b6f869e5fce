"""PipelineStrategy equals single-process PyTorch (float64) for every schedule, and refuses misuse everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stratagem.testing import run_local_cluster

from . import pp_script

pytestmark = pytest.mark.timeout(280)
SCRIPT = Path(pp_script.__file__)


def reference_history(optimizer_kind: str, initial: dict) -> list[dict]:
    """Plain PyTorch on the whole global batch of every step (mean loss)."""
    torch.set_default_dtype(torch.float64)
    try:
        model = pp_script.make_model()
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
        optimizer = pp_script.make_optimizer(optimizer_kind, model.parameters())
        history = []
        for x, y in pp_script.make_data():
            optimizer.zero_grad()
            loss = pp_script.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            history.append({"loss": loss.item(), "params": {k: v.clone() for k, v in model.state_dict().items()}})
        return history
    finally:
        torch.set_default_dtype(torch.float32)


def run_and_compare(tmp_path: Path, data: int, pipe: int, cases: list[str]) -> list[dict]:
    workers = data * pipe
    results = run_local_cluster(SCRIPT, workers, args=[str(tmp_path), "--mesh", f"{data},{pipe}",
                                                       "--cases", ",".join(cases)], timeout=250)
    for r in results:
        assert r.returncode == 0, f"{r.task} failed:\n{r.output[-5000:]}"
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(workers)]
    total = sum(p.numel() for p in pp_script.make_model().parameters())
    for case in cases:
        expected = reference_history(case.split(":")[1], outputs[0][case]["initial"])
        held = {}
        for rank, result in enumerate(outputs):
            out = result[case]
            assert out["num_replicas"] == data
            assert out["initial"] == outputs[0][case]["initial"], f"{case}: process {rank} did not start alike"
            assert out["optimizer_params"] == out["held_params"] > 0
            held[rank % pipe] = (out["stages"], out["held_params"])
            assert len(out["history"]) == len(expected)
            for step, (got, want) in enumerate(zip(out["history"], expected)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-12), f"{case}, process {rank}, step {step}"
                for name, value in want["params"].items():
                    torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value,
                                               rtol=1e-12, atol=1e-12,
                                               msg=lambda m: f"{case}, process {rank}, step {step}, {name}: {m}")
            assert out["after_round_trip"] == out["history"][-1]["params"]
            assert "does not support PipelineStrategy" in out["checkpoint"]
        # every stage is held once along the pipe axis; no process holds the whole model
        stages = sorted(s for s, _ in held.values() for s in s)
        assert stages == list(range(len(stages))) and len(stages) >= pipe
        assert sum(count for _, count in held.values()) == total
    for rank, result in enumerate(outputs):
        errors = result["errors"]
        assert "'fc9' names no child" in errors["missing"]
        assert "needs 9 stages" in errors["too_many_stages"] and "only 8 children" in errors["too_many_stages"]
        assert "splits an nn.Sequential" in errors["not_sequential"] and "Transformer" in errors["not_sequential"]
        assert f"has {3 * workers} processes, but the cluster has {workers}" in errors["mesh"]
        assert "schedule must be one of" in errors["schedule"] and "'pipedream'" in errors["schedule"]
        assert f"needs a multiple of {pipe} stages" in errors["interleaved_stages"]
        assert f"needs {2 * pipe} stages" in errors["zero_bubble_stages"]
        if workers > 1:
            assert "different PipelineStrategy configurations" in errors["different"]
    return outputs


def test_every_schedule_on_two_stages_processes(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 2, ["gpipe:sgd", "1f1b:adam", "interleaved:sgd", "zero_bubble:adam",
                                     "split:adam"])


def test_pipeline_by_data_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, 2, ["1f1b:adam", "zero_bubble:sgd"])

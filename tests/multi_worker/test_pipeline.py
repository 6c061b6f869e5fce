"""PipelineStrategy equals single-process PyTorch (float64) for every schedule, and refuses misuse everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

from stratagem.testing import run_local_cluster

from . import pp_script

pytestmark = pytest.mark.timeout(280)
SCRIPT = Path(pp_script.__file__)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline.py"


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
        return history, optimizer
    finally:
        torch.set_default_dtype(torch.float32)


def check_checkpoint(path: Path, case: str, params: dict, reference_optimizer: torch.optim.Optimizer) -> None:
    """One logical copy, as plain PyTorch files; it restores into a plain model and optimizer."""
    torch.set_default_dtype(torch.float64)
    try:
        model = pp_script.make_model()
        optimizer = pp_script.make_optimizer(case.split(":")[1], model.parameters())
        sg.Checkpoint(model=model, optimizer=optimizer).restore(path)
    finally:
        torch.set_default_dtype(torch.float32)
    for name, value in params.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)
    want = reference_optimizer.state_dict()["state"]
    got = optimizer.state_dict()["state"]
    assert sorted(got) == sorted(want)
    for index, state in want.items():
        for key, value in state.items():
            torch.testing.assert_close(got[index][key], value, rtol=1e-12, atol=1e-12)


def predict(params: dict) -> torch.Tensor:
    model = pp_script.make_model().double()
    model.load_state_dict(params)
    with torch.no_grad():
        return model(pp_script.make_data((7,))[0][0])


def run_and_compare(tmp_path: Path, data: int, pipe: int, cases: list[str]) -> list[dict]:
    workers = data * pipe
    results = run_local_cluster(SCRIPT, workers, args=[str(tmp_path), "--mesh", f"{data},{pipe}",
                                                       "--cases", ",".join(cases)], timeout=250)
    for r in results:
        assert r.returncode == 0, f"{r.task} failed:\n{r.output[-5000:]}"
    outputs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(workers)]
    total = sum(p.numel() for p in pp_script.make_model().parameters())
    for case in cases:
        expected, reference_optimizer = reference_history(case.split(":")[1], outputs[0][case]["initial"])
        check_checkpoint(tmp_path / f"ckpt-{case.replace(':', '-')}", case, expected[-1]["params"],
                         reference_optimizer)
        predicted = predict(expected[-1]["params"])
        held = {}
        for rank, result in enumerate(outputs):
            out = result[case]
            assert out["num_replicas"] == data
            assert out["initial"] == outputs[0][case]["initial"], f"{case}: process {rank} did not start alike"
            assert out["optimizer_params"] == out["held_params"] > 0 and out["optimizer_meta_state"] == 0
            held[rank % pipe] = (out["stages"], out["held_params"])
            assert len(out["history"]) == len(expected)
            for step, (got, want) in enumerate(zip(out["history"], expected)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-12), f"{case}, process {rank}, step {step}"
                for name, value in want["params"].items():
                    torch.testing.assert_close(torch.tensor(got["params"][name], dtype=torch.float64), value,
                                               rtol=1e-12, atol=1e-12,
                                               msg=lambda m: f"{case}, process {rank}, step {step}, {name}: {m}")
            assert out["after_round_trip"] == out["history"][-1]["params"]
            torch.testing.assert_close(torch.tensor(out["predict"], dtype=torch.float64), predicted)
            for index, state in reference_optimizer.state_dict()["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(torch.tensor(out["optimizer_state"][str(index)][key],
                                                            dtype=torch.float64), value, rtol=1e-12, atol=1e-12)
            assert len(out["optimizer_state"]) == len(reference_optimizer.state_dict()["state"])
            assert out["restored"] == out["history"][-1]["params"], f"{case}: restored into another layout"
            assert out["restored_optimizer"] == out["optimizer_state"]
            if pipe > 1:
                assert "holds only stage(s)" in out["direct_call"] and "forward_backward" in out["direct_call"]
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
        if pipe > 1:
            assert "got batches of different shapes" in errors["different_batches"]
    return outputs


def test_every_schedule_on_two_stages_processes(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 2, ["gpipe:sgd", "1f1b:adam", "interleaved:sgd", "zero_bubble:adam",
                                     "split:adam"])


def test_pipeline_by_data_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 2, 2, ["interleaved:adam"])


def test_example_runs_as_its_docstring_says() -> None:
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLE), "--steps", "10",
               "--schedule", "interleaved"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[worker 0] step 10" in proc.stdout and "[worker 1] step 10" in proc.stdout, proc.stdout
    assert "stages [0, 2] of pipe rank 0" in proc.stdout and "stages [1, 3] of pipe rank 1" in proc.stdout
    assert "[worker 0] held-out loss" in proc.stdout and "[worker 1] held-out loss" in proc.stdout


def test_four_stages_processes_with_middle_stages(tmp_path: Path) -> None:
    run_and_compare(tmp_path, 1, 4, ["1f1b:sgd", "zero_bubble:adam"])
